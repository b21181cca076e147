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

`Engine` is made of parts, one module each: this module holds its state, its
jobs and `submit`; `engine_out` makes a round's datagrams, `engine_in` takes
them in (in batches), `bookkeeping` follows a round to its end (timers,
completion, failure, what is kept after), and `records` holds the types they
share (`JobSpec`, `SendBatch`, the events).
"""

from __future__ import annotations

import math
from collections import Counter, deque
from typing import Any

import numpy as np

from dlcp.codecs import lanes as lane_ops
from dlcp.core.aggregate import ShardAggregator
from dlcp.core.bookkeeping import RoundBookkeeping
from dlcp.core.collector import ResultCollector
from dlcp.core.engine_in import EngineIn
from dlcp.core.engine_out import EngineOut
from dlcp.core.layout import Layout
from dlcp.core.records import (
    CONTROL_CLASS,
    Event,
    JobSpec,
    OpKey,
    RoundComplete,
    RoundFailed,
    Send,
    SendBatch,
    _Contribution,
    _Finished,
    manifest_capacity,
    nack_capacity,
)
from dlcp.core.timing import NackClock, Timing
from dlcp.errors import LocalError, Reason
from dlcp.wire.credit import Credit, credit_of, credit_payload
from dlcp.wire.header import Codec, Header, PacketType, encode, lane_bytes
from dlcp.wire.mac import MacKey, mac_state

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
    "manifest_capacity",
    "nack_capacity",
]

# rounds whose settled datagrams wait for `Engine.drop_settled` at most (the
# oldest are freed first when more end without a call)
_SETTLED_MAX = 4


class Engine(EngineOut, EngineIn, RoundBookkeeping):
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
