"""`codec="auto"`: the wire codec the cost model predicts fastest, the same on every rank.

`AutoCodec` is the decision logic without sockets or collectives (time comes
in as `now`); `DlcpState` feeds it and runs the two small collectives.

* Learning and measuring: `dlcp.shim.auto_measure` (bucket sizes, backward
  timing, iteration times and goodput of the last steps).
* Predicting: `dlcp.costmodel.model.predict` per candidate (the wire codecs
  the daemon carries) with this host's calibration (`host_calibration`, cached
  per host) and the network: the link rate (the daemon's per-peer rates from
  its rate controller, or a fixed `link_bps` / `DLCP_LINK_BPS`), capped by the
  goodput the transport measurably achieved with that codec in its last
  steps (`measure`): bytes on the wire over the time buckets were in flight
  between submit and reply; a codec not run yet is given the best goodput
  measured so far.
* Correcting, counting the error and paying for a trial: the arithmetic
  and its reasons are `dlcp.shim.auto_model`'s (`correction`,
  `error_penalty`, `payback_step`); `due` applies them.
* Exploring: an untried codec is worth trying only when its corrected
  prediction is within a margin of the best measured time (it enters the
  choice as corrected prediction / (1 + margin), optimistic by the model's
  uncertainty); otherwise it is never run. The margin is `explore` over the
  number of codecs measured: each measurement adds a point to the correction.
  A codec being tried is judged `probe` counted steps after the switch (one
  clearly worse window ends its trial: from then on its measured time, not
  the prediction, speaks for it).
  `explored_steps` counts the steps spent in codecs that were tried and then
  left, the cost of exploring.
* Agreeing: at a decision every rank averages its vector of times (measured,
  or corrected predictions; float32 all-reduce), takes `pick` of the average
  (the first candidate, in the fixed order fp32, fp16, thc8, thc4, fft, within
  `min_gain` of the fastest), then all ranks take the MAX of their picks, so
  even a rank that rounded differently follows. The new codec applies from
  the next step on.
* When: after `warmup` steps (in `warmup_codec`: fp16 by default, whose
  error is negligible (1e-4) and which halves the bytes at little CPU cost, so
  the steps before auto knows anything are never far from the best; the first
  step is not counted, so the first correction rests on `warmup` - 1 steps),
  then every `every` steps, `probe` counted steps after a switch to a codec
  not tried before, at the reviews (`warmup` x 2**k steps after the last link
  change, not while a codec is on trial; only with a `payback` or an
  `explore_budget`), and at the end of any step where some rank saw its link
  rate move by more than `change` from the rate of the last decision while
  the link was or becomes the bottleneck (within `change` of the best
  measured goodput; a flag carried by the step's agreement all-reduce, MAX
  over the ranks). Such a decision
  forgets all measurements first: they were taken on another link. All but
  the flag depend only on the step count and the agreed decisions, which
  every rank shares.

The arithmetic of these decisions (pick, correction, judge, payback, the
link and calibration readers) is `dlcp.shim.auto_model`'s; this module keeps
the state between steps (`AutoCodec`).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Any

from dlcp.codecs import CODEC_NAMES
from dlcp.costmodel.calibrate import Calibration
from dlcp.costmodel.model import Network, parse_link, predict
from dlcp.costmodel.profile import ModelProfile
from dlcp.errors import LocalError
from dlcp.shim.auto_measure import Measurements
from dlcp.shim.auto_model import (
    UNAVAILABLE_S,
    _positive_int,
    available,
    correction,
    error_penalty,
    host_calibration,
    judge,
    link_from_status,
    payback_step,
    pick,
)

__all__ = [
    "AUTO",
    "DEFAULT_CANDIDATES",
    "UNAVAILABLE_S",
    "AutoCodec",
    "available",
    "correction",
    "error_penalty",
    "host_calibration",
    "judge",
    "link_from_status",
    "payback_step",
    "pick",
]

AUTO = "auto"
# The candidates without `candidates=`. fft (lossy beyond a round, its first
# round dense) and sketch (its two exchanges make the hook wait for the index
# union, and its calibration is costly) are candidates only when named.
DEFAULT_CANDIDATES: tuple[str, ...] = ("fp32", "fp16", "thc8", "thc4")


class AutoCodec:
    """The decision state of `codec="auto"` for one `DlcpState` (picklable).

    Settings: candidates, warmup_codec, warmup, every, min_gain, max_rel_error,
    change, poll_steps, window, probe, explore, error_cost (the weight of a
    codec's squared error in its time, `error_penalty`; 0: time alone),
    payback (a trial's cost in units of its steps, for the ski-rental rule;
    0: no waiting), explore_budget (the largest fraction of the steps run
    that failed trials may take; None: no limit), cpu_share, jitter_s, link_bps
    (fixed: the daemon's rates are then not read), measure (cap the link by the
    measured goodput, judge codecs that ran by their measured iterations and
    correct the model by them).
    Stats: codec (the current choice; None before the first decision), steps,
    decisions, switches (choices that changed the codec after the first),
    link_bps (latest), decided_link_bps, goodput_bps (measured per codec,
    median of its last steps), measured_s (iteration seconds per codec, the
    same way), predicted (the ranks' averaged seconds per candidate at the
    last decision, measured or corrected predictions), correction (the factors
    on the CPU steps and on the rest applied at the last decision), explored_steps (steps
    spent in codecs tried and then left), deferred (untried codecs held back at
    the last decision -> the step from which they may run), history ([step,
    codec] at every change).
    """

    def __init__(
        self,
        *,
        candidates: Sequence[str] | None = None,
        warmup_codec: str = "fp16",
        warmup: int = 3,
        every: int = 50,
        min_gain: float = 0.05,
        max_rel_error: float | None = None,
        change: float = 0.3,
        poll_steps: int = 5,
        window: int = 5,
        probe: int = 2,
        explore: float = 0.15,
        error_cost: float = 1.0,
        payback: float = 1.0,
        explore_budget: float | None = 0.05,
        cpu_share: float = 1.0,
        jitter_s: float = 0.0,
        link_bps: float | str | None = None,
        measure: bool = True,
    ) -> None:
        names = tuple(candidates) if candidates is not None else DEFAULT_CANDIDATES
        bad = [c for c in names if c not in CODEC_NAMES]
        if bad or not names or len(set(names)) != len(names):
            raise LocalError(
                f"auto candidates must be distinct wire codecs ({', '.join(CODEC_NAMES)}), "
                f"got {list(names)}"
            )
        if warmup_codec not in CODEC_NAMES:
            raise LocalError(f"auto warmup_codec {warmup_codec!r} is not a wire codec")
        self.candidates = tuple(sorted(names, key=CODEC_NAMES.index))  # most accurate first
        self.warmup_codec = warmup_codec
        self.warmup = _positive_int("warmup", warmup)
        self.every = _positive_int("every", every)
        self.poll_steps = _positive_int("poll_steps", poll_steps)
        self.window = _positive_int("window", window)
        self.probe = _positive_int("probe", probe)
        for name, value in (
            ("min_gain", min_gain),
            ("change", change),
            ("jitter_s", jitter_s),
            ("explore", explore),
            ("error_cost", error_cost),
            ("payback", payback),
        ):
            if not (math.isfinite(value) and value >= 0):
                raise LocalError(f"auto {name} must be >= 0, got {value!r}")
        if not 0 < cpu_share <= 1:
            raise LocalError(f"auto cpu_share must be in (0, 1], got {cpu_share!r}")
        if explore_budget is not None and not (
            math.isfinite(explore_budget) and explore_budget >= 0
        ):
            raise LocalError(f"auto explore_budget must be >= 0 or None, got {explore_budget!r}")
        if max_rel_error is not None and not max_rel_error >= 0:
            raise LocalError(f"auto max_rel_error must be >= 0 or None, got {max_rel_error!r}")
        self.min_gain = float(min_gain)
        self.explore = float(explore)
        self.error_cost = float(error_cost)
        self.payback = float(payback)
        self.explore_budget = None if explore_budget is None else float(explore_budget)
        self.max_rel_error = max_rel_error
        self.change = float(change)
        self.cpu_share = float(cpu_share)
        self.jitter_s = float(jitter_s)
        self.measure = bool(measure)
        if link_bps is None:
            link_bps = os.environ.get("DLCP_LINK_BPS") or None
        self.fixed_link_bps = parse_link(link_bps) if isinstance(link_bps, str) else link_bps
        if self.fixed_link_bps is not None and not self.fixed_link_bps > 0:
            raise LocalError(f"link_bps must be > 0, got {link_bps!r}")

        self.calibration: Calibration | None = None
        self.codec: str | None = None
        self.steps = 0
        self.decisions = 0
        self.switches = 0
        self.link_bps: float | None = self.fixed_link_bps
        self.decided_link_bps: float | None = None
        self.predicted: dict[str, float] = {}
        self.history: list[list[Any]] = []
        self.correction: tuple[float, float] | None = None
        self.explored_steps = 0
        self.deferred: dict[str, float] = {}  # untried codec -> step (of the epoch) it pays back
        self.seen = Measurements(self.window)  # what the steps showed
        self._tried: set[str] = {self.warmup_codec}  # since the last link change (shared)
        self._epoch = 0  # the step of the last link change (shared)
        self._followup: int | None = None  # step of a decision after a switch
        self._fresh = True  # the step under way is the run's or a new codec's first
        self._trial: str | None = None  # the codec on trial (tried, not yet judged)
        self._trial_steps = 0

    # -- what the hook reports ---------------------------------------------------------
    @property
    def current(self) -> str:
        """The codec of the step under way."""
        return self.codec or self.warmup_codec

    @property
    def reads_link(self) -> bool:
        """Whether the link rate comes from the daemon (no fixed rate)."""
        return self.fixed_link_bps is None

    def bucket_entered(self, numel: int, now: float) -> None:
        self.seen.bucket_entered(numel, now)

    def bucket_left(self, now: float) -> None:
        self.seen.bucket_left(now)

    def end_step(
        self,
        exchanges: Sequence[tuple[int, float, float]] = (),
        *,
        hosts: int = 2,
        now: float | None = None,
    ) -> None:
        """The step's last bucket is done and decoded (at `now`): keep what it
        showed. `exchanges`: per bucket (values, submitted at, reply at) through
        the daemon, `hosts` hosts."""
        cal = self.calibration
        cost = cal.codecs.get(self.current) if cal is not None else None
        first_step, self._fresh = self._fresh, False
        self.seen.end_step(self.current, cost, exchanges, hosts, now, timed=not first_step)
        self.steps += 1
        if self._trial is not None:
            self._trial_steps += 1

    def measured(self, codec: str) -> float | None:
        """The iteration seconds measured with `codec` (median of its last steps)."""
        return self.seen.measured(codec)

    def forget(self) -> None:
        """Drop every measurement (the link changed); every rank calls it at once."""
        self.seen.forget()
        self._tried = {self.current}
        self._epoch = self.steps

    def goodput(self, codec: str) -> float | None:
        """The goodput (bytes/s) measured with `codec` (median of its last steps)."""
        return self.seen.goodput(codec)

    @property
    def goodput_bps(self) -> dict[str, float]:
        """The measured goodput per codec, bits/s."""
        return self.seen.goodput_bps

    def network(self, codec: str | None = None) -> Network:
        """The network the predictions for `codec` assume: the link rate, capped
        (with `measure`) by the goodput measured with `codec`, or for a codec
        not run yet, by the best goodput measured."""
        nominal = Network.from_rate(self.link_bps)
        if not self.measure:
            return nominal
        rate = self.goodput(codec or self.current)
        if rate is None:
            rate = self.seen.best_goodput()
        if rate is None or rate >= nominal.push_bytes_s:
            return nominal
        return Network(rate, rate, nominal.push_s, nominal.pull_s, self.link_bps)

    def discard_step(self) -> None:
        """Forget a step that did not complete (it is not counted)."""
        self.seen.discard_step()

    def observe_link(self, bps: float | None) -> None:
        """A link rate read from the daemon (ignored with a fixed rate)."""
        if self.reads_link and bps is not None and bps > 0:
            self.link_bps = float(bps)

    def poll_due(self) -> bool:
        """Whether to ask the daemon for its rates after this step."""
        return self.reads_link and self.steps % self.poll_steps == 0

    # -- when to decide ------------------------------------------------------------------
    def scheduled(self) -> bool:
        """A decision every rank makes at the same step (after `end_step`)."""
        if self.steps == self._followup:
            return True
        if self.steps >= self.warmup and (self.steps - self.warmup) % self.every == 0:
            return True
        # (a codec on trial is judged at its follow-up, not on fewer steps)
        return self.reviews and self._trial is None and self._review(self.steps - self._epoch)

    @property
    def reviews(self) -> bool:
        """Whether trials can be deferred (`due`), and decisions are also made at
        the reviews (`_review`), where they may come due: with `measure`, and a
        `payback` or an `explore_budget`."""
        return self.measure and (self.payback > 0 or self.explore_budget is not None)

    def _review(self, k: int) -> bool:
        """Whether `k` steps since the last link change is a review: `warmup`
        times a power of two (3, 6, 12, 24, ... steps). A deferred trial comes
        due at a step count proportional to its cost (payback, budget), so
        checking at doubling step counts runs it at most twice as late, with
        only a logarithmic number of decisions."""
        if k < self.warmup or k % self.warmup:
            return False
        n = k // self.warmup
        return n & (n - 1) == 0

    def link_changed(self) -> bool:
        """This rank's wish for a decision: its link rate moved by more than
        `change` while the link was or becomes the bottleneck (the slower of the
        two rates within `change` of the best goodput measured; a link far above
        what the transport moves, unthrottled, may move as it likes)."""
        new, old = self.link_bps, self.decided_link_bps
        if self.decisions == 0 or new is None:
            return False
        if old is None:
            return True
        if abs(new - old) <= self.change * old:
            return False
        best = max(self.goodput_bps.values(), default=None) if self.measure else None
        return best is None or min(new, old) < (1.0 + self.change) * best

    # -- deciding --------------------------------------------------------------------------
    def profile(self) -> ModelProfile | None:
        """What the last steps showed, as the cost model's profile (None before any)."""
        return self.seen.profile()

    def local_times(self, hosts: int) -> list[float]:
        """This rank's iteration seconds per candidate: measured for codecs that
        ran, the corrected prediction for the others, made optimistic by
        `explore` (see the module's "Correcting" and "Exploring");
        `UNAVAILABLE_S` for codecs it cannot judge. Forward and the optimizer
        step are left out: they cost every codec the same."""
        prof = self.profile()
        cal = self.calibration
        if prof is None or cal is None:
            return [0.0 if c == self.current else UNAVAILABLE_S for c in self.candidates]
        predicted: dict[str, float] = {}
        cpu: dict[str, float] = {}
        for name in self.candidates:
            cost = cal.codecs.get(name)
            if cost is None or (
                self.max_rel_error is not None and cost.rel_error > self.max_rel_error
            ):
                continue
            net = self.network(name)
            p = predict(prof, cost, net, hosts, cpu_share=self.cpu_share, jitter_s=self.jitter_s)
            if math.isfinite(p.iteration_s) and p.iteration_s > 0:
                predicted[name] = p.iteration_s
                cpu[name] = p.encode_s
        took = {c: m for c in predicted if self.measure and (m := self.measured(c)) is not None}
        penalty = {c: error_penalty(cal.codecs[c].rel_error, self.error_cost) for c in predicted}
        times, self.correction = judge(self.candidates, predicted, took, self.explore, cpu, penalty)
        return [t if math.isfinite(t) else UNAVAILABLE_S for t in times]

    def proposal(self, times: Sequence[float]) -> int:
        """The index of the candidate for the ranks' averaged `times`: `pick`,
        among the codecs tried since the last link change and the untried ones
        whose trial has paid back (`due`)."""
        due = self.due(times)
        allowed = [
            t if due[c] else UNAVAILABLE_S for c, t in zip(self.candidates, times, strict=True)
        ]
        return self.candidates.index(pick(allowed, self.candidates, self.min_gain))

    def due(self, times: Sequence[float]) -> dict[str, bool]:
        """Per candidate, for the ranks' averaged `times`: whether it may be
        chosen now. A codec tried (or measured) since the last link change
        always may; an untried one only (1) once its trial pays back
        (`payback_step`): its relative gain over the fastest tried codec (its
        time being the optimistic corrected prediction, error penalty
        included) times the steps run since the last link change reaches
        `payback` x its trial's steps (`probe` + 1), and (2) while the steps of
        failed trials (`explored_steps`) and its trial's stay within
        `explore_budget` of the steps run. Without a measured codec to compare
        with (at the first decision after a link change, or without
        `measure`), every codec may: the model alone decides. Sets `deferred`
        (untried codec -> the step count from which both hold; inf: never, for
        a codec predicted no faster). Depends only on `times` and state every
        rank shares (steps, decisions, trials), so the ranks agree."""
        self.deferred = {}
        by_name = dict(zip(self.candidates, times, strict=True))
        allowed = {c: True for c in self.candidates}
        if not self.reviews or not any(self.measured(c) is not None for c in self._tried):
            return allowed
        tried = self._tried | {c for c in self.candidates if self.measured(c) is not None}
        base = min((by_name[c] for c in tried if c in by_name), default=UNAVAILABLE_S)
        if not available(base) or base <= 0:
            return allowed
        trial = self.probe + 1
        budget = self.explore_budget
        if budget is None:
            afford = 0.0
        elif budget > 0:
            # (a codec on trial being judged: its steps are lost if another is tried)
            spent = self.explored_steps + (self._trial_steps if self._trial is not None else 0)
            afford = (spent + trial) / budget
        else:
            afford = math.inf
        for c, t in by_name.items():
            if c in tried or not available(t):
                continue
            at = max(self._epoch + payback_step(1.0 - t / base, trial, self.payback), afford)
            if self.steps < at:
                allowed[c] = False
                self.deferred[c] = at
        return allowed

    def adopt(self, index: int, times: Sequence[float]) -> str | None:
        """Take the agreed candidate; returns the previous codec when it changed."""
        name = self.candidates[index]
        before = self.codec
        self.decisions += 1
        self.decided_link_bps = self.link_bps
        self.predicted = {c: float(t) for c, t in zip(self.candidates, times, strict=True)}
        self.codec = name
        self._followup = None
        if name == before:
            self._trial = None  # the codec on trial (if any) stays: it was no detour
            return None
        if self._trial is not None:  # leaving the codec on trial: exploring cost its steps
            self.explored_steps += self._trial_steps
            self._trial = None
        self._fresh = True
        if self.measure and name not in self._tried:
            self._trial, self._trial_steps = name, 0
            self._followup = self.steps + self.probe + 1  # its first step is not counted
        self._tried.add(name)
        if before is not None:
            self.switches += 1
        self.history.append([self.steps, name])
        if len(self.history) > 64:
            del self.history[:-64]
        return before or self.warmup_codec

    def __setstate__(self, state: dict[str, Any]) -> None:
        if "seen" not in state:  # pickled before `Measurements` held these
            seen = Measurements(state["window"])
            for name in (
                "_sizes",
                "_gaps",
                "_left",
                "_first_in",
                "_seen",
                "_goodput",
                "_iteration",
            ):
                if name in state:
                    setattr(seen, name, state.pop(name))
            state["seen"] = seen
        self.__dict__.update(state)

    def describe(self) -> dict[str, Any]:
        """For `DlcpState.stats()`, logs and benchmark records."""
        return {
            "codec": self.current,
            "chosen": self.codec,
            "steps": self.steps,
            "decisions": self.decisions,
            "switches": self.switches,
            "link_bps": self.link_bps,
            "decided_link_bps": self.decided_link_bps,
            "goodput_bps": self.goodput_bps,
            "measured_s": self.seen.measured_s,
            "predicted_s": {c: (t if available(t) else None) for c, t in self.predicted.items()},
            "correction": self.correction,
            "explored_steps": self.explored_steps,
            "deferred": dict(self.deferred),
            "history": [list(h) for h in self.history],
        }
