"""Loss-bound schedules: the fraction p of a round's lanes that may be lost.

Bounds lie in [0, 0.5]. Every host must use the same bound for a round, so
feed schedules only values every host shares: the round and epoch numbers and
the gradient norm of the aggregated result (identical on all replicas), never
a host's local contribution.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod

from dlcp.errors import LocalError
from dlcp.policies._check import check_bound, check_float, check_int
from dlcp.policies.registry import register

__all__ = [
    "MAX_BOUND",
    "ConstantSchedule",
    "DiminishingSchedule",
    "LossSchedule",
    "PhaseSchedule",
]

MAX_BOUND = 0.5


def _bound(value: float, name: str) -> float:
    return check_bound(value, name, hi=MAX_BOUND)


class LossSchedule(ABC):
    """The loss bound of each round."""

    name: str = ""

    @abstractmethod
    def bound(self, *, round: int, epoch: int, grad_norm: float | None = None) -> float:
        """The bound in [0, 0.5] for `round` of `epoch`.

        `grad_norm`, when given, is the latest global gradient norm (of the
        previous round's result) and is recorded as by `observe`.
        """

    def observe(self, *, round: int, epoch: int, grad_norm: float) -> None:  # noqa: B027
        """Record the global gradient norm of a finished round (default: ignored)."""


@register("schedule", "constant")
class ConstantSchedule(LossSchedule):
    """The same bound `p` for every round."""

    def __init__(self, *, p: float = 0.01) -> None:
        self.p = _bound(p, "p")

    def bound(self, *, round: int, epoch: int, grad_norm: float | None = None) -> float:
        return self.p


@register("schedule", "diminishing")
class DiminishingSchedule(LossSchedule):
    """Inverse-time decay: p_t = max(p_min, p0 / (1 + t / decay)).

    t is the epoch (`per="epoch"`, default) or the round (`per="round"`, for
    code that never counts epochs). A shrinking error keeps the convergence
    argument of lossy/sparsified SGD (the diminishing theta_t of FFT
    sparsification) while early, noisy rounds tolerate the most loss.
    """

    def __init__(
        self,
        *,
        p0: float = 0.05,
        decay: float = 10.0,
        p_min: float = 0.005,
        per: str = "epoch",
    ) -> None:
        self.p0 = _bound(p0, "p0")
        self.p_min = _bound(p_min, "p_min")
        if self.p_min > self.p0:
            raise LocalError(f"p_min {self.p_min} exceeds p0 {self.p0}")
        self.decay = check_float(decay, "decay", lo=0.0, lo_open=True)
        if per not in ("epoch", "round"):
            raise LocalError(f"per must be 'epoch' or 'round', got {per!r}")
        self.per = per

    def bound(self, *, round: int, epoch: int, grad_norm: float | None = None) -> float:
        t = check_int(epoch if self.per == "epoch" else round, self.per, lo=0)
        return max(self.p_min, self.p0 / (1.0 + t / self.decay))


@register("schedule", "phase")
class PhaseSchedule(LossSchedule):
    """DBLP: a low bound at the start and in critical-learning epochs, else high.

    Epochs before `warmup_epochs` are critical. When an epoch ends, the mean
    of its observed gradient norms is compared with the previous epoch's: a
    relative change |m_e - m_{e-1}| / m_{e-1} >= `threshold` makes the next
    `hold_epochs` epochs critical. An epoch ends when a round of a later
    epoch is observed or asked for.
    """

    def __init__(
        self,
        *,
        low: float = 0.01,
        high: float = 0.05,
        warmup_epochs: int = 5,
        threshold: float = 0.5,
        hold_epochs: int = 1,
    ) -> None:
        self.low = _bound(low, "low")
        self.high = _bound(high, "high")
        if self.low > self.high:
            raise LocalError(f"low {self.low} exceeds high {self.high}")
        self.warmup_epochs = check_int(warmup_epochs, "warmup_epochs", lo=0)
        self.threshold = check_float(threshold, "threshold", lo=0.0, lo_open=True)
        self.hold_epochs = check_int(hold_epochs, "hold_epochs", lo=1)
        # internal state
        self._epoch: int | None = None  # epoch being accumulated
        self._sum = 0.0
        self._count = 0
        self._last_round: int | None = None
        self._last_value = 0.0
        self._prev_mean: float | None = None  # mean of the last finished epoch
        self._critical_until = -1  # last epoch made critical by a detected change
        # stats
        self.epoch_means: dict[int, float] = {}
        self.critical_epochs: list[int] = []  # epochs where a change was detected

    def observe(self, *, round: int, epoch: int, grad_norm: float) -> None:
        self._advance(check_int(epoch, "epoch", lo=0))
        x = float(grad_norm)
        if not math.isfinite(x) or x < 0:
            return
        if round == self._last_round:  # the same round again: keep its latest value
            self._sum += x - self._last_value
        else:
            self._sum += x
            self._count += 1
            self._last_round = round
        self._last_value = x

    def bound(self, *, round: int, epoch: int, grad_norm: float | None = None) -> float:
        if grad_norm is not None:
            self.observe(round=round, epoch=epoch, grad_norm=grad_norm)
        else:
            self._advance(check_int(epoch, "epoch", lo=0))
        return self.low if self.is_critical(epoch) else self.high

    def is_critical(self, epoch: int) -> bool:
        """Whether `epoch` gets the low bound (warm-up or a detected change)."""
        return epoch < self.warmup_epochs or epoch <= self._critical_until

    def _advance(self, epoch: int) -> None:
        if self._epoch is None:
            self._epoch = epoch
            return
        if epoch <= self._epoch:
            return
        if self._count:
            mean = self._sum / self._count
            self.epoch_means[self._epoch] = mean
            prev = self._prev_mean
            if prev is not None and _relative_change(prev, mean) >= self.threshold:
                self._critical_until = max(self._critical_until, epoch + self.hold_epochs - 1)
                self.critical_epochs.append(epoch)
            self._prev_mean = mean
        self._epoch = epoch
        self._sum = 0.0
        self._count = 0
        self._last_round = None


def _relative_change(prev: float, cur: float) -> float:
    if prev == 0.0:
        return 0.0 if cur == 0.0 else math.inf
    return abs(cur - prev) / prev
