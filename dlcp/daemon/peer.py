"""A remote daemon as the outbox sees it (`Peer`): its paths and pacers, its
queues (one FIFO of first transmissions and one of urgent packets per
priority class), the order they are served in (`_next_queue`), and what it
knows of the peer's flow-control window and path health.
"""

from __future__ import annotations

import os
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from dlcp.core.pathhealth import HealthConfig, PathHealth
from dlcp.core.rate import Pacer, PathRates, RateConfig
from dlcp.daemon.flow import WINDOW_MIN
from dlcp.daemon.packet_keys import (
    _DATA,
    _DR,
    _RESULT,
    NATIVE_KEYS,
    _barrier_key,
    _identities_heads,
    _keys,
)
from dlcp.daemon.sentpaths import SentPaths
from dlcp.daemon.transport import UdpPath
from dlcp.policies import LoadBalancer, PathState
from dlcp.wire.header import Flags

__all__ = ["FRONT", "N_CLASSES", "N_QUEUES", "Peer"]

N_CLASSES = 8
# A peer's queues: one a class for first transmissions of DATA/RESULT packets
# (0 .. N_CLASSES - 1), served in the order they were pushed (`Peer.steps`),
# and one a class for urgent packets (FRONT + class: control packets, DONEs,
# retransmissions), served before them, the highest class first. A queue's
# packets leave with the DSCP of its class (index % N_CLASSES).
FRONT = N_CLASSES
N_QUEUES = 2 * N_CLASSES
_F_RETRANSMIT = int(Flags.RETRANSMIT)
# by type byte: 0 for DATA and RESULT, 1 for the others
_NOT_DR_TABLE = bytes(0 if t in (_DATA, _RESULT) else 1 for t in range(256))


def _new_queue() -> deque[bytes]:
    """A class's send queue: a `_keys.Fifo` (what `_take` and `_unqueue` read
    and pop without a step per datagram) where built, else a deque."""
    return _keys.Fifo() if NATIVE_KEYS else deque()


SHARDS_TRACKED = 4096  # shards (and legs) whose packets per path are counted for their DONE

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
    # path of recently sent DATA/RESULT packets, as `pathloss.track` notes them
    # (multi-path peers only): a chunk a send, in two generations
    sent_paths: SentPaths = field(default_factory=SentPaths)
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
    # probe round; `spray` moves what the balancer put on an unusable path to
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


def _left(peer: Peer, datagram: bytes) -> None:
    """`datagram` left the queue: release DONEs it was holding back."""
    if datagram[3] in _DR:
        _release(peer, _barrier_key(datagram), 1)


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


def new_peer(
    addresses: tuple[str, ...],
    port: int,
    paths: Sequence[UdpPath],
    rate_config: RateConfig,
    *,
    pacing: bool,
    balancer: LoadBalancer,
    window_bytes: int,
    health: HealthConfig | None,
    loss_interval: float,
    now: float,
) -> Peer:
    """A peer at `addresses`:`port` reached over the daemon's `paths`: a rate
    controller per path, a pacer each with `pacing`, path health where it has
    two or more paths and `health` is given, and the flow-control window."""
    n_paths = max(1, min(len(addresses), len(paths)))
    rate = PathRates(n_paths, rate_config, decrease_interval=loss_interval)
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
        if pacing
        else None
    )
    p = Peer(addresses, port, paths, rate, pacers, balancer)
    p.window = window_bytes
    if health is not None and len(p.paths) > 1:
        p.health = PathHealth(len(p.paths), health)
    # until its first credit says what it grants (it may be sent to by
    # hosts this daemon does not know of): the least window
    p.granted = WINDOW_MIN if window_bytes else 0
    return p
