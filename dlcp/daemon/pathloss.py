"""Losses charged to the paths they happened on: a NACK's packets looked up
among those recently sent to the peer (`Peer.sent_paths`, which `track`
fills as they go) and each path's balancer statistics and rate cut by its
own losses (`charge`). Functions of a `Peer`'s state: the outbox calls them.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from dlcp.core.layout import Layout
from dlcp.daemon.packet_keys import _DATA, _F_RESULT_LEG, _RESULT
from dlcp.daemon.peer import SHARDS_TRACKED, Peer
from dlcp.errors import LocalError
from dlcp.wire.header import HEADER_SIZE, Header, narrow_fits

__all__ = ["TRACKED_PER_GENERATION", "charge", "charge_nack", "show_rates", "track"]

TRACKED_PER_GENERATION = 1 << 15  # sent packets whose path is remembered (two generations)


def charge(peer: Peer, p: int, n: int, now: float) -> None:
    """`n` packets sent on path `p` were lost: the balancer's path statistics,
    then the path's rate, judged on the path's recent loss rate."""
    ps = peer.paths[p]
    peer.balancer.on_loss(ps, n, now)
    peer.rate.on_loss(p, n, now, loss_rate=ps.loss_rate)
    show_rates(peer)


def show_rates(peer: Peer) -> None:
    """Give the balancer each path's rate once some path of the peer found
    congestion; before that every rate is still growing in slow start and
    says nothing about what a path can carry (None)."""
    known = peer.pacers is not None and not all(c.slow_start for c in peer.rate.paths)
    for ps, c in zip(peer.paths, peer.rate.paths, strict=True):
        ps.rate_bps = c.rate_bps if known else None


def charge_nack(
    peer: Peer,
    nack: Header,
    datagram: bytes | memoryview,
    *,
    shards: int,
    payload: int,
    now: float,
    ranks: int = 0,
) -> None:
    """Tell the peer's balancer which paths lost the packets an accepted NACK names.

    `datagram` is the NACK as received (its payload lists shard-local packet
    indices, u32 big endian); `shards`, `payload` and `ranks` are the job's,
    for the bucket's layout (`JobSpec.layout`). Each named packet is
    looked up by (job, round, bucket, shard, offset, type) among the
    packets recently sent to this peer and charged to the path it took;
    the entry is forgotten, so a repeated NACK does not count it twice.
    Packets never sent or no longer remembered are not charged, and
    neither are retransmissions (`_send` does not remember them): a
    receiver repeats a NACK once the peer's usual answer time has passed
    (NackClock), so a repeat may cross a retransmission still in flight,
    and charging it would count a loss on a path that lost nothing.
    """
    n = nack.count
    if n <= 0:
        return
    paths = peer.paths
    if len(paths) == 1:
        charge(peer, 0, n, now)
        return
    try:
        narrow = narrow_fits(nack.codec, ranks)
        layout = Layout(nack.total, nack.codec, shards, payload, narrow)
        idx = np.frombuffer(datagram, ">u4", n, HEADER_SIZE).astype(np.int64)
    except (LocalError, ValueError):
        return
    first = layout.shard_packets(nack.shard).start
    per = layout.per_packet
    if nack.flags & _F_RESULT_LEG:
        split = layout.result_split
        step = -(-per // split)
        offsets = (first + idx // split) * per + (idx % split) * step
        kind = bytes((_RESULT,))
    else:
        offsets = (first + idx) * per
        kind = bytes((_DATA,))
    prefix = bytes(datagram[8:22])  # job, round, bucket, shard: where every header has them
    lost = [0] * len(paths)
    for p in peer.sent_paths.pop(kind + prefix, offsets.astype(">u4").tobytes()):
        if 0 <= p < len(lost):
            lost[p] += 1
    for p, k in enumerate(lost):
        if k:
            charge(peer, p, k, now)


def track(
    peer: Peer,
    notes: Iterable[tuple[bytes, bytes]],
    per_shard: Iterable[tuple[bytes, int]],
    path: int,
) -> None:
    """Remember the path of DATA/RESULT datagrams that went on `path` (`notes`:
    (barrier key, offset fields) of each run of one shard and leg, as
    `on_nack` looks them up), and count them per shard and
    path for the shard's DONE (`per_shard`: (barrier key, packets), in order
    of first appearance)."""
    sent = peer.sent_paths
    for bkey, offsets in notes:
        sent.note(bkey, offsets, path)
    shard_paths = peer.shard_paths
    for bkey, k in per_shard:
        counts = shard_paths.get(bkey)
        if counts is None:
            counts = shard_paths[bkey] = [0] * len(peer.paths)
        counts[path] += k
    if len(shard_paths) > SHARDS_TRACKED:  # DONEs that never went: forget the oldest
        for bkey in list(shard_paths)[: len(shard_paths) // 2]:
            del shard_paths[bkey]
    sent.rotate(TRACKED_PER_GENERATION)
