"""A shard aggregator's clock and its end: when the shard may complete (every
required packet in, the loss bound met), the NACKs it sends and when
(`poll`, `next_timer`: per sender, paced by that sender's NACK clock and
manifest), when it gives up, and the result it makes of its sums (the
received and missing packet ranges, lost lanes zeroed).

A part of `dlcp.core.aggregate.ShardAggregator` (a mixin) that holds no
state of its own; what it reads is declared below for the type checker.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np

from dlcp.core.aggtypes import Nack, ShardResult, _Tick
from dlcp.core.timing import NackClock, Timing, done_wait, repeat_wait, time_answer

__all__ = ["ShardClock"]


class ShardClock:
    """Completion, NACK timing and the result of a shard aggregator."""

    if TYPE_CHECKING:
        _complete_rows: set[int]
        _held: dict[int, np.ndarray]
        _need: int | None
        _row: dict[int, int]
        _summed_own: np.ndarray | None
        _summed_row: int | None
        block_max: np.ndarray
        bound: float
        clocks: Mapping[int, NackClock]
        counts: np.ndarray
        created: float
        done_at: float | None
        droppable: np.ndarray
        last_arrival: float
        last_nack: np.ndarray
        manifest: np.ndarray
        n_manifests: int
        n_received: int
        out: np.ndarray | None
        received: np.ndarray
        result: ShardResult | None
        senders: tuple[int, ...]
        shard: int
        slots: np.ndarray
        timing: Timing
        unanswered: list[int]
        weight: np.ndarray

        def _sum_rows(self, out: np.ndarray | None, sdt: np.dtype) -> np.ndarray: ...

    # -- decisions --------------------------------------------------------
    def may_complete(self) -> bool:
        """Cheap check: could `poll` complete the shard now? (else leave it to timers)

        Completion needs every manifest and every non-droppable packet, so at
        least `received.size - droppable` packets; poll does the exact test.
        """
        if self.n_received == self.received.size:
            return True
        if self.n_manifests < len(self.senders):
            return False
        if self._need is None:
            self._need = self.received.size - int(self.droppable.sum())
        return self.n_received >= self._need

    @property
    def complete(self) -> bool:
        return self.result is not None

    def _required_missing(self, row: int | None = None) -> np.ndarray:
        """Per sender and packet (of sender row `row` only, if given): missing
        and not known to be droppable."""
        if row is not None:
            return ~self.received[row] & ~self.droppable[row]
        return ~self.received & ~self.droppable

    def poll(self, now: float) -> tuple[list[Nack], bool]:
        """Advance timers: NACKs to send, and whether the shard just completed."""
        if self.result is not None:
            return [], False
        if self.received.all():
            self._finish()
            return [], True
        nacks: list[Nack] = []
        required = self._required_missing()
        total = int(self.counts.sum()) * len(self.senders)
        have = int((self.received * self.counts).sum())
        within = have >= (1.0 - self.bound) * total
        if self.manifest.all() and not required.any() and within:
            if self.done_at is None:
                self.done_at = now
            if now >= self.done_at + self.timing.linger:
                self._finish()
                return [], True
            return [], False
        # Something required is missing. Ask for it once it is overdue.
        for row, node in enumerate(self.senders):
            if now < self.last_nack[row] + self._repeat_after(row):
                continue
            if self.manifest[row]:
                if now < self.last_arrival + self.timing.nack_delay:
                    continue
                missing = np.flatnonzero(required[row])
                if missing.size == 0 and self.manifest.all() and not within:
                    # Required data is in but the bound is not met: ask for the
                    # droppable packets needed to reach it.
                    missing = self._to_reach_bound(row, total - have, total)
                if missing.size:
                    nacks.append(Nack(node, self.shard, tuple(int(m) for m in missing)))
                    self.last_nack[row] = now
                    self.unanswered[row] += 1
            elif now >= self._manifest_due(row):  # no DONE, and the shard has gone quiet
                nacks.append(Nack(node, self.shard, (), need_manifest=True))
                self.last_nack[row] = now
                self.unanswered[row] += 1
        return nacks, False

    def _repeat_after(self, row: int) -> float:
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

    def _to_reach_bound(self, row: int, missing_lanes: int, total: int) -> np.ndarray:
        allowed = int(self.bound * total)
        need = missing_lanes - allowed
        gone = np.flatnonzero(~self.received[row])
        take = np.searchsorted(np.cumsum(self.counts[gone]), need) + 1
        return gone[:take]

    def next_timer(self) -> float | None:
        """When `poll` next has something to do (never a time it would idle at)."""
        if self.result is not None:
            return None
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
            again = self.last_nack[row] + self._repeat_after(row)
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
        return self.result is None and now >= self.created + self.timing.timeout

    def missing_senders(self) -> list[int]:
        return [n for r, n in enumerate(self.senders) if not self.received[r].any()]

    def _finish(self) -> None:
        sdt = self.slots.dtype
        out = self.out
        if self._summed_row is not None:  # summed on arrival: own lanes where none came
            assert out is not None and self._summed_own is not None
            own = self._summed_own
            for a, b in self._missing_spans(self._summed_row):
                out[a:b] = own[a:b]
            sums = out
            self._held = {}
            self._summed_own = None
        else:
            sums = self._sum_rows(out, sdt)
        self._result(sums, sdt)

    def _missing_spans(self, row: int) -> list[tuple[int, int]]:
        """The lane ranges (shard-relative) of runs of packets `row` lacks."""
        return self._spans(~self.received[row])

    def _received_spans(self, row: int) -> list[tuple[int, int]]:
        """The lane ranges (shard-relative) of runs of packets `row` holds."""
        return self._spans(self.received[row])

    def _spans(self, packets: np.ndarray) -> list[tuple[int, int]]:
        """The lane ranges (shard-relative) of the runs of packets set in `packets`."""
        idx = np.flatnonzero(packets)
        if idx.size == 0:
            return []
        starts = np.concatenate(([0], np.cumsum(self.counts)))
        cut = np.flatnonzero(np.diff(idx) != 1) + 1
        firsts = idx[np.concatenate(([0], cut))]
        lasts = idx[np.concatenate((cut - 1, [idx.size - 1]))]
        return list(zip(starts[firsts].tolist(), starts[lasts + 1].tolist(), strict=True))

    def _result(self, sums: np.ndarray, sdt: np.dtype) -> None:
        contributors = (self.received * self.weight[:, None]).sum(axis=0)
        lost = int(((~self.received) * self.counts).sum())
        self.result = ShardResult(
            shard=self.shard,
            sums=sums,
            contributors=contributors.astype(np.int64),
            block_max=self.block_max.max(axis=0) if len(self.senders) else self.block_max[0],
            lost_lanes=lost,
            total_lanes=int(self.counts.sum()) * len(self.senders),
        )
        self.slots = np.zeros((0, 0), dtype=sdt)  # free the per-sender copies
