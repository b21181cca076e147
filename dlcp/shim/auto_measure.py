"""What the steps through `codec="auto"` showed (`Measurements`): the
profile of the model's backward pass, and per codec the iteration times and
the goodput measured. `dlcp.shim.auto.AutoCodec` decides from them.

* Learning: every step through auto, the hook reports each bucket's size and
  when it entered and left the hook. The time from one bucket leaving the hook
  to the next entering it is backward compute (encoding and submitting are
  inside the hook, so they are not counted); the first bucket's share is
  extrapolated by its size. The profile is the latest step's bucket sizes with
  the element-wise median ready times of the last `window` steps of that shape.
* Measuring: a codec that has run is judged by what it measurably took: the
  median of its last `window` iterations as the model counts them (from
  backward's start, extrapolated, to the step's results decoded). The first
  step of the run and the first step after every switch are left out (they
  carry one-off costs: start-up, a new codec's first scale agreement).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Sequence

from dlcp.costmodel.calibrate import CodecCost
from dlcp.costmodel.model import DEFAULT_PULL_S, DEFAULT_PUSH_S
from dlcp.costmodel.profile import Bucket, ModelProfile

__all__ = ["Measurements"]


class Measurements:
    """The step under way's buckets (sizes, gaps) and the last `window` steps'
    profiles, iteration times and goodput per codec (picklable)."""

    def __init__(self, window: int) -> None:
        self.window = window
        # this step's buckets, and the last steps' (sizes, ready times)
        self._sizes: list[int] = []
        self._gaps: list[float] = []
        self._left: float | None = None
        self._first_in: float | None = None  # when this step's first bucket entered
        self._seen: deque[tuple[tuple[int, ...], tuple[float, ...]]] = deque(maxlen=window)
        self._goodput: dict[str, deque[float]] = {}  # bytes/s of the last steps, per codec
        self._iteration: dict[str, deque[float]] = {}  # seconds of the last steps, per codec

    def bucket_entered(self, numel: int, now: float) -> None:
        if not self._sizes:
            self._first_in = now
        if self._left is not None and self._sizes:
            self._gaps.append(max(0.0, now - self._left))
        self._sizes.append(int(numel))

    def bucket_left(self, now: float) -> None:
        self._left = now

    def discard_step(self) -> None:
        """Forget a step that did not complete (it is not counted)."""
        self._sizes, self._gaps, self._left, self._first_in = [], [], None, None

    def end_step(
        self,
        codec: str,
        cost: CodecCost | None,
        exchanges: Sequence[tuple[int, float, float]],
        hosts: int,
        now: float | None,
        *,
        timed: bool,
    ) -> None:
        """The step (in `codec`, whose calibrated `cost` counts its bytes) is
        done at `now`: keep its profile, goodput and (`timed`: not a first
        step) its iteration time."""
        self._learn_goodput(codec, cost, exchanges, hosts)
        sizes, gaps, first_in = self._sizes, self._gaps, self._first_in
        self.discard_step()
        if not sizes or len(gaps) != len(sizes) - 1:
            return
        total = sum(sizes)
        rest = total - sizes[0]
        first = sum(gaps) * sizes[0] / rest if rest > 0 and gaps else 0.0
        ready = [first]
        for g in gaps:
            ready.append(ready[-1] + g)
        self._seen.append((tuple(sizes), tuple(ready)))
        if now is not None and first_in is not None and timed:
            seen = self._iteration.setdefault(codec, deque(maxlen=self.window))
            seen.append(first + max(0.0, now - first_in))

    def _learn_goodput(
        self,
        codec: str,
        cost: CodecCost | None,
        exchanges: Sequence[tuple[int, float, float]],
        hosts: int,
    ) -> None:
        """Bytes each host sent and received in this step's exchanges (as the cost
        model counts them, for the codec in use) over the time at least one of
        them was in flight, less the model's fixed time per exchange."""
        if cost is None or hosts < 2 or not exchanges:
            return
        per_value = (sum(cost.push) + sum(cost.pull)) * (hosts - 1) / hosts
        wire = 0.0
        busy = 0.0
        free_at = -math.inf
        for numel, sent, replied in sorted(exchanges, key=lambda e: e[1]):
            wire += numel * per_value
            busy += max(0.0, replied - max(sent, free_at))
            free_at = max(free_at, replied)
        net = max(busy - len(exchanges) * (DEFAULT_PUSH_S + DEFAULT_PULL_S), 0.1 * busy)
        if net > 0 and wire > 0:
            seen = self._goodput.setdefault(codec, deque(maxlen=self.window))
            seen.append(wire / net)

    def forget(self) -> None:
        """Drop the iteration times and goodput (the link changed)."""
        self._goodput.clear()
        self._iteration.clear()

    def measured(self, codec: str) -> float | None:
        """The iteration seconds measured with `codec` (median of its last steps)."""
        seen = self._iteration.get(codec)
        return statistics.median(seen) if seen else None

    @property
    def measured_s(self) -> dict[str, float]:
        """The measured iteration seconds per codec."""
        return {c: m for c in self._iteration if (m := self.measured(c)) is not None}

    def goodput(self, codec: str) -> float | None:
        """The goodput (bytes/s) measured with `codec` (median of its last steps)."""
        seen = self._goodput.get(codec)
        return statistics.median(seen) if seen else None

    def best_goodput(self) -> float | None:
        """The best goodput (bytes/s) measured with any codec."""
        rates = [g for c in self._goodput if (g := self.goodput(c)) is not None]
        return max(rates) if rates else None

    @property
    def goodput_bps(self) -> dict[str, float]:
        """The measured goodput per codec, bits/s."""
        return {c: 8.0 * g for c in self._goodput if (g := self.goodput(c)) is not None}

    def profile(self) -> ModelProfile | None:
        """What the last steps showed, as the cost model's profile (None before any)."""
        if not self._seen:
            return None
        sizes = self._seen[-1][0]
        rows = [ready for s, ready in self._seen if s == sizes]
        ready = [statistics.median(col) for col in zip(*rows, strict=True)]
        backward = ready[-1]
        buckets = tuple(Bucket(n, min(r, backward)) for n, r in zip(sizes, ready, strict=True))
        return ModelProfile("ddp", buckets, 0.0, backward)
