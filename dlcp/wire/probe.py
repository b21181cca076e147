"""Path probes: CONTROL packets that test one path to a peer (dlcp/core/pathhealth.py).

A daemon probes each path to a peer with two or more paths while it has
traffic for it; the peer echoes each probe at once on the same path index
(its local address on that path, to the prober's address on it). Payload:
kind u8 (2 probe, 3 echo), path u8 (the prober's path index), sequence
number u32 (per path, from 1). `Engine.control_datagram` builds the packet.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

__all__ = ["PROBE_SIZE", "Probe", "probe_of", "probe_payload"]

_PROBE = struct.Struct("!BBI")
_KIND_PROBE = 2
_KIND_ECHO = 3
PROBE_SIZE = _PROBE.size


class Probe(NamedTuple):
    """A probe (`echo` False) or its echo, for the prober's `path` and `seq`."""

    echo: bool
    path: int
    seq: int


def probe_payload(path: int, seq: int, *, echo: bool = False) -> bytes:
    return _PROBE.pack(_KIND_ECHO if echo else _KIND_PROBE, path, seq)


def probe_of(payload: bytes | memoryview) -> Probe | None:
    """What a probe's or echo's payload says; None for another kind of CONTROL packet."""
    if len(payload) < _PROBE.size or payload[0] not in (_KIND_PROBE, _KIND_ECHO):
        return None
    kind, path, seq = _PROBE.unpack_from(payload)
    return Probe(kind == _KIND_ECHO, path, seq)
