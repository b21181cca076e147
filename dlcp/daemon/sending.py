"""The outbox's sending half: `flush` takes each backlogged peer's queues in
their order (`peer._next_queue`), as far as its flow-control window and its
pacers allow, and hands them to the path sockets in GSO-sized batches, one
class a call: a peer with one path as much a call as its window and tokens
allow, one with several in batches whose packets the load balancer puts on
paths (`dlcp.daemon.spray`, which also moves what it put on a path that is
down to the live ones); NACKs' losses cut the
rates (`pathloss.charge`), and a path found down has its recent urgent datagrams
queued again (`path_down`).

`Sending` is the outbox's (`dlcp.daemon.outbox.Outbox.sending`), given the
outbox's backlog and `push`.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from dlcp.core.rate import WIRE_OVERHEAD
from dlcp.daemon.flow import probe_wait, take_credit, window_room
from dlcp.daemon.packet_keys import NATIVE_KEYS, _take, _unqueue
from dlcp.daemon.pathloss import show_rates
from dlcp.daemon.peer import FRONT, N_CLASSES, Peer, _next_queue, _release, _took
from dlcp.daemon.reroute import RESEND_HORIZON
from dlcp.daemon.spray import spray
from dlcp.daemon.transport import MAX_GSO_SEGMENTS

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


def _pacing_wake(now: float, waits: list[float]) -> float:
    """When to come back for the paths still short of budget (`waits` > 0;
    inf: out of use): the first of them due, but no sooner than PACING_QUANTUM."""
    soonest = math.inf  # min(w for w in waits if w > 0), without a generator's steps
    for w in waits:
        if 0 < w < soonest:
            soonest = w
    return now + max(soonest, PACING_QUANTUM)


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
            sent, held, full = spray(peer, batch, i, waits, self.tos, now)
            if sent:  # the batch's first `sent` (`spray` took those sent behind)
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
