"""A frozen copy of dlcp/daemon/outbox.py as it was before the outbox's bulk
paths (main at 2d6a5c5, one Python step per packet in push and flush): the
reference that tests/test_outbox_batch.py holds the outbox to, datagram for
datagram. Not used by dlcp itself; do not change it to follow the outbox.
Deliberate changes since, marked "changed" below: a peer with one path is
sent up to FLUSH_BYTES per send call when its pacer has the tokens (the
outbox's one-path flushes, handed to sendmmsg); and the service order: urgent
packets (all but first transmissions of DATA/RESULT) in queues of their own
(FRONT + class), served first by class, and first transmissions served by the
step of their shard and leg (numbered as shards and legs come, while some of
them is queued), then by class, here kept one step a packet.

Its original docstring:

Per-destination send queues: strict priority between classes, paced per path, sprayed.

The engine hands datagrams with a priority class; they wait here per peer in
one FIFO per class. `flush` sends the highest class first, in GSO-sized
batches, choosing a path per packet with the load balancer among the paths
whose pacer has budget; each (peer, path) has its own rate controller and
pacer, cut by the losses NACKs charge to that path. What the pacers or a full
socket hold back waits for the next `flush` (the daemon calls it again at
`next_wake`, or when the socket is writable).
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from dlcp.core.layout import Layout
from dlcp.core.rate import WIRE_OVERHEAD, Pacer, PathRates, RateConfig
from dlcp.daemon.transport import MAX_GSO_SEGMENTS, UdpPath
from dlcp.errors import LocalError
from dlcp.policies import LoadBalancer, PathState
from dlcp.wire.header import HEADER_SIZE, Flags, Header

__all__ = ["Outbox", "Peer"]

N_CLASSES = 8
FRONT = N_CLASSES  # changed: urgent queues, FRONT + class


def _identity(datagram: bytes) -> bytes:
    """What makes a packet itself, whatever its flags, class or MAC: the type
    byte and the header fields from job to element count (bytes 8..35). A NACK
    for a packet still queued here must not queue it again."""
    return datagram[3:4] + datagram[8:36]


_DATA, _RESULT, _DONE = 1, 2, 4  # PacketType values, byte 3 of the header
_F_DROPPABLE = int(Flags.DROPPABLE)


def _barrier_key(datagram: bytes) -> bytes:
    """(job, round, bucket, shard) and the leg: what a DONE vouches for."""
    result_leg = datagram[3] == _RESULT or (datagram[3] == _DONE and datagram[4] & _F_RESULT_LEG)
    return datagram[8:22] + (b"r" if result_leg else b"d")


_F_RESULT_LEG = int(Flags.RESULT_LEG)
_F_RETRANSMIT = int(Flags.RETRANSMIT)
TRACKED_PER_GENERATION = 1 << 15  # sent packets whose path is remembered (two generations)
SHARDS_TRACKED = 4096  # shards (and legs) whose packets per path are counted for their DONE
BATCH_BYTES = 64 * 1024  # bytes handed to the kernel per send (one GSO super-datagram)
FLUSH_BYTES = 4 << 20  # changed: the most a one-path peer is sent per call
FLUSH_COUNT = 4096
BURST_BYTES = 64 * 1024  # changed: pacer burst, one batch (256 KB before)
# ... or this long at the path's rate, if more: the daemon's loop comes back to
# send only every millisecond or few when busy receiving; a fixed burst lost
# the tokens beyond it and held a 10 Gbit/s rate to a fraction of that
BURST_SECONDS = 0.004
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
    """When to come back for the paths still short of budget (`waits` > 0): the
    first of them due, but no sooner than PACING_QUANTUM."""
    return now + max(min(w for w in waits if w > 0), PACING_QUANTUM)


@dataclass(eq=False)
class Peer:
    """A remote daemon: its path addresses, pacing and path statistics.

    `rate` has one rate controller per path, `pacers` one pacer per path (None:
    no pacing); path p is (local[p], addresses[p]).
    """

    addresses: tuple[str, ...]
    port: int
    local: Sequence[UdpPath]
    rate: PathRates
    pacers: list[Pacer] | None
    balancer: LoadBalancer
    paths: list[PathState] = field(default_factory=list)
    # changed: 2 * N_CLASSES queues; each first transmission's step (per class)
    queues: list[deque[bytes]] = field(
        default_factory=lambda: [deque() for _ in range(2 * N_CLASSES)]
    )
    steps: list[deque[int]] = field(default_factory=lambda: [deque() for _ in range(N_CLASSES)])
    step_of: dict[bytes, int] = field(default_factory=dict)
    queued: int = 0
    pending: set[bytes] = field(default_factory=set)  # identities of queued packets
    # DONE barrier per (job, round, bucket, shard, leg): DATA/RESULT packets still
    # queued here, the lowest-priority class of its non-droppable ones (kept for
    # DONEs sent again; bounded: SHARDS_TRACKED), held DONEs
    inflight: Counter[bytes] = field(default_factory=Counter)
    trail_class: dict[bytes, int] = field(default_factory=dict)
    held: dict[bytes, list[tuple[bytes, int]]] = field(default_factory=dict)
    sent_packets: Counter[tuple[int, int]] = field(default_factory=Counter)  # (class, path)
    sent_bytes: Counter[tuple[int, int]] = field(default_factory=Counter)
    # path of recently sent DATA/RESULT packets, keyed as in `pathloss.track` (multi-path
    # peers only); two generations: when `tracked` fills up it becomes `tracked_old`
    tracked: dict[bytes, int] = field(default_factory=dict)
    tracked_old: dict[bytes, int] = field(default_factory=dict)
    # packets per path of each recent shard and leg (barrier key), multi-path peers
    # only: its DONEs take the path that carried the most (bounded: SHARDS_TRACKED)
    shard_paths: dict[bytes, list[int]] = field(default_factory=dict)
    wake_at: float | None = None  # when the pacers last asked to be flushed again

    def __post_init__(self) -> None:
        n = min(len(self.addresses), len(self.local))
        self.paths = [PathState(key=(self.local[p].address, self.addresses[p])) for p in range(n)]

    @property
    def name(self) -> str:
        return f"{self.addresses[0]}:{self.port}"

    def dest(self, path: int) -> tuple[str, int]:
        return self.addresses[path], self.port


def _least_lossy(paths: Sequence[PathState]) -> int:
    """The path with the lowest recent loss rate among those with a traffic share."""
    used = [p for p in range(len(paths)) if paths[p].weight > 0] or list(range(len(paths)))
    return min(used, key=lambda p: paths[p].loss_rate)


class Outbox:
    def __init__(
        self,
        paths: Sequence[UdpPath],
        *,
        dscp: Sequence[int],
        rate: RateConfig,
        pacing: bool,
        balancer_factory: object,
    ) -> None:
        self.paths = paths
        self.tos = [int(d) << 2 for d in dscp]
        self.rate_config = rate
        self.pacing = pacing
        self._balancer_factory = balancer_factory
        self.peers: dict[tuple[tuple[str, ...], int], Peer] = {}
        self.backlog: set[Peer] = set()
        self.blocked = False  # a socket was full: wait for writability
        self.next_wake: float | None = None
        self.repeats = 0
        self.step = 0  # changed: the last step given to a shard and leg
        self.loss_interval = 0.05  # at most one rate cut per path in this many seconds

    def peer(self, addresses: tuple[str, ...], port: int, now: float) -> Peer:
        key = (addresses, port)
        p = self.peers.get(key)
        if p is None:
            n_paths = max(1, min(len(addresses), len(self.paths)))
            rate = PathRates(n_paths, self.rate_config, decrease_interval=self.loss_interval)
            pacers = (
                [
                    Pacer(  # changed: no tokens to start with
                        rate_bps=r,
                        burst_bytes=BURST_BYTES,
                        now=now,
                        burst_seconds=BURST_SECONDS,
                        tokens=0.0,
                    )
                    for r in rate.rates()
                ]
                if self.pacing
                else None
            )
            balancer = self._balancer_factory()  # type: ignore[operator]
            p = Peer(addresses, port, self.paths, rate, pacers, balancer)
            self.peers[key] = p
        return p

    def set_balancer_factory(self, factory: object) -> None:
        self._balancer_factory = factory
        for p in self.peers.values():
            p.balancer = factory()  # type: ignore[operator]

    def push(self, peer: Peer, datagram: bytes, priority: int) -> bool:
        """Queue a datagram; False when the same bytes are already waiting (a repeat).
        A DONE is never a repeat (as in dlcp/daemon/outbox.py since the copy)."""
        if datagram[3] != _DONE:
            key = _identity(datagram)
            if key in peer.pending:
                self.repeats += 1
                return False
            peer.pending.add(key)
        peer.queued += 1
        self.backlog.add(peer)
        kind = datagram[3]
        cls = min(max(priority, 0), N_CLASSES - 1)
        if kind == _DONE:
            # A DONE says "all my packets of this shard are out". It waits here
            # until they have left, and then travels in the class of the last of
            # them, so neither our queues nor the switch's let it overtake them
            # (the receiver would NACK packets that are merely queued). So does
            # a DONE sent again (asked for by the receiver) after the first.
            bkey = _barrier_key(datagram)
            if peer.inflight.get(bkey):
                peer.held.setdefault(bkey, []).append((datagram, cls))
            else:
                cls = peer.trail_class.get(bkey, cls)
                peer.queues[FRONT + cls].append(datagram)  # changed: urgent
            return True
        if kind in (_DATA, _RESULT):
            bkey = _barrier_key(datagram)
            peer.inflight[bkey] += 1
            droppable = datagram[4] & _F_DROPPABLE
            if not droppable and cls < N_CLASSES - 1 and cls > peer.trail_class.get(bkey, -1):
                trail = peer.trail_class
                if bkey not in trail and len(trail) >= SHARDS_TRACKED:
                    for old in list(trail)[: len(trail) // 2]:  # the oldest shards
                        del trail[old]
                trail[bkey] = cls
        # changed: urgent packets to the urgent queues, the others with their step
        if kind not in (_DATA, _RESULT) or datagram[4] & _F_RETRANSMIT:
            peer.queues[FRONT + cls].append(datagram)
            return True
        bkey = _barrier_key(datagram)
        if bkey not in peer.step_of:
            self.step += 1
            peer.step_of[bkey] = self.step
        peer.queues[cls].append(datagram)
        peer.steps[cls].append(peer.step_of[bkey])
        return True

    @staticmethod
    def _next_queue(peer: Peer) -> int:
        """changed: the highest urgent queue with packets, else the class whose
        head has the lowest step (the highest class among equals); -1: none."""
        for i in range(FRONT, 2 * N_CLASSES):
            if peer.queues[i]:
                return i
        heads = [(s[0], c) for c, s in enumerate(peer.steps) if s]
        return min(heads)[1] if heads else -1

    @staticmethod
    def _popped(peer: Peer, queue: int, i: int = 0) -> None:
        """changed: the step of the packet at `i` in `queue` goes with it."""
        if queue < FRONT:
            del peer.steps[queue][i]

    def drop_head(self) -> None:
        """After a send error: drop the first datagram of every backlogged peer's
        top non-empty class (the one that failed), so the queue moves on."""
        for peer in list(self.backlog):
            i = self._next_queue(peer)  # changed: the queue served next
            if i >= 0:
                dg = peer.queues[i].popleft()
                self._popped(peer, i)
                peer.pending.discard(_identity(dg))
                peer.queued -= 1
                self._left(peer, dg)
            if peer.queued == 0:
                self.backlog.discard(peer)

    @staticmethod
    def _left(peer: Peer, datagram: bytes) -> None:
        """`datagram` left the queue: release DONEs it was holding back."""
        if datagram[3] not in (_DATA, _RESULT):
            return
        bkey = _barrier_key(datagram)
        left = peer.inflight[bkey] - 1
        if left > 0:
            peer.inflight[bkey] = left
            return
        del peer.inflight[bkey]
        peer.step_of.pop(bkey, None)  # changed
        held = peer.held.pop(bkey, None)
        if held:
            trail = peer.trail_class.get(bkey)
            for dg, cls in held:
                peer.queues[FRONT + (cls if trail is None else trail)].append(dg)  # changed

    def on_nack(
        self,
        peer: Peer,
        nack: Header,
        datagram: bytes | memoryview,
        *,
        shards: int,
        payload: int,
        now: float,
    ) -> None:
        """Tell the peer's balancer which paths lost the packets an accepted NACK names.

        `datagram` is the NACK as received (its payload lists shard-local packet
        indices, u32 big endian); `shards` and `payload` are the job's, for the
        bucket's layout. Each named packet is
        looked up by (job, round, bucket, shard, offset, type) among the
        packets recently sent to this peer and charged to the path it took;
        the entry is forgotten, so a repeated NACK does not count it twice.
        Packets never sent or no longer remembered are not charged, and
        neither are retransmissions (`_track` does not remember them).
        """
        n = nack.count
        if n <= 0:
            return
        paths = peer.paths
        if len(paths) == 1:
            self._charge(peer, 0, n, now)
            return
        try:
            layout = Layout(nack.total, nack.codec, shards, payload)
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
        new, old = peer.tracked, peer.tracked_old
        raw = offsets.astype(">u4").tobytes()
        for i in range(0, len(raw), 4):
            key = prefix + raw[i : i + 4] + kind
            p = new.pop(key, None)
            q = old.pop(key, None)
            if p is None:
                p = q
            if p is not None and p < len(lost):
                lost[p] += 1
        for p, k in enumerate(lost):
            if k:
                self._charge(peer, p, k, now)

    @staticmethod
    def _charge(peer: Peer, p: int, n: int, now: float) -> None:
        """`n` packets sent on path `p` were lost: the balancer's path statistics,
        then the path's rate, judged on the path's recent loss rate."""
        ps = peer.paths[p]
        peer.balancer.on_loss(ps, n, now)
        peer.rate.on_loss(p, n, now, loss_rate=ps.loss_rate)
        Outbox._show_rates(peer)

    @staticmethod
    def _show_rates(peer: Peer) -> None:
        """Give the balancer each path's rate once some path of the peer found
        congestion; before that every rate is still growing in slow start and
        says nothing about what a path can carry (None)."""
        known = peer.pacers is not None and not all(c.slow_start for c in peer.rate.paths)
        for ps, c in zip(peer.paths, peer.rate.paths, strict=True):
            ps.rate_bps = c.rate_bps if known else None

    @staticmethod
    def _track(peer: Peer, dgs: list[bytes], path: int) -> None:
        """Remember the path each DATA/RESULT datagram of `dgs` but the
        retransmissions went on, and count them all per shard and path for the
        shard's DONE."""
        tracked = peer.tracked
        shard_paths = peer.shard_paths
        for dg in dgs:
            t = dg[3]
            if t in (_DATA, _RESULT):
                prefix = dg[8:22]
                if not dg[4] & _F_RETRANSMIT:
                    tracked[prefix + dg[28:32] + dg[3:4]] = path
                bkey = prefix + (b"r" if t == _RESULT else b"d")
                counts = shard_paths.get(bkey)
                if counts is None:
                    counts = shard_paths[bkey] = [0] * len(peer.paths)
                counts[path] += 1
        if len(shard_paths) > SHARDS_TRACKED:  # DONEs that never went: forget the oldest
            for bkey in list(shard_paths)[: len(shard_paths) // 2]:
                del shard_paths[bkey]
        if len(tracked) > TRACKED_PER_GENERATION:
            peer.tracked_old = tracked
            peer.tracked = {}

    def on_loss(self, peer: Peer, n: int, now: float) -> None:
        """A peer's NACK named `n` packets: counted. The rates are cut per path by
        `on_nack`, which knows the path each of them took."""
        peer.rate.on_nacked(n)

    def queued(self) -> int:
        return sum(p.queued for p in self.peers.values())

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
                    for pacer in peer.pacers:  # changed: an idle path keeps a quantum
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
                if late > 0:
                    pacer.catch_up(late, now)
                pacer.set_rate(rate, now)
            self._show_rates(peer)
        while (queue := self._next_queue(peer)) >= 0:  # changed: the service order
            q = peer.queues[queue]
            waits: list[float] | None = None
            if pacers is not None:
                # a path with any budget may take its part of the batch (into
                # debt that its later sends pay off: the rate holds over time)
                waits = [pacer.delay(1.0, now) for pacer in pacers]
                waits = [0.0 if w < PACING_SLACK else w for w in waits]
                if min(waits) > 0:
                    return _pacing_wake(now, waits)
            # one batch: at most a GSO super-datagram's worth; changed: with
            # one path, what the tokens allow up to FLUSH_BYTES (at least that)
            room, most = BATCH_BYTES, MAX_GSO_SEGMENTS
            if len(peer.paths) == 1:
                room, most = FLUSH_BYTES, FLUSH_COUNT
                if pacers is not None:
                    # changed: at least a datagram (a batch before)
                    room = max(len(q[0]), min(room, int(pacers[0].tokens(now))))
            batch = [q[0]]
            size = len(q[0])
            limit = min(len(q), most)
            if queue < FRONT:  # changed: packets of the head's step only
                steps, run = peer.steps[queue], 1
                while run < limit and steps[run] == steps[0]:
                    run += 1
                limit = run
            while len(batch) < limit and size + len(q[len(batch)]) <= room:
                size += len(q[len(batch)])
                batch.append(q[len(batch)])
            sent, held, full = self._send(peer, batch, queue, waits, now)
            for _ in range(sent):
                dg = q.popleft()
                self._popped(peer, queue)
                peer.pending.discard(_identity(dg))
                self._left(peer, dg)
            peer.queued -= sent
            if full:
                self.blocked = True
                return None
            if held:  # the balancer chose paths without budget: they wait for it
                assert waits is not None
                return _pacing_wake(now, waits)
        return None

    def _send(
        self, peer: Peer, batch: list[bytes], queue: int, waits: list[float] | None, now: float
    ) -> tuple[int, bool, bool]:
        """Send what of `batch` the balancer puts on paths with budget (`waits` 0,
        or no pacing); returns (sent from the head, some held for a path without
        budget, socket full). Packets sent behind an unsent one leave the queue
        here; the unsent stay at its head, to be assigned again."""
        paths = peer.paths
        cls = queue % N_CLASSES  # changed: the queue's class
        tos = self.tos[cls]
        if len(paths) == 1:
            n = peer.local[0].send(batch, peer.dest(0), tos)
            if n:
                nbytes = sum(len(d) for d in batch[:n])
                self._sent(peer, cls, 0, n, nbytes, now)
            return n, False, n < len(batch)
        ready = None if waits is None else np.array([w == 0 for w in waits])
        assign = peer.balancer.assign(n=len(batch), paths=paths, ready=ready)
        safest = -1
        for i, dg in enumerate(batch):
            t = dg[3]
            if t == _DONE:
                # The DONE takes the path that carried most of its shard, whose
                # switch queue it should not overtake: a DONE that arrives first
                # on an idle path makes the receiver NACK packets still queued.
                counts = peer.shard_paths.get(_barrier_key(dg))
                if counts is not None:
                    assign[i] = counts.index(max(counts))
            elif dg[4] & _F_RETRANSMIT and t in (_DATA, _RESULT):
                # A retransmission takes the path that loses least, among those
                # the balancer uses: losing it again costs another NACK round.
                if safest < 0:
                    safest = _least_lossy(paths)
                if paths[safest].loss_rate < paths[int(assign[i])].loss_rate:
                    assign[i] = safest
        # send per path in order; a partial send on any path stops the batch there
        order = np.argsort(assign, kind="stable")
        done = 0
        full = held = False
        sent_mask = np.zeros(len(batch), dtype=bool)
        for p in np.unique(assign).tolist():
            if ready is not None and not ready[p]:
                held = True  # no budget on this path: its packets wait
                continue
            idx = order[assign[order] == p]
            dgs = [batch[i] for i in idx.tolist()]
            n = peer.local[p].send(dgs, peer.dest(p), tos)
            sent_mask[idx[:n]] = True
            if n:
                self._sent(peer, cls, p, n, sum(len(d) for d in dgs[:n]), now)
                self._track(peer, dgs[:n], p)
            done += n
            if n < len(dgs):
                full = True
                break
        if done == len(batch):
            return done, False, False
        # keep the unsent ones at the head of the queue, in their order
        prefix = int(np.argmin(sent_mask))
        q = peer.queues[queue]
        for i in range(len(batch) - 1, prefix - 1, -1):
            if sent_mask[i]:
                dg = q[i]
                peer.pending.discard(_identity(dg))
                del q[i]  # sent out of order on another path
                self._popped(peer, queue, i)
                self._left(peer, dg)
                peer.queued -= 1
        return prefix, held, full

    @staticmethod
    def _sent(peer: Peer, cls: int, p: int, n: int, nbytes: int, now: float) -> None:
        """`n` packets (`nbytes`) of class `cls` went out on path `p`."""
        peer.balancer.on_sent(peer.paths[p], n)
        peer.rate.on_sent(p, nbytes)
        peer.sent_packets[(cls, p)] += n
        peer.sent_bytes[(cls, p)] += nbytes
        if peer.pacers is not None:
            peer.pacers[p].consume(nbytes + n * WIRE_OVERHEAD, now)  # changed: wire bytes
