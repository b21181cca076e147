"""The network-bound table of BENCHMARKS.md, from the JSON of the issue's commands.

    python bench/net200_report.py bench/results/net200

Reads clean.json, loss1.json, loss5.json, burst.json, congested.json (each one
`dlcp bench allreduce --hosts 3 --rate 200mbit --scenario S [--loss P] --size
10MB --iters 40 --codec fp32 --backends dlcp,gloo,gloo-prio`) and
train-loss5.json, train-burst.json (`dlcp bench train ... --backends
dlcp,gloo,gloo-prio`) from the directory, and prints the markdown tables with
the issue's targets beside the measured ratios (all from one invocation
each). A missing file is a row that says so.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

Rec = dict[str, Any]

# (file, label, [(ratio name, measured key, against, limit)])
SCENARIOS: list[tuple[str, str, list[tuple[str, str, str, float]]]] = [
    ("clean", "clean", [("p50", "p50_s", "gloo", 1.05), ("p99", "p99_s", "gloo", 1.10)]),
    ("loss1", "loss 1 %", [("p99", "p99_s", "gloo", 0.80)]),
    ("loss5", "loss 5 %", [("p99", "p99_s", "gloo", 0.65)]),
    ("burst", "burst", [("p99", "p99_s", "gloo", 0.60), ("p99", "p99_s", "gloo-prio", 0.80)]),
    (
        "congested",
        "congested",
        [("p50", "p50_s", "gloo-prio", 1.05), ("p99", "p99_s", "gloo-prio", 1.05)],
    ),
]
TRAININGS = [("train-loss5", "loss 5 %"), ("train-burst", "burst")]
SPREAD = 1.25  # dlcp's own p99/p50, every scenario
LOST = 0.001  # lanes lost on the clean link


def _load(path: Path) -> dict[str, Rec]:
    if not path.exists():
        return {}
    return {r["backend"]: r for r in json.loads(path.read_text())}


def _s(r: Rec | None, key: str) -> str:
    v = None if r is None else r.get(key)
    return "failed" if v is None else f"{v:.3f}"


def _mark(ok: bool) -> str:
    return "met" if ok else "**not met**"


def allreduce_table(d: Path) -> list[str]:
    out = [
        "| scenario | dlcp p50 / p99 s | Gloo p50 / p99 s | gloo-prio p50 / p99 s "
        "| dlcp lanes lost | dlcp p99/p50 | CPU-bound (dlcp, Gloo, prio) "
        "| targets (ratio, bar: verdict) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, label, targets in SCENARIOS:
        recs = _load(d / f"{name}.json")
        dl = recs.get("dlcp")
        if dl is None:
            out.append(f"| {label} | not run | | | | | | |")
            continue
        gl, gp = recs.get("gloo"), recs.get("gloo-prio")
        verdicts = []
        for what, key, base_name, limit in targets:
            base = recs.get(base_name)
            b = None if base is None else base.get(key)
            if not b:
                verdicts.append(f"{what} vs {base_name}: {base_name} failed, no ratio")
                continue
            ratio = dl[key] / b
            verdict = _mark(ratio <= limit)
            verdicts.append(f"{what} vs {base_name} {ratio:.2f} (<= {limit}): {verdict}")
        spread = dl["p99_s"] / dl["p50_s"]
        verdicts.append(f"p99/p50 {spread:.2f} (<= {SPREAD}): {_mark(spread <= SPREAD)}")
        lost = dl.get("loss_frac") or 0.0
        if name == "clean":
            verdicts.append(f"lost {lost:.2%} (<= {LOST:.1%}): {_mark(lost <= LOST)}")
        out.append(
            f"| {label} | {_s(dl, 'p50_s')} / {_s(dl, 'p99_s')} | {_s(gl, 'p50_s')} / "
            f"{_s(gl, 'p99_s')} | {_s(gp, 'p50_s')} / {_s(gp, 'p99_s')} | {lost:.2%} "
            f"| {spread:.2f} | {', '.join(_bound(r) for r in (dl, gl, gp))} "
            f"| {'; '.join(verdicts)} |"
        )
    return out


def _bound(r: Rec | None) -> str:
    """cpu / net from the record's cpu_bound (dlcp.bench.cpuload); - when not measured."""
    if r is None or r.get("cpu_bound") is None:
        return "-"
    return "cpu" if r["cpu_bound"] else "net"


def train_table(d: Path) -> list[str]:
    out = [
        "| scenario | dlcp TTA s (final acc) | Gloo | gloo-prio | CPU-bound (dlcp, Gloo, prio) "
        "| targets |",
        "|---|---|---|---|---|---|",
    ]
    for name, label in TRAININGS:
        recs = _load(d / f"{name}.json")
        dl, gl, gp = recs.get("dlcp"), recs.get("gloo"), recs.get("gloo-prio")
        if dl is None:
            out.append(f"| {label} | not run | | | | |")
            continue

        def cell(r: Rec | None) -> str:
            if r is None:
                return "not run"
            tta = r.get("tta_s")
            acc = r.get("final_acc")
            t = "not reached" if tta is None else f"{tta:.1f}"
            return f"{t} ({acc:.3f})" if acc is not None else t

        verdicts = []
        for base, limit in ((gl, 0.8), (gp, 1.0)):
            if base is None or dl.get("tta_s") is None or base.get("tta_s") is None:
                verdicts.append("no ratio")
                continue
            ratio = dl["tta_s"] / base["tta_s"]
            verdict = _mark(ratio <= limit)
            verdicts.append(f"vs {base['backend']} {ratio:.2f} (<= {limit}): {verdict}")
        if gl is not None and dl.get("final_acc") is not None and gl.get("final_acc") is not None:
            gap = (gl["final_acc"] - dl["final_acc"]) * 100
            verdicts.append(f"accuracy {gap:+.1f} points below Gloo (<= 0.5): {_mark(gap <= 0.5)}")
        bound = ", ".join(_bound(r) for r in (dl, gl, gp))
        out.append(
            f"| {label} | {cell(dl)} | {cell(gl)} | {cell(gp)} | {bound} | {'; '.join(verdicts)} |"
        )
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    d = Path(argv[0])
    print("\n".join([*allreduce_table(d), "", *train_table(d)]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
