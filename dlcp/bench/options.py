"""The benches' options from their parsed command lines: the cluster's `Setup`
and each bench's options object (`dlcp.bench.cli` defines the arguments).
"""

from __future__ import annotations

import argparse
from typing import Any

from dlcp.bench.common import BenchError, parse_rate, parse_size

__all__ = ["allreduce_options", "setup_from_args", "suite_options", "train_options"]


def setup_from_args(args: argparse.Namespace) -> Any:
    from dlcp.bench.setup import PathDown, Setup

    if not (args.down_at >= 0 and args.down_for >= 0):
        raise BenchError("--down-at and --down-for must be >= 0 seconds")
    return Setup(
        path_down=PathDown(after_s=args.down_at, length_s=args.down_for, path=args.down_path),
        hosts=args.hosts,
        rate_bps=parse_rate(args.rate),
        scenario=args.scenario,
        loss_pct=args.loss,
        mtu=args.mtu,
        pacing=args.pacing,
        mode=args.mode,
        servers=_servers(args),
        colocate=args.colocate or (args.mode == "ps" and args.servers == 0),
        name=args.name,
    )


def _loss_bound(args: argparse.Namespace) -> float:
    """--loss-bound, whose default is 0 in --mode ps and with --fsdp (else 0.05)."""
    if args.loss_bound is None:
        return 0.0 if args.mode == "ps" or getattr(args, "fsdp", False) else 0.05
    return float(args.loss_bound)


def _servers(args: argparse.Namespace) -> int:
    """--servers, whose default is 1 in --mode ps (else none)."""
    if args.servers is None:
        return 1 if args.mode == "ps" else 0
    return int(args.servers)


def allreduce_options(args: argparse.Namespace) -> Any:
    from dlcp.bench.allreduce import AllreduceOptions

    bucket = 0 if args.bucket.strip() == "0" else parse_size(args.bucket)
    return AllreduceOptions(
        setup=setup_from_args(args),
        size_bytes=parse_size(args.size),
        iters=args.iters,
        codec=args.codec,
        backends=tuple(args.backends),
        bound=_loss_bound(args),
        warmup=args.warmup,
        bucket_bytes=bucket,
        check=not args.no_check,
        stall_s=args.stall,
        budget_s=args.budget,
        progress=not args.no_progress,
    )


def train_options(args: argparse.Namespace) -> Any:
    from dlcp.bench.train import TrainOptions

    try:
        hidden = tuple(int(h) for h in args.hidden.split(",") if h.strip())
    except ValueError:
        raise BenchError(f"--hidden wants widths like 1024,768,256, not {args.hidden!r}") from None
    dscp = None if args.control_dscp.strip().lower() == "none" else args.control_dscp
    return TrainOptions(
        setup=setup_from_args(args),
        target_acc=args.target_acc,
        codec=args.codec,
        backends=tuple(args.backends),
        steps=args.steps,
        batch=args.batch,
        lr=args.lr,
        model=args.model,
        overlap=args.overlap == "on",
        fsdp=args.fsdp,
        hidden=hidden,
        seed=args.seed,
        eval_every=args.eval_every,
        bound=_loss_bound(args),
        bucket_mb=args.bucket_mb,
        control_dscp=dscp,
        time_budget_s=args.budget,
        stall_s=args.stall,
        progress=not args.no_progress,
    )


def suite_options(args: argparse.Namespace) -> Any:
    from dlcp.bench.allreduce import AllreduceOptions
    from dlcp.bench.setup import Setup
    from dlcp.bench.suite import SuiteOptions
    from dlcp.bench.train import TrainOptions

    rates = [parse_rate(r) for r in args.rates.split(",") if r.strip()]
    size, iters, steps = parse_size(args.size), args.iters, args.steps
    budget = args.budget
    if args.quick:
        rates, size, iters, steps, budget = rates[:1], 8_000_000, 8, 60, min(budget, 120.0)
    setup = Setup(hosts=args.hosts)
    return SuiteOptions(
        out=args.out,
        hosts=args.hosts,
        rates=rates,
        size_bytes=size,
        iters=iters,
        train_rate=parse_rate(args.train_rate),
        train=TrainOptions(setup=setup, steps=steps, bound=args.loss_bound, time_budget_s=budget),
        allreduce=AllreduceOptions(setup=setup, bound=args.loss_bound),
        parts=(args.only,) if args.only else ("allreduce", "train"),
        ablations=not args.no_ablations,
        mtu=args.mtu,
        pacing=args.pacing,
        progress=not args.no_progress,
        logs=args.logs,
    )
