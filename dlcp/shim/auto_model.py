"""The arithmetic of `codec="auto"` (`dlcp.shim.auto.AutoCodec` keeps the state
and calls these): whether a predicted time is usable (`available`), the
candidate to take from times averaged over ranks (`pick`), the correction of
the cost model's predictions by measured times (`correction`), the times a
decision compares (`judge`), what a lossy codec's error costs in steps
(`error_penalty`), when a switch pays back (`payback_step`), and reading the
link rate and this host's codec calibration (`link_from_status`,
`host_calibration`).

Why, as `dlcp.shim.auto.AutoCodec` uses them:

* Correcting: a calibration taken on an idle host and a link rate say little
  about a host whose daemons and ranks share a few cores, so the model's
  absolute times are off. Auto corrects them online (`correction`): one
  factor, measured / predicted, while one codec has been measured; from two
  on, one factor for the codec steps' CPU time (how many processes share the
  cores) and one for the rest (the transport), fitted to the measured codecs.
  A codec not run yet is judged by its corrected prediction.
* Counting the error: compression pays only if it saves more than it costs,
  accuracy included. Every time a decision compares (measured or predicted)
  is multiplied by `error_penalty` of the codec's calibrated one-round
  relative error e: 1 + `error_cost` * e**2, the steps of that codec that make
  the progress of one exact step (compressed SGD's (1 + omega) bound; error
  feedback recovers part of it, so this is the pessimistic end). With the
  default `error_cost` 1: fp16 (e 3e-4) +0 %, thc8 (e 0.12) +1.5 %, thc4 (e 1.7)
  x3.9, so thc4 runs only where it is measured or predicted ~4x faster.
  `max_rel_error` still drops a codec outright.
* Paying for a trial (`due`): a trial costs its `probe` + 1 steps if the
  codec proves no faster (in time, and in accuracy for a lossy one), and the
  model is often wrong on a busy host, so once some codec has been measured a
  trial must also pay for itself. (1) Payback, the ski-rental rule
  (`payback_step`): steps run since the last link change x the codec's
  predicted relative gain >= `payback` x its trial's steps; a small predicted
  gain waits long, a large one briefly, and either regret (trying a codec
  that loses, or not trying one that wins) stays within about twice the
  other. (2) Budget: failed trials' steps (`explored_steps`), with the one to
  come, stay within `explore_budget` of all steps run, so exploring never
  costs more than that fraction of the steps (a failed trial's step costs
  up to ~2 steps of the best codec: ~2x that in time), and never falls in
  the first steps of training, where accuracy moves fastest. A deferred
  codec is checked again at the reviews (`warmup` x 2**k steps after the
  last link change: at most twice as late as it came due) and at the other
  decisions; `deferred` lists, per untried codec, the step from which it may
  run. The first decision after a link change has nothing measured on the
  new link: the model alone decides, at once, as before.
"""

from __future__ import annotations

import contextlib
import math
import os
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from dlcp.costmodel.calibrate import Calibration
from dlcp.errors import LocalError

__all__ = [
    "UNAVAILABLE_S",
    "available",
    "correction",
    "error_penalty",
    "host_calibration",
    "judge",
    "link_from_status",
    "payback_step",
    "pick",
]

# The predicted time of a codec auto must not choose (not calibrated, too lossy):
# finite, so that averaging over ranks stays finite and comparable.
UNAVAILABLE_S = 1e30


def available(t: float) -> bool:
    """Whether a predicted (possibly averaged, float32) time is a real one."""
    return t < UNAVAILABLE_S / 2


def pick(times: Sequence[float], candidates: Sequence[str], min_gain: float = 0.05) -> str:
    """The codec for predicted `times` (one per candidate): the first candidate in
    order whose time is within `min_gain` of the fastest. Candidates are ordered
    most accurate first, so this prefers accuracy when the gain is small (as
    `dlcp.costmodel.model.choose_codec` does), and ties go to the earlier one."""
    if len(times) != len(candidates) or not candidates:
        raise LocalError("pick needs one predicted time per candidate")
    best = min(times)
    if not available(best):
        return candidates[0]
    for name, t in zip(candidates, times, strict=True):
        if t <= best * (1.0 + min_gain):
            return name
    raise AssertionError("unreachable: the fastest is within any gain of itself")


def correction(
    predicted: Mapping[str, float],
    cpu: Mapping[str, float],
    measured: Mapping[str, float],
) -> tuple[float, float] | None:
    """How far off the model is, from the codecs measured so far: factors
    (on the CPU steps, on the rest) such that measured ~ f_cpu * cpu + f_rest *
    (predicted - cpu), where `cpu` is the predicted seconds of codec work.

    The model's errors differ by part: the codec steps' CPU time depends on
    how many processes share the cores (unknown to a rank), the rest on the
    transport. With two measured codecs or more whose CPU shares differ, both
    factors are fitted (least squares on relative errors); otherwise, or when
    a fitted factor is not positive, one factor for both: the median of
    measured / predicted. None when nothing was measured."""
    seen = [c for c in measured if predicted.get(c, 0.0) > 0]
    if not seen:
        return None
    one = statistics.median(measured[c] / predicted[c] for c in seen)
    if len(seen) >= 2 and all(c in cpu for c in seen):
        sxx = sxy = syy = sxm = sym = 0.0
        for c in seen:
            w = 1.0 / measured[c] ** 2 if measured[c] > 0 else 0.0
            x = min(max(cpu[c], 0.0), predicted[c])
            y, m = predicted[c] - x, measured[c]
            sxx, sxy, syy = sxx + w * x * x, sxy + w * x * y, syy + w * y * y
            sxm, sym = sxm + w * x * m, sym + w * y * m
        det = sxx * syy - sxy * sxy
        if det > 1e-6 * sxx * syy > 0:
            f_cpu = (sxm * syy - sym * sxy) / det
            f_rest = (sym * sxx - sxm * sxy) / det
            if f_cpu > 0 and f_rest > 0:
                return f_cpu, f_rest
    return one, one


def judge(
    candidates: Sequence[str],
    predicted: Mapping[str, float],
    measured: Mapping[str, float],
    explore: float,
    cpu: Mapping[str, float] | None = None,
    penalty: Mapping[str, float] | None = None,
) -> tuple[list[float], tuple[float, float] | None]:
    """The times a decision compares, one per candidate (`UNAVAILABLE_S` for a
    candidate with no prediction):

    * a codec with a `measured` time: that time;
    * any other: its `predicted` time corrected by the measured ones
      (`correction`; `cpu`: the predicted seconds of codec work of each),
      divided by 1 + `explore` / (the number of measured codecs) when some
      codec has been measured: an untried codec is tried only when its
      corrected prediction is within that margin of the best measured time
      (and within `pick`'s gain of the fastest). The margin is the model's
      uncertainty after correction, which shrinks as measurements accumulate.

    Either is then multiplied by the candidate's `penalty` (default 1: see
    `error_penalty`), which makes it the time per exact step's worth of
    progress. The correction is fitted to the plain times.

    Returns the times and the correction (None when nothing was measured)."""
    cpu = cpu or {}
    penalty = penalty or {}
    factors = correction(predicted, cpu, measured)
    seen = sum(1 for c in measured if c in predicted)
    margin = explore / seen if seen else 0.0
    out = []
    for name in candidates:
        if name in measured and name in predicted:
            out.append(float(measured[name]) * penalty.get(name, 1.0))
        elif name in predicted:
            t = predicted[name]
            if factors is not None:
                x = min(max(cpu.get(name, 0.0), 0.0), t)
                t = (factors[0] * x + factors[1] * (t - x)) / (1.0 + margin)
            out.append(t * penalty.get(name, 1.0))
        else:
            out.append(UNAVAILABLE_S)
    return out, factors


def error_penalty(rel_error: float, weight: float = 1.0) -> float:
    """How many steps of a codec whose averaged gradient has relative L2 error
    `rel_error` (one round, as calibrated) make the progress of one exact step:
    1 + `weight` * rel_error ** 2.

    An unbiased compressor with relative error e adds noise of e**2 times the
    gradient's squared norm; SGD's step count to a target grows with the
    gradient's second moment, so by up to that factor (the (1 + omega) of the
    compressed-SGD bounds, omega = e**2). Error feedback carries the error into
    later rounds and recovers part of it, so this is the pessimistic end;
    `weight` (auto's `error_cost`) scales it, 0 ignores errors."""
    if weight == 0:
        return 1.0
    if not (math.isfinite(rel_error) and rel_error >= 0):
        return math.inf  # an error not known: as if unusable
    return 1.0 + weight * rel_error * rel_error


def payback_step(gain: float, trial_steps: int, payback: float = 1.0) -> float:
    """The steps (since the last link change) after which trying a codec
    predicted `gain` (relative: 0.2 = 20 % less time per step) faster has paid
    for itself: the ski-rental break-even. A trial of `trial_steps` steps costs
    at most about that many steps (if the codec turns out no faster, and its
    error set training back), times `payback`; not trying it costs `gain` of
    a step per step run, if the prediction holds. Trying once the steps run
    times `gain` reach the trial's cost keeps either regret within twice the
    other's, whether training then ends or goes on. `math.inf` for no gain;
    0 with `payback` 0 (try at once)."""
    if payback <= 0:
        return 0.0
    if not gain > 0:
        return math.inf
    return payback * trial_steps / gain


def link_from_status(status: Mapping[str, Any], peers: Sequence[str] | None = None) -> float | None:
    """This host's link rate from a daemon `status` reply: the sum of its rate
    controllers' per-peer rates (over `peers`, names "address:port", when given
    and present; else over all), or None when it has no peers yet."""
    rows = list(status.get("peers") or [])
    if peers:
        mine = [r for r in rows if r.get("peer") in set(peers)]
        rows = mine or rows
    rates = [float(r["rate_bps"]) for r in rows if r.get("rate_bps")]
    return sum(rates) if rates else None


def host_calibration(
    specs: Sequence[str], hosts: int, path: Path | str | None = None
) -> Calibration:
    """This host's codec costs for `specs`: the cached calibration (the one `dlcp plan`
    makes), with missing codecs calibrated now and the cache updated."""
    from dlcp.costmodel.calibrate import calibrate, default_cache

    hosts = max(hosts, 2)
    target = Path(path) if path is not None else default_cache(hosts)
    try:
        cal: Calibration | None = Calibration.load(target)
    except LocalError:
        cal = None
    missing = [s for s in specs if cal is None or s not in cal.codecs]
    if missing:
        fresh = calibrate(missing, hosts=hosts)
        if cal is None:
            cal = fresh
        else:
            cal.codecs.update(fresh.codecs)
        # ranks of one host may calibrate at once: write aside, then rename
        tmp = target.with_name(f"{target.name}.{os.getpid()}.tmp")
        with contextlib.suppress(OSError):
            cal.save(tmp)
            os.replace(tmp, target)
    assert cal is not None
    return cal


def _positive_int(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise LocalError(f"auto {name} must be a positive int, got {value!r}")
    return value
