"""The engine's round bookkeeping: the aggregators and collectors a round opens,
its progress (NACKs when a shard stalls, results when one is summed), its
completion and failure, the timers that drive them (`get_timer`,
`handle_timer`), and the records kept after a round closes (late packets,
held completions, settled gathered datagrams).

A part of `dlcp.core.engine.Engine` (a mixin) that holds no state of its own;
what it reads of the engine is declared below for the type checker.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from dlcp.core.aggregate import Nack, ShardAggregator
from dlcp.core.collector import ResultCollector
from dlcp.core.layout import Layout
from dlcp.core.records import (
    Event,
    JobSpec,
    OpKey,
    RoundComplete,
    RoundFailed,
    _Contribution,
    _Finished,
)
from dlcp.core.timing import NackClock, Timing
from dlcp.errors import DlcpError
from dlcp.wire.mac import detach_gathered

__all__ = ["RoundBookkeeping"]


class RoundBookkeeping:
    """Rounds' progress, completion, failure, timers and the records kept after."""

    if TYPE_CHECKING:
        _aggs: dict[tuple[OpKey, int], ShardAggregator]
        _clocks: dict[int, dict[int, NackClock]]
        _closed: dict[OpKey, float]
        _closed_rounds: dict[int, dict[tuple[int, int], list[int]]]
        _closed_shards: dict[tuple[OpKey, int], float]
        _collectors: dict[OpKey, ResultCollector]
        _contribs: dict[OpKey, _Contribution]
        _events: deque[Event]
        _finished: dict[tuple[OpKey, int], _Finished]
        _gathered: dict[OpKey, list[list[bytes]]]
        _held: dict[OpKey, tuple[float, RoundComplete]]
        _newest: dict[int, int]
        _pruned_at: dict[int, int]
        _settled: deque[list[list[bytes]]]
        jobs: dict[int, JobSpec]
        last_error: str
        stats: Counter[str]
        timing: Timing

        def _send_ack(
            self, spec: JobSpec, op: OpKey, lay: Layout, shard: int, owner: int
        ) -> None: ...

        def _send_nack(
            self, spec: JobSpec, op: OpKey, lay: Layout, nack: Nack, result: bool
        ) -> None: ...

        def _send_result_done(self, f: _Finished, node: int, copies: int) -> None: ...

        def _send_results(self, f: _Finished, node: int, only: Sequence[int] | None) -> None: ...

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
