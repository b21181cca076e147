"""The per-node protocol engine: all-reduce rounds over datagrams, without IO.

Driven like aioquic's connection: `submit()` a local contribution,
`receive()` datagrams, `handle_timer(now)` when `get_timer()` is due; drain
`datagrams_to_send()` to the network and `next_event()` for finished or failed
rounds. Nodes are integers; the daemon maps them to paths and addresses.

Roles per round (DESIGN.md "Data path"): every contributor sends each shard's
packets to the shard's owner and a DONE manifest; owners sum their shard
(`ShardAggregator`) and send result packets to every contributor; each
contributor gathers the whole bucket (`ResultCollector`), ACKs the owners and
reports `RoundComplete`. In "transpose" mode contributors own one shard each;
in "ps" mode dedicated aggregator nodes do.
"""

from __future__ import annotations

import math
import struct
from collections import Counter, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import repeat
from typing import Any, NamedTuple

import numpy as np

from dlcp.codecs import lanes as lane_ops
from dlcp.core.aggregate import Nack, ResultCollector, RunRejected, ShardAggregator, ShardResult
from dlcp.core.layout import DEFAULT_PAYLOAD, Layout
from dlcp.core.runs import LANE_TYPES, run_starts, sources
from dlcp.core.timing import NackClock, Timing
from dlcp.errors import DlcpError, LocalError, Reason, RemoteError, WireError
from dlcp.wire.batch import HEADER_DTYPE, decode_batch, encode_batch
from dlcp.wire.credit import Credit, credit_of, credit_payload
from dlcp.wire.header import (
    HEADER_SIZE,
    LANE_BITS,
    Codec,
    Flags,
    Header,
    PacketType,
    decode,
    encode,
    header_of_valid,
    lane_bytes,
)
from dlcp.wire.mac import MAC_ALGORITHMS, MacKey, detach_gathered, mac_state
from dlcp.wire.slices import Slices

__all__ = [
    "Credit",
    "Engine",
    "Event",
    "JobSpec",
    "RoundComplete",
    "RoundFailed",
    "Send",
    "SendBatch",
    "credit_of",
    "nack_capacity",
]

OpKey = tuple[int, int, int]  # job, round, bucket
# rounds whose settled datagrams wait for `Engine.drop_settled` at most (the
# oldest are freed first when more end without a call)
_SETTLED_MAX = 4
# header fields that packets of one run (`Engine.receive_many`) share
_U32 = struct.Struct("!I")
_F32 = struct.Struct("!f")
CONTROL_CLASS = 0
RETRANSMIT_CLASS = 1  # recovered packets are needed now: top gradient class
LOWEST_RELIABLE_CLASS = 5


@dataclass(frozen=True)
class JobSpec:
    """One job's membership as this node sees it."""

    job: int
    key: bytes
    me: int
    contributors: tuple[int, ...]
    owners: tuple[int, ...]  # owner node of shard s
    payload: int = DEFAULT_PAYLOAD
    window: int = 256  # rounds behind the newest that are still accepted
    mac: str = "blake2b"  # the packet MAC function (dlcp/wire/mac.py), the same at every node

    @classmethod
    def transpose(cls, job: int, key: bytes, me: int, hosts: int, **kw: Any) -> JobSpec:
        nodes = tuple(range(hosts))
        return cls(job=job, key=key, me=me, contributors=nodes, owners=nodes, **kw)

    def __post_init__(self) -> None:
        if not self.contributors or not self.owners:
            raise LocalError(f"job {self.job}: no contributors or no owners")
        if len(set(self.contributors)) != len(self.contributors):
            raise LocalError(f"job {self.job}: duplicate contributors")
        if self.me not in self.contributors and self.me not in self.owners:
            raise LocalError(f"job {self.job}: node {self.me} is not a member")
        if len(self.contributors) > lane_ops.MAX_CONTRIBUTORS:
            raise LocalError(f"job {self.job}: more than {lane_ops.MAX_CONTRIBUTORS} contributors")
        if len(self.key) < 16:
            raise LocalError(f"job {self.job}: MAC key shorter than 16 bytes")
        if self.mac not in MAC_ALGORITHMS:
            raise LocalError(f"job {self.job}: MAC {self.mac!r} is not one of {MAC_ALGORITHMS}")

    @property
    def members(self) -> frozenset[int]:
        return frozenset(self.contributors) | frozenset(self.owners)

    def senders_to(self, node: int) -> frozenset[int]:
        """The other nodes that send `node` a bucket's bytes: the contributors
        when it owns shards (data), the owners when it contributes (results)."""
        out: set[int] = set()
        if node in self.owners:
            out.update(self.contributors)
        if node in self.contributors:
            out.update(self.owners)
        out.discard(node)
        return frozenset(out)


class Send(NamedTuple):
    """A datagram for node `node`, in priority class `priority`."""

    node: int
    datagram: bytes
    priority: int
    droppable: bool = False
    kind: str = "data"  # data | result | control: for metrics


class SendBatch(NamedTuple):
    """Datagrams of one job for node `node`, in order, with their priority
    classes and droppable flags (`droppable` None: none is droppable). The
    engine hands out its datagrams in these: one per shard's run of packets, so
    nothing downstream makes or reads an object per datagram."""

    node: int
    datagrams: list[bytes]
    priorities: list[int]
    droppable: list[bool] | None = None
    kind: str = "data"  # data | result | control: for metrics

    def sends(self) -> list[Send]:
        """The batch as one `Send` per datagram."""
        drop: Iterable[bool] = repeat(False) if self.droppable is None else self.droppable
        return [
            Send(self.node, dg, p, d, self.kind)
            for dg, p, d in zip(self.datagrams, self.priorities, drop, strict=False)
        ]


def _batch(
    node: int,
    datagrams: list[bytes],
    priorities: list[int],
    droppable: list[bool] | None,
    kind: str,
) -> SendBatch:
    if len(priorities) != len(datagrams):
        raise ValueError(f"{len(datagrams)} datagrams but {len(priorities)} priorities")
    if droppable is not None and len(droppable) != len(datagrams):
        raise ValueError(f"{len(datagrams)} datagrams but {len(droppable)} droppable flags")
    return SendBatch(node, datagrams, priorities, droppable, kind)


_RETRANSMIT = int(Flags.RETRANSMIT)


def _retransmitted(heads: np.ndarray) -> bool:
    """Whether any of a run's header records is a retransmission."""
    return bool((heads["flags"] & _RETRANSMIT).any())


def _int_list(a: np.ndarray) -> list[int]:
    """`a.tolist()`; where every element is one value (a bucket's packets in
    one class, the usual case) the list repeats one int, made once."""
    if a.size and a.min() == a.max():
        return [int(a[0])] * a.size
    return a.tolist()


def manifest_capacity(payload: int) -> int:
    """How many packets one DONE part covers within a payload budget of
    `payload` bytes (a bit each, whole bytes: a multiple of 8)."""
    return max(1, payload) * 8


def nack_capacity(payload: int) -> int:
    """How many packets one NACK lists within a payload budget of `payload`
    bytes (a u32 index each)."""
    return max(1, payload // 4)


def _control(node: int, datagram: bytes) -> SendBatch:
    return SendBatch(node, [datagram], [CONTROL_CLASS], None, "control")


@dataclass
class RoundComplete:
    job: int
    round: int
    bucket: int
    layout: Layout
    sums: np.ndarray  # summed lanes of the whole bucket
    contributors: np.ndarray  # per data packet: contributions in its sums
    block_max: np.ndarray  # per data packet: max block magnitude (next scale)
    lost_lanes: int
    total_lanes: int


@dataclass
class RoundFailed:
    job: int
    round: int
    bucket: int
    reason: str


Event = RoundComplete | RoundFailed


@dataclass
class _Contribution:
    """What this node sent for a round, kept to answer NACKs."""

    spec: JobSpec
    layout: Layout
    round: int
    bucket: int
    lanes: memoryview  # data lanes (or summed lanes) of the whole bucket
    summed: bool
    weight: int
    classes: np.ndarray
    droppable: np.ndarray
    layers: np.ndarray
    bound: float
    scale: float
    block_max: np.ndarray
    resent: dict[tuple[int, int], np.ndarray] = field(default_factory=dict)


@dataclass
class _Finished:
    """A completed shard that this node owns, kept for result NACKs."""

    spec: JobSpec
    layout: Layout
    round: int
    bucket: int
    result: ShardResult
    classes: np.ndarray
    layers: np.ndarray
    until: float
    waiting: set[int] = field(default_factory=set)  # receivers yet to ACK
    resent: dict[tuple[int, int], np.ndarray] = field(default_factory=dict)
    # the shard's result datagrams as first sent (one set serves every
    # receiver: nothing in them names it) and their classes; retransmissions
    # re-MAC their payloads, so `result.sums` is never read again and may be
    # the caller's `out`, which it reuses once the round completes here
    datagrams: list[bytes] | None = None
    classes_sent: list[int] | None = None
    gathered: bool = False  # `datagrams` read `result.sums` in place


def _payload_of(datagram: Any) -> memoryview:
    """A sent datagram's payload: bytes after the header, or a `Gathered`
    datagram's payload in place."""
    if isinstance(datagram, bytes | bytearray | memoryview):
        return memoryview(datagram)[HEADER_SIZE:]
    payload: memoryview = datagram.payload
    return payload


class Engine:
    """All rounds of all jobs at one node."""

    def __init__(self, *, timing: Timing | None = None, gather: bool = False) -> None:
        self.timing = timing or Timing()
        self.gather = gather
        self.jobs: dict[int, JobSpec] = {}
        self._keys: dict[int, MacKey] = {}
        # per job, per peer node: how soon it answers this node's NACKs
        self._clocks: dict[int, dict[int, NackClock]] = {}
        self._aggs: dict[tuple[OpKey, int], ShardAggregator] = {}
        self._finished: dict[tuple[OpKey, int], _Finished] = {}
        self._contribs: dict[OpKey, _Contribution] = {}
        self._collectors: dict[OpKey, ResultCollector] = {}
        self._closed: dict[OpKey, float] = {}  # completed or failed rounds, for late packets
        self._closed_shards: dict[tuple[OpKey, int], float] = {}  # shards aggregated here
        # Shards closed here (aggregated, failed or timed out) for the whole stale
        # window, not just `retain`: job -> (bucket, shard) -> [highest closed
        # round, bitmap of closed rounds below it]. A replayed packet of such a
        # round is late instead of opening a fresh aggregator (RELIABILITY.md).
        self._closed_rounds: dict[int, dict[tuple[int, int], list[int]]] = {}
        self._pruned_at: dict[int, int] = {}
        self._newest: dict[int, int] = {}
        self._out: list[SendBatch] = []
        # per round this node contributes to: its lists of Gathered datagrams
        # (`gather`), whose payloads lie in the caller's buffers (`lanes`, `out`)
        self._gathered: dict[OpKey, list[list[bytes]]] = {}
        # ... and those of rounds settled since `drop_settled` (at most
        # _SETTLED_MAX rounds'): freeing a leg's tens of thousands of
        # datagrams, long out of cache, took about a millisecond, which a
        # round's end, its caller and the peers waiting on its ACKs need not
        # wait for
        self._settled: deque[list[list[bytes]]] = deque(maxlen=_SETTLED_MAX)
        # rounds complete here whose completion waits (until the deadline) for
        # receivers' ACKs of this node's gathered result shards
        self._held: dict[OpKey, tuple[float, RoundComplete]] = {}
        self._events: deque[Event] = deque()
        self.stats: Counter[str] = Counter()
        self.rejects: Counter[Reason] = Counter()
        self.last_error = ""

    # -- jobs -------------------------------------------------------------
    def add_job(self, spec: JobSpec) -> None:
        try:
            key = mac_state(spec.key, spec.mac)
        except ValueError as exc:
            raise LocalError(f"job {spec.job}: {exc}") from exc
        self.jobs[spec.job] = spec
        self._keys[spec.job] = key
        self._clocks[spec.job] = {
            n: NackClock() for n in {*spec.contributors, *spec.owners} if n != spec.me
        }

    def nack_answers(self, job: int) -> dict[int, dict[str, Any]]:
        """Per peer node of `job`: how soon it answers this node's NACKs (mean
        and mean deviation, seconds; None before an answer was timed), how
        many answers were timed, and the wait before a NACK to it is repeated."""
        out: dict[int, dict[str, Any]] = {}
        for node, clock in sorted(self._clocks.get(job, {}).items()):
            timed = clock.srtt is not None
            out[node] = {
                "answer_s": clock.srtt,
                "deviation_s": clock.rttvar if timed else None,
                "answers": clock.samples,
                "repeat_after_s": clock.repeat_after(self.timing),
            }
        return out

    def remove_job(self, job: int, now: float) -> None:
        self.jobs.pop(job, None)
        self._keys.pop(job, None)
        self._clocks.pop(job, None)
        for op in [op for op in self._collectors if op[0] == job]:
            self._fail(op, "job removed", now)
        for k in [k for k in self._aggs if k[0][0] == job]:
            del self._aggs[k]
        for k in [k for k in self._finished if k[0][0] == job]:
            del self._finished[k]
        for op in [op for op in self._contribs if op[0] == job]:
            del self._contribs[op]
        for op in [op for op in self._held if op[0] == job]:
            self._complete(op, self._held.pop(op)[1])  # its results are whole
        for op in [op for op in self._gathered if op[0] == job]:
            self._settle_gathered(op)
        for op in [op for op in self._closed if op[0] == job]:
            del self._closed[op]
        for k in [k for k in self._closed_shards if k[0][0] == job]:
            del self._closed_shards[k]
        self._closed_rounds.pop(job, None)
        self._pruned_at.pop(job, None)
        self._newest.pop(job, None)

    def _mac(self, spec: JobSpec) -> MacKey:
        key = self._keys.get(spec.job)
        return key if key is not None else mac_state(spec.key, spec.mac)

    @property
    def keys(self) -> dict[int, MacKey]:
        return self._keys

    # -- outputs ----------------------------------------------------------
    def send_batches(self) -> list[SendBatch]:
        """The datagrams to send since the last call, in order, in batches."""
        out, self._out = self._out, []
        return out

    def datagrams_to_send(self) -> list[Send]:
        """`send_batches`, one `Send` per datagram."""
        return [s for b in self.send_batches() for s in b.sends()]

    def next_event(self) -> Event | None:
        return self._events.popleft() if self._events else None

    def pending_rounds(self) -> int:
        """Rounds begun here and not yet completed or failed (held ones too)."""
        return len(self._collectors) + len(self._held)

    def credit_datagram(
        self, job: int, epoch: int, received: int, drained: bool = False, window: int = 0
    ) -> bytes | None:
        """A flow-control credit to a peer of `job` (dlcp/daemon/outbox.py):
        a CONTROL packet saying that `received` bytes from it have left this
        daemon's sockets, in the count named `epoch`, whether the sockets
        were empty then (`drained`) and the window it grants the peer
        (`window` bytes, 0: none said; see `Credit`); None for a job not
        here. Its round is the newest seen, so that the peer does not take it
        for a stale one."""
        return self.control_datagram(job, credit_payload(epoch, received, drained, window))

    def control_datagram(self, job: int, payload: bytes) -> bytes | None:
        """A CONTROL packet of `job` to a peer with `payload` (its first byte
        the kind: a credit, a path probe or its echo; dlcp/wire/credit.py,
        probe.py); None for a job not here. Its round is the newest seen, so
        that the peer does not take it for a stale one."""
        spec = self.jobs.get(job)
        if spec is None:
            return None
        header = Header(
            type=PacketType.CONTROL,
            job=job,
            round=self._newest.get(job, 0),
            bucket=0,
            priority=CONTROL_CLASS,
            codec=Codec.FP32,
            shard=0,
            sender=spec.me,
            count=len(payload),
        )
        return encode(header, payload, self._mac(spec))

    def has_round(self, job: int, round: int, bucket: int) -> bool:
        """Whether this node submitted (job, round, bucket) and still remembers it."""
        op = (job, round, bucket)
        return op in self._contribs or op in self._closed

    # -- local contributions ---------------------------------------------
    def submit(
        self,
        *,
        job: int,
        round: int,
        bucket: int,
        codec: Codec,
        total: int,
        lanes: bytes | memoryview | np.ndarray,
        now: float,
        summed: bool = False,
        weight: int = 1,
        classes: np.ndarray | None = None,
        droppable: np.ndarray | None = None,
        layers: np.ndarray | None = None,
        bound: float = 0.0,
        scale: float = 0.0,
        block_max: np.ndarray | None = None,
        out: np.ndarray | None = None,
    ) -> None:
        """Start a round with this node's contribution (`total` lanes of `codec`).

        `classes`, `droppable`, `layers` and `block_max` are per data packet of
        the bucket (policy decisions made by the caller); `bound` is the loss
        bound the droppable packets were chosen under. `out` (`total` lanes of
        the codec's sum dtype, `lane_ops.sum_dtype`) is where the results are
        put as they arrive, and `RoundComplete.sums` then is `out`; it is the
        caller's only once the round has completed or failed.
        """
        spec = self.jobs.get(job)
        if spec is None:
            raise LocalError(f"unknown job {job}")
        if spec.me not in spec.contributors:
            raise LocalError(f"node {spec.me} does not contribute to job {job}")
        op = (job, round, bucket)
        if op in self._contribs or op in self._closed:
            raise LocalError(f"round {round} bucket {bucket} of job {job} was already submitted")
        if not 0.0 <= bound <= 0.5:
            raise LocalError(f"loss bound {bound} outside 0..0.5")
        if codec == Codec.UNION and bound > 0:
            raise LocalError("the sketch's index union (codec UNION) is never droppable: bound 0")
        if not 1 <= weight <= lane_ops.MAX_CONTRIBUTORS:
            raise LocalError(f"weight {weight} outside 1..{lane_ops.MAX_CONTRIBUTORS}")
        if not math.isfinite(scale):
            raise LocalError("scale must be finite")
        layout = Layout(total=total, codec=codec, shards=len(spec.owners), payload=spec.payload)
        view = memoryview(np.ascontiguousarray(lanes)).cast("B")  # type: ignore[arg-type]
        if len(view) != lane_bytes(codec, total, summed):
            raise LocalError(
                f"{len(view)} bytes of lanes, {codec.name} needs "
                f"{lane_bytes(codec, total, summed)} for {total} lanes"
            )
        n = layout.packets

        def per_packet(a: np.ndarray | None, fill: float | int, dtype: type) -> np.ndarray:
            if a is None:
                return np.full(n, fill, dtype=dtype)
            a = np.asarray(a, dtype=dtype)
            if a.shape != (n,):
                raise LocalError(f"per-packet array of shape {a.shape}, bucket has {n} packets")
            return a

        c = _Contribution(
            spec=spec,
            layout=layout,
            round=round,
            bucket=bucket,
            lanes=view,
            summed=summed,
            weight=weight,
            classes=per_packet(classes, 1, np.uint8),
            droppable=per_packet(droppable, False, np.bool_) & (bound > 0),
            layers=per_packet(layers, 0, np.uint16),
            bound=bound,
            scale=scale,
            block_max=per_packet(block_max, 0.0, np.float32),
        )
        if c.classes.max(initial=0) > 7:
            raise LocalError("priority classes must be 0..7")
        collector = ResultCollector(
            layout=layout,
            owners=spec.owners,
            me=spec.me,
            senders=len(spec.contributors),
            now=now,
            timing=self.timing,
            out=out,
            clocks=self._clocks.get(job, {}),
        )
        self._contribs[op] = c
        self._collectors[op] = collector
        self._see_round(job, round)
        for shard, owner in enumerate(spec.owners):
            pk = layout.shard_packets(shard)
            if not pk:
                continue
            if owner == spec.me:
                self._local_contribution(op, shard, c, now)
            else:
                self._send_data(c, shard, owner, None)
                self._send_manifest(c, shard, owner, copies=2)
        self._check_complete(op, now)

    def _local_contribution(self, op: OpKey, shard: int, c: _Contribution, now: float) -> None:
        agg = self._aggregator(op, shard, c.layout, now)
        lay = c.layout
        pk = lay.shard_packets(shard)
        off, count = lay.shard_range(shard)
        agg.on_local(
            sender=c.spec.me,
            lanes=self._slice(c, off, count),
            summed=c.summed,
            weight=c.weight,
            droppable=c.droppable[pk.start : pk.stop],
            scale=c.scale,
            block_max=c.block_max[pk.start : pk.stop],
            now=now,
        )
        agg.note_meta(c.classes[pk.start : pk.stop], c.layers[pk.start : pk.stop])
        agg.on_manifest(sender=c.spec.me, droppable=np.zeros(len(pk), bool), bound=c.bound, now=now)
        self._progress(op, shard, now)

    @staticmethod
    def _slice(c: _Contribution, off: int, count: int) -> memoryview:
        start = lane_bytes(c.layout.codec, off, c.summed)
        return c.lanes[start : start + lane_bytes(c.layout.codec, count, c.summed)]

    # -- packet building ---------------------------------------------------
    def _heads(self, n: int, **common: Any) -> np.ndarray:
        """`n` header records, each with the `common` fields (the rest 0): the
        fields all packets share are set in one record, which is copied into
        each, instead of a pass over all records per field."""
        one = np.zeros(1, dtype=HEADER_DTYPE)
        for name, value in common.items():
            one[name] = value
        return np.repeat(one, n)

    def _send_data(
        self, c: _Contribution, shard: int, owner: int, only: Sequence[int] | None
    ) -> None:
        lay = c.layout
        pk = lay.shard_packets(shard)
        idx = np.arange(pk.start, pk.stop) if only is None else pk.start + np.asarray(only, int)
        if idx.size == 0:
            return
        # the per-packet arrays of these packets: views of the shard's range on a
        # first send, not copies made by indexing with `idx`
        pick: slice | np.ndarray = slice(pk.start, pk.stop) if only is None else idx
        h = self._heads(
            idx.size,
            type=PacketType.DATA,
            codec=lay.codec,
            job=c.spec.job,
            round=c.round,
            bucket=c.bucket,
            shard=shard,
            sender=c.spec.me,
            contributors=c.weight,
            total=lay.total,
            param=c.scale,
        )
        offs = idx * lay.per_packet
        counts = np.minimum(lay.per_packet, lay.total - offs)
        drop = c.droppable[pick] if only is None else np.zeros(idx.size, bool)
        flags = np.where(drop, int(Flags.DROPPABLE), 0) | (int(Flags.SUMMED) if c.summed else 0)
        if only is None:
            flags[-1] |= int(Flags.LAST)
            prio = c.classes[pick]
        else:
            flags |= int(Flags.RETRANSMIT)
            prio = np.minimum(c.classes[idx], RETRANSMIT_CLASS).astype(np.uint8)
        h["flags"] = flags
        h["priority"] = prio
        h["layer"] = c.layers[pick]
        h["offset"] = offs
        h["count"] = counts
        h["aux"] = c.block_max[pick].view(np.uint32)
        bits = LANE_BITS[lay.codec][1 if c.summed else 0]
        # lane_bytes, for every packet at once; no slice object per packet
        payloads = Slices(c.lanes, (offs * bits + 7) // 8, (counts * bits + 7) // 8)
        dgs = encode_batch(h, payloads, self._mac(c.spec), gather=self.gather)
        if self.gather:
            self._gathered.setdefault((c.spec.job, c.round, c.bucket), []).append(dgs)
        self._out.append(
            _batch(owner, dgs, _int_list(prio), drop.tolist() if drop.any() else None, "data")
        )
        self.stats["data_packets_sent" if only is None else "data_retransmits"] += idx.size

    def _send_manifest(self, c: _Contribution, shard: int, owner: int, copies: int) -> None:
        """The shard's DONE: a bit a packet (droppable or not), in parts of
        `manifest_capacity` packets, each within the job's payload budget
        (one IP packet; one DONE for all of a large shard was IP-fragmented
        past about 11,000 packets, and could not be encoded past 523,544).
        A part's `offset` is its first packet, `count` its packets."""
        pk = c.layout.shard_packets(shard)
        bits = c.droppable[pk.start : pk.stop]
        per = manifest_capacity(c.layout.payload)
        key = self._mac(c.spec)
        parts = []
        for first in range(0, max(bits.size, 1), per):
            part = bits[first : first + per]
            header = Header(
                type=PacketType.DONE,
                job=c.spec.job,
                round=c.round,
                bucket=c.bucket,
                flags=Flags.LAST,
                priority=CONTROL_CLASS,
                codec=c.layout.codec,
                shard=shard,
                sender=c.spec.me,
                contributors=c.weight,
                offset=first,
                count=part.size,
                total=c.layout.total,
                param=c.bound,
            )
            parts.append(encode(header, np.packbits(part, bitorder="little").tobytes(), key))
        for _ in range(copies):
            for dg in parts:
                self._out.append(_control(owner, dg))

    def _send_results(self, f: _Finished, node: int, only: Sequence[int] | None) -> None:
        if only is None and f.datagrams is not None:  # the same datagrams to another receiver
            assert f.classes_sent is not None
            self._out.append(_batch(node, f.datagrams, f.classes_sent, None, "result"))
            self.stats["result_packets_sent"] += len(f.datagrams)
            return
        lay = f.layout
        shard = f.result.shard
        ranges = lay.shard_result_arrays(shard)
        pick = slice(None) if only is None else np.asarray(only, dtype=np.int64)
        offs = ranges[0][pick]
        counts = ranges[1][pick]
        if offs.size == 0:
            return
        local = offs // lay.per_packet - lay.shard_packets(shard).start
        payloads: Sequence[bytes | memoryview]
        if only is None:  # the whole shard: packed once, sliced per packet
            wire = lane_ops.summed_wire(lay.codec, f.result.sums)
            view = wire.data.cast("B")  # no copy where the sums are wire lanes already
            bits = LANE_BITS[lay.codec][1]  # 1-bit lanes (UNION) start on packet bytes
            rel = offs - lay.shard_range(shard)[0]
            payloads = Slices(view, rel * bits // 8, (counts * bits + 7) // 8)
        else:  # the payloads first sent (the sums may have been overwritten since)
            assert f.datagrams is not None
            payloads = [_payload_of(f.datagrams[int(j)]) for j in only]
        h = self._heads(
            offs.size,
            type=PacketType.RESULT,
            flags=int(Flags.RETRANSMIT) if only is not None else 0,
            codec=lay.codec,
            job=f.spec.job,
            round=f.round,
            bucket=f.bucket,
            shard=shard,
            sender=f.spec.me,
            total=lay.total,
        )
        h["offset"] = offs
        h["count"] = counts
        h["contributors"] = f.result.contributors[local]
        h["param"] = f.result.block_max[local]
        prio = np.minimum(f.classes[local], LOWEST_RELIABLE_CLASS)
        h["priority"] = prio
        h["layer"] = f.layers[local]
        dgs = encode_batch(h, payloads, self._mac(f.spec), gather=self.gather and only is None)
        classes = _int_list(prio)
        if only is None:
            f.datagrams, f.classes_sent = dgs, classes
            op = (f.spec.job, f.round, f.bucket)
            if self.gather and op in self._collectors:  # the sums may be the caller's `out`
                self._gathered.setdefault(op, []).append(dgs)
                f.gathered = True
        self._out.append(_batch(node, dgs, classes, None, "result"))
        self.stats["result_packets_sent" if only is None else "result_retransmits"] += offs.size

    def _send_result_done(self, f: _Finished, node: int, copies: int) -> None:
        header = Header(
            type=PacketType.DONE,
            job=f.spec.job,
            round=f.round,
            bucket=f.bucket,
            flags=Flags.RESULT_LEG | Flags.LAST,
            priority=CONTROL_CLASS,
            codec=f.layout.codec,
            shard=f.result.shard,
            sender=f.spec.me,
            total=f.layout.total,
            aux=f.result.lost_lanes,
        )
        dg = encode(header, b"", self._mac(f.spec))
        for _ in range(copies):
            self._out.append(_control(node, dg))

    def _send_nack(self, spec: JobSpec, op: OpKey, lay: Layout, nack: Nack, result: bool) -> None:
        """Ask for `nack.packets` again in as many NACK datagrams as it takes
        for each to fit the job's payload budget (`nack_capacity`: one IP
        packet each, however many were lost; before, one NACK listed them all
        and more than about 16,000 could not be encoded). A part's `offset` is
        its place in the list, so the outbox does not take the parts for
        repeats of one another; the first part carries NEED_MANIFEST when the
        manifest is asked for too."""
        flags = Flags.RESULT_LEG if result else Flags.NONE
        if nack.need_manifest:
            flags |= Flags.NEED_MANIFEST
        wanted = np.asarray(nack.packets, dtype=">u4")
        per = nack_capacity(lay.payload)
        key = self._mac(spec)
        datagrams = []
        for first in range(0, max(wanted.size, 1), per):
            part = wanted[first : first + per]
            header = Header(
                type=PacketType.NACK,
                job=op[0],
                round=op[1],
                bucket=op[2],
                flags=flags if first == 0 else flags & ~Flags.NEED_MANIFEST,
                priority=CONTROL_CLASS,
                codec=lay.codec,
                shard=nack.shard,
                sender=spec.me,
                offset=first,  # the part's place in the list: each part a packet of its own
                count=part.size,
                total=lay.total,
            )
            datagrams.append(encode(header, part.tobytes(), key))
        self._out.append(
            _batch(nack.node, datagrams, [CONTROL_CLASS] * len(datagrams), None, "control")
        )
        self.stats["result_nacks_sent" if result else "data_nacks_sent"] += len(datagrams)

    def _send_ack(self, spec: JobSpec, op: OpKey, lay: Layout, shard: int, owner: int) -> None:
        header = Header(
            type=PacketType.ACK,
            job=op[0],
            round=op[1],
            bucket=op[2],
            flags=Flags.RESULT_LEG,
            priority=CONTROL_CLASS,
            codec=lay.codec,
            shard=shard,
            sender=spec.me,
            total=lay.total,
        )
        self._out.append(_control(owner, encode(header, b"", self._mac(spec))))

    # -- receiving ----------------------------------------------------------
    def receive(
        self, datagram: bytes | memoryview, now: float, src: int | None = None
    ) -> Header | None:
        """Take one datagram from the network; rejects are counted, never raised.

        `src` is the node the datagram's source address belongs to, when the
        caller knows it; a header claiming another sender is rejected.
        Returns the header of an accepted packet, None for a rejected one.
        """
        try:
            header, payload = decode(datagram, self._keys)
        except WireError as exc:
            self.rejects[exc.reason] += 1
            return None
        return header if self.receive_packet(header, payload, now, src) else None

    def receive_batch(
        self,
        datagrams: Sequence[bytes | memoryview],
        now: float,
        srcs: Sequence[int | None] | np.ndarray | None = None,
    ) -> list[tuple[int, Header]]:
        """Take many datagrams at once (see `receive_many`); returns (position,
        header) of the accepted packets, rejects are counted."""
        acc = self.receive_many(datagrams, now, srcs)
        return [(i, header_of_valid(datagrams[i])) for i in acc.tolist()]

    def receive_many(
        self,
        datagrams: Sequence[bytes | memoryview],
        now: float,
        srcs: Sequence[int | None] | np.ndarray | None = None,
    ) -> np.ndarray:
        """Take many datagrams at once; returns the positions of the accepted ones.

        Batch decode (vectorised checks, per-packet MAC), then consecutive data
        or result packets of one sender for one shard are taken as a run: the
        per-packet checks once, the aggregator's or collector's bookkeeping with
        array operations. The outcome (state, sums, stats, rejects per reason)
        is that of `receive` called per datagram in order.
        """
        batch = decode_batch(datagrams, self._keys)
        if batch.rejects:
            self.rejects.update(batch.rejects)
        n = len(batch)
        if n == 0:
            return np.zeros(0, dtype=np.int64)
        f = batch.fields
        index = batch.index
        src = sources(srcs, index)
        starts = run_starts(f, src)
        ends = [*starts[1:], n]
        ok = np.zeros(n, dtype=bool)
        payloads = batch.payloads
        ptype = f["type"]
        for a, b in zip(starts, ends, strict=True):
            if LANE_TYPES[ptype[a]]:
                h = header_of_valid(datagrams[int(index[a])])
                s_ = int(src[a])
                bad = self._receive_run(h, f[a:b], payloads[a:b], now, None if s_ < 0 else s_)
                ok[a:b] = True if bad is None else ~bad
                continue
            for k in range(a, b):
                s_ = int(src[k])
                h = header_of_valid(datagrams[int(index[k])])
                ok[k] = self.receive_packet(h, payloads[k], now, None if s_ < 0 else s_)
        return index[ok]

    def _receive_run(
        self,
        h: Header,
        heads: np.ndarray,
        payloads: Sequence[memoryview],
        now: float,
        src: int | None,
    ) -> np.ndarray | None:
        """A run of data or result packets that share everything `_dispatch`
        checks (`h` is the first one's header, `heads` their records); returns
        which were rejected (None: none)."""
        n = len(payloads)
        try:
            spec = self._check_dispatch(h, src)
            op = (h.job, h.round, h.bucket)
            if h.type == PacketType.DATA:
                return self._data_run(spec, op, h, heads, payloads, now)
            return self._result_run(spec, op, h, heads, payloads, now)
        except RunRejected as exc:
            n_bad = int(exc.bad.sum())
            self.rejects[Reason.BAD_RANGE] += n_bad
            self.rejects[exc.reason] += n - n_bad
        except RemoteError as exc:
            self.rejects[exc.reason] += n
        except (DlcpError, ValueError) as exc:  # a bug or inconsistency, never fatal here
            self.rejects[Reason.BAD_RANGE] += n
            self.stats["internal_errors"] += n
            self.last_error = str(exc)
        return np.ones(n, dtype=bool)

    def _data_run(
        self,
        spec: JobSpec,
        op: OpKey,
        h: Header,
        heads: np.ndarray,
        payloads: Sequence[memoryview],
        now: float,
    ) -> np.ndarray | None:
        lay = self._owned_layout(spec, op, h)
        if lay is None:
            self.stats["late_packets"] += len(payloads) - 1
            return None
        self._heard(op, h.sender, now)
        agg = self._aggregator(op, h.shard, lay, now)
        if any(agg.unanswered) and _retransmitted(heads):
            agg.answered(h.sender, now)
        stored, bad = agg.on_data_run(
            sender=h.sender,
            heads=heads,
            payloads=payloads,
            summed=bool(h.flags & Flags.SUMMED),
            weight=h.contributors,
            scale=h.param,
            now=now,
        )
        self._count_run(len(payloads), stored, bad, "data_packets_received")
        if stored and agg.may_complete():
            self._progress(op, h.shard, now)
            if self._aggs.get((op, h.shard)) is not agg:  # the run closed the shard
                # what follows its last stored packet met a closed shard: late
                bad = self._after_close(bad, agg.last_stored + 1, len(payloads), late=True)
        return bad

    def _result_run(
        self,
        spec: JobSpec,
        op: OpKey,
        h: Header,
        heads: np.ndarray,
        payloads: Sequence[memoryview],
        now: float,
    ) -> np.ndarray | None:
        col = self._collectors.get(op)
        if col is None:
            self.stats["late_packets"] += len(payloads)
            return None
        self._check_owner(spec, h)
        if col.layout.total != h.total or col.layout.codec != h.codec:
            raise RemoteError(Reason.MISMATCH, "result for a different bucket size or codec")
        if col.awaits_answer(h.shard) and _retransmitted(heads):
            col.answered(h.shard, now)
        stored, bad = col.on_result_run(
            shard=h.shard, sender=h.sender, heads=heads, payloads=payloads, now=now
        )
        self._count_run(len(payloads), stored, bad, "result_packets_received")
        self._check_complete(op, now)
        if stored and h.shard not in col.waiting:  # the run completed the shard
            # what follows its last stored packet met a shard no longer waited
            # for (duplicates), or a completed round (late)
            late = self._collectors.get(op) is not col
            bad = self._after_close(bad, col.last_stored + 1, len(payloads), late=late)
        return bad

    def _after_close(
        self, bad: np.ndarray | None, first: int, n: int, *, late: bool
    ) -> np.ndarray | None:
        """A run closed its shard (or the shard's results) at packet `first - 1`;
        packet by packet, those from `first` on would have found it closed: late
        (`late`) or duplicates, none of them rejected. `_count_run` counted them
        as BAD_RANGE (`bad`) and duplicates: recount them so; returns `bad` with
        them accepted."""
        tail = n - first
        if tail <= 0:
            return bad
        n_bad = 0 if bad is None else int(bad[first:].sum())
        if n_bad:
            assert bad is not None
            self.rejects[Reason.BAD_RANGE] -= n_bad
            bad = bad.copy()
            bad[first:] = False
        if late:
            self.stats["duplicate_packets"] -= tail - n_bad
            self.stats["late_packets"] += tail
        else:
            self.stats["duplicate_packets"] += n_bad
        return bad if bad is None or bad.any() else None

    def _count_run(self, n: int, stored: int, bad: np.ndarray | None, received: str) -> None:
        """Count a run's outcome (`stored`, BAD_RANGE, the rest duplicates)."""
        n_bad = 0 if bad is None else int(bad.sum())
        if n_bad:
            self.rejects[Reason.BAD_RANGE] += n_bad
        if stored:
            self.stats[received] += stored
        if n - n_bad - stored:
            self.stats["duplicate_packets"] += n - n_bad - stored

    def receive_packet(
        self, h: Header, payload: memoryview, now: float, src: int | None = None
    ) -> bool:
        """Take one authenticated packet (from `decode` or `decode_batch`); False: rejected."""
        try:
            self._dispatch(h, payload, now, src)
        except RemoteError as exc:
            self.rejects[exc.reason] += 1
            return False
        except (DlcpError, ValueError) as exc:  # a bug or inconsistency, never fatal here
            self.rejects[Reason.BAD_RANGE] += 1
            self.stats["internal_errors"] += 1
            self.last_error = str(exc)
            return False
        return True

    def _dispatch(self, h: Header, payload: memoryview, now: float, src: int | None) -> None:
        spec = self._check_dispatch(h, src)
        self._route(spec, (h.job, h.round, h.bucket), h, payload, now)

    def _check_dispatch(self, h: Header, src: int | None) -> JobSpec:
        """The checks every packet passes before its type's handler; its job's spec."""
        spec = self.jobs.get(h.job)
        if spec is None:
            raise RemoteError(Reason.UNKNOWN_JOB, str(h.job))
        if h.sender not in spec.members or (src is not None and src != h.sender):
            raise RemoteError(Reason.BAD_SENDER, f"node {h.sender} from {src}")
        if h.sender == spec.me:
            raise RemoteError(Reason.BAD_SENDER, "a packet claiming to be from this node")
        if h.round + spec.window < self._newest.get(h.job, 0):
            raise RemoteError(Reason.STALE_ROUND, f"round {h.round}")
        if h.shard >= len(spec.owners):
            raise RemoteError(Reason.BAD_RANGE, f"shard {h.shard} of {len(spec.owners)}")
        return spec

    def _route(self, spec: JobSpec, op: OpKey, h: Header, payload: memoryview, now: float) -> None:
        result_leg = bool(h.flags & Flags.RESULT_LEG)
        t = h.type
        if t == PacketType.DATA:
            self._on_data(spec, op, h, payload, now)
        elif t == PacketType.DONE and not result_leg:
            self._on_manifest(spec, op, h, payload, now)
        elif t == PacketType.RESULT:
            self._on_result(spec, op, h, payload, now)
        elif t == PacketType.DONE:
            col = self._collectors.get(op)
            if col is None:
                self.stats["late_packets"] += 1
                return
            self._check_owner(spec, h)
            # (its `aux`, the owner's lost lanes, is not needed: `ResultCollector.tally`)
            col.on_done(shard=h.shard, sender=h.sender, now=now)
            self._poll_collector(op, col, now)
        elif t == PacketType.NACK:
            self._on_nack(spec, op, h, payload, result_leg, now)
        elif t == PacketType.ACK:
            f = self._finished.get((op, h.shard))
            if f is not None:
                f.waiting.discard(h.sender)
                if not f.waiting:
                    del self._finished[(op, h.shard)]
                    if op in self._held:
                        self._release_held(now, op=op)
        else:
            self.stats["control_packets"] += 1

    def _check_owner(self, spec: JobSpec, h: Header) -> None:
        if spec.owners[h.shard] != h.sender:
            raise RemoteError(Reason.BAD_SENDER, f"node {h.sender} does not own shard {h.shard}")

    def _owned_layout(self, spec: JobSpec, op: OpKey, h: Header) -> Layout | None:
        """Layout of a shard this node owns; None when the round is closed here."""
        if spec.owners[h.shard] != spec.me:
            raise RemoteError(Reason.BAD_RANGE, f"shard {h.shard} is not owned by this node")
        if h.sender not in spec.contributors:
            raise RemoteError(Reason.BAD_SENDER, f"node {h.sender} does not contribute")
        if (
            (op, h.shard) in self._finished
            or (op, h.shard) in self._closed_shards
            or op in self._closed
            or self._shard_closed(spec, op, h.shard)
        ):
            self.stats["late_packets"] += 1
            return None
        agg = self._aggs.get((op, h.shard))
        if agg is not None:
            if agg.layout.total != h.total or agg.layout.codec != h.codec:
                raise RemoteError(Reason.MISMATCH, "bucket size or codec differs between senders")
            return agg.layout
        try:
            return Layout(
                total=h.total, codec=h.codec, shards=len(spec.owners), payload=spec.payload
            )
        except LocalError as exc:
            raise RemoteError(Reason.BAD_RANGE, str(exc)) from exc

    def _on_data(
        self, spec: JobSpec, op: OpKey, h: Header, payload: memoryview, now: float
    ) -> None:
        lay = self._owned_layout(spec, op, h)
        if lay is None:
            return
        self._heard(op, h.sender, now)
        agg = self._aggregator(op, h.shard, lay, now)
        if h.flags & Flags.RETRANSMIT:
            agg.answered(h.sender, now)
        fresh = agg.on_data(
            sender=h.sender,
            offset=h.offset,
            count=h.count,
            payload=payload,
            summed=bool(h.flags & Flags.SUMMED),
            weight=h.contributors,
            droppable=bool(h.flags & Flags.DROPPABLE),
            scale=h.param,
            block_max=_F32.unpack(_U32.pack(h.aux))[0],
            now=now,
            priority=h.priority,
            layer=h.layer,
        )
        if not fresh:
            self.stats["duplicate_packets"] += 1
            return
        self.stats["data_packets_received"] += 1
        if agg.may_complete():
            self._progress(op, h.shard, now)

    def _heard(self, op: OpKey, sender: int, now: float) -> None:
        """A data-leg packet of round `op` from `sender`: this node's collector
        of the round, if any, hears that the sender is still busy with it."""
        col = self._collectors.get(op)
        if col is not None:
            col.heard_from(sender, now)

    def _on_manifest(
        self, spec: JobSpec, op: OpKey, h: Header, payload: memoryview, now: float
    ) -> None:
        lay = self._owned_layout(spec, op, h)
        if lay is None:
            return
        self._heard(op, h.sender, now)
        agg = self._aggregator(op, h.shard, lay, now)
        per = manifest_capacity(lay.payload)
        first, n = h.offset, h.count
        if first % per or n != min(per, agg.n_packets - first) or len(payload) * 8 < n:
            raise RemoteError(
                Reason.BAD_RANGE,
                f"manifest part of packets {first}+{n} ({len(payload)} bytes): a shard of "
                f"{agg.n_packets} packets goes in parts of {per}",
            )
        bits = np.unpackbits(np.frombuffer(payload, np.uint8), bitorder="little")[:n]
        agg.on_manifest(
            sender=h.sender, droppable=bits.astype(bool), bound=h.param, now=now, first=first
        )
        self._progress(op, h.shard, now)

    def _on_result(
        self, spec: JobSpec, op: OpKey, h: Header, payload: memoryview, now: float
    ) -> None:
        col = self._collectors.get(op)
        if col is None:
            self.stats["late_packets"] += 1
            return
        self._check_owner(spec, h)
        if col.layout.total != h.total or col.layout.codec != h.codec:
            raise RemoteError(Reason.MISMATCH, "result for a different bucket size or codec")
        if h.flags & Flags.RETRANSMIT:
            col.answered(h.shard, now)
        fresh = col.on_result(
            shard=h.shard,
            sender=h.sender,
            offset=h.offset,
            count=h.count,
            payload=payload,
            contributors=h.contributors,
            block_max=h.param,
            now=now,
        )
        self.stats["result_packets_received" if fresh else "duplicate_packets"] += 1
        self._check_complete(op, now)

    def _unsent_lately(
        self,
        spec: JobSpec,
        store: dict[tuple[int, int], np.ndarray],
        key: tuple[int, int],
        n: int,
        idx: np.ndarray,
        now: float,
    ) -> list[int]:
        """The NACKed packets not already resent lately: within half the wait
        after which the NACKing node (`key[1]`) repeats a NACK, as this node
        would repeat its own to that node (the paths both ways alike), or
        within `nack_interval` until that is known.

        A receiver repeats its NACK while packets are missing; resending what
        is still queued or in flight would only feed a retransmission storm.
        """
        last = store.get(key)
        if last is None:
            last = store[key] = np.full(n, -np.inf)
        window = self.timing.nack_interval
        clock = self._clocks.get(spec.job, {}).get(key[1])
        if clock is not None and clock.samples:
            window = clock.repeat_after(self.timing) / 2
        fresh = idx[now >= last[idx] + window]
        dup = idx.size - fresh.size
        if dup:
            self.stats["retransmits_suppressed"] += dup
        last[fresh] = now
        return fresh.tolist()

    def _on_nack(
        self,
        spec: JobSpec,
        op: OpKey,
        h: Header,
        payload: memoryview,
        result_leg: bool,
        now: float,
    ) -> None:
        idx = np.frombuffer(payload, dtype=">u4").astype(np.int64)
        if result_leg:
            f = self._finished.get((op, h.shard))
            if f is None:
                self.stats["nacks_ignored"] += 1
                return
            n = f.layout.shard_result_count(h.shard)
            if idx.size and idx.max() >= n:
                raise RemoteError(Reason.BAD_RANGE, f"NACK for result packet {idx.max()} of {n}")
            if idx.size:
                todo = self._unsent_lately(spec, f.resent, (h.shard, h.sender), n, idx, now)
                if todo:
                    self._send_results(f, h.sender, todo)
            if h.flags & Flags.NEED_MANIFEST:
                self._send_result_done(f, h.sender, copies=1)
            return
        self._check_owner(spec, h)
        c = self._contribs.get(op)
        if c is None:
            self.stats["nacks_ignored"] += 1
            return
        n = len(c.layout.shard_packets(h.shard))
        if idx.size and idx.max() >= n:
            raise RemoteError(Reason.BAD_RANGE, f"NACK for packet {idx.max()} of {n}")
        if idx.size:
            todo = self._unsent_lately(spec, c.resent, (h.shard, h.sender), n, idx, now)
            if todo:
                self._send_data(c, h.shard, h.sender, todo)
        if h.flags & Flags.NEED_MANIFEST:
            self._send_manifest(c, h.shard, h.sender, copies=1)

    # -- state transitions --------------------------------------------------
    def _aggregator(self, op: OpKey, shard: int, lay: Layout, now: float) -> ShardAggregator:
        key = (op, shard)
        agg = self._aggs.get(key)
        if agg is None:
            spec = self.jobs[op[0]]
            agg = ShardAggregator(
                layout=lay,
                shard=shard,
                senders=spec.contributors,
                now=now,
                timing=self.timing,
                clocks=self._clocks.get(op[0]),
            )
            self._aggs[key] = agg
            self._see_round(op[0], op[1])
        return agg

    # -- closed-round memory ------------------------------------------------
    def _see_round(self, job: int, round: int) -> None:
        """Move the job's newest round; forget closed shards behind the window."""
        newest = self._newest.get(job, 0)
        if round <= newest:
            return
        self._newest[job] = round
        spec = self.jobs.get(job)
        closed = self._closed_rounds.get(job)
        if spec is None or not closed:
            return
        # Every round of an entry whose highest closed round is this far behind
        # is stale for the window check already: drop it (amortised, every
        # quarter window).
        if round - self._pruned_at.get(job, 0) < max(1, spec.window // 4):
            return
        self._pruned_at[job] = round
        for k in [k for k, (high, _) in closed.items() if high + spec.window < round]:
            del closed[k]

    def _close_shard(self, op: OpKey, shard: int) -> None:
        """Remember that (op, shard) closed here for as long as the round is in the window."""
        spec = self.jobs.get(op[0])
        if spec is None:
            return
        rnd = op[1]
        entry = self._closed_rounds.setdefault(op[0], {}).get((op[2], shard))
        if entry is None:
            self._closed_rounds[op[0]][(op[2], shard)] = [rnd, 1]
            return
        high, bits = entry
        if rnd > high:
            entry[0] = rnd
            entry[1] = ((bits << (rnd - high)) | 1) & ((1 << (spec.window + 1)) - 1)
        elif high - rnd <= spec.window:
            entry[1] = bits | (1 << (high - rnd))

    def _shard_closed(self, spec: JobSpec, op: OpKey, shard: int) -> bool:
        """Whether (op, shard) closed here within the window. A round a whole
        window behind one of the same bucket and shard that closed here counts
        as closed too: it cannot be a live round."""
        entry = self._closed_rounds.get(op[0], {}).get((op[2], shard))
        if entry is None:
            return False
        high, bits = entry
        rnd = op[1]
        if rnd > high:
            return False
        return high - rnd > spec.window or bool(bits >> (high - rnd) & 1)

    def _progress(self, op: OpKey, shard: int, now: float) -> None:
        agg = self._aggs.get((op, shard))
        if agg is None:
            return
        if agg.out is None and agg.result is None:
            col = self._collectors.get(op)
            if col is not None and col.layout == agg.layout:
                sums = col.shard_sums(shard)
                if sums.dtype == agg.slots.dtype:
                    agg.sum_into(sums)  # the owner's sums go straight where they are collected
        nacks, finished = agg.poll(now)
        spec = self.jobs[op[0]]
        for nack in nacks:
            self._send_nack(spec, op, agg.layout, nack, result=False)
        if finished:
            self._shard_done(op, shard, agg, now)

    def _shard_done(self, op: OpKey, shard: int, agg: ShardAggregator, now: float) -> None:
        spec = self.jobs[op[0]]
        del self._aggs[(op, shard)]
        assert agg.result is not None
        receivers = {n for n in spec.contributors if n != spec.me}
        f = _Finished(
            spec=spec,
            layout=agg.layout,
            round=op[1],
            bucket=op[2],
            result=agg.result,
            classes=agg.classes,
            layers=agg.layers,
            # kept until every receiver ACKs, or as long as a receiver's round
            # may still be waiting for it (it times out after `timeout`)
            until=now + max(self.timing.retain, self.timing.timeout),
            waiting=set(receivers),
        )
        self._closed_shards[(op, shard)] = now
        self._close_shard(op, shard)
        self.stats["shards_aggregated"] += 1
        self.stats["lanes_lost"] += agg.result.lost_lanes
        self.stats["lanes_expected"] += agg.result.total_lanes
        if receivers:
            self._finished[(op, shard)] = f
        for node in sorted(receivers):
            self._send_results(f, node, None)
            self._send_result_done(f, node, copies=2)
        col = self._collectors.get(op)
        if col is not None:
            col.on_local(agg.result)
            self._check_complete(op, now)

    def _poll_collector(self, op: OpKey, col: ResultCollector, now: float) -> None:
        spec = self.jobs[op[0]]
        for nack in col.poll(now):
            # This node's own shard reaches the collector from the aggregator
            # here (`on_local`), never from the network: nothing to ask for.
            if nack.node != spec.me:
                self._send_nack(spec, op, col.layout, nack, result=True)
        self._check_complete(op, now)

    def _check_complete(self, op: OpKey, now: float) -> None:
        col = self._collectors.get(op)
        if col is None:
            return
        spec = self.jobs[op[0]]
        self._ack_whole_shards(spec, op, col)
        if not col.complete:
            return
        del self._collectors[op]
        self._contribs.pop(op, None)
        self._closed[op] = now
        col.tally()
        event = RoundComplete(
            job=op[0],
            round=op[1],
            bucket=op[2],
            layout=col.layout,
            sums=col.sums,
            contributors=col.contributors,
            block_max=col.block_max,
            lost_lanes=col.lost_lanes,
            total_lanes=col.total_lanes,
        )
        if self.timing.ack_wait > 0 and self._unacked_gathered(op):
            # the receivers' ACKs are usually a moment away (each sends them as
            # its round completes): waiting for them spares copying the shard
            self._held[op] = (now + self.timing.ack_wait, event)
            self.stats["completions_held"] += 1
            return
        self._complete(op, event)

    def _ack_whole_shards(self, spec: JobSpec, op: OpKey, col: ResultCollector) -> None:
        """ACK each other owner's result shard as soon as it is whole here, not
        when this node's whole round is: an owner whose round completes while
        a receiver has yet to ACK holds it (`timing.ack_wait`), and waiting for
        the slowest receiver's whole round held nearly every round for the
        full wait."""
        for shard, owner in enumerate(spec.owners):
            if (
                owner != spec.me
                and shard not in col.waiting
                and shard not in col.acked
                and col.layout.shard_packets(shard)
            ):
                col.acked.add(shard)
                self._send_ack(spec, op, col.layout, shard, owner)

    def _complete(self, op: OpKey, event: RoundComplete) -> None:
        """Tell the caller: its buffers are its own again."""
        self._settle_gathered(op)
        self.stats["rounds_completed"] += 1
        self._events.append(event)

    def _unacked_gathered(self, op: OpKey) -> list[list[bytes]]:
        """The datagrams of the result shards of round `op` that this node sent
        from the caller's buffer in place and some receiver has yet to ACK."""
        return [
            f.datagrams
            for (o, _shard), f in self._finished.items()
            if o == op and f.gathered and f.waiting and f.datagrams is not None
        ]

    def _release_held(self, now: float, *, op: OpKey | None = None) -> None:
        """Complete the held rounds whose ACKs are all in or whose wait is over
        (only `op`, if given)."""
        for key in [op] if op is not None else list(self._held):
            held = self._held.get(key)
            if held is None:
                continue
            due, event = held
            if now >= due or not self._unacked_gathered(key):
                del self._held[key]
                self._complete(key, event)

    def _settle_gathered(self, op: OpKey) -> None:
        """Round `op` ends here: its caller gets its buffers back and may change
        them. Gathered datagrams that may still be sent from them take copies
        of their payloads: the result datagrams of shards some receiver has not
        ACKed (kept for its NACKs), and any other still queued downstream."""
        lists = self._gathered.pop(op, None)
        if not lists:
            return
        keep = self._unacked_gathered(op)
        copied = sum(detach_gathered(dgs) for dgs in keep)
        kept = {id(dgs) for dgs in keep}
        copied += sum(detach_gathered(dgs, True) for dgs in lists if id(dgs) not in kept)
        self.stats["gathered_bytes_copied"] += copied
        self._settled.append(lists)  # read nothing of the caller's any more

    def drop_settled(self) -> None:
        """Free the datagrams of the rounds settled so far (their payloads are
        their own or no longer read): for a caller to call once it has told
        the ranks and sent what a round's end made, rather than have them freed
        while those wait."""
        self._settled.clear()

    def _fail(self, op: OpKey, reason: str, now: float) -> None:
        self._collectors.pop(op, None)
        self._contribs.pop(op, None)
        self._settle_gathered(op)
        self._close_aggs(op)
        self._closed[op] = now
        self.stats["rounds_failed"] += 1
        self._events.append(RoundFailed(job=op[0], round=op[1], bucket=op[2], reason=reason))

    def _timer_failed(self, op: OpKey, exc: Exception, now: float) -> None:
        """A bug or inconsistency met while a timer handled round `op`: the
        round fails with the error as its reason (its ranks are told), rather
        than the error escaping and stopping every other round's timers."""
        self.stats["internal_errors"] += 1
        self.last_error = str(exc)
        if op not in self._closed:
            self._fail(op, f"internal error: {exc}", now)
        else:
            self._close_aggs(op)  # a shard outliving its round

    def _close_aggs(self, op: OpKey) -> None:
        """Drop and close every shard of round `op` aggregated here."""
        for k in [k for k in self._aggs if k[0] == op]:
            del self._aggs[k]
            self._close_shard(op, k[1])

    # -- timers -------------------------------------------------------------
    def get_timer(self) -> float | None:
        times: Iterable[float | None] = (
            *(a.next_timer() for a in self._aggs.values()),
            *(c.next_timer() for c in self._collectors.values()),
            *(f.until for f in self._finished.values()),
            *(due for due, _event in self._held.values()),
        )
        due = [t for t in times if t is not None]
        closed = [*self._closed.values(), *self._closed_shards.values()]
        if closed:
            due.append(min(closed) + self.timing.retain)
        return min(due) if due else None

    def handle_timer(self, now: float) -> None:
        for (op, shard), agg in list(self._aggs.items()):
            if (op, shard) not in self._aggs:
                continue
            if agg.timed_out(now):
                lacking = agg.missing_senders()
                why = f"shard {shard} timed out after {self.timing.timeout:g}s"
                why += (
                    f"; nothing from node(s) {lacking}" if lacking else "; required packets missing"
                )
                if op in self._collectors:
                    self._fail(op, why, now)
                else:
                    del self._aggs[(op, shard)]
                    self._close_shard(op, shard)
                    self.stats["rounds_failed"] += 1
                continue
            try:
                self._progress(op, shard, now)
            except (DlcpError, ValueError) as exc:
                self._timer_failed(op, exc, now)
        for op, col in list(self._collectors.items()):
            if self._collectors.get(op) is not col:  # failed above
                continue
            if col.timed_out(now):
                owners = sorted({w.owner for w in col.waiting.values()})
                why = f"results from node(s) {owners} timed out ({col.describe_waiting(now)})"
                self._fail(op, why, now)
                continue
            try:
                self._poll_collector(op, col, now)
            except (DlcpError, ValueError) as exc:
                self._timer_failed(op, exc, now)
        if self._held:
            self._release_held(now)
        for key in [k for k, f in self._finished.items() if f.until <= now]:
            del self._finished[key]
        for op in [op for op, t in self._closed.items() if t + self.timing.retain <= now]:
            del self._closed[op]
        for k in [k for k, t in self._closed_shards.items() if t + self.timing.retain <= now]:
            del self._closed_shards[k]
