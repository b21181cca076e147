"""`dlcp bench allreduce|train|ddp|all|report`: dlcp against Gloo on an emulated cluster.

Every bench builds its own testbed (network namespaces; needs root), runs
every requested backend on it in the same invocation, and removes it. This
module defines the arguments and runs the benches; `dlcp.bench.options` turns
parsed arguments into each bench's options.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dlcp.bench import ddp_cli, report_cli
from dlcp.bench.backends import help_text
from dlcp.bench.common import (
    CODECS,
    SCENARIOS,
    BenchError,
    parse_backends,
)
from dlcp.bench.ddp_cli import ddp_options
from dlcp.bench.options import allreduce_options, setup_from_args, suite_options, train_options

__all__ = [
    "allreduce_options",
    "ddp_options",
    "register",
    "setup_from_args",
    "suite_options",
    "train_options",
]


def register(sub: Any) -> None:
    parser = sub.add_parser(
        "bench",
        help="benchmarks against Gloo on an emulated cluster (root)",
        description="dlcp against Gloo and gloo-prio on an emulated cluster in network "
        "namespaces (needs root). Each bench builds its own testbed and removes it.",
    )
    actions = parser.add_subparsers(dest="bench_command", metavar="BENCH")
    actions.required = True

    ar = actions.add_parser(
        "allreduce",
        help="all-reduce latency percentiles",
        description="All-reduce a float32 buffer K times with every backend on the same "
        "emulated cluster; per-iteration times, p50/p99, bus bandwidth, CPU.",
    )
    _cluster_args(ar, rate="1gbit", bench="allreduce")
    ar.add_argument("--size", default="32MB", help="buffer size (default: %(default)s)")
    ar.add_argument("--iters", type=int, default=20, help="timed iterations (default: 20)")
    ar.add_argument("--warmup", type=int, default=2, help="untimed first iterations (default: 2)")
    ar.add_argument(
        "--bucket",
        default="0",
        help="dlcp submits the buffer in buckets of this size, all at once, as DDP "
        "does; 0 for one bucket (default: %(default)s)",
    )
    ar.add_argument(
        "--no-check", action="store_true", help="do not check dlcp's results against exact sums"
    )
    ar.add_argument(
        "--budget",
        type=float,
        default=None,
        metavar="S",
        help="stop a backend still running S seconds after its workers started: its record "
        "gets error and stopped=budget, and the bench goes on (default: 60 s plus, per "
        "iteration, the larger of 2 s and 2 x hosts x size at the link rate)",
    )
    _common_args(ar, default_json=None)
    ar.set_defaults(func=_allreduce)

    tr = actions.add_parser(
        "train",
        help="time to accuracy of a real model",
        description="Train a model with DDP, one rank per host, same seed for every "
        "backend; time until it reaches its target (--target). Models (--model), all "
        "offline: mlp, an MLP on scikit-learn's 8x8 digits (1.09M parameters; target "
        "test accuracy 0.90, Adam); cnn, a CNN on the digits upsampled to 16x16 (0.62M "
        "parameters; target test accuracy 0.95, Adam); gpt, a byte-level transformer "
        "(0.83M parameters, 64 bytes of context) on this Python's standard library "
        "sources, the last tenth held out (target validation loss 3.0 nats a byte, "
        "AdamW). tta_s in the JSON is the time to the target.",
    )
    _cluster_args(tr, rate="100mbit", bench="train", codecs=(*CODECS, "auto"))
    tr.add_argument("--model", choices=("mlp", "cnn", "gpt"), default="mlp", help="(default: mlp)")
    tr.add_argument(
        "--target",
        "--target-acc",
        dest="target_acc",
        type=float,
        default=None,
        help="target test accuracy (mlp 0.90, cnn 0.95) or validation loss (gpt 3.0): "
        "the model's by default",
    )
    tr.add_argument(
        "--overlap",
        choices=("on", "off"),
        default="off",
        help="on: the dlcp backends' optimizer runs through dlcp.overlap, layer by layer "
        "in the next forward (dlcp-nooverlap: the same without; default: off)",
    )
    tr.add_argument(
        "--fsdp",
        action="store_true",
        help="FSDP2 (fully_shard, each block a unit) instead of DDP: dlcp runs as the "
        "process group's backend (init_process_group's 'cpu:dlcp'), Gloo as its own",
    )
    tr.add_argument("--steps", type=int, default=80, help="training steps (default: 80)")
    tr.add_argument("--batch", type=int, default=None, help="batch per rank (default: 32; gpt: 4)")
    tr.add_argument(
        "--lr",
        type=float,
        default=None,
        help="learning rate (default: mlp 2e-3, cnn 1e-3, gpt 2e-3)",
    )
    tr.add_argument(
        "--hidden",
        default="512,512,512,512,512",
        help="MLP hidden widths (default: %(default)s: 1.09M parameters)",
    )
    tr.add_argument("--seed", type=int, default=0, help="seed of every backend (default: 0)")
    tr.add_argument("--eval-every", type=int, default=5, help="steps between evaluations")
    tr.add_argument("--bucket-mb", type=float, default=1.0, help="DDP bucket_cap_mb (default: 1)")
    tr.add_argument(
        "--budget",
        type=float,
        default=None,
        metavar="S",
        help="stop each backend after S seconds of training, keeping its curve (a target "
        "not reached by then counts as TTA > S)",
    )
    tr.add_argument(
        "--control-dscp",
        default="cs6",
        help="DSCP of the dlcp backend's process-group TCP (the shim's rendezvous and "
        "per-step agreement), dlcp's control class; 'none' leaves it unmarked "
        "(default: %(default)s)",
    )
    _common_args(tr, default_json=None)
    tr.set_defaults(func=_train)

    dd = actions.add_parser(
        "ddp",
        help="DDP step time with dlcp's hook and with Gloo's default hook",
        description="Train an MLP of --grad-size of fp32 gradients with DDP, one rank per "
        "host, with dlcp's communication hook and with DDP's own hooks over Gloo (default "
        "all-reduce, fp16, bf16, PowerSGD), steps alternated on the same emulated cluster; "
        "step times, p50/p99, CPU, and where dlcp's buckets spent their time (the shim's "
        "timeline).",
    )
    ddp_cli.add_args(dd, backends=_backends_arg, scenario=_scenario_args)
    _common_args(dd, default_json=None)
    dd.set_defaults(func=_ddp)

    al = actions.add_parser(
        "all",
        help="every scenario, backend and ablation; JSON, plots, summary",
        description="All-reduce (clean, thc8, 1%% and 5%% loss, bursts, congestion, two "
        "paths, with ablations) at each --rates, and time to accuracy (clean, 5%% loss, "
        "congestion). Writes JSON, PNG plots and summary.md into --out. Takes about "
        "two hours on 2 cores; --quick takes about 20 minutes.",
    )
    al.add_argument("--out", required=True, type=Path, help="output directory")
    al.add_argument("--hosts", type=int, default=3, help="hosts (default: 3)")
    al.add_argument(
        "--rates", default="1gbit,200mbit", help="all-reduce link rates (default: %(default)s)"
    )
    al.add_argument("--train-rate", default="100mbit", help="train link rate (default: 100mbit)")
    al.add_argument("--size", default="32MB", help="all-reduce buffer (default: 32MB)")
    al.add_argument("--iters", type=int, default=20, help="all-reduce iterations (default: 20)")
    al.add_argument("--steps", type=int, default=80, help="training steps (default: 80)")
    al.add_argument(
        "--budget",
        type=float,
        default=300.0,
        metavar="S",
        help="stop a backend's training after S seconds (default: 300; Gloo under "
        "congestion at 100 Mbit/s would take half an hour)",
    )
    al.add_argument("--loss-bound", type=float, default=0.05, help="dlcp loss bound")
    al.add_argument("--mtu", type=int, default=1500, help="link MTU (default: 1500)")
    _pacing_arg(al)
    al.add_argument(
        "--only", choices=("allreduce", "train"), default=None, help="run one half only"
    )
    al.add_argument("--no-ablations", action="store_true", help="skip the dlcp ablations")
    al.add_argument(
        "--quick",
        action="store_true",
        help="8MB, 8 iterations, the first rate only, 60 training steps: a smoke run of everything",
    )
    al.add_argument("--logs", action="store_true", help="keep daemon and worker logs in OUT/logs")
    al.add_argument("--no-progress", action="store_true", help="no progress bars")
    al.set_defaults(func=_all)

    rp = actions.add_parser(
        "report",
        help="the issues' targets against benchmark JSON (BENCHMARKS.md's first tables)",
        description="Print the open issues' targets beside what the records measured: "
        "the network-bound table (200 Mbit/s, 3 hosts: clean, loss 1 %%, loss 5 %%, burst, "
        "congested, two trainings) and the CPU table (unshaped 2 hosts, 1 Gbit/s). Reads "
        "the JSON that `dlcp bench allreduce|train --json` wrote (files, or directories of "
        "them); each file is one invocation and every ratio is within one. A `dlcp bench "
        "all` directory also gets its plots and summary.md redrawn.",
    )
    rp.add_argument("paths", type=Path, nargs="+", help="JSON files or directories of them")
    rp.set_defaults(func=report_cli.run)


def _backends_arg(text: str) -> list[str]:
    try:
        return parse_backends(text)
    except BenchError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _cluster_args(
    p: argparse.ArgumentParser, *, rate: str, bench: str, codecs: tuple[str, ...] = CODECS
) -> None:
    p.add_argument("--hosts", type=int, default=3, help="emulated hosts (default: 3)")
    p.add_argument(
        "--rate",
        default=rate,
        help=f"switch port rate, e.g. 1gbit, 200mbit, none (default: {rate})",
    )
    _scenario_args(p, SCENARIOS)
    p.add_argument(
        "--down-at",
        type=float,
        default=4.0,
        metavar="S",
        help="for --scenario pathdown: seconds into each backend's run (default: 4)",
    )
    p.add_argument(
        "--down-for",
        type=float,
        default=6.0,
        metavar="S",
        help="for --scenario pathdown: seconds the port stays down; 0: until the run "
        "ends (default: 6)",
    )
    p.add_argument(
        "--down-path",
        type=int,
        default=0,
        metavar="P",
        help="for --scenario pathdown: the path whose port on host 0 goes down (default: "
        "0, the one Gloo uses)",
    )
    p.add_argument("--codec", choices=codecs, default="fp32", help="dlcp's codec (default: fp32)")
    p.add_argument(
        "--backends", default="dlcp,gloo,gloo-prio", type=_backends_arg, help=help_text(bench)
    )
    p.add_argument(
        "--loss-bound",
        type=float,
        default=None,
        help="dlcp's loss bound, the fraction of a bucket that may be lost (default: 0.05; "
        "0 in --mode ps: parameter servers sum exactly, as BytePS's do; 0 with train's --fsdp)",
    )
    p.add_argument("--mtu", type=int, default=1500, help="link MTU (default: 1500)")
    _pacing_arg(p)
    p.add_argument(
        "--mode",
        choices=("transpose", "switch", "ps"),
        default="transpose",
        help="dlcp's all-reduce: transpose = host to host (each host sums a shard); "
        "switch = summed in the switch (the testbed gets an aggregator daemon there, "
        "`dlcp testbed up --switch-aggregator`): each host sends its buckets once up "
        "and receives the sums once down; ps = summed by parameter servers (--servers, "
        "--colocate) (default: transpose)",
    )
    p.add_argument(
        "--servers",
        type=int,
        default=None,
        metavar="N",
        help="--mode ps: N dedicated parameter servers, testbed hosts of their own after "
        "the --hosts training hosts, with daemons and no ranks; 0: none, the training "
        "hosts aggregate (co-located) (default: 1)",
    )
    p.add_argument(
        "--colocate",
        action="store_true",
        help="--mode ps: the training hosts aggregate too, beside the --servers",
    )
    p.add_argument("--name", default=None, help="testbed name (default: bench-<pid>)")


def _scenario_args(p: argparse.ArgumentParser, choices: tuple[str, ...]) -> None:
    """--scenario (of `choices`) and --loss."""
    what = {
        "clean": "clean",
        "loss": "loss: --loss %% random loss on every switch port",
        "burst": "burst: 300 ms of 50%% loss every 2 s on one port",
        "congested": "congested: TCP + UDP background on every port (on 2 cores its "
        "background saturates the CPU above 200mbit: `bench all` runs it at 200mbit only)",
        "multipath": "multipath: two paths (Gloo on both interfaces, GLOO_SOCKET_IFNAME=eth0,eth1)",
        "pathdown": "pathdown: two paths, and 4 s into each backend's run host 0's port on "
        "path 0 goes down for 6 s",
    }
    p.add_argument(
        "--scenario",
        choices=choices,
        default="clean",
        help="; ".join(what[c] for c in choices) + " (default: clean)",
    )
    p.add_argument("--loss", type=float, default=1.0, metavar="PCT", help="for --scenario loss")


def _pacing_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--pacing",
        choices=("link", "share"),
        default="link",
        help="dlcp's pacing: link = the daemon's own (its link rate configured; each "
        "peer paced by AIMD up to the link over the hosts that send to it); share = "
        "that share also as the floor and start, for diagnosis (default: link)",
    )


def _common_args(p: argparse.ArgumentParser, *, default_json: str | None) -> None:
    p.add_argument(
        "--json",
        type=Path,
        default=default_json,
        help="write the records here; each has cpu_bound (true: the machine was under "
        "10%% idle or a process waited for a CPU over half the run: not a network "
        "result), idle_frac, runq_wait_frac and machine_cpu_s",
    )
    p.add_argument(
        "--stall",
        type=float,
        default=120.0,
        metavar="S",
        help="stop a backend whose workers, once they have all joined, report nothing (a "
        "warm-up's end, a finished round or step) for S seconds: its record gets error and "
        "stopped=stall, and the bench goes on with the next backend (default: 120, two "
        "round timeouts)",
    )
    p.add_argument("--plot", type=Path, default=None, help="write a PNG plot here")
    p.add_argument("--logs", type=Path, default=None, help="keep daemon and worker logs here")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def _finish(records: list[dict[str, Any]]) -> int:
    failed = [r for r in records if r.get("error")]
    for r in failed:
        first = str(r["error"]).splitlines()[0]
        print(f"dlcp bench: {r['backend']} failed: {first}", file=sys.stderr)
    return 1 if failed else 0


def _write(
    args: argparse.Namespace,
    records: list[dict[str, Any]],
    table: str,
    save: Callable[[list[dict[str, Any]], Path], object],
    plot: Callable[[Path], object],
) -> int:
    """A bench's table printed, its records saved and plotted as asked; its exit code."""
    print(table)
    if args.json:
        save(records, args.json)
        print(f"dlcp bench: wrote {args.json}", file=sys.stderr)
    if args.plot:
        plot(args.plot)
        print(f"dlcp bench: wrote {args.plot}", file=sys.stderr)
    return _finish(records)


def _allreduce(args: argparse.Namespace) -> int:
    from dlcp.bench.allreduce import format_table, run_allreduce, save
    from dlcp.bench.plots import plot_latency_cdf

    opts = allreduce_options(args)
    records = run_allreduce(opts, log_dir=args.logs)
    title = f"all-reduce, {opts.setup.describe()}"
    return _write(
        args, records, format_table(records), save,
        lambda out: plot_latency_cdf(records, out, title=title),
    )  # fmt: skip


def _train(args: argparse.Namespace) -> int:
    from dlcp.bench.plots import plot_tta
    from dlcp.bench.train import format_table, run_train, save

    opts = train_options(args)
    records = run_train(opts, log_dir=args.logs)
    title = f"time to accuracy, {opts.setup.describe()}"
    return _write(
        args, records, format_table(records), save, lambda out: plot_tta(records, out, title=title)
    )


def _ddp(args: argparse.Namespace) -> int:
    from dlcp.bench.ddp import format_table, run_ddp, save
    from dlcp.bench.plots import plot_latency_cdf

    opts = ddp_options(args)
    records = run_ddp(opts, log_dir=args.logs)
    steps = [{**r, "times_s": r["step_times_s"]} for r in records]
    title = f"DDP step, {opts.setup.describe()}"
    return _write(
        args, records, format_table(records), save,
        lambda out: plot_latency_cdf(steps, out, title=title),
    )  # fmt: skip


def _all(args: argparse.Namespace) -> int:
    from dlcp.bench.suite import run_suite

    opts = suite_options(args)
    failures = run_suite(opts)
    print((opts.out / "summary.md").read_text())
    print(f"dlcp bench: results in {opts.out}", file=sys.stderr)
    return 1 if failures else 0
