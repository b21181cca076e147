"""Per-destination send queues: operations in the order they came, paced per path, sprayed.

The engine hands datagrams with a priority class; they wait here per peer in
one FIFO per class (a class is also the packet's DSCP, and one send call
carries one class). `flush` serves first what was queued first: each push of
a shard's first transmission is one step of the peer's order, and the class
whose oldest packet belongs to the oldest step goes next (within a step, the
highest class first). Control packets, DONEs and retransmissions are urgent:
they go before every step. So a host sends a shard's data, droppable packets
and DONE before the results it queued later, whatever their classes: the
other hosts' aggregations, which wait for that DONE, never wait behind this
host's results (a strict priority by class let results of class 1 overtake
droppable data of class 7 and its DONE, and the other hosts' rounds waited
for this host's whole result leg). The switches still serve the classes
strictly by DSCP. `flush` sends in GSO-sized
batches, choosing a path per packet with the load balancer among the paths
whose pacer has budget; each (peer, path) has its own rate controller and
pacer, cut by the losses NACKs charge to that path. What the pacers or a full
socket hold back waits for the next `flush` (the daemon calls it again at
`next_wake`, or when the socket is writable).
"""

from __future__ import annotations

import math
import os
from collections import Counter, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import repeat

import numpy as np

from dlcp.core.layout import Layout
from dlcp.core.pathhealth import HealthConfig, PathHealth
from dlcp.core.rate import WIRE_OVERHEAD, Pacer, PathRates, RateConfig
from dlcp.daemon.flow import WINDOW_MIN, probe_wait, take_credit, window_room
from dlcp.daemon.packet_keys import (
    _BKEY,
    _DATA,
    _DONE,
    _DR,
    _F_RESULT_LEG,
    _RESULT,
    NATIVE_KEYS,
    _barrier_key,
    _by_class,
    _clamped_classes,
    _identities,
    _identities_heads,
    _identity,
    _keys,
    _shard_keys,
    _take,
    _unqueue,
)
from dlcp.daemon.reroute import RESEND_HORIZON, remember, reroute
from dlcp.daemon.transport import MAX_GSO_SEGMENTS, UdpPath
from dlcp.errors import LocalError
from dlcp.policies import LoadBalancer, PathState
from dlcp.wire.header import HEADER_SIZE, Flags, Header

__all__ = ["Outbox", "Peer"]

N_CLASSES = 8
# A peer's queues: one a class for first transmissions of DATA/RESULT packets
# (0 .. N_CLASSES - 1), served in the order they were pushed (`Peer.steps`),
# and one a class for urgent packets (FRONT + class: control packets, DONEs,
# retransmissions), served before them, the highest class first. A queue's
# packets leave with the DSCP of its class (index % N_CLASSES).
FRONT = N_CLASSES
N_QUEUES = 2 * N_CLASSES


_DONE_BYTE = bytes((_DONE,))
_DONE_TOKEN = b"\xff"  # + position: a DONE's key in push_many (no identity starts with it)
_F_DROPPABLE = int(Flags.DROPPABLE)


_F_RETRANSMIT = int(Flags.RETRANSMIT)
# bytes.translate tables over type and flags bytes
_NOT_DR_TABLE = bytes(0 if t in (_DATA, _RESULT) else 1 for t in range(256))
_DROPPABLE_TABLE = bytes(f & _F_DROPPABLE for f in range(256))
_RETRANSMIT_TABLE = bytes(1 if f & _F_RETRANSMIT else 0 for f in range(256))
_MIN_RUN = 4  # shorter runs of DATA/RESULT packets are queued one by one
TRACKED_PER_GENERATION = 1 << 15  # sent packets whose path is remembered (two generations)
SHARDS_TRACKED = 4096  # shards (and legs) whose packets per path are counted for their DONE
BATCH_BYTES = 64 * 1024  # bytes handed to the kernel per send (one GSO super-datagram)
# A peer with one path gets up to this much per send call when its pacer has
# the tokens (or it is not paced): UdpPath.send cuts it into super-datagrams
# and hands them to the kernel in batches of sendmmsg. The outbox's own work
# (identities, barriers, counters, pacer) is then done once a flush instead of
# once per super-datagram, which cost as much as the kernel's part of a send.
# 4 MB rather than 1: the send calls took 17 ns a datagram less at MTU 1500
# (bench/send_path.py, 360 against 377) and a daemon about 2 % less CPU a
# round (BENCHMARKS.md, round 32). A flush sends all the window and pacers
# allow either way; this only cuts it into fewer calls.
FLUSH_BYTES = 4 << 20
FLUSH_COUNT = 4096  # ... and at most this many datagrams
# pacer burst: one batch (or BURST_SECONDS at the rate, if more). Senders
# converging on a port that they fill to `rate.utilization` leave it a queue
# of their bursts, drained only by the rest of the link, and a strict
# priority starves the droppable class, whose queue is short, behind it:
# bursts of 256 KB from 2 senders kept 300-500 KB queued at a 200 Mbit/s
# port for a whole phase of a round, and half the droppable packets were lost
# there. So are a sender's batches no larger than its tokens (below) and an
# idle path's burst a PACING_QUANTUM (`flush`).
BURST_BYTES = 64 * 1024
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


def _new_queue() -> deque[bytes]:
    """A class's send queue: a `_keys.Fifo` (what `_take` and `_unqueue` read
    and pop without a step per datagram) where built, else a deque."""
    return _keys.Fifo() if NATIVE_KEYS else deque()


def _batch(
    q: deque[bytes], nbytes: int = BATCH_BYTES, count: int = MAX_GSO_SEGMENTS
) -> tuple[list[bytes], Sequence[int]]:
    """`_take` with the defaults of one super-datagram."""
    return _take(q, nbytes, count)


def _pacing_wake(now: float, waits: list[float]) -> float:
    """When to come back for the paths still short of budget (`waits` > 0;
    inf: out of use): the first of them due, but no sooner than PACING_QUANTUM."""
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
    queues: list[deque[bytes]] = field(
        default_factory=lambda: [_new_queue() for _ in range(N_QUEUES)]
    )
    queued: int = 0
    # each class's queue of first transmissions as runs of [step, packets],
    # oldest first (their counts add up to the queue's length): a shard and
    # leg's step numbers the order in which shards and legs came (`step_of`,
    # kept while some of its packets are queued). `_next_queue` serves the
    # class with the oldest head.
    steps: list[deque[list[int]]] = field(
        default_factory=lambda: [deque() for _ in range(N_CLASSES)]
    )
    step_of: dict[bytes, int] = field(default_factory=dict)
    # identities of queued packets, so that a push does not queue one twice: all
    # but DONEs (never repeats) and the DATA/RESULT packets of shards and legs
    # not `watched`. A shard's packets are queued unwatched when none of it is
    # queued yet and the batch cannot repeat itself (the engine's first send of
    # a shard); a later push of that shard while some of it is still queued
    # (a retransmission) watches it: its queued packets' identities are found
    # in the queues, once. It is unwatched when its last packet has left.
    pending: set[bytes] = field(default_factory=set)
    watched: set[bytes] = field(default_factory=set)  # barrier keys
    # DONE barrier per (job, round, bucket, shard, leg): DATA/RESULT packets still
    # queued here, the lowest-priority class of its non-droppable ones (kept for
    # DONEs sent again; bounded: SHARDS_TRACKED), held DONEs
    inflight: Counter[bytes] = field(default_factory=Counter)
    trail_class: dict[bytes, int] = field(default_factory=dict)
    held: dict[bytes, list[tuple[bytes, int]]] = field(default_factory=dict)
    sent_packets: Counter[tuple[int, int]] = field(default_factory=Counter)  # (class, path)
    sent_bytes: Counter[tuple[int, int]] = field(default_factory=Counter)
    # path of recently sent DATA/RESULT packets, keyed as in `Outbox._track` (multi-path
    # peers only); two generations: when `tracked` fills up it becomes `tracked_old`
    tracked: dict[bytes, int] = field(default_factory=dict)
    tracked_old: dict[bytes, int] = field(default_factory=dict)
    # packets per path of each recent shard and leg (barrier key), multi-path peers
    # only: its DONEs take the path that carried the most (bounded: SHARDS_TRACKED)
    shard_paths: dict[bytes, list[int]] = field(default_factory=dict)
    wake_at: float | None = None  # when the pacers last asked to be flushed again
    # flow control, as a sender: bytes sent to the peer in all (`sent_total`),
    # the part the peer has credited (in its count plus `credit_offset`: the
    # count of the receiver `credit_epoch`), since when a full window waits
    window: int = 0  # 0: none
    # the window the peer grants in its credits (its share of its own receive
    # budget among all the hosts sending to it, which this daemon may not all
    # know of; 0: none said): `limit` is the smaller of the two
    granted: int = 0
    sent_total: int = 0
    credited: int = 0
    credit_epoch: int | None = None
    credit_offset: int = 0
    credit_resync: bool = False  # a probe went: the next drained credit sets the offset
    probes: int = 0  # probes sent since the last credit (each waits twice as long)
    stalled_since: float | None = None
    window_stalls: int = 0  # times a flush stopped at the full window
    window_resets: int = 0  # probes sent after CREDIT_TIMEOUT at a full window
    # ... and as a receiver: bytes taken from the sockets that came from the
    # peer, and the count last credited to it (`rx_epoch` names this count)
    rx_bytes: int = 0
    rx_credited: int = 0
    rx_epoch: int = field(default_factory=lambda: int.from_bytes(os.urandom(8), "big") >> 1)
    rx_granted: int = 0  # the window last granted to it in a credit (0: none yet)
    rx_job: int | None = None  # the job it last sent us bytes in
    # path health (peers with two or more paths; dlcp/core/pathhealth.py): the
    # daemon probes the paths and sets `usable` (None: every path) after each
    # probe round; `_send` moves what the balancer put on an unusable path to
    # the usable ones, round robin from `reroute_next`. `tx_job`: the job the
    # daemon last queued packets of for the peer (the probes' job)
    health: PathHealth | None = None
    usable: list[bool] | None = None
    reroute_next: int = 0
    tx_job: int | None = None
    # per path, the urgent datagrams sent on it within RESEND_HORIZON: (sent
    # at, class, datagram), re-sent on the live paths when it is found down
    recent: dict[int, deque[tuple[float, int, bytes]]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        n = min(len(self.addresses), len(self.local))
        self.paths = [PathState(key=(self.local[p].address, self.addresses[p])) for p in range(n)]

    @property
    def name(self) -> str:
        return f"{self.addresses[0]}:{self.port}"

    @property
    def limit(self) -> int:
        """The bytes that may be in flight to the peer: this daemon's window
        for it, or the peer's grant where that is smaller."""
        if self.granted and self.granted < self.window:
            return self.granted
        return self.window

    @property
    def in_flight(self) -> int:
        """Bytes sent to the peer that it has not yet credited."""
        return self.sent_total - self.credited

    def dest(self, path: int) -> tuple[str, int]:
        return self.addresses[path], self.port

    def live_path(self) -> int:
        """A path to send a single control packet on: the first usable one."""
        usable = self.usable
        return 0 if usable is None else usable.index(True)


def _least_lossy(paths: Sequence[PathState]) -> int:
    """The path with the lowest recent loss rate among those with a traffic share."""
    used = [p for p in range(len(paths)) if paths[p].weight > 0] or list(range(len(paths)))
    return min(used, key=lambda p: paths[p].loss_rate)


def _append(peer: Peer, cls: int, n: int, step: int) -> None:
    """`n` packets of `step` joined the tail of class `cls`'s queue."""
    runs = peer.steps[cls]
    if runs and runs[-1][0] == step:
        runs[-1][1] += n
    else:
        runs.append([step, n])


def _took(peer: Peer, cls: int, n: int) -> None:
    """`n` packets left the head of class `cls`'s queue."""
    runs = peer.steps[cls]
    while n > 0:
        head = runs[0]
        if head[1] > n:
            head[1] -= n
            return
        n -= head[1]
        runs.popleft()


def _next_queue(peer: Peer) -> int:
    """The queue to send from next: the highest class's urgent queue, else the
    class whose head was pushed first (the highest class among equals); -1
    when nothing is queued."""
    queues = peer.queues
    for i in range(FRONT, N_QUEUES):
        if queues[i]:
            return i
    best, best_step = -1, 0
    for cls, runs in enumerate(peer.steps):
        if runs and (best < 0 or runs[0][0] < best_step):
            best, best_step = cls, runs[0][0]
    return best


def _urgent(datagram: bytes) -> bool:
    """Whether a datagram is not a first transmission of DATA/RESULT."""
    return datagram[3] not in _DR or bool(datagram[4] & _F_RETRANSMIT)


class Outbox:
    def __init__(
        self,
        paths: Sequence[UdpPath],
        *,
        dscp: Sequence[int],
        rate: RateConfig,
        pacing: bool,
        balancer_factory: object,
        window_bytes: int = 0,
        health: HealthConfig | None = None,
    ) -> None:
        """`window_bytes`: each peer's flow-control window (0: none; see
        flow.CREDIT_TIMEOUT); `health`: probe the paths of peers with two or more
        (None: never, every path stays in use)."""
        self.health = health
        self.paths = paths
        self.window_bytes = window_bytes
        self.credits = 0  # credits taken
        self.tos = [int(d) << 2 for d in dscp]
        self.rate_config = rate
        self.pacing = pacing
        self._balancer_factory = balancer_factory
        self.peers: dict[tuple[tuple[str, ...], int], Peer] = {}
        self.multipath: list[Peer] = []  # the peers whose paths are probed (`Peer.health`)
        self.backlog: set[Peer] = set()
        self.blocked = False  # a socket was full: wait for writability
        self.next_wake: float | None = None
        self.repeats = 0
        self._step = 0  # the last step given to a shard and leg (see `Peer.steps`)
        self.loss_interval = 0.05  # at most one rate cut per path in this many seconds
        self.resent_on_down = 0  # urgent datagrams queued again when their path went down

    def peer(self, addresses: tuple[str, ...], port: int, now: float) -> Peer:
        key = (addresses, port)
        p = self.peers.get(key)
        if p is None:
            n_paths = max(1, min(len(addresses), len(self.paths)))
            rate = PathRates(n_paths, self.rate_config, decrease_interval=self.loss_interval)
            pacers = (
                [
                    # no burst to start with: the H - 1 senders of a job's
                    # first round towards one port start at once
                    Pacer(
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
            p.window = self.window_bytes
            if self.health is not None and len(p.paths) > 1:
                p.health = PathHealth(len(p.paths), self.health)
                self.multipath.append(p)
            # until its first credit says what it grants (it may be sent to by
            # hosts this daemon does not know of): the least window
            p.granted = WINDOW_MIN if self.window_bytes else 0
            self.peers[key] = p
        return p

    def set_balancer_factory(self, factory: object) -> None:
        self._balancer_factory = factory
        for p in self.peers.values():
            p.balancer = factory()  # type: ignore[operator]

    def push(self, peer: Peer, datagram: bytes, priority: int) -> bool:
        """Queue a datagram; False when the same bytes are already waiting (a repeat).

        A DONE is never a repeat: the engine sends each one twice, as insurance
        against losing it (and again when a receiver asks), and every copy goes.
        """
        if datagram[3] != _DONE:
            key = _identity(datagram)
            if datagram[3] in _DR and key[:_BKEY] not in peer.watched:
                self._watch(peer, key[:_BKEY])
            if key in peer.pending:
                self.repeats += 1
                return False
            peer.pending.add(key)
        peer.queued += 1
        self.backlog.add(peer)
        self._queue(peer, datagram, min(max(priority, 0), N_CLASSES - 1))
        return True

    def _step_for(self, peer: Peer, bkey: bytes) -> int:
        """Shard and leg `bkey`'s step: the next one when none of it is queued."""
        step = peer.step_of.get(bkey)
        if step is None:
            self._step += 1
            step = peer.step_of[bkey] = self._step
        return step

    @staticmethod
    def _watch(peer: Peer, bkey: bytes) -> None:
        """Keep the identities of shard and leg `bkey`'s DATA/RESULT packets in
        `pending` from now on until none is queued; those queued already are
        looked up in the queues (see `Peer.pending`)."""
        peer.watched.add(bkey)
        if not peer.inflight.get(bkey):
            return
        for q in peer.queues:
            if q:
                ids, heads = _identities_heads(list(q))
                peer.pending.update([i for i, h in zip(ids, heads, strict=True) if h == bkey])

    def _queue(self, peer: Peer, datagram: bytes, cls: int) -> None:
        """Put a datagram that is not a repeat (already in `pending` and `queued`)
        in class `cls`'s queue, or hold it (a DONE behind its shard)."""
        kind = datagram[3]
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
                peer.queues[FRONT + cls].append(datagram)
            return
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
        if _urgent(datagram):
            peer.queues[FRONT + cls].append(datagram)
        else:
            peer.queues[cls].append(datagram)
            _append(peer, cls, 1, self._step_for(peer, _barrier_key(datagram)))

    def push_many(self, peer: Peer, datagrams: Sequence[bytes], priorities: Sequence[int]) -> int:
        """Queue `datagrams` (with their `priorities`) in order, exactly as `push`
        one after the other would; returns how many were queued (the rest were
        repeats). The per-packet bookkeeping is done in bulk where it can be: a
        run of DATA/RESULT packets of one class (the bulk of a shard) costs a
        few list comprehensions and C-level Counter/deque operations, and a
        batch that cannot repeat a packet (a shard's first send) keeps no
        identity apiece (see `Peer.pending`)."""
        n = len(datagrams)
        if n != len(priorities):
            raise LocalError(f"{n} datagrams but {len(priorities)} priorities")
        if n < 2:
            return self._push_each(peer, datagrams, priorities)
        heads, bkeys, distinct = _shard_keys(datagrams)  # heads: type and flags bytes
        types = heads[0::2]
        watched, inflight = peer.watched, peer.inflight
        checked = False  # whether the packets other than DATA/RESULT/DONE were looked up
        if distinct is None or any(  # two of its DATA/RESULT packets may be the same
            b in watched or inflight.get(b) for b in distinct
        ):
            # a repeat is possible: every shard and leg of the batch is watched,
            # and the identities of all but the DONEs are looked up
            for b in distinct if distinct is not None else dict.fromkeys(bkeys):
                if b is not None and b not in watched:
                    self._watch(peer, b)
            kept = self._not_repeats(peer, datagrams, types)
            checked = True
            if kept is not None:
                if not kept:
                    return 0
                n = len(kept)
                datagrams = [datagrams[k] for k in kept]
                priorities = [priorities[k] for k in kept]
                bkeys = [bkeys[k] for k in kept]
                heads = b"".join([heads[2 * k : 2 * k + 2] for k in kept])
        # else none of its DATA/RESULT packets can be a repeat: a run of
        # increasing offsets per shard and leg, none of them queued (or
        # watched); its other packets (DONEs, never repeats, and the odd ACK or
        # NACK, looked up one by one below) come between them
        peer.queued += n
        self.backlog.add(peer)
        # one pass (in C): whether all are one class, and each into range
        priorities, uniform = _clamped_classes(
            priorities if isinstance(priorities, list) else list(priorities), N_CLASSES
        )
        flags = heads[1::2]
        others = heads[0::2].translate(_NOT_DR_TABLE)  # 1 where not DATA/RESULT
        # runs of DATA/RESULT packets between the others, in order: each of the
        # others sees what the packets before it left (a DONE is held by them)
        start = 0
        queued = n
        while start < n:
            stop = others.find(1, start)
            if stop < 0:
                stop = n
            if stop - start >= _MIN_RUN:
                self._queue_run(
                    peer,
                    datagrams[start:stop],
                    bkeys[start:stop],  # all DATA/RESULT: no None
                    priorities[start:stop],
                    flags[start:stop],
                    uniform,
                )
            else:
                for i in range(start, stop):
                    self._queue(peer, datagrams[i], priorities[i])
            if stop < n:
                dg = datagrams[stop]
                if checked or dg[3] == _DONE or self._not_pending(peer, dg):
                    self._queue(peer, dg, priorities[stop])
                else:  # a repeat of an ACK or NACK still queued
                    peer.queued -= 1
                    queued -= 1
            start = stop + 1
        return queued

    def _not_pending(self, peer: Peer, datagram: bytes) -> bool:
        """`push`'s look-up for a packet other than DATA/RESULT/DONE: False
        (counted) when it is queued already, else its identity is kept."""
        key = _identity(datagram)
        if key in peer.pending:
            self.repeats += 1
            return False
        peer.pending.add(key)
        return True

    def _not_repeats(
        self, peer: Peer, datagrams: Sequence[bytes], types: bytes
    ) -> list[int] | None:
        """Put the identities of `datagrams` (their type bytes `types`) but
        DONEs in `pending`, leaving out (and counting) a repeat: one already
        queued, or earlier in the batch. Returns the positions of those that are
        not repeats, or None when all of them are new."""
        pending = peer.pending
        ids = _identities(datagrams)
        k = types.find(_DONE_BYTE)
        if k >= 0:  # a DONE is never a repeat (see `push`): a key of its own, not kept
            tokens = []
            while k >= 0:
                ids[k] = _DONE_TOKEN + k.to_bytes(4, "little")
                tokens.append(ids[k])
                k = types.find(_DONE_BYTE, k + 1)
        else:
            tokens = None
        before = len(pending)
        kept: list[int] | None = None
        if pending.isdisjoint(ids):
            pending.update(ids)
            if len(pending) - before != len(ids):  # a repeat within the batch
                pending.difference_update(ids)  # all of them were new
                kept = []
        else:
            kept = []
        if kept is not None:
            seen: set[bytes] = set()
            for k, key in enumerate(ids):
                if key not in pending and key not in seen:
                    seen.add(key)
                    kept.append(k)
            self.repeats += len(ids) - len(kept)
            pending.update(seen)
        if tokens:
            pending.difference_update(tokens)
        return kept

    def _push_each(self, peer: Peer, datagrams: Sequence[bytes], priorities: Sequence[int]) -> int:
        push = self.push
        k = 0
        for dg, priority in zip(datagrams, priorities, strict=True):
            if push(peer, dg, priority):
                k += 1
        return k

    def _queue_run(
        self,
        peer: Peer,
        dgs: Sequence[bytes],
        bkeys: list[bytes],
        classes: Sequence[int],
        flags: bytes,
        uniform: bool = False,
    ) -> None:
        """`_queue` for each of `dgs`, DATA/RESULT packets (with their barrier
        keys, classes and flags bytes) that are not repeats, in bulk: same
        queues, barriers, trail, steps. `uniform`: the classes are known to be
        one."""
        n = len(dgs)
        head = bkeys[0]
        inflight = peer.inflight
        distinct: Iterable[bytes]  # in order of first appearance
        one = bkeys.count(head) == n  # one shard and leg (the usual run)
        if one:
            inflight[head] += n
            distinct = (head,)
        else:
            counts = Counter(bkeys)
            for bkey, k in counts.items():
                inflight[bkey] += k
            distinct = counts
        cls0 = classes[0]
        uniform = uniform or classes.count(cls0) == n
        # the trail class of each shard: the highest class of its non-droppable
        # packets below the droppable class (in order of first appearance)
        drop = flags.translate(_DROPPABLE_TABLE)
        split: list[list[bytes] | None] | None = None  # each class's packets, where they differ
        want: dict[bytes, int]
        if uniform and 1 not in drop:
            want = dict.fromkeys(distinct, cls0) if cls0 < N_CLASSES - 1 else {}
        elif uniform and one:  # some droppable: the class, if any packet is not
            want = {head: cls0} if cls0 < N_CLASSES - 1 and 0 in drop else {}
        elif one:  # in C: no Python step a packet
            split, top = _by_class(dgs, classes, drop, N_CLASSES)
            want = {head: top} if top >= 0 else {}
        else:
            want = {}
            for bkey, cls, d in zip(bkeys, classes, drop, strict=True):
                if not d and cls < N_CLASSES - 1 and cls > want.get(bkey, -1):
                    want[bkey] = cls
        trail = peer.trail_class
        if len(trail) + len(want) <= SHARDS_TRACKED:  # no eviction: same as one by one
            for bkey, cls in want.items():
                if cls > trail.get(bkey, -1):
                    trail[bkey] = cls
        else:  # the oldest shards are forgotten on the way: one by one
            for bkey, cls, d in zip(bkeys, classes, drop, strict=True):
                if not d and cls < N_CLASSES - 1 and cls > trail.get(bkey, -1):
                    if bkey not in trail and len(trail) >= SHARDS_TRACKED:
                        for old in list(trail)[: len(trail) // 2]:
                            del trail[old]
                    trail[bkey] = cls
        resent = flags.translate(_RETRANSMIT_TABLE)
        if not one or 0 < resent.count(1) < n:
            # each shard and leg's first transmissions or retransmissions on
            # their own (one run of each, usually)
            start = 0
            for stop in range(1, n + 1):
                if stop == n or bkeys[stop] is not bkeys[start] or resent[stop] != resent[start]:
                    self._place(peer, dgs[start:stop], bkeys[start], classes[start:stop], None)
                    start = stop
            return
        if not uniform and split is None:
            split = _by_class(dgs, classes, drop, N_CLASSES)[0]
        self._place(peer, dgs, head, classes, split)

    def _place(
        self,
        peer: Peer,
        dgs: Sequence[bytes],
        bkey: bytes,
        classes: Sequence[int],
        split: list[list[bytes] | None] | None,
    ) -> None:
        """Append DATA/RESULT packets of shard and leg `bkey`, all first
        transmissions or all retransmissions, to their classes' queues (`split`:
        each class's of them, when known and the classes are not all one)."""
        urgent = bool(dgs[0][4] & _F_RETRANSMIT)
        at = FRONT if urgent else 0
        step = 0 if urgent else self._step_for(peer, bkey)
        cls0 = classes[0]
        if split is None and classes.count(cls0) == len(dgs):
            peer.queues[at + cls0].extend(dgs)
            if step:
                _append(peer, cls0, len(dgs), step)
            return
        if split is None:
            split = _by_class(dgs, classes, bytes(len(dgs)), N_CLASSES)[0]
        for cls, part in enumerate(split):
            if part is not None:
                peer.queues[at + cls].extend(part)
                if step:
                    _append(peer, cls, len(part), step)

    def drop_head(self) -> None:
        """After a send error: drop the first datagram of the class every
        backlogged peer sends next (the one that failed), so the queue moves on."""
        for peer in list(self.backlog):
            i = _next_queue(peer)
            if i >= 0:
                dg = peer.queues[i].popleft()
                if i < FRONT:
                    _took(peer, i, 1)
                peer.pending.discard(_identity(dg))
                peer.queued -= 1
                self._left(peer, dg)
            if peer.queued == 0:
                self.backlog.discard(peer)

    @staticmethod
    def _left(peer: Peer, datagram: bytes) -> None:
        """`datagram` left the queue: release DONEs it was holding back."""
        if datagram[3] in _DR:
            Outbox._release(peer, _barrier_key(datagram), 1)

    @staticmethod
    def _release(peer: Peer, bkey: bytes, n: int) -> None:
        """`n` DATA/RESULT packets of shard and leg `bkey` left the queue: release
        the DONEs they were holding back once none is left."""
        inflight = peer.inflight
        left = inflight[bkey] - n
        if left > 0:
            inflight[bkey] = left
            return
        del inflight[bkey]
        peer.step_of.pop(bkey, None)
        peer.watched.discard(bkey)  # none queued: nothing to repeat
        held = peer.held.pop(bkey, None)
        if held:
            trail = peer.trail_class.get(bkey)
            for dg, cls in held:
                peer.queues[FRONT + (cls if trail is None else trail)].append(dg)

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
            key = kind + prefix + raw[i : i + 4]
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
    def _track(
        peer: Peer, keys: Iterable[bytes], per_shard: Iterable[tuple[bytes, int]], path: int
    ) -> None:
        """Remember the path of DATA/RESULT datagrams that went on `path` (`keys`:
        their leg, job, round, bucket, shard and offset, as `on_nack` looks them
        up), and count them per shard and path for the shard's DONE (`per_shard`:
        (barrier key, packets), in order of first appearance)."""
        tracked = peer.tracked
        shard_paths = peer.shard_paths
        tracked.update(zip(keys, repeat(path)))
        for bkey, k in per_shard:
            counts = shard_paths.get(bkey)
            if counts is None:
                counts = shard_paths[bkey] = [0] * len(peer.paths)
            counts[path] += k
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
                if late > 0:
                    pacer.catch_up(late, now)
                pacer.set_rate(rate, now)
            self._show_rates(peer)
        one = len(peer.paths) == 1
        pacer0 = pacers[0] if pacers is not None and one else None
        pending, watched = peer.pending, peer.watched
        release = self._release
        while (i := _next_queue(peer)) >= 0:
            q = peer.queues[i]
            cls = i % N_CLASSES
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
            if pacer0 is not None:  # one path: its budget alone
                wait = pacer0.delay(1.0, now)
                if wait >= PACING_SLACK:
                    return _pacing_wake(now, [wait])
            elif pacers is not None:
                # a path with any budget may take its part of the batch (into
                # debt that its later sends pay off: the rate holds over time)
                waits = [pacer.delay(1.0, now) for pacer in pacers]
                waits = [0.0 if w < PACING_SLACK else w for w in waits]
                if peer.usable is not None:  # a path out of use is never ready
                    waits = [w if u else math.inf for w, u in zip(waits, peer.usable, strict=True)]
                if min(waits) > 0:
                    return _pacing_wake(now, waits)
            if one:  # as much as the tokens allow (at least a batch: into debt)
                room = FLUSH_BYTES
                if pacer0 is not None:
                    # what the tokens allow, at least a datagram (into debt):
                    # not a whole batch, whose 44 datagrams at a time from
                    # each sender kept a queue at a port they fill to 97 %
                    room = max(len(q[0]), min(room, int(pacer0.tokens(now))))
                batch, sizes = _batch(q, min(room, window), min(FLUSH_COUNT, run))
                sent = peer.local[0].send(batch, peer.dest(0), self.tos[cls])
                held, full = False, sent < len(batch)
                if sent:
                    self._sent(peer, cls, 0, sent, sizes[sent - 1], now)
                    if i < FRONT:
                        _took(peer, i, sent)
                    # identities out of `pending`, the batch off the queue, and
                    # per shard the packets its held DONEs were waiting for
                    for bkey, k in _unqueue(pending, batch, sent, popleft, watched):
                        release(peer, bkey, k)
                    peer.queued -= sent
            else:
                batch, sizes = _batch(q, min(BATCH_BYTES, window), min(MAX_GSO_SEGMENTS, run))
                ids, heads = _identities_heads(batch)
                sent, held, full = self._send(peer, batch, ids, heads, i, waits, now)
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

    def _send(
        self,
        peer: Peer,
        batch: list[bytes],
        ids: list[bytes],
        heads: list[bytes],
        queue: int,
        waits: list[float] | None,
        now: float,
    ) -> tuple[int, bool, bool]:
        """Send what of `batch` (`ids`: their identities, `heads` the first `_BKEY`
        bytes of those) the balancer puts on
        paths with budget (`waits` 0, or no pacing), for a peer with several
        paths; returns (sent from the head, some held for a path without budget,
        socket full). Packets sent behind an unsent one leave the queue here;
        the unsent stay at its head, to be assigned again."""
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
        special = [i for i, dg in enumerate(batch) if dg[3] == _DONE or dg[4] & _F_RETRANSMIT]
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
        # what `_track` remembers: (leg, job, round, bucket, shard) and offset
        kinds = b"".join(ids)[:: len(ids[0])]  # the type bytes (identities: same length)
        all_dr = kinds.translate(_NOT_DR_TABLE).count(0) == len(kinds)
        keys = [h + i[21:25] for h, i in zip(heads, ids, strict=True)]
        one_shard = all_dr and heads.count(heads[0]) == len(heads)
        # the urgent ones (`_urgent`), kept per path for `path_down` where probed:
        # DONEs and retransmissions (`special`), and every other type but DATA/RESULT
        urgent: list[int] = []
        if peer.health is not None:
            others = [] if all_dr else [i for i, t in enumerate(kinds) if t not in _DR]
            urgent = sorted({*special, *others})
        # send per path in order; a partial send on any path stops the batch there
        order = sorted(range(len(batch)), key=assign.__getitem__)  # stable: by path
        start = done = 0
        full = held = False
        sent_idx: list[int] = []
        for p in sorted(set(assign)):
            end = start + assign.count(p)
            idx = order[start:end]
            start = end
            if ready is not None and not ready[p]:
                held = True  # no budget on this path: its packets wait
                continue
            dgs = list(map(batch.__getitem__, idx))
            n = peer.local[p].send(dgs, peer.dest(p), tos)
            if n:
                out = idx if n == len(idx) else idx[:n]
                sent_idx += out
                if urgent:  # those of them that went on this path
                    sent = set(out) if n < len(idx) else None
                    mine = [i for i in urgent if assign[i] == p and (sent is None or i in sent)]
                    remember(peer, p, cls, [batch[i] for i in mine], now)
                self._sent(peer, cls, p, n, sum(map(len, dgs if n == len(dgs) else dgs[:n])), now)
                if not one_shard:
                    out = [i for i in out if kinds[i] in _DR]
                # (with none: the shards' counts are still kept within bounds)
                per_shard = (
                    ((heads[0], n),)
                    if one_shard
                    else Counter(map(heads.__getitem__, out)).items()  # first seen first
                )
                first = out if not resent else [i for i in out if i not in resent]
                self._track(peer, map(keys.__getitem__, first), per_shard, p)
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
                self._left(peer, dg)
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
