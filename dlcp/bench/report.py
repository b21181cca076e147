"""Markdown tables of benchmark records, and time-to-accuracy ratios.

The issues' targets against these records are `dlcp.bench.scorecard`'s.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from dlcp.bench import cpuload
from dlcp.bench.common import format_bytes, format_rate
from dlcp.bench.plots import scenario_label

__all__ = ["markdown_allreduce", "markdown_train", "tta_speedup"]

Rec = dict[str, Any]


def _ok(r: Rec | None) -> bool:
    return r is not None and not r.get("error")


def _find(
    records: Sequence[Rec],
    *,
    backend: str,
    scenario: str,
    loss_pct: float | None = None,
    codec: str | None = None,
    run: Any = None,
) -> Rec | None:
    for r in records:
        if r.get("backend") != backend or r.get("scenario") != scenario:
            continue
        if loss_pct is not None and abs(float(r.get("loss_pct") or 0.0) - loss_pct) > 1e-9:
            continue
        if codec is not None and r.get("codec") != codec:
            continue
        if run is not None and r.get("run") not in (None, run):
            continue
        if _ok(r):
            return r
    return None


def _ratio(a: Rec | None, b: Rec | None, key: str, key_b: str | None = None) -> float | None:
    if not (_ok(a) and _ok(b)):
        return None
    assert a is not None and b is not None
    x, y = a.get(key), b.get(key_b or key)
    if x is None or y is None or not y:
        return None
    return float(x) / float(y)


def tta_speedup(other: Rec | None, mine: Rec | None) -> tuple[float | None, bool]:
    """other's TTA over mine, and whether that is only a lower bound (other never
    reached the target in the time it trained)."""
    if not (_ok(other) and _ok(mine)) or other is None or mine is None:
        return None, False
    if not mine.get("tta_s"):
        return None, False
    if other.get("tta_s"):
        return float(other["tta_s"]) / float(mine["tta_s"]), False
    if other.get("wall_s"):
        return float(other["wall_s"]) / float(mine["tta_s"]), True
    return None, False


def _fmt(x: float | None, spec: str = ".2f", suffix: str = "") -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "-"
    return f"{x:{spec}}{suffix}"


def _gloo_of(records: Sequence[Rec], r: Rec, backend: str) -> Rec | None:
    return _find(
        records,
        backend=backend,
        scenario=r["scenario"],
        loss_pct=float(r.get("loss_pct") or 0.0),
        run=r.get("run"),
    )


def markdown_allreduce(records: Sequence[Rec]) -> str:
    """Allreduce records as a markdown table with ratios to Gloo."""
    lines = [
        "| scenario | backend | codec | p50 s | p99 s | p99/p50 | busbw Gbit/s | CPU s "
        "| machine CPU s | bound | lost | p50 / Gloo | p99 / Gloo |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        label = scenario_label(r)
        if r.get("error"):
            first = str(r["error"]).splitlines()[0][:120]
            lines.append(f"| {label} | {r['backend']} | {r['codec']} | failed: {first} ||||||||||")
            continue
        g = _gloo_of(records, r, "gloo")
        tail = _ratio(r, r, "p99_s", "p50_s")
        lost = _fmt(100 * float(r.get("loss_frac") or 0), ".2f", "%")
        lines.append(
            f"| {label} | {r['backend']} | {r['codec']} | {_fmt(r['p50_s'], '.3f')} "
            f"| {_fmt(r['p99_s'], '.3f')} | {_fmt(tail)} | {_fmt(r.get('busbw_gbps'), '.3f')} "
            f"| {_fmt(r.get('cpu_s'), '.1f')} | {_fmt(r.get('machine_cpu_s'), '.1f')} "
            f"| {cpuload.mark(r)} | {lost} "
            f"| {_fmt(_ratio(r, g, 'p50_s'), '.2f', 'x')} "
            f"| {_fmt(_ratio(r, g, 'p99_s'), '.2f', 'x')} |"
        )
    if records:
        f = records[0]
        lines.append("")
        lines.append(
            f"{f['hosts']} hosts, {format_rate(f.get('rate_bps'))} links, "
            f"{format_bytes(f['size_bytes'])} float32 buffer, {f['iters']} timed iterations each. "
            "CPU s: the backend's processes; machine CPU s: the whole machine's busy CPU "
            "(the emulated switch and softirq threads included); bound: cpu = the run was "
            "CPU-bound, net = it was not."
        )
    lines += [f"\n**{n}.**" for n in cpuload.baseline_notes(records, scenario_label)]
    return "\n".join(lines)


def markdown_train(records: Sequence[Rec]) -> str:
    """Train records as a markdown table with TTA speed-ups."""
    lines = [
        "| scenario | backend | codec | TTA s | final acc % | step p50 s | train s | bound "
        "| lost | Gloo TTA / TTA | gloo-prio TTA / TTA |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        label = scenario_label(r)
        if r.get("error"):
            first = str(r["error"]).splitlines()[0][:120]
            lines.append(f"| {label} | {r['backend']} | {r['codec']} | failed: {first} ||||||||")
            continue

        def sp(b: str, r: Rec = r) -> str:
            value, bound = tta_speedup(_gloo_of(records, r, b), r)
            return ("> " if bound else "") + _fmt(value, ".2f", "x")

        final = r.get("final_acc")
        tta = _fmt(r.get("tta_s"), ".1f")
        if r.get("tta_s") is None and r.get("wall_s"):
            tta = f"> {float(r['wall_s']):.1f}"
        stopped = r.get("stopped_at_step")
        steps = f" (stopped at step {stopped}, budget)" if stopped is not None else ""
        lines.append(
            f"| {label} | {r['backend']} | {r['codec']} | {tta}{steps} "
            f"| {_fmt(None if final is None else 100 * float(final), '.1f')} "
            f"| {_fmt(r.get('step_p50_s'), '.3f')} | {_fmt(r.get('wall_s'), '.1f')} "
            f"| {cpuload.mark(r)} | {_fmt(100 * float(r.get('loss_frac') or 0), '.2f', '%')} "
            f"| {sp('gloo')} | {sp('gloo-prio')} |"
        )
    if records:
        f = records[0]
        lines.append("")
        lines.append(
            f"{f['hosts']} ranks, {format_rate(f.get('rate_bps'))} links, target accuracy "
            f"{100 * float(f['target_acc']):g} %, {f['steps']} steps for every backend "
            f"(MLP {f.get('hidden')}, {f.get('params', '?')} parameters). "
            "bound: cpu = the run was CPU-bound, net = it was not."
        )
    lines += [f"\n**{n}.**" for n in cpuload.baseline_notes(records, scenario_label)]
    return "\n".join(lines)
