"""PNG plots of benchmark records: all-reduce latency CDFs, time-to-accuracy curves.

matplotlib with the non-interactive Agg backend (no display needed). Every
function takes records as written to the JSON files, so plots can be redrawn
from saved results: `dlcp bench plot FILE.json...`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["STYLE", "plot_latency_cdf", "plot_tta", "scenario_label"]

# backend -> (colour, line style); ablations dashed in dlcp's colour family
STYLE: dict[str, tuple[str, str]] = {
    "dlcp": ("#d62728", "-"),
    "gloo": ("#1f77b4", "-"),
    "gloo-prio": ("#2ca02c", "-"),
    "gloo-fp16": ("#17becf", "-"),
    "gloo-fp16-prio": ("#17becf", "--"),
    "gloo-bf16": ("#bcbd22", "-"),
    "gloo-bf16-prio": ("#bcbd22", "--"),
    "gloo-powersgd": ("#e377c2", "-"),
    "gloo-powersgd-prio": ("#e377c2", "--"),
    "dlcp-noprio": ("#ff7f0e", "--"),
    "dlcp-nobound": ("#9467bd", "--"),
    "dlcp-1path": ("#8c564b", "--"),
}


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def scenario_label(rec: dict[str, Any]) -> str:
    """'loss 5%' for a loss record, else the scenario name."""
    s = str(rec.get("scenario", "?"))
    if s == "loss" and rec.get("loss_pct"):
        return f"loss {rec['loss_pct']:g}%"
    return s


def _label(rec: dict[str, Any]) -> str:
    if rec.get("_label"):
        return str(rec["_label"])
    name = str(rec["backend"])
    if name.startswith("dlcp") and rec.get("codec", "fp32") != "fp32":
        name += f" {rec['codec']}"
    return name


def _style(rec: dict[str, Any]) -> tuple[str, str]:
    colour, line = STYLE.get(str(rec["backend"]), ("#7f7f7f", ":"))
    if rec.get("codec", "fp32") != "fp32" and str(rec["backend"]).startswith("dlcp"):
        line = "-."
    return colour, line


def _groups(records: Sequence[dict[str, Any]]) -> list[tuple[str, list[dict[str, Any]]]]:
    """Records by scenario; a backend that appears twice in a scenario (e.g.
    Gloo beside dlcp fp32 and beside dlcp thc8) gets its codec run named."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        groups.setdefault(scenario_label(r), []).append(dict(r))
    for recs in groups.values():
        seen: dict[str, int] = {}
        for r in recs:
            seen[r["backend"]] = seen.get(r["backend"], 0) + 1
        for r in recs:
            if seen[r["backend"]] > 1 and not str(r["backend"]).startswith("dlcp"):
                partner = next(
                    (q for q in recs if q.get("run") == r.get("run") and q is not r
                     and str(q["backend"]).startswith("dlcp")),
                    None,
                )  # fmt: skip
                if partner is not None and partner.get("codec", "fp32") != "fp32":
                    r["_label"] = f"{r['backend']} (beside {partner['codec']})"
    return list(groups.items())


def _grid(n: int) -> tuple[int, int]:
    cols = min(3, max(1, n))
    return math.ceil(n / cols), cols


def plot_latency_cdf(
    records: Sequence[dict[str, Any]], path: Path | str, *, title: str | None = None
) -> Path:
    """One subplot per scenario: the CDF of per-iteration all-reduce times per backend."""
    plt = _pyplot()
    groups = _groups([r for r in records if r.get("times_s")])
    if not groups:
        groups = [("no data", [])]
    rows, cols = _grid(len(groups))
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.6 * rows), squeeze=False)
    for ax, (name, recs) in zip(axes.flat, groups, strict=False):
        for r in recs:
            xs = sorted(float(t) for t in r["times_s"])
            ys = [(i + 1) / len(xs) for i in range(len(xs))]
            colour, line = _style(r)
            ax.step(xs, ys, where="post", color=colour, linestyle=line, label=_label(r))
        ax.set_title(name)
        ax.set_xlabel("all-reduce time (s)")
        ax.set_ylabel("CDF")
        ax.set_xscale("log")
        ax.set_ylim(0, 1.02)
        ax.grid(True, which="both", alpha=0.3)
        if recs:
            ax.legend(fontsize="small", loc="lower right")
    for ax in list(axes.flat)[len(groups) :]:
        ax.set_visible(False)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return _save(fig, plt, path)


def plot_tta(
    records: Sequence[dict[str, Any]], path: Path | str, *, title: str | None = None
) -> Path:
    """One subplot per scenario: test accuracy over training time per backend,
    the target as a dashed line and each backend's TTA marked."""
    plt = _pyplot()
    groups = _groups([r for r in records if r.get("curve")])
    if not groups:
        groups = [("no data", [])]
    rows, cols = _grid(len(groups))
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.6 * rows), squeeze=False)
    for ax, (name, recs) in zip(axes.flat, groups, strict=False):
        target = None
        low = 50.0  # zoomed in, unless a backend ends below that (stuck)
        for r in recs:
            ts = [float(p[0]) for p in r["curve"]]
            accs = [100 * float(p[1]) for p in r["curve"]]
            colour, line = _style(r)
            label = _label(r)
            if r.get("stopped_at_step") is not None and r.get("wall_s"):
                # stopped by the time budget: carry the last accuracy to the stop
                label += f" (stopped at {float(r['wall_s']):.0f} s)"
                ts.append(float(r["wall_s"]))
                accs.append(accs[-1] if accs else 0.0)
            ax.plot(ts, accs, color=colour, linestyle=line, label=label, marker=".")
            if accs:
                low = min(low, max(0.0, 10 * (accs[-1] // 10) - 10))
            if r.get("stopped_at_step") is not None and ts:
                ax.plot(ts[-1:], accs[-1:], color=colour, marker="x", markersize=9)
            if r.get("tta_s") is not None:
                ax.axvline(float(r["tta_s"]), color=colour, alpha=0.35, linewidth=1)
            target = r.get("target_acc", target)
        if target is not None:
            ax.axhline(100 * float(target), color="black", linestyle=":", linewidth=1)
        ax.set_title(name)
        ax.set_xlabel("training time (s)")
        ax.set_ylabel("test accuracy (%)")
        ax.set_ylim(low, 100)
        ax.grid(True, alpha=0.3)
        if recs:
            ax.legend(fontsize="small", loc="lower right")
    for ax in list(axes.flat)[len(groups) :]:
        ax.set_visible(False)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return _save(fig, plt, path)


def _save(fig: Any, plt: Any, path: Path | str) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
