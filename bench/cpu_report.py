"""The CPU-bound rows of BENCHMARKS.md (issue "CPU on the testbed path").

    python bench/cpu_report.py bench/results/cpu

Reads unshaped.json (`dlcp bench allreduce --hosts 2 --rate none --scenario
clean --size 100MB --iters 10 --backends dlcp,gloo`), gbit1-clean.json
(`--hosts 3 --rate 1gbit --scenario clean --size 32MB --iters 20 --backends
dlcp,gloo`) and gbit1-congested.json (the same with `--scenario congested
--backends dlcp,gloo,gloo-prio`) and prints one markdown table: times, the
processes' and the machine's CPU seconds, whether each run was CPU-bound,
and the issue's targets beside the ratios. A missing file is a row that
says so.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

Rec = dict[str, Any]

# (file, label, p50 bar vs Gloo, CPU bar vs Gloo)
ROWS: list[tuple[str, str, float | None, float | None]] = [
    ("unshaped", "unshaped, 2 hosts, 100 MB", 1.0, None),
    ("gbit1-clean", "1 Gbit/s clean, 3 hosts, 32 MB", 1.05, 1.5),
    ("gbit1-congested", "1 Gbit/s congested, 3 hosts, 32 MB", None, None),
]


def _verdict(ratio: float, bar: float) -> str:
    return f"{ratio:.2f}x (<= {bar}): " + ("met" if ratio <= bar else "**not met**")


def _cell(r: Rec | None) -> str:
    if r is None:
        return "not run"
    if r.get("error") or r.get("p50_s") is None:
        return "failed"
    bound = {True: "cpu", False: "net"}.get(r.get("cpu_bound"), "-")  # type: ignore[arg-type]
    return (
        f"{r['p50_s']:.3f} / {r['p99_s']:.3f}; CPU {r['cpu_s']:.1f} s, "
        f"machine {r.get('machine_cpu_s', float('nan')):.1f} s; {bound}"
    )


def table(d: Path) -> list[str]:
    out = [
        "| run | dlcp p50 / p99 s; CPU; bound | Gloo | gloo-prio | targets |",
        "|---|---|---|---|---|",
    ]
    for name, label, p50_bar, cpu_bar in ROWS:
        path = d / f"{name}.json"
        if not path.exists():
            out.append(f"| {label} | not run | | | |")
            continue
        recs = {r["backend"]: r for r in json.loads(path.read_text())}
        dl, gl, gp = recs.get("dlcp"), recs.get("gloo"), recs.get("gloo-prio")
        verdicts = []
        if dl and gl and dl.get("p50_s") and gl.get("p50_s"):
            if p50_bar is not None:
                verdicts.append("p50 " + _verdict(dl["p50_s"] / gl["p50_s"], p50_bar))
            if cpu_bar is not None:
                verdicts.append("CPU " + _verdict(dl["cpu_s"] / gl["cpu_s"], cpu_bar))
                verdicts.append(f"machine CPU {dl['machine_cpu_s'] / gl['machine_cpu_s']:.2f}x")
        if gl and gl.get("cpu_bound"):
            verdicts.append("Gloo CPU-bound: not a network result")
        out.append(
            f"| {label} | {_cell(dl)} | {_cell(gl)} | {_cell(gp) if gp else '-'} "
            f"| {'; '.join(verdicts) or '-'} |"
        )
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    print("\n".join(table(Path(argv[0]))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
