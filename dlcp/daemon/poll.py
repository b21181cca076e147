"""One poll's drain taken with Python work per source and job, not per buffer.

`_udp.recv_drain` (dlcp/daemon/drain.h) takes a poll's buffers (recvmmsg, in
the budgets of `NetworkIn._splits`) and returns them as one drain: a
`Datagrams` of every datagram in arrival order and, per datagram, its source
(an index into the drain's distinct sources), its job (-1: shorter than a
header), its type byte, its length and its pair: the index of its (source,
job) among the drain's, with each pair's datagrams and bytes counted. `take`
then does what `NetworkIn._receive` does per buffer (or run of buffers) with
a Python step per pair (a few: the peers that sent in the drain) and array
operations: each datagram's node, the datagrams from an address outside
their job dropped and counted, the peers' received bytes and credits, the
engine's one call, and the accepted control packets (NACKs, credits and
probes, the bytes that acknowledge each peer).

The outcome is `NetworkIn._receive`'s on the same buffers: the same datagrams
and nodes reach the engine, the same counters and rejects, the same NACKs,
credits, probes and acknowledged bytes, in the same order.
tests/test_poll_native.py holds the two (and the per-datagram reference) equal.
DLCP_NATIVE_POLL=0 (or DLCP_NATIVE_RECV=0) turns it off: the per-buffer path.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from dlcp.daemon.flow import CREDIT_STEP
from dlcp.daemon.transport import NATIVE_RECV, split_gro
from dlcp.wire.batch import _bulk
from dlcp.wire.header import HEADER_SIZE, PacketType

if TYPE_CHECKING:
    from dlcp.daemon.jobs import JobState
    from dlcp.daemon.netin import NetworkIn
    from dlcp.daemon.outbox import Peer

__all__ = ["NATIVE_POLL", "Drain", "py_drain", "take"]

NATIVE_POLL = (
    NATIVE_RECV and _bulk is not None and os.environ.get("DLCP_NATIVE_POLL", "1") != "0"
)

# recv_drain's tuple: buffers, bytes, datagrams, sources, source index (int32
# bytes), job (int64 bytes), type bytes, length (int64 bytes), more, pair
# (int32 bytes: the index of the datagram's (source, job) among the drain's,
# numbered as they first appear), pairs (int64 bytes, five a pair: source
# index, job, first datagram, datagrams, bytes)
Drain = tuple[
    int, int, Sequence[memoryview], list[str], bytes, bytes, bytes, bytes, int, bytes, bytes
]

_DATA = int(PacketType.DATA)
_NACK = int(PacketType.NACK)
_CONTROL = int(PacketType.CONTROL)
_ACKING = np.zeros(256, dtype=bool)  # by type byte: the packets that acknowledge their peer
_ACKING[[PacketType.RESULT, PacketType.ACK, PacketType.DONE]] = True
_KIND_BYTES = {k: bytes([k]) for k in (_DATA, _NACK, _CONTROL)}


def py_drain(buffers: Sequence[tuple[bytes, int, str]], more: int = 0) -> Drain:
    """The drain of `buffers` (data, GRO segment size, source) in Python: the
    definition `_udp.drain_buffers` and `_udp.recv_drain` are held to (the
    datagrams a list of views instead of a `Datagrams`)."""
    dgs: list[memoryview] = []
    srcs: list[str] = []
    at: dict[str, int] = {}
    src: list[int] = []
    job: list[int] = []
    kind = bytearray()
    pair: list[int] = []
    pairs: dict[tuple[int, int], list[int]] = {}  # (source, job): index, first, datagrams, bytes
    for data, seg, s in buffers:
        i = at.setdefault(s, len(srcs))
        if i == len(srcs):
            srcs.append(s)
        for dg in split_gro(data, seg)[0]:
            whole = len(dg) >= HEADER_SIZE
            dgs.append(dg)
            src.append(i)
            job.append(int.from_bytes(dg[8:12], "big") if whole else -1)
            kind.append(dg[3] if whole else 0)
            entry = pairs.setdefault((i, job[-1]), [len(pairs), len(dgs) - 1, 0, 0])
            entry[2] += 1
            entry[3] += len(dg)
            pair.append(entry[0])
    table = [[s_, j, *e[1:]] for (s_, j), e in pairs.items()]
    return (
        len(buffers),
        sum(len(b[0]) for b in buffers),
        dgs,
        srcs,
        np.array(src, np.int32).tobytes(),
        np.array(job, np.int64).tobytes(),
        bytes(kind),
        np.array([len(d) for d in dgs], np.int64).tobytes(),
        more,
        np.array(pair, np.int32).tobytes(),
        np.array(table, np.int64).reshape(-1, 5).tobytes(),
    )


def take(net: NetworkIn, drain: Drain, now: float) -> None:
    """`NetworkIn._receive`'s work on one drain (see the module's doc)."""
    _, nbytes, dgs, srcs, _, _, kinds, len_raw, _, pair_raw, pairs_raw = drain
    n = len(dgs)
    net.counters["rx_packets"] += n  # all of them, those rejected here too
    net.counters["rx_bytes"] += nbytes
    if n == 0:
        return
    inverse = np.frombuffer(pair_raw, np.int32)
    pairs = np.frombuffer(pairs_raw, np.int64).reshape(-1, 5).tolist()
    k = len(pairs)
    groups: list[tuple[JobState | None, int]] = []  # (job, node) of each pair, -1: none
    dropped = [False] * k
    senders: dict[Peer, JobState] = {}  # the peers that sent, by their first datagram
    jobs = net.jobs
    for g, (src, job_id, _, count, size) in enumerate(pairs):
        job = None if job_id < 0 else jobs.get(job_id)
        node = None if job is None else job.node_of.get(srcs[src])
        if job is not None and node is None:
            dropped[g] = True
            net.daemon_rejects["bad_address"] += count
        if job is None or node is None:
            groups.append((job, -1))
            continue
        groups.append((job, node))
        peer = job.peers.get(node)
        if peer is not None:  # the bytes of its datagrams (each holds a whole header)
            peer.rx_bytes += size
            senders[peer] = job
    for peer, job in senders.items():  # their bytes left the socket: room for more
        peer.rx_job = job.spec.job
        if peer.health is not None:
            peer.health.touch(now)
        if peer.rx_bytes - peer.rx_credited >= CREDIT_STEP:
            net._credit(peer, job)
    kind = np.frombuffer(kinds, np.uint8)
    lengths = np.frombuffer(len_raw, np.int64)
    if any(dropped):
        kept = np.flatnonzero(~np.array(dropped)[inverse])
        if not kept.size:
            return
        dgs = _bulk.pick(dgs, kept)
        inverse, lengths, kind = inverse[kept], lengths[kept], kind[kept]
    nodes = np.array([node for _, node in groups], np.int64)
    accepted = net.engine.receive_many(dgs, now, nodes[inverse])
    if not accepted.size:
        return
    kind = kind[accepted]
    control = kind != _DATA
    if not control.any():
        return
    positions = accepted[control]
    _on_control(
        net, positions, kind[control], inverse[positions], lengths[positions], dgs, groups, now
    )


def _peer_of(group: tuple[JobState | None, int]) -> Peer | None:
    job, node = group
    return None if job is None or node < 0 else job.peers.get(node)


def _on_control(
    net: NetworkIn,
    positions: np.ndarray,
    kind: np.ndarray,
    group: np.ndarray,
    lengths: np.ndarray,
    dgs: Sequence[Any],
    groups: list[tuple[JobState | None, int]],
    now: float,
) -> None:
    """Accepted packets other than data, at `positions` of `dgs` (of pairs
    `group`, `lengths` bytes each): each NACK in order, then each credit or
    probe, then per peer the bytes of its results, ACKs and DONEs."""
    types = kind.tobytes()
    if _KIND_BYTES[_NACK] in types:
        nack = kind == _NACK
        for i, g in zip(positions[nack].tolist(), group[nack].tolist(), strict=True):
            peer = _peer_of(groups[g])
            if peer is None:
                continue
            job = groups[g][0]
            assert job is not None
            net.on_nack(peer, job, dgs[i], now)
    if _KIND_BYTES[_CONTROL] in types:
        credit = kind == _CONTROL
        for i, g in zip(positions[credit].tolist(), group[credit].tolist(), strict=True):
            peer = _peer_of(groups[g])
            if peer is None:
                continue
            job = groups[g][0]
            assert job is not None
            net.on_control(peer, job, dgs[i], now)
    acking = _ACKING[kind]
    if not acking.any():
        return
    g = group[acking]
    nbytes = np.bincount(g, weights=lengths[acking], minlength=len(groups))
    _, first = np.unique(g, return_index=True)  # each pair's first acknowledging packet
    acked: dict[Peer, int] = {}
    for gg in g[np.sort(first)].tolist():  # pairs in the order of those
        peer = _peer_of(groups[gg])
        if peer is not None and nbytes[gg]:
            acked[peer] = acked.get(peer, 0) + int(nbytes[gg])
    for peer, nb in acked.items():  # once per peer and drain
        peer.rate.on_ack(nb, None, now)
