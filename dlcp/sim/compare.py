"""Tables of simulated runs. `python -m dlcp.sim.compare SIM.json BENCH.json
...` (pairs): p50 and p99 of dlcp and the ring against dlcp and Gloo of the
bench, with each ratio; `python -m dlcp.sim.compare --scale FILE...`: round
time against hosts, a row per record."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

__all__ = ["rows", "scale_table", "table"]

P50_BAR, P99_BAR = 0.15, 0.25


def _by(recs: list[dict[str, Any]], backend: str) -> dict[str, Any] | None:
    return next((r for r in recs if r.get("backend") == backend), None)


def rows(sim: Path, bench: Path) -> list[list[str]]:
    s, b = json.loads(sim.read_text()), json.loads(bench.read_text())
    out = []
    for mine, theirs in (("dlcp", "dlcp"), ("ring", "gloo")):
        a, t = _by(s, mine), _by(b, theirs)
        if a is None or t is None:
            continue
        scen = a["scenario"] + (f" {a['loss_pct']:g} %" if a["scenario"] == "loss" else "")
        r50, r99 = a["p50_s"] / t["p50_s"], a["p99_s"] / t["p99_s"]
        ok50 = "met" if abs(r50 - 1) <= P50_BAR else "**not met**"
        ok99 = "met" if abs(r99 - 1) <= P99_BAR else "**not met**"
        out.append([
            scen, f"{mine} / {theirs}", f"{a['p50_s']:.3f} / {t['p50_s']:.3f}",
            f"{r50:.2f} ({ok50})",
            f"{a['p99_s']:.3f} / {t['p99_s']:.3f}", f"{r99:.2f} ({ok99})",
            f"{100 * a.get('loss_frac', 0):.2f} % / {100 * t.get('loss_frac', 0):.2f} %",
            f"{a['iters']} / {t['iters']}",
        ])  # fmt: skip
    return out


def table(pairs: list[tuple[Path, Path]]) -> str:
    head = [
        "scenario", "sim / testbed", "p50 s", "p50 ratio (within 15 %)", "p99 s",
        "p99 ratio (within 25 %)", "lanes lost", "rounds",
    ]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for sim, bench in pairs:
        lines += ["| " + " | ".join(r) + " |" for r in rows(sim, bench)]
    return "\n".join(lines)


def scale_table(files: list[Path]) -> str:
    """Round time against hosts: a row per run record of `files`."""
    recs = [r for f in files for r in json.loads(f.read_text())]
    recs.sort(key=lambda r: (r["scenario"], r["mode"], r["hosts"]))
    head = ["scenario", "mode", "hosts", "p50 s", "p99 s", "lanes lost", "drops per class"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in recs:
        scen = r["scenario"] + (f" {r['loss_pct']:g} %" if r["scenario"] == "loss" else "")
        drops = ",".join(str(d) for d in r["drops_per_class"])
        lines.append(
            f"| {scen} | {r['mode']} | {r['hosts']} | {r['p50_s']:.4f} | {r['p99_s']:.4f} | "
            f"{100 * r.get('loss_frac', 0):.2f} % | {drops} |"
        )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if argv[:1] == ["--scale"]:
        print(scale_table([Path(a) for a in argv[1:]]))
        return 0
    if len(argv) % 2 or not argv:
        print("usage: python -m dlcp.sim.compare SIM.json BENCH.json [...]", file=sys.stderr)
        return 2
    paths = [Path(a) for a in argv]
    print(table(list(zip(paths[::2], paths[1::2], strict=True))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
