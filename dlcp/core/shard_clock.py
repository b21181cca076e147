"""A shard aggregator's clock: when the shard may complete (every required
packet in, the loss bound met), the NACKs it sends and when (`poll`,
`next_timer`: per sender, paced by that sender's NACK clock and manifest),
and when it gives up.

`ShardClock` owns its times (when the shard opened, last heard from, was
last NACKed, met its bound) and per sender the NACKs yet unanswered; it
reads the aggregator's arrival record (which packets came, which are
droppable, whose manifest is in), arrays the aggregator fills in place and
hands it once, at construction.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

from dlcp.core.aggtypes import Nack, _Tick
from dlcp.core.timing import NackClock, Timing, done_wait, repeat_wait, time_answer

__all__ = ["ShardClock"]


class ShardClock:
    """Completion, NACK timing and time-out of one shard aggregator."""

    def __init__(
        self,
        *,
        shard: int,
        senders: tuple[int, ...],
        rows: Mapping[int, int],
        counts: np.ndarray,
        received: np.ndarray,
        droppable: np.ndarray,
        manifest: np.ndarray,
        timing: Timing,
        clocks: Mapping[int, NackClock],
        now: float,
    ) -> None:
        self.shard = shard
        self.senders = senders
        self._row = rows  # sender node -> row (the aggregator's)
        self.timing = timing
        # per sender node, how soon it answers NACKs (the engine's, shared by
        # every shard of the job); a sender without one: `nack_interval`
        self.clocks = clocks
        # the aggregator's arrival record (read only here; filled in place there)
        self.counts = counts
        self.received = received
        self.droppable = droppable
        self.manifest = manifest
        s = len(self.senders)
        self.created = now
        self.last_arrival = now
        self.done_at: float | None = None  # when every required packet and the bound were met
        self.last_nack = np.full(s, -math.inf)
        # per sender row, the NACKs sent to it since it last answered one
        self.unanswered = [0] * s
        # the rows found to hold every packet (`received` only ever gains them)
        self._complete_rows: set[int] = set()

    # -- decisions --------------------------------------------------------
    def _required_missing(self, row: int | None = None) -> np.ndarray:
        """Per sender and packet (of sender row `row` only, if given): missing
        and not known to be droppable."""
        if row is not None:
            return ~self.received[row] & ~self.droppable[row]
        return ~self.received & ~self.droppable

    def poll(self, now: float, bound: float) -> tuple[list[Nack], bool]:
        """Advance timers: NACKs to send, and whether the shard is to complete
        now (every packet in, or the required ones and `bound` met for the
        linger time)."""
        if self.received.all():
            return [], True
        nacks: list[Nack] = []
        required = self._required_missing()
        total = int(self.counts.sum()) * len(self.senders)
        have = int((self.received * self.counts).sum())
        within = have >= (1.0 - bound) * total
        if self.manifest.all() and not required.any() and within:
            if self.done_at is None:
                self.done_at = now
            if now >= self.done_at + self.timing.linger:
                return [], True
            return [], False
        # Something required is missing. Ask for it once it is overdue.
        for row, node in enumerate(self.senders):
            if now < self.last_nack[row] + self.repeat_after(row):
                continue
            if self.manifest[row]:
                if now < self.last_arrival + self.timing.nack_delay:
                    continue
                missing = np.flatnonzero(required[row])
                if missing.size == 0 and self.manifest.all() and not within:
                    # Required data is in but the bound is not met: ask for the
                    # droppable packets needed to reach it.
                    missing = self._to_reach_bound(row, total - have, total, bound)
                if missing.size:
                    nacks.append(Nack(node, self.shard, tuple(int(m) for m in missing)))
                    self.last_nack[row] = now
                    self.unanswered[row] += 1
            elif now >= self._manifest_due(row):  # no DONE, and the shard has gone quiet
                nacks.append(Nack(node, self.shard, (), need_manifest=True))
                self.last_nack[row] = now
                self.unanswered[row] += 1
        return nacks, False

    def repeat_after(self, row: int) -> float:
        """How long after its last NACK sender row `row` is asked again."""
        clock = self.clocks.get(self.senders[row])
        return repeat_wait(clock, self.timing, self.unanswered[row])

    def _manifest_due(self, row: int) -> float:
        """When sender row `row`, whose DONE has not come, is asked for it.

        Its packets came but no DONE: the DONE leaves right behind them, so
        both copies were lost (a burst) once the shard has been quiet for the
        time this sender takes to answer a NACK (`done_wait`), a few
        round-trips, not a grace. Nothing from it yet, or a sender never
        timed: it may not have started (a late rank), so a grace after the
        round began and after the last arrival."""
        wait = done_wait(self.clocks.get(self.senders[row]), self.timing)
        if wait < self.timing.grace and self.received[row].any():
            return self.last_arrival + wait
        return max(self.created, self.last_arrival) + self.timing.grace

    def answered(self, sender: int, now: float) -> None:
        """A retransmission from `sender` was stored: its answer to the NACKs
        sent it (`time_answer`)."""
        row = self._row.get(sender)
        if row is None or not self.unanswered[row]:
            return
        clock = self.clocks.get(sender)
        time_answer(clock, self.unanswered[row], float(self.last_nack[row]), now)
        self.unanswered[row] = 0

    def _to_reach_bound(self, row: int, missing_lanes: int, total: int, bound: float) -> np.ndarray:
        allowed = int(bound * total)
        need = missing_lanes - allowed
        gone = np.flatnonzero(~self.received[row])
        take = np.searchsorted(np.cumsum(self.counts[gone]), need) + 1
        return gone[:take]

    def next_timer(self) -> float | None:
        """When `poll` next has something to do (never a time it would idle at)."""
        t = _Tick()
        t.arm(self.created + self.timing.timeout)
        if self.done_at is not None:
            t.arm(self.done_at + self.timing.linger)
            return t.at
        # Called after every drain: a row is looked at only where its answer
        # may arm a time (its manifest in and some packet missing), and the
        # whole shard only where that row lacks just droppable packets. Most
        # calls of a round find no manifest in yet but the node's own.
        short: bool | None = None  # whether only the bound is unmet
        for row in range(len(self.senders)):
            again = self.last_nack[row] + self.repeat_after(row)
            if self.manifest[row]:
                if self._row_complete(row):
                    continue
                if not self._required_missing(row).any():
                    if short is None:
                        short = bool(self.manifest.all()) and not self._required_missing().any()
                    if not short:
                        continue
                t.arm(max(again, self.last_arrival + self.timing.nack_delay))
            else:
                t.arm(max(again, self._manifest_due(row)))
        return t.at

    def _row_complete(self, row: int) -> bool:
        """Whether sender row `row` holds every packet (kept once true)."""
        if row in self._complete_rows:
            return True
        if self.received[row].all():
            self._complete_rows.add(row)
            return True
        return False

    def timed_out(self, now: float) -> bool:
        return now >= self.created + self.timing.timeout
