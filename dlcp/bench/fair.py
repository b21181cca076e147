"""The baseline a dlcp record is judged against: the fastest PyTorch baseline
of the same invocation whose accuracy is no worse.

"No worse" is measured where the records measure it:
- training (`bench train`): the baseline's final accuracy at least dlcp's
  minus `ACC_POINTS` (0.5 points);
- all-reduce: the baseline's `result_error` (relative L2 error of its mean;
  Gloo fp32's is 0, the casts have their own) at most dlcp's;
- otherwise (`bench ddp`, which measures no accuracy, or a record without
  the measure): the codec's nominal significant bits per value on the wire
  (`dlcp.bench.backends.NOMINAL_BITS`: fp32 24, fp16 11, bf16 8, thc8 8,
  thc4 4) at least dlcp's codec's.
"Fastest": the lowest p50 (all-reduce, DDP step); in training the lowest
time to accuracy (one that never reached it after every one that did, then
by median step).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from dlcp.bench.backends import NOMINAL_BITS, TABLE

__all__ = ["ACC_POINTS", "baselines", "fastest_fair", "kind", "no_worse", "speed"]

Rec = dict[str, Any]
ACC_POINTS = 0.005  # final accuracy within 0.5 points counts as no worse


def kind(r: Rec) -> str:
    """allreduce, train or ddp: which bench wrote the record."""
    if "grad_bytes" in r:
        return "ddp"
    return "train" if "tta_s" in r or "target_acc" in r else "allreduce"


def _num(r: Rec, key: str) -> float | None:
    x = r.get(key)
    if x is None:
        return None
    v = float(x)
    return v if math.isfinite(v) else None


def baselines(records: Sequence[Rec]) -> list[Rec]:
    """The PyTorch (Gloo family) records among `records` that did not fail."""
    out = []
    for r in records:
        b = TABLE.get(str(r.get("backend")))
        if b is not None and not b.is_dlcp and not r.get("error"):
            out.append(r)
    return out


def no_worse(base: Rec, mine: Rec) -> bool:
    """Whether `base`'s accuracy is no worse than `mine`'s (see the module)."""
    k = kind(mine)
    if k == "train":
        a, b = _num(mine, "final_acc"), _num(base, "final_acc")
        if a is not None and b is not None:
            return b >= a - ACC_POINTS - 1e-12
    elif k == "allreduce":
        a, b = _num(mine, "result_error"), _num(base, "result_error")
        if a is not None and b is not None:
            return b <= a
    bits_a = NOMINAL_BITS.get(str(mine.get("codec", "fp32")))
    bits_b = NOMINAL_BITS.get(str(base.get("codec", "fp32")))
    return bits_a is not None and bits_b is not None and bits_b >= bits_a


def speed(r: Rec) -> tuple[float, float]:
    """A sort key: smaller is faster."""
    if kind(r) == "train":
        tta = _num(r, "tta_s")
        return (math.inf if tta is None else tta, _num(r, "step_p50_s") or math.inf)
    return (_num(r, "p50_s") or math.inf, _num(r, "p99_s") or math.inf)


def fastest_fair(mine: Rec, records: Sequence[Rec]) -> Rec | None:
    """The fastest baseline among `records` (one invocation) whose accuracy is
    no worse than `mine`'s; None when there is none."""
    same = [
        r
        for r in baselines(records)
        if kind(r) == kind(mine)
        and r.get("scenario") == mine.get("scenario")
        and abs(float(r.get("loss_pct") or 0.0) - float(mine.get("loss_pct") or 0.0)) < 1e-9
        and r.get("run") == mine.get("run")
    ]
    return min((r for r in same if no_worse(r, mine)), key=speed, default=None)


def versus(mine: Rec, records: Sequence[Rec]) -> str:
    """'0.93x gloo-fp16': a dlcp record's p50 (training: its time to accuracy)
    over its fair baseline's, for the benches' printed tables; '-' for a
    baseline's own record or when there is none."""
    b = TABLE.get(str(mine.get("backend")))
    if b is None or not b.is_dlcp or mine.get("error"):
        return "-"
    base = fastest_fair(mine, records)
    if base is None:
        return "none"
    key = "tta_s" if kind(mine) == "train" else "p50_s"
    a, c = _num(mine, key), _num(base, key)
    if a is None or not c:
        return f"- {base['backend']}"
    return f"{a / c:.2f}x {base['backend']}"
