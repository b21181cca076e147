"""What a node remembers of rounds that ended here, to answer "is this packet
late?" (RELIABILITY.md "Late and replayed packets").

`ClosedRounds` keeps the rounds completed or failed here and the shards
aggregated here for `timing.retain`, and for the whole stale window a bitmap
per job, bucket and shard of the rounds whose shard closed here (aggregated,
failed or timed out), so that a replayed packet of such a round is late
instead of opening a fresh aggregator. It also follows each job's newest
round, which bounds that window.
"""

from __future__ import annotations

from dlcp.core.records import JobSpec, OpKey
from dlcp.core.timing import Timing

__all__ = ["ClosedRounds"]


class ClosedRounds:
    """The ended rounds and closed shards of every job at one node."""

    def __init__(self, timing: Timing) -> None:
        self.timing = timing
        self.rounds: dict[OpKey, float] = {}  # completed or failed here: when
        self.shards: dict[tuple[OpKey, int], float] = {}  # aggregated here: when
        # job -> (bucket, shard) -> [highest closed round, bitmap of closed rounds below it]
        self.bitmaps: dict[int, dict[tuple[int, int], list[int]]] = {}
        self._pruned_at: dict[int, int] = {}
        # per job, the newest round seen here (read by the receive path per
        # packet, so a plain dict; changed only by `see` and `forget_job`)
        self.newest: dict[int, int] = {}

    # -- the window -------------------------------------------------------
    def see(self, spec: JobSpec | None, job: int, round: int) -> None:
        """Move the job's newest round; forget closed shards behind the window."""
        newest = self.newest.get(job, 0)
        if round <= newest:
            return
        self.newest[job] = round
        closed = self.bitmaps.get(job)
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

    # -- closing ----------------------------------------------------------
    def close_round(self, op: OpKey, now: float) -> None:
        """Round `op` completed or failed here."""
        self.rounds[op] = now

    def shard_aggregated(self, spec: JobSpec, op: OpKey, shard: int, now: float) -> None:
        """Shard `shard` of `op` was summed here."""
        self.shards[(op, shard)] = now
        self.close_shard(spec, op, shard)

    def close_shard(self, spec: JobSpec | None, op: OpKey, shard: int) -> None:
        """Remember that (op, shard) closed here for as long as the round is in the window."""
        if spec is None:
            return
        rnd = op[1]
        entry = self.bitmaps.setdefault(op[0], {}).get((op[2], shard))
        if entry is None:
            self.bitmaps[op[0]][(op[2], shard)] = [rnd, 1]
            return
        high, bits = entry
        if rnd > high:
            entry[0] = rnd
            entry[1] = ((bits << (rnd - high)) | 1) & ((1 << (spec.window + 1)) - 1)
        elif high - rnd <= spec.window:
            entry[1] = bits | (1 << (high - rnd))

    # -- questions --------------------------------------------------------
    def round_closed(self, op: OpKey) -> bool:
        """Whether round `op` completed or failed here within `retain`."""
        return op in self.rounds

    def is_late(self, spec: JobSpec, op: OpKey, shard: int) -> bool:
        """Whether a data-leg packet of (op, shard) comes after the shard or
        its round closed here: within `retain`, or by the bitmaps within the
        window. A round a whole window behind one of the same bucket and shard
        that closed here counts as closed too: it cannot be a live round."""
        if (op, shard) in self.shards or op in self.rounds:
            return True
        entry = self.bitmaps.get(op[0], {}).get((op[2], shard))
        if entry is None:
            return False
        high, bits = entry
        rnd = op[1]
        if rnd > high:
            return False
        return high - rnd > spec.window or bool(bits >> (high - rnd) & 1)

    # -- expiry -----------------------------------------------------------
    def next_expiry(self) -> float | None:
        """When the oldest retained round or shard is forgotten."""
        closed = [*self.rounds.values(), *self.shards.values()]
        return min(closed) + self.timing.retain if closed else None

    def expire(self, now: float) -> None:
        """Forget the rounds and shards closed `retain` ago (the bitmaps stay)."""
        retain = self.timing.retain
        for op in [op for op, t in self.rounds.items() if t + retain <= now]:
            del self.rounds[op]
        for k in [k for k, t in self.shards.items() if t + retain <= now]:
            del self.shards[k]

    def forget_job(self, job: int) -> None:
        for op in [op for op in self.rounds if op[0] == job]:
            del self.rounds[op]
        for k in [k for k in self.shards if k[0][0] == job]:
            del self.shards[k]
        self.bitmaps.pop(job, None)
        self._pruned_at.pop(job, None)
        self.newest.pop(job, None)
