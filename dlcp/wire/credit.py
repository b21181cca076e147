"""The flow-control credit: a CONTROL packet's payload (dlcp/daemon/outbox.py).

A receiving daemon credits each peer with the bytes of the peer's it has taken
off its sockets (`Engine.credit_datagram` builds the packet, `credit_of` reads
it; docs/operations.md describes the flow control).
"""

from __future__ import annotations

import struct
from typing import NamedTuple

__all__ = ["CREDIT_DRAINED", "CREDIT_SIZE", "Credit", "credit_of", "credit_payload"]

# A CONTROL packet's payload that credits its receiver: kind 1, the count's
# epoch, the bytes counted, flags, the window granted (`Engine.credit_datagram`,
# `credit_of`). Credits of older daemons, without the grant (18 bytes) or
# without flags too (17 bytes), are read as well, and a newer daemon's longer
# credit as far as these fields go: a field added later must leave them be.
_CREDIT = struct.Struct("!BQQBQ")
_CREDIT_V2 = struct.Struct("!BQQB")
_CREDIT_V1 = struct.Struct("!BQQ")
_CREDIT_KIND = 1
# flag: the sender's sockets held no datagram when it counted (nothing of the
# peer's waits there: what the count lacks was dropped or is still on the way)
CREDIT_DRAINED = 1


class Credit(NamedTuple):
    """What a credit says: `received` bytes of the peer's have left the
    crediting daemon's sockets, in its count named `epoch`; `drained`: its
    sockets were empty then; `window`: the bytes the peer may have in flight
    to it (its share of the crediting daemon's receive budget among all the
    hosts that send to it, in every job it has; 0: not said)."""

    epoch: int
    received: int
    drained: bool
    window: int


def credit_of(payload: bytes | memoryview) -> Credit | None:
    """What a credit's payload says; None for another kind of CONTROL packet."""
    if len(payload) < 1 or payload[0] != _CREDIT_KIND:
        return None
    n = len(payload)
    if n >= _CREDIT.size:  # a newer daemon's may add fields after these: read what is known
        _kind, epoch, received, flags, window = _CREDIT.unpack_from(payload)
    elif n == _CREDIT_V2.size:
        _kind, epoch, received, flags = _CREDIT_V2.unpack(payload)
        window = 0
    elif n == _CREDIT_V1.size:
        _kind, epoch, received = _CREDIT_V1.unpack(payload)
        flags = window = 0
    else:
        return None
    return Credit(epoch, received, bool(flags & CREDIT_DRAINED), window)


CREDIT_SIZE = _CREDIT.size


def credit_payload(epoch: int, received: int, drained: bool = False, window: int = 0) -> bytes:
    """The payload of a credit (see `Credit`)."""
    flags = CREDIT_DRAINED if drained else 0
    return _CREDIT.pack(_CREDIT_KIND, epoch, received, flags, window)
