"""Drop policies: which packets of a bucket may be lost within the loss bound.

A droppable packet travels in the droppable class (short queue) and is not
recovered by NACK. Whatever the policy, the lanes of the droppable packets of
one call never exceed `lane_budget(bound, total lanes)`, so call it once per
unit whose completion the receiver checks (one sender's packets of one shard).
`deadline_drops` is the sender-side counterpart: which queued droppable
packets to discard when the pacing backlog cannot make the round's deadline.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod

import numpy as np
import numpy.typing as npt

from dlcp.errors import LocalError
from dlcp.policies._check import (
    as_1d,
    check_bound,
    check_float,
    check_int,
    check_same_length,
    density,
)
from dlcp.policies.registry import register

__all__ = [
    "DropPolicy",
    "NoDrop",
    "SmallestNormDrop",
    "deadline_drops",
    "lane_budget",
]


def lane_budget(bound: float, total: int) -> int:
    """The most lanes of `total` that may be lost under `bound`.

    The largest b with b / total <= bound and total - b >= (1 - bound) * total,
    both as evaluated in floating point, so receivers testing either form agree.
    """
    bound = check_bound(bound)
    total = check_int(total, "total", lo=0)
    if total == 0 or bound == 0.0:
        return 0
    b = min(total, math.floor(bound * total))
    while b > 0 and (b / total > bound or total - b < (1.0 - bound) * total):
        b -= 1
    return b


class DropPolicy(ABC):
    """Marks the packets of one bucket (or shard) that may be lost."""

    name: str = ""

    @abstractmethod
    def droppable(
        self, *, norms: np.ndarray, counts: np.ndarray, bound: float
    ) -> npt.NDArray[np.bool_]:
        """A flag per packet; droppable lanes / all lanes stays <= `bound`.

        `norms`: L2 norm of each packet's slice, `counts`: lanes per packet,
        `bound`: the round's loss bound (0 makes nothing droppable).
        """


@register("drop", "none")
class NoDrop(DropPolicy):
    """Nothing is droppable: every packet is recovered (lossless baseline)."""

    def droppable(
        self, *, norms: np.ndarray, counts: np.ndarray, bound: float
    ) -> npt.NDArray[np.bool_]:
        check_bound(bound)
        n = check_same_length(norms=np.asarray(norms), counts=np.asarray(counts))
        return np.zeros(n, dtype=np.bool_)


@register("drop", "smallest_norm")
class SmallestNormDrop(DropPolicy):
    """The smallest-density packets, within the budget and below a magnitude cut.

    Packets are ordered by density (norm / sqrt(count), i.e. by energy per
    lane), smallest first. Only the bottom `magnitude_cut` fraction of the
    packets can be droppable, and never one whose density ties a packet above
    the cut (0.5: the top half by magnitude is never droppable). Of those, the
    longest smallest-first run whose lanes fit `lane_budget(bound, total)`.
    """

    def __init__(self, *, magnitude_cut: float = 0.5) -> None:
        self.magnitude_cut = check_float(magnitude_cut, "magnitude_cut", lo=0.0, hi=1.0)

    def droppable(
        self, *, norms: np.ndarray, counts: np.ndarray, bound: float
    ) -> npt.NDArray[np.bool_]:
        bound = check_bound(bound)
        dens, lanes = density(norms, counts)
        n = len(dens)
        out = np.zeros(n, dtype=np.bool_)
        if n == 0 or bound == 0.0:
            return out
        budget = lane_budget(bound, int(lanes.sum()))
        k = math.floor(self.magnitude_cut * n)
        if budget == 0 or k == 0:
            return out
        out[_smallest_fitting(dens, lanes, budget, k)] = True
        return out


def _smallest_fitting(dens: np.ndarray, lanes: np.ndarray, budget: int, k: int) -> np.ndarray:
    """The packets, smallest density first (ties in index order), whose lanes
    add up to at most `budget`, among those strictly below the density of the
    `k`-th smallest (0-based; `k` >= n: all). A bucket's 5 % is a small part
    of it: a partition finds the few smallest and only those are sorted, not
    the whole bucket (a stable sort of 35,000 densities cost 3 ms a shard)."""
    n = len(dens)
    # each packet carries at most max(lanes): the budget takes at least this many
    m = min(n, 2 * (budget // max(1, int(lanes.max())) + 1) + 64)
    ranks = sorted({r for r in (k, m) if r < n})
    part = np.partition(dens, ranks) if ranks else dens  # both ranks in one pass
    kth = float(part[k]) if k < n else np.inf
    while m < n:
        t = part[m]
        cand = np.flatnonzero(dens < t)  # the smallest m at most, ties at t left out
        cand = cand[np.argsort(dens[cand], kind="stable")]  # their place in the full order
        allowed = cand[dens[cand] < kth]
        used = np.cumsum(lanes[allowed])
        take = int(np.searchsorted(used, budget, side="right"))
        # done when the budget ran out within them, or every allowed packet is in them
        if take < len(allowed) or len(allowed) < len(cand):
            return allowed[:take]
        m *= 4
        if m < n:
            part = np.partition(dens, m)
    order = np.argsort(dens, kind="stable")
    ranked = dens[order]
    limit = n if k >= n else int(np.searchsorted(ranked, ranked[k], side="left"))
    used = np.cumsum(lanes[order[:limit]])
    return order[: int(np.searchsorted(used, budget, side="right"))]


def deadline_drops(
    *,
    droppable: npt.ArrayLike,
    counts: npt.ArrayLike,
    norms: npt.ArrayLike,
    need: float,
    left: float,
    budget: int | npt.ArrayLike,
    used: int | npt.ArrayLike = 0,
    sizes: npt.ArrayLike | None = None,
    groups: npt.ArrayLike | None = None,
) -> npt.NDArray[np.bool_]:
    """Which queued packets to discard so the backlog can meet the round deadline.

    The backlog (one entry per queued packet: `droppable` flag, lanes
    `counts`, `norms`, optional wire `sizes` in bytes, default the lanes) needs
    `need` seconds at the current rate and `left` seconds remain. Discards
    droppable packets, smallest density first, until the discarded share of
    the backlog's bytes covers the shortfall (need - left) / need, or nothing
    more may go. A bucket's discards never exceed its remaining lane budget
    `budget - used`; with `groups` (bucket index 0..G-1 per packet) `budget`
    and `used` are per bucket (arrays of G, or scalars for all).
    """
    flags = as_1d(droppable, "droppable", np.bool_)
    dens, lanes = density(norms, counts)
    weight = lanes.astype(np.float64) if sizes is None else as_1d(sizes, "sizes", np.float64)
    group = (
        np.zeros(len(flags), dtype=np.int64)
        if groups is None
        else as_1d(groups, "groups", np.int64)
    )
    n = check_same_length(droppable=flags, norms=dens, sizes=weight, groups=group)
    need = check_float(need, "need", lo=0.0)
    left = check_float(left, "left")
    out = np.zeros(n, dtype=np.bool_)
    if n == 0 or need <= max(left, 0.0) or not flags.any():
        return out
    if weight.size and (weight < 0).any():
        raise LocalError("sizes must be >= 0")
    if group.size and group.min() < 0:
        raise LocalError("groups must be >= 0")
    n_groups = int(group.max()) + 1
    remaining = _per_group(budget, "budget", n_groups) - _per_group(used, "used", n_groups)
    target = min(1.0, (need - max(left, 0.0)) / need) * float(weight.sum())
    if target <= 0.0:
        return out

    cand = np.flatnonzero(flags)
    order = cand[np.lexsort((cand, dens[cand]))]  # smallest density first, then queue order
    # Lanes each candidate's bucket would have lost up to and including it.
    g = group[order]
    by_group = np.argsort(g, kind="stable")
    run = lanes[order][by_group]
    total = np.cumsum(run)
    starts = np.r_[True, g[by_group][1:] != g[by_group][:-1]]
    before = np.maximum.accumulate(np.where(starts, total - run, 0))
    fits = np.empty(len(order), dtype=np.bool_)
    fits[by_group] = (total - before) <= remaining[g[by_group]]

    chosen = order[fits]
    shed = np.cumsum(weight[chosen])
    take = min(len(chosen), int(np.searchsorted(shed, target, side="left")) + 1)
    out[chosen[:take]] = True
    return out


def _per_group(value: int | npt.ArrayLike, name: str, n_groups: int) -> npt.NDArray[np.int64]:
    arr = np.asarray(value)
    if arr.ndim == 0:
        return np.full(n_groups, check_int(arr.item(), name), dtype=np.int64)
    arr = as_1d(arr, name, np.int64)
    if len(arr) < n_groups:
        raise LocalError(f"{name} has {len(arr)} entries for {n_groups} groups")
    return arr[:n_groups]
