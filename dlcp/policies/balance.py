"""Load balancers: which path each packet to one peer takes.

Packets carry their place in the bucket, so their order does not matter and
they may be sprayed over every path. The daemon keeps one `PathState` per path
(local source, remote address[, source port]) and one balancer per peer; it
asks `assign` for a bucket's packets, reports what it sent with `record_sent`
(or `on_sent`), losses found by NACKs (and droppable lanes missing at
completion) with `on_loss`, and RTT samples with `on_rtt`. With pacing, each
path has its own rate: `assign` is told which paths have pacing budget now
(`ready`): `spray` and `weighted` pick among those, so a path that is paced
slower (congested, or cut for loss) carries less; `adaptive` weighs each path's
rate into its shares instead, and `flow` keeps its path.
"""

from __future__ import annotations

import hashlib
import math
from abc import ABC, abstractmethod
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from dlcp.errors import LocalError
from dlcp.policies._check import as_1d, check_float, check_int
from dlcp.policies.registry import register

__all__ = [
    "AdaptiveBalancer",
    "FlowBalancer",
    "LoadBalancer",
    "PathState",
    "SprayBalancer",
    "WeightedBalancer",
]


@dataclass(slots=True, eq=False)
class PathState:
    """What the daemon knows about one path; updated by the balancer's hooks.

    `loss_rate` is lost / sent over a sliding window of about `loss_window`
    packets (decayed counts), `rtt_ewma` an EWMA of RTT samples in seconds,
    `weight` the share of traffic the balancer last gave the path, `rate_bps`
    the path's pacing rate once the daemon's rate control has found what the
    paths to this peer carry (None: unknown, or no pacing).
    """

    key: Hashable = None
    weight: float = 1.0
    sent: int = 0
    lost: int = 0
    window_sent: float = 0.0
    window_lost: float = 0.0
    rtt_ewma: float | None = None
    rtt_min: float | None = None
    last_loss: float | None = None
    last_rtt: float | None = None
    rate_bps: float | None = None

    @property
    def loss_rate(self) -> float:
        """Recent lost / sent, 0 before anything was sent."""
        if self.window_sent <= 0.0:
            return 0.0
        return min(1.0, self.window_lost / self.window_sent)


def _check_paths(paths: Sequence[PathState]) -> int:
    if not paths:
        raise LocalError("load balancing needs at least one path")
    return len(paths)


def _ready_mask(ready: npt.ArrayLike | None, n_paths: int) -> npt.NDArray[np.bool_] | None:
    """`ready` as a boolean mask over the paths; None when it restricts nothing
    (not given, every path ready, or none: then any path may be used)."""
    if ready is None:
        return None
    mask = np.asarray(ready)
    if mask.shape != (n_paths,) or mask.dtype != np.bool_:
        raise LocalError(f"ready must be {n_paths} booleans, one per path")
    if mask.all() or not mask.any():
        return None
    return mask


class LoadBalancer(ABC):
    """Chooses a path index per packet for one peer.

    `loss_window` (packets) and `rtt_gain` set how the hooks smooth the path
    statistics; only "adaptive" lets configuration change them.
    """

    name: str = ""
    loss_window: float = 1000.0
    rtt_gain: float = 0.125
    # whether the shares follow each path's loss and delay (then a path the
    # daemon's probes find degraded stays in use, at the share it weighs)
    weighs_paths: bool = False

    @abstractmethod
    def assign(
        self, *, n: int, paths: Sequence[PathState], ready: npt.ArrayLike | None = None
    ) -> npt.NDArray[np.intp]:
        """Path index (into `paths`) for each of `n` packets.

        `ready` (one bool per path), if given, names the paths that may send
        now (pacing budget); balancers that spread traffic keep to those.
        """

    def on_sent(self, path: PathState, n: int) -> None:
        """`n` packets went out on `path`."""
        if type(n) is not int or n < 0:  # the flush's counts are ints: checked only otherwise
            n = check_int(n, "n", lo=0)
        path.sent += n
        keep = (1.0 - 1.0 / self.loss_window) ** n
        path.window_sent = path.window_sent * keep + n
        path.window_lost *= keep

    def on_loss(self, path: PathState, n: int, now: float) -> None:
        """`n` packets sent on `path` were found lost at `now`."""
        n = check_int(n, "n", lo=0)
        if n == 0:
            return
        path.lost += n
        path.window_lost = min(path.window_lost + n, path.window_sent)
        path.last_loss = now

    def on_rtt(self, path: PathState, rtt: float, now: float) -> None:
        """An RTT sample (seconds) measured on `path` at `now`."""
        rtt = check_float(rtt, "rtt", lo=0.0, lo_open=True)
        if path.rtt_ewma is None:
            path.rtt_ewma = rtt
        else:
            path.rtt_ewma += self.rtt_gain * (rtt - path.rtt_ewma)
        path.rtt_min = rtt if path.rtt_min is None else min(path.rtt_min, rtt)
        path.last_rtt = now

    def record_sent(self, paths: Sequence[PathState], assignment: npt.ArrayLike) -> None:
        """`on_sent` for every path from an `assign` result that was sent."""
        idx = as_1d(assignment, "assignment", np.intp)
        counts = np.bincount(idx, minlength=len(paths))
        if len(counts) > len(paths):
            raise LocalError("assignment names a path that does not exist")
        for path, c in zip(paths, counts.tolist(), strict=True):
            if c:
                self.on_sent(path, c)


@register("balance", "flow")
class FlowBalancer(LoadBalancer):
    """One path for all of the peer's packets, chosen by a hash (ECMP-like).

    The flow key is `key`, or else the paths' keys on first use. A stable
    hash (BLAKE2b of its repr), so every run picks the same path. `ready` is
    ignored: a flow waits for its own path's pacer.
    """

    def __init__(self, *, key: str | None = None) -> None:
        if key is not None and not isinstance(key, str):
            raise LocalError(f"flow key must be a string, got {key!r}")
        self.key = key
        self._choice: int | None = None
        self._n_paths = 0

    def assign(
        self, *, n: int, paths: Sequence[PathState], ready: npt.ArrayLike | None = None
    ) -> npt.NDArray[np.intp]:
        n = check_int(n, "n", lo=0)
        n_paths = _check_paths(paths)
        _ready_mask(ready, n_paths)  # checked, but a flow keeps its path
        if self._choice is None or n_paths != self._n_paths:
            flow = self.key if self.key is not None else repr(tuple(p.key for p in paths))
            digest = hashlib.blake2b(flow.encode(), digest_size=8).digest()
            self._choice = int.from_bytes(digest, "big") % n_paths
            self._n_paths = n_paths
            for i, p in enumerate(paths):
                p.weight = 1.0 if i == self._choice else 0.0
        return np.full(n, self._choice, dtype=np.intp)


@register("balance", "spray")
class SprayBalancer(LoadBalancer):
    """Round robin per packet, continuing across calls (counts differ by <= 1).

    With `ready`, the round robin skips the paths that are not ready, so each
    path carries what its pacing rate allows.
    """

    def __init__(self) -> None:
        self._next = 0

    def assign(
        self, *, n: int, paths: Sequence[PathState], ready: npt.ArrayLike | None = None
    ) -> npt.NDArray[np.intp]:
        n = check_int(n, "n", lo=0)
        n_paths = _check_paths(paths)
        mask = _ready_mask(ready, n_paths)
        for p in paths:
            p.weight = 1.0 / n_paths
        start = self._next % n_paths
        if mask is None:
            self._next = (start + n) % n_paths
            return (start + np.arange(n, dtype=np.intp)) % n_paths
        # the ready paths in round-robin order from the next one due
        live = np.flatnonzero(mask)
        order = live[np.argsort((live - start) % n_paths, kind="stable")]
        out = order[np.arange(n) % len(order)].astype(np.intp)
        if n:
            self._next = (int(out[-1]) + 1) % n_paths
        return out


class _Stride:
    """Deterministic smooth weighted round robin (stride scheduling), vectorised.

    Path i's packets sit on a virtual time line every 1 / share_i, starting
    half a stride in; each call takes the n earliest (ties to the lower path
    index). Over any run of calls path i's count stays within about one packet
    of total * share_i, and its packets are spread evenly.
    """

    def __init__(self) -> None:
        self.next_time = np.zeros(0)  # virtual time of each path's next packet
        self.shares = np.zeros(0)

    def set_shares(self, shares: np.ndarray) -> None:
        old, new = self.shares, shares
        if len(old) != len(new):
            self.next_time = np.where(new > 0, 0.5 / np.where(new > 0, new, 1.0), np.inf)
        else:
            # Keep each path's phase: the fraction of its stride still to go.
            with np.errstate(divide="ignore", invalid="ignore"):
                frac = np.where((old > 0) & np.isfinite(self.next_time), self.next_time * old, 0.5)
                self.next_time = np.where(new > 0, np.clip(frac, 0.0, 1.0) / new, np.inf)
        self.shares = new.copy()

    def take(self, n: int, ready: npt.NDArray[np.bool_] | None = None) -> npt.NDArray[np.intp]:
        """The next `n` packets' paths; with `ready`, only among those paths, and
        the others forgo their turns (they do not catch up later in a burst)."""
        usable = self.shares > 0
        if ready is not None and (usable & ready).any():
            usable = usable & ready
        else:
            ready = None
        live = np.flatnonzero(usable)
        if n == 0:
            return np.zeros(0, dtype=np.intp)
        s = self.shares[live]
        start = self.next_time[live]
        # Enough candidates per path that the n earliest are among them.
        m = np.ceil(n * s / s.sum()).astype(np.int64) + len(s) + 2
        path = np.repeat(live, m)
        j = np.arange(int(m.sum())) - np.repeat(np.cumsum(m) - m, m)
        t = np.repeat(start, m) + j / np.repeat(s, m)
        pick = np.lexsort((path, t))[:n]
        chosen = path[pick]
        end = t[pick[-1]]
        taken = np.bincount(chosen, minlength=len(self.shares))
        self.next_time = (
            np.where(
                self.shares > 0,
                self.next_time + taken / np.where(self.shares > 0, self.shares, 1.0),
                np.inf,
            )
            - end
        )
        if ready is not None:
            skipped = ~ready & (self.shares > 0)
            self.next_time[skipped] = np.maximum(self.next_time[skipped], 0.0)
        return chosen.astype(np.intp)


def _normalise(weights: np.ndarray) -> np.ndarray:
    total = float(weights.sum())
    if not total > 0 or not math.isfinite(total):
        raise LocalError("path weights must be finite, >= 0 and not all 0")
    return weights / total


@register("balance", "weighted")
class WeightedBalancer(LoadBalancer):
    """Static weights from configuration (one per path), smooth weighted round robin.

    Without `weights`, every path weighs the same. With `ready`, the paths
    that are not ready are skipped (their turns go to the others).
    """

    def __init__(self, *, weights: Sequence[float] | None = None) -> None:
        if weights is None:
            self.weights: tuple[float, ...] | None = None
        else:
            if isinstance(weights, str) or not isinstance(weights, Sequence | np.ndarray):
                raise LocalError("weights must be a list of numbers, one per path")
            w = tuple(check_float(x, "weights[]", lo=0.0) for x in weights)
            _normalise(np.asarray(w, dtype=np.float64))
            self.weights = w
        self._stride = _Stride()

    def assign(
        self, *, n: int, paths: Sequence[PathState], ready: npt.ArrayLike | None = None
    ) -> npt.NDArray[np.intp]:
        n = check_int(n, "n", lo=0)
        n_paths = _check_paths(paths)
        mask = _ready_mask(ready, n_paths)
        if self.weights is None:
            w = np.ones(n_paths)
        elif len(self.weights) != n_paths:
            raise LocalError(f"{len(self.weights)} weights configured for {n_paths} paths")
        else:
            w = np.asarray(self.weights, dtype=np.float64)
        shares = _normalise(w)
        if len(self._stride.shares) != n_paths or not np.array_equal(shares, self._stride.shares):
            self._stride.set_shares(shares)
        for p, s in zip(paths, shares.tolist(), strict=True):
            p.weight = s
        return self._stride.take(n, mask)


@register("balance", "adaptive")
class AdaptiveBalancer(LoadBalancer):
    """Weights from each path's recent loss, delay and pacing rate, re-read on every call.

    raw_i = keep(loss_rate_i) / (rtt_ewma_i ** delay_exponent) * rate_i (paths
    without an RTT sample use the mean of the others; rates only count when
    the daemon paces, as each path's share of the fastest), normalised, with
    every path kept at >= `min_share` so a degraded path still gets probes and
    its recovery is seen.

    keep(l) is what a path is worth per packet sent. Loss up to
    `loss_tolerance` is taken as random, not congestion (the rate control's
    `rate.loss_tolerance`; the daemon passes it on unless the balancer sets its
    own): such a path still delivers 1 - l of what it carries, retransmissions
    take the least lossy path, so it keeps its goodput share, keep(l) = 1 - l.
    Loss beyond the tolerance falls off steeply:
    keep(l) = (1 - t) * ((1 - l) / (1 - t)) ** loss_exponent. With tolerance 0
    (the default) that is (1 - l) ** loss_exponent: a path at 10 % loss weighs
    about 4 % of a clean one; with the daemon's 0.15 it weighs 0.9 of one, and
    a path at 25 % about 2 %. `ready` is ignored: the shares already weigh
    each path's rate, and a path that is briefly out of pacing budget should
    wait for it, not hand its share to a lossy path.
    """

    def __init__(
        self,
        *,
        loss_exponent: float = 30.0,
        delay_exponent: float = 1.0,
        min_share: float = 0.05,
        loss_window: float = 1000.0,
        rtt_gain: float = 0.125,
        loss_tolerance: float = 0.0,
    ) -> None:
        self.loss_exponent = check_float(loss_exponent, "loss_exponent", lo=0.0)
        self.loss_tolerance = check_float(loss_tolerance, "loss_tolerance", lo=0.0, hi=1.0)
        if not self.loss_tolerance < 1.0:
            raise LocalError(f"loss_tolerance must be < 1, got {loss_tolerance}")
        self.delay_exponent = check_float(delay_exponent, "delay_exponent", lo=0.0)
        self.min_share = check_float(min_share, "min_share", lo=0.0, hi=1.0)
        self.loss_window = check_float(loss_window, "loss_window", lo=1.0)
        self.rtt_gain = check_float(rtt_gain, "rtt_gain", lo=0.0, hi=1.0, lo_open=True)
        self._stride = _Stride()

    weighs_paths = True

    def shares(self, paths: Sequence[PathState]) -> npt.NDArray[np.float64]:
        """The traffic share of each path, from its current statistics."""
        n_paths = _check_paths(paths)
        loss = np.array([p.loss_rate for p in paths])
        rtts = np.array([np.nan if p.rtt_ewma is None else p.rtt_ewma for p in paths])
        known = ~np.isnan(rtts)
        rtts = np.where(known, rtts, rtts[known].mean() if known.any() else 1.0)
        raw = self.keep(loss) / rtts**self.delay_exponent
        rates = np.array([np.nan if p.rate_bps is None else p.rate_bps for p in paths])
        paced = ~np.isnan(rates) & (rates > 0)
        if paced.any():
            fastest = rates[paced].max()
            raw = raw * np.where(paced, rates, fastest) / fastest
        if not raw.sum() > 0:  # every path fully lossy: spread evenly
            raw = np.ones(n_paths)
        return _floor_shares(raw / raw.sum(), min(self.min_share, 1.0 / n_paths))

    def keep(self, loss: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
        """What a path at loss rate `loss` is worth per packet sent (see the class)."""
        tol = self.loss_tolerance
        beyond = (1.0 - tol) * (np.clip(1.0 - loss, 0.0, 1.0) / (1.0 - tol)) ** self.loss_exponent
        return np.where(loss <= tol, 1.0 - loss, beyond)

    def assign(
        self, *, n: int, paths: Sequence[PathState], ready: npt.ArrayLike | None = None
    ) -> npt.NDArray[np.intp]:
        n = check_int(n, "n", lo=0)
        shares = self.shares(paths)
        _ready_mask(ready, len(shares))  # checked, but the shares decide
        if len(self._stride.shares) != len(shares) or not np.array_equal(
            shares, self._stride.shares
        ):
            self._stride.set_shares(shares)
        for p, s in zip(paths, shares.tolist(), strict=True):
            p.weight = s
        return self._stride.take(n)


def _floor_shares(shares: np.ndarray, floor: float) -> np.ndarray:
    """`shares` (summing to 1) with each raised to >= floor, the rest scaled down."""
    fixed = np.zeros(len(shares), dtype=np.bool_)
    out = shares.copy()
    for _ in range(len(shares)):
        low = ~fixed & (out < floor)
        if not low.any():
            break
        fixed |= low
        rest = 1.0 - floor * fixed.sum()
        free = shares[~fixed]
        out = np.where(fixed, floor, 0.0)
        if free.size:
            out[~fixed] = free / free.sum() * rest if free.sum() > 0 else rest / free.size
    return out
