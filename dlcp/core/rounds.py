"""The table of open rounds at one node and the work that drives each to its end.

`OpenRounds` holds a `Round` per live operation. It opens a round's
aggregators, moves a shard on when packets or timers say so (NACKs when it
stalls, results when it is summed), completes, holds and fails rounds (each
through the phase table, `dlcp.core.round.TRANSITIONS`), and runs the timers
(`get_timer`, `handle_timer`). Its datagrams are made by an `Emitter`; what
is remembered after a round ends goes to `ClosedRounds`. Its own state: the
rounds, the events for the caller, the datagrams settled since `drop_settled`.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Iterator, Sequence

import numpy as np

from dlcp.core.aggregate import ShardAggregator
from dlcp.core.aggtypes import Nack
from dlcp.core.closed import ClosedRounds
from dlcp.core.collector import ResultCollector
from dlcp.core.early import EARLY_CODECS, EarlyResults
from dlcp.core.emitter import Emitter
from dlcp.core.layout import Layout
from dlcp.core.records import (
    ALL_GATHER,
    ALLREDUCE,
    REDUCE_SCATTER,
    Event,
    JobSpec,
    OpKey,
    RoundComplete,
    RoundFailed,
    Tally,
    _Contribution,
    _Finished,
)
from dlcp.core.round import Phase, Round, Step
from dlcp.core.timing import NackClock, Timing
from dlcp.errors import DlcpError
from dlcp.wire.header import lane_bytes
from dlcp.wire.mac import detach_gathered

__all__ = ["OpenRounds"]

_SETTLED_MAX = 4  # rounds' settled datagrams kept for `drop_settled` (the oldest freed first)


class OpenRounds:
    """Every live round of every job at one node, driven to its end."""

    def __init__(
        self,
        *,
        timing: Timing,
        clocks: dict[int, dict[int, NackClock]],
        emitter: Emitter,
        closed: ClosedRounds,
        tally: Tally,
        early_batch: int = 0,
    ) -> None:
        self.timing = timing
        # whole packets' results go early, this many at a time (dlcp.core.early; 0: no)
        self.early_batch = early_batch
        self.clocks = clocks  # the engine's, per job and peer (read only here)
        self.emitter = emitter
        self.closed = closed
        self.tally = tally
        self.stats = tally.stats
        self.table: dict[OpKey, Round] = {}
        self.events: deque[Event] = deque()
        # the gathered datagrams of rounds settled since `drop_settled`:
        # freeing a leg's tens of thousands of datagrams, long out of cache,
        # took about a millisecond, which a round's end, its caller and the
        # peers waiting on its ACKs need not wait for
        self.settled: deque[list[list[bytes]]] = deque(maxlen=_SETTLED_MAX)
        self._seq = 0  # opening order of aggregators, collectors and held rounds

    # -- the table --------------------------------------------------------
    def get(self, op: OpKey) -> Round | None:
        return self.table.get(op)

    def _round(self, spec: JobSpec, op: OpKey) -> Round:
        r = self.table.get(op)
        if r is None:
            r = self.table[op] = Round(spec, op)
        return r

    def _next(self) -> int:
        self._seq += 1
        return self._seq

    def _tidy(self, r: Round) -> None:
        """Drop `r` from the table once nothing of it is live."""
        if r.idle() and self.table.get(r.op) is r:
            del self.table[r.op]

    def aggregators(self) -> Iterator[tuple[OpKey, int, ShardAggregator]]:
        """Every open aggregator, in the order they opened."""
        rows = [(r.agg_seq[s], r.op, s, a) for r in self.table.values() for s, a in r.aggs.items()]
        rows.sort(key=lambda row: row[0])
        return ((op, s, a) for _, op, s, a in rows)

    def collectors(self) -> list[tuple[Round, ResultCollector]]:
        """Every open collector, in the order its round was submitted."""
        rows = [r for r in self.table.values() if r.collector is not None]
        rows.sort(key=lambda r: r.collector_seq)
        return [(r, r.collector) for r in rows if r.collector is not None]

    def pending(self) -> int:
        """Rounds begun here and not yet completed or failed (held ones too)."""
        return sum(r.phase in (Phase.OPEN, Phase.HELD) for r in self.table.values())

    # -- opening ----------------------------------------------------------
    def open(self, c: _Contribution, collector: ResultCollector, now: float) -> None:
        """Start round `c` with this node's contribution: its own shards to
        their aggregators here, the others' data and manifests to their owners."""
        spec = c.spec
        op = (spec.job, c.round, c.bucket)
        r = self._round(spec, op)
        r.move(Step.SUBMIT)
        r.contribution, r.collector, r.collector_seq = c, collector, self._next()
        r.kind = c.kind
        self.closed.see(spec, spec.job, c.round)
        for shard, owner in enumerate(spec.owners):
            if not c.layout.shard_packets(shard):
                continue
            if owner == spec.me:
                self._local_contribution(r, shard, c, now)
            elif c.kind == ALL_GATHER:  # no data of its own: "ready" for the owner's results
                self.emitter.manifest(c, shard, owner, copies=2)
            else:
                self.emitter.data(c, shard, owner, None, r.gathered)
                self.emitter.manifest(c, shard, owner, copies=2)
        self.check_complete(r, now)

    def aggregator(
        self,
        spec: JobSpec,
        op: OpKey,
        shard: int,
        lay: Layout,
        now: float,
        senders: Sequence[int] | None = None,
    ) -> tuple[Round, ShardAggregator]:
        """The aggregator of (op, shard), opened (and its round) if need be;
        `senders`: who contributes (default the job's contributors)."""
        r = self.table.get(op)
        if r is None:
            r = self.table[op] = Round(spec, op)
        agg = r.aggs.get(shard)
        if agg is None:
            agg = ShardAggregator(
                layout=lay,
                shard=shard,
                senders=spec.contributors if senders is None else senders,
                now=now,
                timing=self.timing,
                clocks=self.clocks.get(op[0]),
            )
            r.aggs[shard] = agg
            self._seq += 1
            r.agg_seq[shard] = self._seq
            self.closed.see(spec, op[0], op[1])
        return r, agg

    def _local_contribution(self, r: Round, shard: int, c: _Contribution, now: float) -> None:
        alone = None
        if c.kind == ALL_GATHER:  # the owner's shard is its own contribution alone
            old = r.aggs.pop(shard, None)  # opened by receivers' "ready" manifests
            r.agg_seq.pop(shard, None)
            if old is not None:
                r.ready.update(n for n, m in zip(old.senders, old.manifest, strict=True) if m)
            alone = (c.spec.me,)
        r, agg = self.aggregator(r.spec, r.op, shard, c.layout, now, alone)
        lay = c.layout
        pk = lay.shard_packets(shard)
        off, count = lay.shard_range(shard)
        start = lane_bytes(lay.codec, off, c.summed)
        agg.on_local(
            sender=c.spec.me,
            lanes=c.lanes[start : start + lane_bytes(lay.codec, count, c.summed)],
            summed=c.summed,
            weight=c.weight,
            droppable=c.droppable[pk.start : pk.stop],
            scale=c.scale,
            block_max=c.block_max[pk.start : pk.stop],
            now=now,
        )
        agg.note_meta(c.classes[pk.start : pk.stop], c.layers[pk.start : pk.stop])
        if c.class_bounds is not None and c.kind != ALL_GATHER:
            agg.clock.set_bounds(c.class_bounds[pk.start : pk.stop], now)
        agg.on_manifest(sender=c.spec.me, droppable=np.zeros(len(pk), bool), bound=c.bound, now=now)
        self.progress(r, shard, now)

    # -- progress ---------------------------------------------------------
    def progress(self, r: Round, shard: int, now: float) -> None:
        """Poll shard `shard`'s aggregator: its NACKs, and its end if summed."""
        agg = r.aggs.get(shard)
        if agg is None:
            return
        col = r.collector
        acc = agg.acc
        if acc.out is None and agg.result is None and col is not None and col.layout == agg.layout:
            sums = col.shard_sums(shard)
            if sums.dtype == acc.slots.dtype:
                agg.sum_into(sums)  # the owner's sums go straight where they are collected
        nacks, finished = agg.poll(now)
        self._ask(r, agg.layout, nacks, False)
        if finished:
            self._shard_done(r, shard, agg, now)
        else:
            self.early(r, shard, agg)

    def early(self, r: Round, shard: int, agg: ShardAggregator) -> None:
        """The results of the shard's whole packets, sent before it completes."""
        if self.early_batch and r.kind == ALLREDUCE and agg.layout.codec in EARLY_CODECS:
            if shard not in r.early:
                r.early[shard] = EarlyResults(agg, self.early_batch)
            r.early[shard].send(self.emitter, r.spec, r.op)

    def _shard_done(self, r: Round, shard: int, agg: ShardAggregator, now: float) -> None:
        spec, op = r.spec, r.op
        del r.aggs[shard]
        early = r.early.pop(shard, None)
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
            early=None if early is None else early.results,
            codec_sent=None if early is None or early.results is None else early.codec,
            early_datagrams=None if early is None else early.datagrams,
            resent={} if early is None else early.resent,
        )
        self.closed.shard_aggregated(spec, op, shard, now)
        self.stats["shards_aggregated"] += 1
        self.stats["lanes_lost"] += agg.result.lost_lanes
        self.stats["lanes_expected"] += agg.result.total_lanes
        if receivers:
            r.finished[shard] = f
        gathered = r.gathered if r.collector is not None else None
        if r.kind == ALL_GATHER:
            f.deferred = receivers - r.ready
        for node in sorted(receivers - f.deferred):
            if r.kind != REDUCE_SCATTER:  # a reduce-scatter's DONE only: "your data is in"
                self.emitter.results(f, node, None, gathered)
            self.emitter.result_done(f, node, copies=2)
        col = r.collector
        if col is not None:
            col.on_local(agg.result)
            self.check_complete(r, now)
        elif not r.finished:
            self._tidy(r)

    def poll_collector(self, r: Round, col: ResultCollector, now: float) -> None:
        self._ask(r, col.layout, col.poll(now), True)
        self.check_complete(r, now)

    def _ask(self, r: Round, lay: Layout, nacks: Sequence[Nack], result: bool) -> None:
        """`nacks` out, none to this node: its own part and shard are `on_local`'s."""
        for nack in nacks:
            if nack.node != r.spec.me:
                self.emitter.nack(r.spec, r.op, lay, nack, result)

    def ready(self, r: Round, node: int) -> None:
        """An all-gather's receiver `node` has submitted the round (its DONE
        manifest came, or its NACK for results): what waited for it is sent."""
        r.ready.add(node)
        gathered = r.gathered if r.collector is not None else None
        for f in r.finished.values():
            if node in f.deferred:
                f.deferred.discard(node)
                self.emitter.results(f, node, None, gathered)
                self.emitter.result_done(f, node, copies=2)

    def acked(self, r: Round, shard: int, sender: int, now: float) -> None:
        """A receiver's ACK of result shard `shard`: kept no longer once all are in."""
        f = r.finished.get(shard)
        if f is None:
            return
        f.waiting.discard(sender)
        if not f.waiting:
            del r.finished[shard]
            if r.phase is Phase.HELD:
                self._release(r, now)
            self._tidy(r)

    # -- completion -------------------------------------------------------
    def check_complete(self, r: Round, now: float) -> None:
        col = r.collector
        if col is None:
            return
        self._ack_whole_shards(r, col)
        if not col.complete:
            return
        r.collector = r.contribution = None
        self.closed.close_round(r.op, now)
        col.tally()
        op = r.op
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
        if self.timing.ack_wait > 0 and r.unacked_gathered():
            # the receivers' ACKs are usually a moment away (each sends them as
            # its round completes): waiting for them spares copying the shard
            r.move(Step.HOLD)
            r.held, r.held_seq = (now + self.timing.ack_wait, event), self._next()
            self.stats["completions_held"] += 1
            return
        r.move(Step.COMPLETE)
        self._complete(r, event)

    def _ack_whole_shards(self, r: Round, col: ResultCollector) -> None:
        """ACK each other owner's result shard as soon as it is whole here, not
        when this node's whole round is: an owner whose round completes while
        a receiver has yet to ACK holds it (`timing.ack_wait`), and waiting for
        the slowest receiver's whole round held nearly every round for the
        full wait."""
        spec = r.spec
        for shard, owner in enumerate(spec.owners):
            if (
                owner != spec.me
                and shard not in col.waiting
                and shard not in col.acked
                and col.layout.shard_packets(shard)
            ):
                col.acked.add(shard)
                self.emitter.ack(spec, r.op, col.layout, shard, owner)

    def _complete(self, r: Round, event: RoundComplete) -> None:
        """Tell the caller: its buffers are its own again."""
        self._settle(r)
        self.stats["rounds_completed"] += 1
        self.events.append(event)
        self._tidy(r)

    def _release(self, r: Round, now: float) -> None:
        """Complete held round `r` if its ACKs are all in or its wait is over."""
        assert r.held is not None
        due, event = r.held
        if now >= due or not r.unacked_gathered():
            r.held = None
            r.move(Step.RELEASE)
            self._complete(r, event)

    def release_held(self, now: float) -> None:
        """`_release` every held round, in the order they were held."""
        held = sorted((r for r in self.table.values() if r.held), key=lambda r: r.held_seq)
        for r in held:
            self._release(r, now)

    def _settle(self, r: Round) -> None:
        """Round `r` ends here: its caller gets its buffers back and may change
        them. Gathered datagrams that may still be sent from them take copies
        of their payloads: the result datagrams of shards some receiver has not
        ACKed (kept for its NACKs), and any other still queued downstream; an
        all-gather's shard not yet sent to anyone keeps a copy of its sums."""
        for f in r.finished.values():
            if f.deferred and f.datagrams is None:
                f.result = dataclasses.replace(f.result, sums=f.result.sums.copy())
        lists, r.gathered = r.gathered, []
        if not lists:
            return
        keep = r.unacked_gathered()
        copied = sum(detach_gathered(dgs) for dgs in keep)
        kept = {id(dgs) for dgs in keep}
        copied += sum(detach_gathered(dgs, True) for dgs in lists if id(dgs) not in kept)
        self.stats["gathered_bytes_copied"] += copied
        self.settled.append(lists)  # read nothing of the caller's any more

    # -- failure ----------------------------------------------------------
    def fail(self, r: Round, reason: str, now: float) -> None:
        r.move(Step.FAIL)
        r.collector = r.contribution = None
        self._settle(r)
        self._close_aggs(r)
        self.closed.close_round(r.op, now)
        self.stats["rounds_failed"] += 1
        op = r.op
        self.events.append(RoundFailed(job=op[0], round=op[1], bucket=op[2], reason=reason))
        self._tidy(r)

    def _timer_failed(self, r: Round, exc: Exception, now: float) -> None:
        """A bug or inconsistency met while a timer handled round `r`: the
        round fails with the error as its reason (its ranks are told), rather
        than the error escaping and stopping every other round's timers."""
        self.stats["internal_errors"] += 1
        self.tally.last_error = str(exc)
        if not self.closed.round_closed(r.op) and r.phase is not Phase.HELD:
            self.fail(r, f"internal error: {exc}", now)
        else:
            self._close_aggs(r)  # a shard outliving its round
            self._tidy(r)

    def _close_aggs(self, r: Round) -> None:
        """Drop and close every shard of round `r` aggregated here."""
        for shard in list(r.aggs):
            del r.aggs[shard]
            self.closed.close_shard(r.spec, r.op, shard)

    def remove_job(self, job: int, now: float) -> None:
        """Every round of `job` ends here: the open ones fail, the held ones
        complete (their results are whole), the rest is dropped."""
        mine = [r for r in self.table.values() if r.op[0] == job]
        for r, _col in self.collectors():
            if r.op[0] == job:
                self.fail(r, "job removed", now)
        for r in mine:
            r.aggs.clear()
            r.finished.clear()
            r.contribution = None
        for r in sorted((r for r in mine if r.held), key=lambda r: r.held_seq):
            assert r.held is not None
            event, r.held = r.held[1], None
            r.move(Step.RELEASE)
            self._complete(r, event)
        for r in mine:
            self._settle(r)
            if self.table.get(r.op) is r:
                del self.table[r.op]

    # -- timers -----------------------------------------------------------
    def get_timer(self) -> float | None:
        times: list[float | None] = []
        for r in self.table.values():
            times.extend(a.next_timer() for a in r.aggs.values())
            if r.collector is not None:
                times.append(r.collector.next_timer())
            times.extend(f.until for f in r.finished.values())
            if r.held is not None:
                times.append(r.held[0])
        due = [t for t in times if t is not None]
        closed = self.closed.next_expiry()
        if closed is not None:
            due.append(closed)
        return min(due) if due else None

    def handle_timer(self, now: float) -> None:
        for op, shard, agg in list(self.aggregators()):
            r = self.table.get(op)
            if r is None or shard not in r.aggs:
                continue
            if agg.timed_out(now):
                lacking = agg.missing_senders()
                why = f"shard {shard} timed out after {self.timing.timeout:g}s"
                why += (
                    f"; nothing from node(s) {lacking}" if lacking else "; required packets missing"
                )
                if r.collector is not None:
                    self.fail(r, why, now)
                else:
                    del r.aggs[shard]
                    r.early.pop(shard, None)
                    self.closed.close_shard(r.spec, op, shard)
                    self.stats["rounds_failed"] += 1
                    self._tidy(r)
                continue
            try:
                self.progress(r, shard, now)
            except (DlcpError, ValueError) as exc:
                self._timer_failed(r, exc, now)
        for r, col in self.collectors():
            if r.collector is not col:  # failed above
                continue
            if col.timed_out(now):
                owners = sorted({w.owner for w in col.waiting.values()})
                why = f"results from node(s) {owners} timed out ({col.describe_waiting(now)})"
                self.fail(r, why, now)
                continue
            try:
                self.poll_collector(r, col, now)
            except (DlcpError, ValueError) as exc:
                self._timer_failed(r, exc, now)
        self.release_held(now)
        for r in list(self.table.values()):
            for shard in [s for s, f in r.finished.items() if f.until <= now]:
                del r.finished[shard]
            self._tidy(r)
        self.closed.expire(now)
