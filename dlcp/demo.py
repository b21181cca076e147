"""`dlcp demo`: the main job. dlcp against Gloo on an emulated congested cluster.

On one machine, as root: builds a three-host cluster in network namespaces
(100 Mbit/s switch ports with dlcp's priority queues), fills every port with
background TCP and UDP traffic, trains the same small MLP on scikit-learn's
digits with Gloo, gloo-prio (Gloo with its packets marked into the switch's
top class), gloo-fp16 (DDP's fp16_compress_hook, the one line of PyTorch that
halves Gloo's bytes) and dlcp (real daemons, the DDP hook), prints a
side-by-side table with dlcp's ratio to each and what each ratio means,
writes a plot and the records, and removes everything. About three to four
minutes on two cores (a backend's training stops after 50 s: Gloo and
gloo-fp16 stall under this background and take the whole budget).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["demo_options", "register", "run"]

DEMO_NAME = "demo"

# What each of dlcp's ratios says (printed under it)
MEANING = {
    "gloo": "Gloo's TCP shares the switch's default queue with the background "
    "traffic, so this ratio is mostly what a priority class buys.",
    "gloo-prio": "gloo-prio is Gloo with its packets in the switch's top class: "
    "this ratio is what dlcp adds beyond priority (per-packet classes, bounded "
    "loss, no wait for the slowest packet).",
    "gloo-fp16": "gloo-fp16 is DDP's fp16_compress_hook over Gloo (half the bytes, "
    "unmarked): this ratio is dlcp against the compression PyTorch already gives.",
}
BASELINES = ("gloo", "gloo-prio", "gloo-fp16")


def register(sub: Any) -> None:
    p = sub.add_parser(
        "demo",
        help="dlcp vs Gloo on an emulated congested cluster (root)",
        description="Build an emulated 3-host cluster with background traffic on every "
        "link, train a small model on the digits data set with Gloo, gloo-prio (Gloo "
        "marked into the switch's top class), gloo-fp16 (DDP's fp16_compress_hook) and "
        "dlcp, print a side-by-side table and "
        "write a plot; everything is removed afterwards. Needs root (network "
        "namespaces); three to four minutes on two cores.",
    )
    p.add_argument("--out", type=Path, default=Path("dlcp-demo"), help="where the plot and "
                   "JSON go (default: ./dlcp-demo)")  # fmt: skip
    p.add_argument("--rate", default="100mbit", help="link rate (default: 100mbit)")
    p.add_argument("--steps", type=int, default=60, help="training steps (default: 60)")
    p.add_argument(
        "--scenario",
        default="congested",
        choices=("congested", "loss", "burst", "clean"),
        help="what disturbs the network: congested (background TCP and UDP on every "
        "port), loss (5%% random loss on every port), burst (300 ms of 50%% loss every "
        "2 s on one port) or clean (default: congested)",
    )
    p.add_argument(
        "--no-prio",
        action="store_true",
        help="skip gloo-prio (Gloo marked into the top class; about half a minute less)",
    )
    p.add_argument(
        "--no-fp16",
        action="store_true",
        help="skip gloo-fp16 (DDP's fp16_compress_hook; about a minute less)",
    )
    p.add_argument("--with-prio", action="store_true", help=argparse.SUPPRESS)  # the default now
    p.add_argument(
        "--budget",
        type=float,
        default=50.0,
        metavar="S",
        help="stop a backend's training after S seconds, keeping its curve "
        "(default: 50; Gloo under congestion needs far longer)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=run)


def demo_options(args: argparse.Namespace) -> Any:
    from dlcp.bench.cluster import Setup
    from dlcp.bench.common import parse_rate
    from dlcp.bench.train import TrainOptions

    backends = (
        ("gloo",)
        + (() if args.no_prio else ("gloo-prio",))
        + (() if args.no_fp16 else ("gloo-fp16",))
        + ("dlcp",)
    )
    return TrainOptions(
        setup=Setup(
            hosts=3,
            rate_bps=parse_rate(args.rate),
            scenario=args.scenario,
            loss_pct=5.0,
            name=DEMO_NAME,
        ),
        target_acc=0.90,
        backends=backends,
        steps=args.steps,
        hidden=(512, 256),
        lr=2e-3,
        eval_every=5,
        time_budget_s=args.budget,
        progress=not args.no_progress,
    )


def run(args: argparse.Namespace) -> int:
    from dlcp.bench.cluster import require_root_for_bench

    require_root_for_bench()  # one clear line before anything is built
    from dlcp.bench.plots import plot_tta
    from dlcp.bench.train import run_train, save

    opts = demo_options(args)
    started = time.monotonic()
    print(
        f"dlcp demo: {opts.setup.describe()}; training a {len(opts.hidden) + 1}-layer MLP on "
        f"digits with {', '.join(opts.backends)} ({opts.steps} steps each)",
        file=sys.stderr,
        flush=True,
    )
    records = run_train(opts)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    save(records, out / "demo.json")
    png = plot_tta(records, out / "demo.png", title=f"dlcp demo: {opts.setup.describe()}")
    print()
    print(side_by_side(records))
    print()
    print(f"plot: {png}   records: {out / 'demo.json'}   ({time.monotonic() - started:.0f} s)")
    return 1 if any(r.get("error") for r in records) else 0


def side_by_side(records: list[dict[str, Any]]) -> str:
    """The demo's table: one column per backend, and dlcp's speed-up."""
    from dlcp.bench.report import tta_speedup
    from dlcp.bench.train import format_table

    by = {r["backend"]: r for r in records}
    names = [b for b in (*BASELINES, "dlcp") if b in by]
    rows: list[tuple[str, list[str]]] = []

    def cell(r: dict[str, Any], key: str, fmt: str, scale: float = 1.0) -> str:
        if r.get("error"):
            return "failed"
        v = r.get(key)
        return "-" if v is None else format(float(v) * scale, fmt)

    target = records[0]["target_acc"] if records else 0.0

    def tta(r: dict[str, Any]) -> str:
        if r.get("tta_s") is None and r.get("wall_s") and not r.get("error"):
            return f"> {float(r['wall_s']):.0f}"
        return cell(r, "tta_s", ".1f")

    def steps(r: dict[str, Any]) -> str:
        done = r.get("stopped_at_step")
        return str(r.get("steps", "-")) if done is None else f"{done} (budget)"

    rows.append((f"time to {100 * target:g} % (s)", [tta(by[n]) for n in names]))
    rows.append(("steps trained", [steps(by[n]) for n in names]))
    rows.append(("training time (s)", [cell(by[n], "wall_s", ".1f") for n in names]))
    rows.append(("median step (s)", [cell(by[n], "step_p50_s", ".3f") for n in names]))
    rows.append(("final accuracy (%)", [cell(by[n], "final_acc", ".1f", 100) for n in names]))
    width = max(len(label) for label, _ in rows) + 2
    lines = [" " * width + "".join(f"{n:>12}" for n in names)]
    lines += [label.ljust(width) + "".join(f"{v:>12}" for v in vals) for label, vals in rows]
    d = by.get("dlcp")
    for name in BASELINES:
        value, bound = tta_speedup(by.get(name), d)
        if value is not None:
            more = f" (at least: {name} had not reached it when stopped)" if bound else ""
            lines.append(
                f"dlcp reaches {100 * target:g} % accuracy {value:.2f}x as fast as {name}{more}"
            )
            lines.append(f"  {MEANING[name]}")
    for r in records:
        if r.get("cpu_bound") and not r.get("error"):
            idle = 100 * float(r.get("idle_frac") or 0.0)
            lines.append(
                f"note: {r['backend']}'s run was CPU-bound (machine {idle:.0f} % idle): its "
                "time measures this machine's cores as much as the network"
            )
    failed = [r for r in records if r.get("error")]
    if failed:
        lines += ["", format_table(failed)]
    return "\n".join(lines)
