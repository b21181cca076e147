"""Per-codec table of `dlcp bench report`: does compression pay here, and does
the cost model say so in advance? (Agarwal et al., MLSys 2022.)

One row per codec and setting (link rate, hosts, scenario, loss, mode), from
the last invocation read of `dlcp bench allreduce` with that dlcp codec and
the last of `dlcp bench train`: dlcp's times beside the fastest PyTorch
baseline of the same invocation whose accuracy is no worse (`dlcp.bench.fair`:
Gloo fp32, or DDP's fp16/bf16/PowerSGD hooks where they ran; the table names
it), the result error, the model's prediction that the bench stored in each
record (`dlcp.bench.predict`) and the measured time over it, and the time to
accuracy. "Pays" by the model compares a codec with fp32: its predicted time
against the model's fp32 time; measured, dlcp with the codec against that
baseline (so the transport's own difference, dlcp fp32's row, is part of it).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from dlcp.bench import cpuload
from dlcp.bench.common import CODECS, format_rate
from dlcp.bench.fair import fastest_fair
from dlcp.bench.plots import scenario_label

__all__ = ["CodecRow", "codec_rows", "markdown_codecs"]

Rec = dict[str, Any]
Key = tuple[Any, ...]
BASELINE = "fp32"


@dataclass
class CodecRow:
    """What one codec measured in one setting: the records of its all-reduce
    and training invocations (dlcp's, and Gloo's beside it)."""

    key: Key  # (rate_bps, hosts, scenario label, mode, codec)
    allreduce: Rec | None = None
    allreduce_gloo: Rec | None = None
    train: Rec | None = None
    train_gloo: Rec | None = None
    allreduce_base: Rec | None = None  # the fastest baseline with no worse accuracy
    train_base: Rec | None = None

    @property
    def codec(self) -> str:
        return str(self.key[-1])

    @property
    def has_prediction(self) -> bool:
        return any(
            r is not None and ("predicted_s" in r or "predicted_step_s" in r)
            for r in (self.allreduce, self.train)
        )


def _ok(r: Rec | None) -> bool:
    return r is not None and not r.get("error")


def _kind(r: Rec) -> str:
    if "grad_bytes" in r:
        return "ddp"
    return "train" if "tta_s" in r or "target_acc" in r else "allreduce"


def _key(r: Rec) -> Key:
    return (
        r.get("rate_bps"),
        r.get("hosts"),
        scenario_label(r),
        r.get("mode") or "transpose",
        r.get("codec", BASELINE),
    )


def codec_rows(invocations: Sequence[Sequence[Rec]]) -> list[CodecRow]:
    """A row per (setting, dlcp codec) in these invocations (the last one read of
    each kind counts), in link, hosts, scenario and `CODECS` order."""
    rows: dict[Key, CodecRow] = {}
    for inv in invocations:
        dl = next((r for r in inv if r.get("backend") == "dlcp"), None)
        if dl is None or _kind(dl) not in ("allreduce", "train"):
            continue
        gloo = next((r for r in inv if r.get("backend") == "gloo"), None)
        base = fastest_fair(dl, inv)
        row = rows.setdefault(_key(dl), CodecRow(_key(dl)))
        if _kind(dl) == "allreduce":
            row.allreduce, row.allreduce_gloo, row.allreduce_base = dl, gloo, base
        else:
            row.train, row.train_gloo, row.train_base = dl, gloo, base

    def order(row: CodecRow) -> tuple[Any, ...]:
        rate, hosts, label, mode, codec = row.key
        rank = CODECS.index(codec) if codec in CODECS else len(CODECS)
        return (rate or 0, hosts or 0, label, mode, rank, codec)

    return sorted(rows.values(), key=order)


def _num(r: Rec | None, key: str) -> float | None:
    if not _ok(r):
        return None
    assert r is not None
    x = r.get(key)
    if x is None:
        return None
    value = float(x)
    return value if math.isfinite(value) else None


def _f(x: float | None, spec: str = ".3f", suffix: str = "") -> str:
    return "-" if x is None else f"{x:{spec}}{suffix}"


def _div(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def _yes(x: bool | None) -> str:
    return "-" if x is None else "yes" if x else "no"


def _less(a: float | None, b: float | None) -> bool | None:
    return None if a is None or b is None else a < b


def _sooner(mine: Rec | None, other: Rec | None) -> bool | None:
    """Whether `mine` reached its target accuracy before `other` (one that never
    reached it is later than one that did); None if either failed or neither reached it."""
    if not (_ok(mine) and _ok(other)):
        return None
    a, b = _num(mine, "tta_s"), _num(other, "tta_s")
    if a is None and b is None:
        return None
    return _less(math.inf if a is None else a, math.inf if b is None else b)


def _times(r: Rec | None) -> str:
    if r is None:
        return "not run"
    if r.get("error"):
        return "failed"
    return f"{_f(_num(r, 'p50_s'))} / {_f(_num(r, 'p99_s'))}"


def _tta(r: Rec | None) -> str:
    if r is None:
        return "not run"
    if r.get("error"):
        return "failed"
    tta = _num(r, "tta_s")
    if tta is None:
        return "not reached"
    return f"{tta:.1f}"


def _error(r: Rec | None) -> str:
    x = _num(r, "result_error")
    if x is None:
        return "-"
    return "0" if x == 0 else f"{x:.2g}"


def _bound(r: Rec | None) -> str:
    """cpu, net or - (not measured, failed, not run)."""
    return cpuload.mark(r) if _ok(r) and r is not None else "-"


def _which(r: Rec | None) -> str:
    return "" if r is None else f" ({r['backend']})"


def _line(row: CodecRow) -> str:
    ar, gl, tr = row.allreduce, row.allreduce_gloo, row.train
    ab, tb = row.allreduce_base, row.train_base
    base = row.codec == BASELINE
    p50, gloo_p50, base_p50 = _num(ar, "p50_s"), _num(gl, "p50_s"), _num(ab, "p50_s")
    pred, pred_fp32 = _num(ar, "predicted_s"), _num(ar, "predicted_fp32_s")
    gloo_pred = _num(gl, "predicted_s")
    step, step_pred = _num(tr, "step_p50_s"), _num(tr, "predicted_step_s")
    step_fp32 = _num(tr, "predicted_fp32_step_s")
    model = [_less(pred, pred_fp32), _less(step_pred, step_fp32)]
    measured = [_less(p50, base_p50), _sooner(tr, tb)]
    pays = "; ".join("-" if base else _yes(x) for x in model)
    pays_measured = "; ".join(_yes(x) for x in measured)
    if ar is None:
        shown_base = "not run"
    elif ab is None:
        shown_base = "none"
    else:
        shown_base = _f(base_p50) + _which(ab)
    rate, _, label, mode, codec = row.key
    setting = f"{format_rate(rate)}, {label}" + ("" if mode == "transpose" else f", {mode}")
    cells = [
        setting,
        codec,
        _times(ar),
        shown_base,
        _f(_div(p50, base_p50), ".2f", "x"),
        f"{_error(ar)}; {_error(ab)}",
        f"{_f(pred)} / {_f(pred_fp32)}",
        f"{_f(_div(p50, pred), '.2f')}; {_f(_div(gloo_p50, gloo_pred), '.2f')}",
        f"{_tta(tr)}; {_tta(tb)}{_which(tb) if tr is not None else ''}",
        f"{_f(step)} / {_f(step_pred)}",
        pays,
        pays_measured,
        f"{_bound(ar)}, {_bound(ab)}; {_bound(tr)}, {_bound(tb)}",
    ]
    return "| " + " | ".join(cells) + " |"


def markdown_codecs(invocations: Sequence[Sequence[Rec]], *, always: bool = False) -> str:
    """The per-codec table; "" when the records hold no codec but fp32 and no
    prediction (unless `always`)."""
    rows = codec_rows(invocations)
    if not always and not any(r.codec != BASELINE or r.has_prediction for r in rows):
        return ""
    targets = sorted(
        {float(r.train["target_acc"]) for r in rows if r.train and r.train.get("target_acc")}
    )
    hosts = sorted({int(r.key[1]) for r in rows if r.key[1] is not None})
    sizes = sorted(
        {
            int(r.allreduce["size_bytes"])
            for r in rows
            if r.allreduce and r.allreduce.get("size_bytes")
        }
    )
    lines = [
        "| link, scenario | codec | dlcp p50 / p99 s | baseline p50 s (which) "
        "| dlcp / baseline | result error (dlcp; baseline) | predicted s, codec / fp32 "
        "| measured / predicted (dlcp; Gloo fp32) | TTA s (dlcp; baseline) "
        "| step p50 s, measured / predicted "
        "| pays by the model (all-reduce; step) | pays measured (all-reduce; TTA) "
        "| CPU-bound (all-reduce dlcp, baseline; train dlcp, baseline) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        *(_line(r) for r in rows),
        "",
        f"{', '.join(map(str, hosts)) or '?'} hosts; all-reduce of "
        f"{' and '.join(f'{s / 1e6:g} MB' for s in sizes) or '-'} of float32; "
        f"TTA: time to {' and '.join(f'{100 * t:g} %' for t in targets) or '-'} test "
        "accuracy on digits. baseline: the fastest PyTorch baseline of the same "
        "invocation (Gloo fp32, DDP's fp16/bf16/PowerSGD hooks) whose accuracy is no "
        "worse: a result error at most dlcp's, a final accuracy within 0.5 points (none: "
        "no baseline was as accurate). result error: relative L2 error of the mean "
        "against the exact one. predicted: `dlcp plan`'s model (dlcp.costmodel) for "
        "the record's codec, hosts and link rate, calibrated on this host; Gloo's is "
        "the model's fp32. "
        "step: the training step's median, predicted for the bench's MLP. pays by the "
        "model: faster than its fp32 prediction (- for fp32 itself); pays measured: "
        "faster than the baseline (all-reduce p50; time to accuracy). CPU-bound: cpu = "
        "the run was CPU-bound (its time is partly the 2 cores'), net = it was not.",
    ]
    return "\n".join(lines)
