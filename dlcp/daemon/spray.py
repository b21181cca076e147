"""The outbox's send to a peer with several paths (`spray`): the load
balancer chooses a path per packet of a batch, DONEs take the path that
carried most of their shard and retransmissions the one that loses least,
what went on a path out of use moves to the live ones (`reroute`), each
path's part goes in one send call, and what of it went is noted for the
NACKs (`pathloss.track`) and, where urgent, for a path found down
(`reroute.remember`). `count_sent` counts a send on any path.

Used by `dlcp.daemon.sending.Sending` (a flush) only.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

import numpy as np

from dlcp.core.rate import WIRE_OVERHEAD
from dlcp.daemon.packet_keys import _DONE, _DR, _barrier_key, _by_path, _identity, _shard_keys
from dlcp.daemon.pathloss import track
from dlcp.daemon.peer import _F_RETRANSMIT, _NOT_DR_TABLE, FRONT, N_CLASSES, Peer, _left, _took
from dlcp.daemon.reroute import remember, reroute
from dlcp.policies import PathState

__all__ = ["count_sent", "spray"]

# by type byte: 1 for a DONE; by flags byte: 1 where RETRANSMIT is set
_DONE_TABLE = bytes(1 if t == _DONE else 0 for t in range(256))
_RESENT_TABLE = bytes(1 if f & _F_RETRANSMIT else 0 for f in range(256))


def _or_bytes(a: bytes, b: bytes) -> bytes:
    """`a | b` byte by byte (both of 0s and 1s, of one length), in bigint steps."""
    return (int.from_bytes(a, "little") | int.from_bytes(b, "little")).to_bytes(len(a), "little")


def _places(mask: bytes) -> list[int]:
    """The places of the 1s in `mask` (a few, usually: a find each)."""
    out = []
    k = mask.find(1)
    while k >= 0:
        out.append(k)
        k = mask.find(1, k + 1)
    return out


def _runs_of(
    out: list[int],
    bkeys: Sequence[bytes | None],
    offsets: bytes,
    resent: set[int],
) -> tuple[list[tuple[bytes, bytes]], Iterable[tuple[bytes, int]]]:
    """What `pathloss.track` notes of the packets at places `out` that went on
    one path (`offsets`: their offset fields in that order; `bkeys` the
    batch's barrier keys, None for other types): per run of one shard and leg,
    the offsets of its first transmissions; and the DATA/RESULT packets
    counted per shard and leg, in order of first appearance."""
    notes: list[tuple[bytes, bytes]] = []
    counts: Counter[bytes] = Counter()
    run: list[bytes] = []
    key: bytes | None = None
    for j, i in enumerate(out):
        b = bkeys[i]
        if b is None:
            continue
        counts[b] += 1
        if i in resent:
            continue
        if b is not key and b != key:
            if run and key is not None:
                notes.append((key, b"".join(run)))
            run, key = [], b
        run.append(offsets[4 * j : 4 * j + 4])
    if run and key is not None:
        notes.append((key, b"".join(run)))
    return notes, counts.items()


def _least_lossy(paths: Sequence[PathState]) -> int:
    """The path with the lowest recent loss rate among those with a traffic share."""
    used = [p for p in range(len(paths)) if paths[p].weight > 0] or list(range(len(paths)))
    return min(used, key=lambda p: paths[p].loss_rate)


def spray(
    peer: Peer,
    batch: list[bytes],
    queue: int,
    waits: list[float] | None,
    tos_of: Sequence[int],
    now: float,
) -> tuple[int, bool, bool]:
    """Send what of `batch` (of queue `queue`, whose class's TOS byte is in
    `tos_of`) the balancer puts on paths with budget (`waits` 0, or no
    pacing), for a peer with several paths; returns (sent from
    the head, some held for a path without budget, socket full). Packets
    sent behind an unsent one leave the queue here; the unsent stay at its
    head, to be assigned again."""
    paths = peer.paths
    cls = queue % N_CLASSES
    tos = tos_of[cls]
    ready = None if waits is None else [w == 0 for w in waits]
    chosen = peer.balancer.assign(
        n=len(batch), paths=paths, ready=None if ready is None else np.array(ready)
    )
    assign: list[int] = (
        chosen.tolist() if isinstance(chosen, np.ndarray) else [int(p) for p in chosen]
    )
    heads, bkeys, _ = _shard_keys(batch)  # type and flags bytes; barrier keys (None: others)
    kinds = heads[0::2]
    n_all = len(batch)
    # the DONEs and retransmissions (few): 1 where either
    special_mask = _or_bytes(kinds.translate(_DONE_TABLE), heads[1::2].translate(_RESENT_TABLE))
    special = _places(special_mask)
    resent: set[int] = set()  # retransmissions: sent, counted, never charged
    safest = -1
    for i in special:
        dg = batch[i]
        t = dg[3]
        if t == _DONE:
            # The DONE takes the path that carried most of its shard, whose
            # switch queue it should not overtake: a DONE that arrives first
            # on an idle path makes the receiver NACK packets still queued.
            counts = peer.shard_paths.get(_barrier_key(dg))
            if counts is not None:
                assign[i] = counts.index(max(counts))
        elif t in _DR:  # a retransmission
            resent.add(i)
            # A retransmission takes the path that loses least, among those
            # the balancer uses: losing it again costs another NACK round.
            if safest < 0:
                safest = _least_lossy(paths)
            if paths[safest].loss_rate < paths[assign[i]].loss_rate:
                assign[i] = safest
    if peer.usable is not None:
        reroute(peer, assign, peer.usable)
    not_dr = kinds.translate(_NOT_DR_TABLE)
    all_dr = 1 not in not_dr
    one_shard = all_dr and bkeys.count(bkeys[0]) == n_all
    # the urgent ones (`_urgent`), kept per path for `path_down` where probed:
    # DONEs and retransmissions (`special`), and every other type but DATA/RESULT
    urgent: list[int] = []
    if peer.health is not None:
        urgent = special if all_dr else _places(_or_bytes(special_mask, not_dr))
    # each path's part, in order (`_by_path`: in C, no step a datagram); a
    # partial send on any path stops the batch there
    groups, places, offsets, _ = _by_path(batch, assign, len(paths))
    done = 0
    full = held = False
    sent_idx: list[int] = []
    for p, dgs in enumerate(groups):
        if dgs is None:
            continue
        idx = places[p]
        assert idx is not None
        if ready is not None and not ready[p]:
            held = True  # no budget on this path: its packets wait
            continue
        n = peer.local[p].send(dgs, peer.dest(p), tos)
        if n:
            out = idx if n == len(idx) else idx[:n]
            sent_idx += out
            if urgent:  # those of them that went on this path
                sent = set(out) if n < len(idx) else None
                mine = [i for i in urgent if assign[i] == p and (sent is None or i in sent)]
                remember(peer, p, cls, [batch[i] for i in mine], now)
            count_sent(peer, cls, p, n, sum(map(len, dgs if n == len(dgs) else dgs[:n])), now)
            offs = offsets[p]
            assert offs is not None
            if one_shard and not resent:  # the usual batch: one note, one count
                bkey = bkeys[0]
                assert bkey is not None
                notes = [(bkey, offs[: 4 * n])]
                per_shard: Iterable[tuple[bytes, int]] = ((bkey, n),)
            else:
                notes, per_shard = _runs_of(out, bkeys, offs, resent)
            track(peer, notes, per_shard, p)
        done += n
        if n < len(dgs):
            full = True
            break
    if done == len(batch):
        return done, False, False
    # keep the unsent ones at the head of the queue, in their order
    sent_mask = [False] * len(batch)
    for i in sent_idx:
        sent_mask[i] = True
    prefix = sent_mask.index(False)
    q = peer.queues[queue]
    for i in range(len(batch) - 1, prefix - 1, -1):
        if sent_mask[i]:
            dg = q[i]
            peer.pending.discard(_identity(dg))
            del q[i]  # sent out of order on another path
            if queue < FRONT:
                _took(peer, queue, 1)
            _left(peer, dg)
            peer.queued -= 1
    return prefix, held, full


def count_sent(peer: Peer, cls: int, p: int, n: int, nbytes: int, now: float) -> None:
    """`n` packets (`nbytes`) of class `cls` went out on path `p`."""
    peer.sent_total += nbytes
    peer.balancer.on_sent(peer.paths[p], n)
    peer.rate.on_sent(p, nbytes)
    peer.sent_packets[(cls, p)] += n
    peer.sent_bytes[(cls, p)] += nbytes
    if peer.pacers is not None:  # the wire's bytes
        peer.pacers[p].consume(nbytes + n * WIRE_OVERHEAD, now)
