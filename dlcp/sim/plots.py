"""Plots of simulated runs (matplotlib, headless)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["round_times", "scaling"]


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def round_times(recs: Sequence[dict[str, Any]], path: Path) -> None:
    """Each backend's round times in order."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for r in recs:
        ax.plot(r["times_s"], marker=".", label=f"{r['backend']} ({r['mode']})")
    ax.set_xlabel("round")
    ax.set_ylabel("round time, s (simulated)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def scaling(rows: Sequence[dict[str, Any]], path: Path, key: str = "p50_s") -> None:
    """`key` against hosts, a line per (backend, mode, scenario)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.5, 4))
    lines: dict[str, list[tuple[int, float]]] = {}
    for r in rows:
        loss = f" {r['loss_pct']}%" if r["scenario"] == "loss" else ""
        name = f"{r['mode']} {r['scenario']}{loss}"
        lines.setdefault(name, []).append((int(r["hosts"]), float(r[key])))
    for name, pts in sorted(lines.items()):
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("hosts")
    ax.set_ylabel(f"{key} (simulated)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
