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

`Engine` is a facade over objects that each own their state (as aioquic's
QuicConnection composes recovery, streams and congestion control): the jobs
and their keys are its own; `OpenRounds` (dlcp.core.rounds) is the table of
live rounds, a `Round` (dlcp.core.round) each with an explicit phase;
`ClosedRounds` (dlcp.core.closed) answers "is this late?"; `Emitter`
(dlcp.core.emitter) makes datagrams; `Receiver` (dlcp.core.receiver) takes
them in, in runs, and `Dispatcher` (dlcp.core.dispatch) packet by packet;
`records` holds the types they share (`JobSpec`, `SendBatch`, the events,
`Tally`).
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import numpy as np

from dlcp.codecs import lanes as lane_ops
from dlcp.core.closed import ClosedRounds
from dlcp.core.collector import ResultCollector
from dlcp.core.dispatch import Dispatcher
from dlcp.core.emitter import Emitter
from dlcp.core.receiver import Receiver
from dlcp.core.records import (
    ALL_GATHER,
    ALLREDUCE,
    REDUCE_SCATTER,
    ROUND_KINDS,
    Event,
    JobSpec,
    RoundComplete,
    RoundFailed,
    Send,
    SendBatch,
    Tally,
    _Contribution,
    manifest_capacity,
    nack_capacity,
)
from dlcp.core.rounds import OpenRounds
from dlcp.core.timing import NackClock, Timing
from dlcp.errors import LocalError, Reason
from dlcp.wire.credit import Credit, credit_of, credit_payload
from dlcp.wire.header import MAX_PRIORITY, Codec, lane_bytes
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


class Engine:
    """All rounds of all jobs at one node."""

    def __init__(
        self, *, timing: Timing | None = None, gather: bool = False, early_results: int = 0
    ) -> None:
        self.timing = timing or Timing()
        self.gather = gather
        self.jobs: dict[int, JobSpec] = {}
        self._keys: dict[int, MacKey] = {}
        # per job, per peer node: how soon it answers this node's NACKs
        self._clocks: dict[int, dict[int, NackClock]] = {}
        self.tally = Tally()
        self.stats: Counter[str] = self.tally.stats
        self.rejects: Counter[Reason] = self.tally.rejects
        self.emitter = Emitter(self._keys, self.stats, gather=gather)
        self.closed = ClosedRounds(self.timing)
        self.rounds = OpenRounds(
            timing=self.timing,
            clocks=self._clocks,
            emitter=self.emitter,
            closed=self.closed,
            tally=self.tally,
            early_batch=early_results,
        )
        self.packets = Dispatcher(
            jobs=self.jobs,
            clocks=self._clocks,
            timing=self.timing,
            rounds=self.rounds,
            closed=self.closed,
            emitter=self.emitter,
            tally=self.tally,
        )
        self.receiver = Receiver(
            keys=self._keys, rounds=self.rounds, packets=self.packets, tally=self.tally
        )
        # the receive path, bound once (called per drain)
        self.receive = self.receiver.receive
        self.receive_batch = self.receiver.receive_batch
        self.receive_many = self.receiver.receive_many
        self.receive_packet = self.packets.receive_packet

    @property
    def last_error(self) -> str:
        """The last internal error met (a bug or inconsistency, counted in
        `stats["internal_errors"]`, never raised)."""
        return self.tally.last_error

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

    def nack_clocks(self, job: int) -> dict[int, NackClock]:
        """Per peer node of `job`: its NACK clock (empty for a job not here)."""
        return self._clocks.get(job, {})

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
        self.rounds.remove_job(job, now)
        self.closed.forget_job(job)

    @property
    def keys(self) -> dict[int, MacKey]:
        return self._keys

    # -- outputs ----------------------------------------------------------
    def send_batches(self) -> list[SendBatch]:
        """The datagrams to send since the last call, in order, in batches."""
        return self.emitter.take()

    def datagrams_to_send(self) -> list[Send]:
        """`send_batches`, one `Send` per datagram."""
        return [s for b in self.send_batches() for s in b.sends()]

    def next_event(self) -> Event | None:
        events = self.rounds.events
        return events.popleft() if events else None

    def pending_rounds(self) -> int:
        """Rounds begun here and not yet completed or failed (held ones too)."""
        return self.rounds.pending()

    def drop_settled(self) -> None:
        """Free the datagrams of the rounds settled so far (their payloads are
        their own or no longer read): for a caller to call once it has told
        the ranks and sent what a round's end made, rather than have them freed
        while those wait."""
        self.rounds.settled.clear()

    def get_timer(self) -> float | None:
        return self.rounds.get_timer()

    def handle_timer(self, now: float) -> None:
        self.rounds.handle_timer(now)

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
        return self.emitter.control(spec, self.closed.newest.get(job, 0), payload)

    def has_round(self, job: int, round: int, bucket: int) -> bool:
        """Whether this node submitted (job, round, bucket) and still remembers it."""
        op = (job, round, bucket)
        r = self.rounds.get(op)
        return (r is not None and r.contribution is not None) or self.closed.round_closed(op)

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
        kind: str = ALLREDUCE,
        class_bounds: np.ndarray | None = None,
    ) -> None:
        """Start a round with this node's contribution (`total` lanes of `codec`).

        `classes`, `droppable`, `layers` and `block_max` are per data packet of
        the bucket (policy decisions made by the caller), and `class_bounds`
        the lowest class any contributor's policy gives each packet unless
        it is droppable (`PriorityPolicy.lowest`; None: not known), with which
        the shards' owner here tells lost packets sooner; `bound` is the loss
        bound the droppable packets were chosen under. `out` (`total` lanes of
        the codec's sum dtype, `lane_ops.sum_dtype`) is where the results are
        put as they arrive, and `RoundComplete.sums` then is `out`; it is the
        caller's only once the round has completed or failed.

        `kind` (`ROUND_KINDS`): "reduce_scatter" moves the DATA leg only, and
        the sums are those of the shards this node owns (the rest of `sums`
        is not written); "all_gather" the RESULT leg only: each owner's own
        lanes of its shard are the result, exactly (the other lanes of
        `lanes` are not read). Both need a transpose job (every contributor
        owns shards), and a round's kind is the same at every node.
        """
        spec = self.jobs.get(job)
        if spec is None:
            raise LocalError(f"unknown job {job}")
        if spec.me not in spec.contributors:
            raise LocalError(f"node {spec.me} does not contribute to job {job}")
        if self.has_round(job, round, bucket):
            raise LocalError(f"round {round} bucket {bucket} of job {job} was already submitted")
        if not 0.0 <= bound <= 0.5:
            raise LocalError(f"loss bound {bound} outside 0..0.5")
        if codec == Codec.UNION and bound > 0:
            raise LocalError("the sketch's index union (codec UNION) is never droppable: bound 0")
        if not 1 <= weight <= lane_ops.MAX_CONTRIBUTORS:
            raise LocalError(f"weight {weight} outside 1..{lane_ops.MAX_CONTRIBUTORS}")
        if not math.isfinite(scale):
            raise LocalError("scale must be finite")
        if kind not in ROUND_KINDS:
            raise LocalError(f"round kind {kind!r}; valid: {', '.join(ROUND_KINDS)}")
        if kind != ALLREDUCE and sorted(set(spec.owners)) != sorted(spec.contributors):
            raise LocalError(f"a {kind} round needs every contributor to own shards (transpose)")
        layout = spec.layout(total, codec)
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
            kind=kind,
            # (the fill is for an absent array: a given one is checked, not filled)
            class_bounds=None
            if class_bounds is None
            else per_packet(class_bounds, MAX_PRIORITY, np.uint8),
        )
        if c.classes.max(initial=0) > 7 or (
            c.class_bounds is not None and c.class_bounds.max(initial=0) > 7
        ):
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
            expect=frozenset(s for s, o in enumerate(spec.owners) if o == spec.me)
            if kind == REDUCE_SCATTER
            else None,
            classes=c.classes if kind != ALL_GATHER else None,
        )
        self.rounds.open(c, collector, now)
