"""The open issues' targets against benchmark records: BENCHMARKS.md's first tables.

    dlcp bench report bench/results/net200 bench/results/cpu

Reads the JSON of `dlcp bench allreduce|train --json` (or a `dlcp bench all`
directory). One file, or one "run" within a file, is one invocation, and
every ratio compares dlcp with Gloo, gloo-prio or another baseline of the
same invocation; "baseline" is the fastest PyTorch baseline there whose
accuracy is no worse (`dlcp.bench.fair`), shown beside each row. A row is
matched by what its records measured (all-reduce or training, link
rate, hosts, scenario, loss), never by a file's name; when several
invocations match, the last one read counts.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dlcp.bench.fair import fastest_fair, kind

__all__ = [
    "CPU_ROWS",
    "HOOK_ROWS",
    "NET_ROWS",
    "OTHER_ROWS",
    "Bar",
    "Row",
    "load",
    "markdown",
    "verdicts",
]

Rec = dict[str, Any]
Invocation = list[Rec]

MBIT = 1_000_000


@dataclass(frozen=True)
class Bar:
    """dlcp's `key` over `against`'s `key` (or over dlcp's own `over`; or,
    `absolute`, itself) at most `limit`. `against` "baseline": the fastest
    baseline of the invocation whose accuracy is no worse (dlcp.bench.fair)."""

    label: str
    key: str
    limit: float
    against: str = "gloo"
    over: str | None = None  # a key of dlcp's own record (a spread such as p99/p50)
    absolute: bool = False


@dataclass(frozen=True)
class Row:
    label: str
    kind: str  # "allreduce", "train" or "ddp"
    rate_bps: int | None
    hosts: int
    scenario: str
    bars: tuple[Bar, ...]
    loss_pct: float = 0.0
    max_lost: float | None = None  # dlcp's loss_frac (lanes left out of the sums)
    codec: str = "fp32"  # dlcp's


_SPREAD = Bar("p99/p50", "p99_s", 1.25, over="p50_s")
_TRAIN = (
    Bar("TTA", "tta_s", 0.8),
    Bar("TTA", "tta_s", 1.0, against="gloo-prio"),
)

# "Network-bound links": `dlcp bench allreduce --hosts 3 --rate 200mbit
# --scenario S --size 10MB --iters 40 --codec fp32 --backends
# dlcp,gloo,gloo-prio`, and `dlcp bench train` under loss 5 % and bursts.
NET_ROWS: tuple[Row, ...] = (
    Row(
        "clean", "allreduce", 200 * MBIT, 3, "clean",
        (Bar("p50", "p50_s", 1.05), Bar("p99", "p99_s", 1.10), _SPREAD),
        max_lost=0.001,
    ),
    Row("loss 1 %", "allreduce", 200 * MBIT, 3, "loss", (Bar("p99", "p99_s", 0.8), _SPREAD), 1.0),
    Row("loss 5 %", "allreduce", 200 * MBIT, 3, "loss", (Bar("p99", "p99_s", 0.65), _SPREAD), 5.0),
    Row(
        "burst", "allreduce", 200 * MBIT, 3, "burst",
        (Bar("p99", "p99_s", 0.6), Bar("p99", "p99_s", 0.8, against="gloo-prio"), _SPREAD),
    ),
    Row(
        "congested", "allreduce", 200 * MBIT, 3, "congested",
        (
            Bar("p50", "p50_s", 1.05, against="gloo-prio"),
            Bar("p99", "p99_s", 1.05, against="gloo-prio"),
            _SPREAD,
        ),
    ),
    Row("train, loss 5 %", "train", 200 * MBIT, 3, "loss", _TRAIN, 5.0),
    Row("train, burst", "train", 200 * MBIT, 3, "burst", _TRAIN),
)  # fmt: skip

# "CPU on the testbed path": unshaped 2 hosts 100 MB; 1 Gbit/s 3 hosts 32 MB.
CPU_ROWS: tuple[Row, ...] = (
    Row("unshaped, 2 hosts", "allreduce", None, 2, "clean", (Bar("p50", "p50_s", 1.0),)),
    Row(
        "1 Gbit/s clean, 3 hosts", "allreduce", 1000 * MBIT, 3, "clean",
        (Bar("p50", "p50_s", 1.05), Bar("CPU", "cpu_s", 1.5)),
    ),
    Row("1 Gbit/s congested, 3 hosts", "allreduce", 1000 * MBIT, 3, "congested", ()),
)  # fmt: skip

# "Path failure": `dlcp bench allreduce --hosts 3 --rate 200mbit --scenario
# pathdown --size 10MB` (the worst round against dlcp's own median), and a
# DDP training (thc8) whose host 0 loses a port for good (`dlcp bench train
# --scenario pathdown --down-for 0 --codec thc8`): the median of the 20 steps
# after the cut against the 20 before. "DDP step time": `dlcp bench ddp
# --hosts 2 --rate none --grad-size 50MB`, the step's p50 against Gloo's.
OTHER_ROWS: tuple[Row, ...] = (
    Row(
        "path down, all-reduce", "allreduce", 200 * MBIT, 3, "pathdown",
        (Bar("worst/p50", "max_s", 3.0, over="p50_s"),),
    ),
    Row(
        "path down, DDP thc8", "train", 200 * MBIT, 3, "pathdown",
        (Bar("steps after/before cut", "cut_median_after_s", 1.3, over="cut_median_before_s"),
         Bar("longest step after cut, s", "cut_max_after_s", 3.0, absolute=True)),
        codec="thc8",
    ),
    Row("DDP step, 2 hosts unshaped, 50 MB", "ddp", None, 2, "clean", (Bar("p50", "p50_s", 1.2),)),
)  # fmt: skip


# "Faster than what PyTorch already gives": `dlcp bench ddp --hosts 3 --rate
# 200mbit --grad-size 10MB --steps 30 --codec C --loss-bound 0.01 --backends
# dlcp,gloo,gloo-fp16 [--scenario loss --loss 5]`, and `dlcp bench train
# --hosts 3 --rate 200mbit --scenario loss --loss 5 --codec C --backends
# dlcp,gloo,gloo-fp16` (the best of fp16 and thc8 counts).
_FP16 = "gloo-fp16"
HOOK_ROWS: tuple[Row, ...] = (
    Row("DDP fp16, clean", "ddp", 200 * MBIT, 3, "clean",
        (Bar("p50", "p50_s", 1.05, against=_FP16),), codec="fp16"),
    Row("DDP thc8, clean", "ddp", 200 * MBIT, 3, "clean",
        (Bar("p50", "p50_s", 0.7, against=_FP16),), codec="thc8"),
    Row("DDP fp32, clean", "ddp", 200 * MBIT, 3, "clean", (Bar("p50", "p50_s", 1.05),)),
    Row("DDP fp16, loss 5 %", "ddp", 200 * MBIT, 3, "loss",
        (Bar("p50", "p50_s", 0.8, against=_FP16),), 5.0, codec="fp16"),
    Row("DDP fp32, loss 5 %", "ddp", 200 * MBIT, 3, "loss", (Bar("p50", "p50_s", 0.8),), 5.0),
    Row("train fp16, loss 5 %", "train", 200 * MBIT, 3, "loss",
        (Bar("TTA", "tta_s", 0.8, against=_FP16),), 5.0, codec="fp16"),
    Row("train thc8, loss 5 %", "train", 200 * MBIT, 3, "loss",
        (Bar("TTA", "tta_s", 0.8, against=_FP16),), 5.0, codec="thc8"),
)  # fmt: skip


def load(paths: Iterable[Path]) -> list[Invocation]:
    """The invocations in these JSON files and directories (every *.json in
    a directory, in name order): one per file, or one per "run" number."""
    out: list[Invocation] = []
    for path in paths:
        files = sorted(path.glob("*.json")) if path.is_dir() else [path]
        for f in files:
            data = json.loads(f.read_text())
            if not isinstance(data, list):
                continue
            recs = [r for r in data if isinstance(r, dict) and "backend" in r]
            runs: dict[Any, Invocation] = {}
            for r in recs:
                runs.setdefault(r.get("run"), []).append(r)
            out += runs.values()
    return out


_kind = kind


def _matches(row: Row, r: Rec) -> bool:
    return (
        _kind(r) == row.kind
        and r.get("rate_bps") == row.rate_bps
        and r.get("hosts") == row.hosts
        and r.get("scenario") == row.scenario
        and abs(float(r.get("loss_pct") or 0.0) - row.loss_pct) < 1e-9
        and (r.get("codec", "fp32") == row.codec or not r["backend"].startswith("dlcp"))
    )


def find(row: Row, invocations: Sequence[Invocation]) -> dict[str, Rec] | None:
    """The backends' records of the last invocation whose dlcp record fits
    `row` and did not fail (the others' may have: they show as failed)."""
    for inv in reversed(invocations):
        by = {r["backend"]: r for r in inv if _matches(row, r)}
        if "dlcp" in by and not by["dlcp"].get("error"):
            return by
    return None


def _mark(ok: bool) -> str:
    return "met" if ok else "**not met**"


def verdicts(row: Row, by: dict[str, Rec]) -> list[str]:
    """Each bar of `row` on these records: `label ratio (<= limit): met`."""
    dl = by["dlcp"]
    out = []
    for bar in row.bars:
        if bar.over or bar.absolute:
            base: Rec | None = dl
        elif bar.against == "baseline":
            base = fastest_fair(dl, list(by.values()))
        else:
            base = by.get(bar.against)
        x, y = dl.get(bar.key), None if base is None else base.get(bar.over or bar.key)
        if bar.absolute:
            y = 1.0 if x is not None else None
        name = bar.label if bar.over or bar.absolute else f"{bar.label} vs {bar.against}"
        if bar.against == "baseline" and base is not None:
            name += f" ({base['backend']})"
        if x is None or not y:
            why = "not run" if base is None else "failed" if base.get("error") else "no value"
            out.append(f"{name}: {why}")
            continue
        ratio = float(x) / float(y)
        shown = f"{ratio:.2f}"
        if (float(shown) <= bar.limit) != (ratio <= bar.limit):  # rounding hides the miss
            shown = f"{ratio:.4f}"
        out.append(f"{name} {shown} (<= {bar.limit:g}): {_mark(ratio <= bar.limit)}")
    if row.max_lost is not None:
        lost = float(dl.get("loss_frac") or 0.0)
        out.append(f"lost {lost:.2%} (<= {row.max_lost:.1%}): {_mark(lost <= row.max_lost)}")
    if (by.get("gloo") or {}).get("cpu_bound"):
        out.append("Gloo CPU-bound: not a network result")
    if row.kind == "train" and "gloo" in by:
        a, b = dl.get("final_acc"), by["gloo"].get("final_acc")
        if a is not None and b is not None:
            gap = (float(b) - float(a)) * 100
            out.append(f"accuracy {gap:+.1f} points below Gloo (<= 0.5): {_mark(gap <= 0.5)}")
    return out


def _bound(r: Rec | None) -> str:
    if r is None or r.get("cpu_bound") is None:
        return "-"
    return "cpu" if r["cpu_bound"] else "net"


def _times(r: Rec | None) -> str:
    if r is None:
        return "not run"
    if r.get("error") or r.get("p50_s") is None:
        return "failed"
    return f"{r['p50_s']:.3f} / {r['p99_s']:.3f}"


def _tta(r: Rec | None) -> str:
    if r is None:
        return "not run"
    if r.get("error"):
        return "failed"
    tta, acc = r.get("tta_s"), r.get("final_acc")
    text = "not reached" if tta is None else f"{tta:.1f}"
    return f"{text} ({acc:.3f})" if acc is not None else text


def _cpu(r: Rec | None) -> str:
    if r is None or r.get("cpu_s") is None:
        return "-"
    return f"{r['cpu_s']:.1f} / {r.get('machine_cpu_s', float('nan')):.1f}"


def _fair(by: dict[str, Rec]) -> str:
    """The fastest baseline with no worse accuracy: its name and its figures."""
    base = fastest_fair(by["dlcp"], list(by.values()))
    if base is None:
        return "none"
    if kind(base) == "train":
        return f"{base['backend']}: TTA {_tta(base)}"
    return f"{base['backend']}: {_times(base)}"


def _allreduce_line(row: Row, by: dict[str, Rec]) -> str:
    dl, gl, gp = by["dlcp"], by.get("gloo"), by.get("gloo-prio")
    lost = float(dl.get("loss_frac") or 0.0)
    cells = [
        row.label,
        _times(dl),
        _times(gl),
        _times(gp),
        _fair(by),
        f"{lost:.2%}",
        f"{_cpu(dl)}; {_cpu(gl)}",
        ", ".join(_bound(r) for r in (dl, gl, gp)),
        "; ".join(verdicts(row, by)) or "-",
    ]
    return "| " + " | ".join(cells) + " |"


def _table(rows: Sequence[Row], invocations: Sequence[Invocation]) -> list[str]:
    out = [
        "| run | dlcp p50 / p99 s | Gloo | gloo-prio | fastest baseline, accuracy no worse "
        "| dlcp lanes lost | CPU s, process / machine (dlcp; Gloo) "
        "| CPU-bound (dlcp, Gloo, prio) | targets |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        by = find(row, invocations)
        if by is None:
            out.append(f"| {row.label} | not run | | | | | | | |")
        elif row.kind == "train":
            dl, gl, gp = by["dlcp"], by.get("gloo"), by.get("gloo-prio")
            bound = ", ".join(_bound(r) for r in (dl, gl, gp))
            verdict = "; ".join(verdicts(row, by))
            out.append(
                f"| {row.label} | TTA {_tta(dl)} | {_tta(gl)} | {_tta(gp)} | {_fair(by)} | "
                f"{float(dl.get('loss_frac') or 0.0):.2%} | {_cpu(dl)}; {_cpu(gl)} "
                f"| {bound} | {verdict} |"
            )
        else:
            out.append(_allreduce_line(row, by))
    return out


def markdown(invocations: Sequence[Invocation]) -> str:
    """Both tables: network-bound (200 Mbit/s) and CPU (1 Gbit/s, unshaped)."""
    return "\n".join(
        [
            "Network-bound, 200 Mbit/s (times in s; training: time to accuracy, final accuracy):",
            "",
            *_table(NET_ROWS, invocations),
            "",
            "CPU on the testbed path (the CPU, not the link, is part of these results):",
            "",
            *_table(CPU_ROWS, invocations),
            "",
            "Path failure and DDP steps:",
            "",
            *_table(OTHER_ROWS, invocations),
            "",
            "Against PyTorch's own compression (DDP's fp16_compress_hook over Gloo):",
            "",
            *_table(HOOK_ROWS, invocations),
        ]
    )
