"""The outbox's sending half: `flush` takes each backlogged peer's queues in
their order (`peer._next_queue`), as far as its flow-control window and its
pacers allow, and hands them to the path sockets in GSO-sized batches, one
class a call, with the load balancer choosing a path per packet (and moving
what it put on a path that is down to the live ones); NACKs' losses cut the
rates (`pathloss.charge`), and a path found down has its recent urgent datagrams
queued again (`path_down`).

`Sending` is the outbox's (`dlcp.daemon.outbox.Outbox.sending`), given the
outbox's backlog and `push`.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterable, Sequence

import numpy as np

from dlcp.core.rate import WIRE_OVERHEAD
from dlcp.daemon.flow import probe_wait, take_credit, window_room
from dlcp.daemon.packet_keys import (
    _DONE,
    _DR,
    NATIVE_KEYS,
    _barrier_key,
    _by_path,
    _identity,
    _shard_keys,
    _take,
    _unqueue,
)
from dlcp.daemon.pathloss import show_rates, track
from dlcp.daemon.peer import (
    _F_RETRANSMIT,
    _NOT_DR_TABLE,
    FRONT,
    N_CLASSES,
    Peer,
    _left,
    _next_queue,
    _release,
    _took,
)
from dlcp.daemon.reroute import RESEND_HORIZON, remember, reroute
from dlcp.daemon.transport import MAX_GSO_SEGMENTS
from dlcp.policies import PathState

__all__ = ["Sending"]

BATCH_BYTES = 64 * 1024  # bytes handed to the kernel per send (one GSO super-datagram)

# A peer with one path gets up to this much per send call when its pacer has
# the tokens (or it is not paced): UdpPath.send cuts it into super-datagrams
# and hands them to the kernel in batches of sendmmsg. The outbox's own work
# (identities, barriers, counters, pacer) is then done once a flush instead of
# once per super-datagram, which cost as much as the kernel's part of a send.
# 4 MB rather than 1: the send calls took 17 ns a datagram less at MTU 1500
# (bench/diag/send_path.py, 360 against 377) and a daemon about 2 % less CPU a
# round (BENCHMARKS.md, round 32). A flush sends all the window and pacers
# allow either way; this only cuts it into fewer calls.
FLUSH_BYTES = 4 << 20

FLUSH_COUNT = 4096  # ... and at most this many datagrams

PACING_SLACK = 1e-6  # seconds: a path due this soon has budget (rounding at wake-ups)

# A pacer short of budget is woken no sooner than this: at high rates one batch
# costs tens of microseconds of tokens, and waking for each (a loop iteration,
# a receive poll and the engine's timers apiece) spends the CPU the sending
# needs. Later wake-ups send what the tokens earned meanwhile at once, so the
# rate over time is the same (the token bucket), in bursts of at most
# rate x PACING_QUANTUM (within the BURST_SECONDS burst).
PACING_QUANTUM = 0.001

# A daemon that comes back later than its pacers asked (busy receiving and
# summing, or waiting for a core) keeps the tokens its rates earned meanwhile,
# up to this long at the rate, beyond the BURST_SECONDS burst (Pacer.catch_up):
# with 4 busy processes on 2 cores the wake-ups came several milliseconds late,
# every token beyond the burst was lost, and pacing at a 10 Gbit/s rate held a
# veth at 0.7x its unpaced throughput while sending a fraction of that rate.
CATCH_UP_SECONDS = 0.02


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


def _pacing_wake(now: float, waits: list[float]) -> float:
    """When to come back for the paths still short of budget (`waits` > 0;
    inf: out of use): the first of them due, but no sooner than PACING_QUANTUM."""
    soonest = math.inf  # min(w for w in waits if w > 0), without a generator's steps
    for w in waits:
        if 0 < w < soonest:
            soonest = w
    return now + max(soonest, PACING_QUANTUM)


def _least_lossy(paths: Sequence[PathState]) -> int:
    """The path with the lowest recent loss rate among those with a traffic share."""
    used = [p for p in range(len(paths)) if paths[p].weight > 0] or list(range(len(paths)))
    return min(used, key=lambda p: paths[p].loss_rate)


class Sending:
    """Flushing the queues to the sockets; rate cuts from losses; credits.

    Owns what a flush finds out (`blocked`, `next_wake`) and counts (`credits`,
    `resent_on_down`), and the TOS byte of each class (`tos`); it is given the
    outbox's set of peers with datagrams queued (`backlog`, which a flush
    empties as their queues do) and its `push` (what a path found down had
    in flight is queued again)."""

    def __init__(
        self,
        *,
        backlog: set[Peer],
        tos: list[int],
        push: Callable[[Peer, bytes, int], bool],
    ) -> None:
        self.backlog = backlog
        self.tos = tos
        self.push = push
        self.blocked = False  # a socket was full: wait for writability
        self.next_wake: float | None = None
        self.credits = 0  # credits taken
        self.resent_on_down = 0  # urgent datagrams queued again when their path went down

    def on_loss(self, peer: Peer, n: int, now: float) -> None:
        """A peer's NACK named `n` packets: counted. The rates are cut per path by
        `on_nack`, which knows the path each of them took."""
        peer.rate.on_nacked(n)

    def flush(self, now: float) -> None:
        """Send what pacing and the sockets allow; sets `next_wake` and `blocked`."""
        self.next_wake = None
        self.blocked = False
        for peer in list(self.backlog):
            wake = self._flush_peer(peer, now)
            peer.wake_at = wake
            if peer.queued == 0:
                self.backlog.discard(peer)
                if peer.pacers is not None:
                    for pacer in peer.pacers:
                        # an idle path's next burst: PACING_QUANTUM at its rate,
                        # so that the H - 1 senders that start a round towards
                        # one port at once do not each send a whole burst
                        pacer.settle(now, pacer.rate_bps * PACING_QUANTUM / 8)
            elif wake is not None and (self.next_wake is None or wake < self.next_wake):
                self.next_wake = wake
            if self.blocked:
                return

    def _flush_peer(self, peer: Peer, now: float) -> float | None:
        pacers = peer.pacers
        if pacers is not None:
            late = 0.0 if peer.wake_at is None else min(now - peer.wake_at, CATCH_UP_SECONDS)
            for pacer, rate in zip(pacers, peer.rate.rates(), strict=True):
                pacer.retune(rate, late, now)  # catch_up where late, set_rate
            show_rates(peer)
        if len(peer.paths) == 1:
            return self._flush_one(peer, now)
        pending, watched = peer.pending, peer.watched
        release = _release
        while (i := _next_queue(peer)) >= 0:
            q = peer.queues[i]
            # what `_unqueue` pops the sent with: a Fifo itself (at once), a
            # deque's popleft (once a datagram)
            popleft = q if NATIVE_KEYS else q.popleft
            # at most the oldest step's packets of the class: then the order is looked at again
            run = FLUSH_COUNT if i >= FRONT else peer.steps[i][0][1]
            window = FLUSH_BYTES
            if peer.window:
                window = window_room(peer, now, len(q[0]))
                if window <= 0:
                    assert peer.stalled_since is not None
                    return peer.stalled_since + probe_wait(peer)
            waits: list[float] | None = None
            if pacers is not None:
                # a path with any budget may take its part of the batch (into
                # debt that its later sends pay off: the rate holds over time)
                waits = [pacer.delay(1.0, now) for pacer in pacers]
                for p, w in enumerate(waits):
                    if w < PACING_SLACK:
                        waits[p] = 0.0
                if peer.usable is not None:  # a path out of use is never ready
                    waits = [w if u else math.inf for w, u in zip(waits, peer.usable, strict=True)]
                if min(waits) > 0:
                    return _pacing_wake(now, waits)
            batch, _ = _take(q, min(BATCH_BYTES, window), min(MAX_GSO_SEGMENTS, run))
            sent, held, full = self._send(peer, batch, i, waits, now)
            if sent:  # the batch's first `sent` (`_send` took those sent behind)
                if i < FRONT:
                    _took(peer, i, sent)
                for bkey, k in _unqueue(pending, batch, sent, popleft, watched):
                    release(peer, bkey, k)
                peer.queued -= sent
            if full:
                self.blocked = True
                return None
            if held:  # the balancer chose paths without budget: they wait for it
                assert waits is not None
                return _pacing_wake(now, waits)
        return None

    def _flush_one(self, peer: Peer, now: float) -> float | None:
        """`_flush_peer` for a peer with one path: as much a send as the
        window and the path's tokens allow. What stays the same for the
        whole flush (the path, its address, its pacer) is looked up once."""
        pacer0 = None if peer.pacers is None else peer.pacers[0]
        path0, dest, tos = peer.local[0], (peer.addresses[0], peer.port), self.tos  # dest(0)
        pending, watched, queues, steps = peer.pending, peer.watched, peer.queues, peer.steps
        paths, release = peer.paths, _release
        # (min() and max() written out: they were most of the calls a batch)
        while (i := _next_queue(peer)) >= 0:
            q = queues[i]
            popleft = q if NATIVE_KEYS else q.popleft  # as in `_flush_peer`
            run = FLUSH_COUNT
            if i < FRONT and (step := steps[i][0][1]) < FLUSH_COUNT:
                run = step
            head = len(q[0])
            window = FLUSH_BYTES
            if peer.window:
                window = window_room(peer, now, head)
                if window <= 0:
                    assert peer.stalled_since is not None
                    return peer.stalled_since + probe_wait(peer)
            room = FLUSH_BYTES  # as much as the tokens allow (at least a batch: into debt)
            if pacer0 is not None:  # one path: its budget alone
                wait, tokens = pacer0.budget(now)
                if wait >= PACING_SLACK:  # `_pacing_wake`
                    return now + (wait if wait > PACING_QUANTUM else PACING_QUANTUM)
                # what the tokens allow, at least a datagram (into debt):
                # not a whole batch, whose 44 datagrams at a time from
                # each sender kept a queue at a port they fill to 97 %
                if (allowed := int(tokens)) < room:
                    room = allowed
                if head > room:
                    room = head
            batch, sizes = _take(q, window if window < room else room, run)
            cls = i % N_CLASSES
            sent = path0.send(batch, dest, tos[cls])
            if sent:  # `_sent(peer, cls, 0, sent, nbytes, now)` inline
                nbytes = sizes[sent - 1]
                peer.sent_total += nbytes
                peer.balancer.on_sent(paths[0], sent)
                peer.rate.on_sent(0, nbytes)
                key = (cls, 0)
                peer.sent_packets[key] += sent
                peer.sent_bytes[key] += nbytes
                if pacer0 is not None:  # the wire's bytes
                    pacer0.consume(nbytes + sent * WIRE_OVERHEAD, now)
                if i < FRONT:
                    _took(peer, i, sent)
                # identities out of `pending`, the batch off the queue, and
                # per shard the packets its held DONEs were waiting for
                for bkey, k in _unqueue(pending, batch, sent, popleft, watched):
                    release(peer, bkey, k)
                peer.queued -= sent
            if sent < len(batch):
                self.blocked = True
                return None
        return None

    def _send(
        self,
        peer: Peer,
        batch: list[bytes],
        queue: int,
        waits: list[float] | None,
        now: float,
    ) -> tuple[int, bool, bool]:
        """Send what of `batch` the balancer puts on paths with budget (`waits`
        0, or no pacing), for a peer with several paths; returns (sent from
        the head, some held for a path without budget, socket full). Packets
        sent behind an unsent one leave the queue here; the unsent stay at its
        head, to be assigned again."""
        paths = peer.paths
        cls = queue % N_CLASSES
        tos = self.tos[cls]
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
                self._sent(peer, cls, p, n, sum(map(len, dgs if n == len(dgs) else dgs[:n])), now)
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

    def path_down(self, peer: Peer, p: int, now: float) -> int:
        """Path `p` to `peer` was found down: queue again what urgent went on it
        within RESEND_HORIZON (they go on the live paths now), so that the
        peer's aggregations do not wait for their timers to ask for the DONEs,
        NACKs and retransmissions it lost; the data packets lost there are
        NACKed once their DONEs arrive. Returns how many were queued."""
        recent = peer.recent.pop(p, None)
        n = 0
        for t, cls, dg in recent or ():
            if t >= now - RESEND_HORIZON and self.push(peer, dg, cls):
                n += 1
        self.resent_on_down += n
        return n

    def on_credit(
        self,
        peer: Peer,
        received: int,
        epoch: int,
        drained: bool = False,
        window: int = 0,
        now: float | None = None,
    ) -> None:
        """A credit from `peer` (`flow.take_credit`), counted."""
        self.credits += 1
        take_credit(peer, received, epoch, drained, window, now)

    @staticmethod
    def _sent(peer: Peer, cls: int, p: int, n: int, nbytes: int, now: float) -> None:
        """`n` packets (`nbytes`) of class `cls` went out on path `p`."""
        peer.sent_total += nbytes
        peer.balancer.on_sent(peer.paths[p], n)
        peer.rate.on_sent(p, nbytes)
        peer.sent_packets[(cls, p)] += n
        peer.sent_bytes[(cls, p)] += nbytes
        if peer.pacers is not None:  # the wire's bytes
            peer.pacers[p].consume(nbytes + n * WIRE_OVERHEAD, now)
