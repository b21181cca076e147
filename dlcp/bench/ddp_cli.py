"""`dlcp bench ddp`'s arguments and the options they make (dlcp.bench.cli registers them)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from dlcp.bench.backends import help_text
from dlcp.bench.common import CODECS, BenchError, parse_rate, parse_size

__all__ = ["DDP_SCENARIOS", "add_args", "ddp_options"]

# the scenarios of bench ddp: no path cut (its steps are not timed around one)
DDP_SCENARIOS: tuple[str, ...] = ("clean", "loss", "burst", "congested", "multipath")


def add_args(
    p: argparse.ArgumentParser,
    *,
    backends: Callable[[str], list[str]],
    scenario: Callable[[argparse.ArgumentParser, tuple[str, ...]], None],
) -> None:
    """bench ddp's arguments; `backends` parses --backends, `scenario` adds
    --scenario and --loss (the other benches' own)."""
    p.add_argument("--hosts", type=int, default=2, help="emulated hosts (default: 2)")
    p.add_argument(
        "--rate", default="none", help="switch port rate, e.g. 1gbit; none: unshaped (default)"
    )
    scenario(p, DDP_SCENARIOS)
    size = p.add_mutually_exclusive_group()
    size.add_argument(
        "--grad-size", default=None, help="fp32 gradients per step, e.g. 50MB (default: 50MB)"
    )
    size.add_argument(
        "--params", type=int, default=None, help="model parameters (instead of --grad-size)"
    )
    p.add_argument(
        "--layers", type=int, default=8, help="equal linear layers of the MLP (default: 8)"
    )
    p.add_argument("--batch", type=int, default=16, help="batch per rank (default: 16)")
    p.add_argument("--steps", type=int, default=20, help="timed steps (default: 20)")
    p.add_argument("--warmup", type=int, default=3, help="untimed first steps (default: 3)")
    p.add_argument("--codec", choices=CODECS, default="fp32", help="dlcp's codec (default: fp32)")
    p.add_argument(
        "--backends",
        default="dlcp,gloo",
        type=backends,
        help=help_text("ddp"),
    )
    p.add_argument(
        "--bucket-cap-mb", type=float, default=25.0, help="DDP bucket_cap_mb (default: 25)"
    )
    p.add_argument("--loss-bound", type=float, default=0.0, help="dlcp's loss bound (default: 0)")
    p.add_argument(
        "--no-model",
        action="store_true",
        help="dlcp.init without model=: the shim learns the buckets' sizes in the first step",
    )
    p.add_argument("--mtu", type=int, default=1500, help="link MTU (default: 1500)")
    p.add_argument("--name", default=None, help="testbed name (default: bench-<pid>)")


def ddp_options(args: argparse.Namespace) -> Any:
    from dlcp.bench.cluster import Setup
    from dlcp.bench.ddp import DdpOptions

    if args.params is not None:
        if args.params < 1:
            raise BenchError(f"--params must be >= 1, not {args.params}")
        grad = 4 * args.params
    else:
        grad = parse_size(args.grad_size or "50MB")
    setup = Setup(
        hosts=args.hosts,
        rate_bps=parse_rate(args.rate),
        scenario=args.scenario,
        loss_pct=args.loss,
        mtu=args.mtu,
        name=args.name,
    )
    return DdpOptions(
        setup=setup,
        grad_bytes=grad,
        layers=args.layers,
        batch=args.batch,
        steps=args.steps,
        warmup=args.warmup,
        codec=args.codec,
        backends=tuple(args.backends),
        bucket_mb=args.bucket_cap_mb,
        bound=args.loss_bound,
        with_model=not args.no_model,
        stall_s=args.stall,
        progress=not args.no_progress,
    )
