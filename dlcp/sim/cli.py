"""`dlcp simulate`: dlcp's real engines and a TCP ring baseline in a simulated network."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

from dlcp.errors import LocalError

__all__ = ["register"]


def register(sub: Any) -> None:
    p = sub.add_parser(
        "simulate",
        help="dlcp's protocol engines at scale in a packet-level network (virtual time)",
        description="Run all-reduce rounds (or DDP-like steps) of dlcp's real engines and "
        "daemon send path, and a ring all-reduce over a TCP model, in a discrete-event "
        "network: one switch or a leaf-spine fabric with the testbed's priority queues. "
        "Deterministic for a seed.",
    )
    p.add_argument("--hosts", type=int, required=True, help="hosts (2..256)")
    p.add_argument("--topology", default="single", help="single (one switch) or leafspine")
    p.add_argument("--oversub", type=float, default=2.0, help="leaf-spine oversubscription (>= 1)")
    p.add_argument("--hosts-per-leaf", type=int, default=16)
    p.add_argument("--spines", type=int, default=4)
    p.add_argument("--rate", required=True, help="host link rate, e.g. 200mbit, 10gbit")
    p.add_argument("--size", required=True, help="all-reduce size, e.g. 10MB")
    p.add_argument("--scenario", default="clean", help="clean, loss, burst, background, linkdown")
    p.add_argument("--loss", type=float, default=1.0, help="%% random loss (scenario loss)")
    p.add_argument("--load", type=float, default=0.3, help="background share of each port")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--mode", default="transpose", help="dlcp's mode: transpose, ps or switch")
    p.add_argument("--balance", default="spray", help="dlcp on a leaf-spine: spray or ecmp")
    p.add_argument("--backends", default="dlcp,ring", help="any of dlcp, ring")
    p.add_argument("--buckets", type=int, default=1, help="> 1: a DDP-like step of buckets")
    p.add_argument("--backward", type=float, default=0.0, help="s over which buckets are released")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--probe-budget", type=int, default=None,
                   help="probes a probe interval a daemon (0: no bound; default 32)")  # fmt: skip
    p.add_argument("--json", type=Path, help="write the records here")
    p.add_argument("--plot", type=Path, help="write a plot of round times (PNG)")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    p.add_argument("--processes", type=int, default=None,
                   help="backends run at once, a process each (default: one a CPU)")  # fmt: skip
    p.set_defaults(func=main)


def settings_of(a: argparse.Namespace) -> tuple[Any, list[str]]:
    """The validated settings and backends (LocalError with one clear line)."""
    from dlcp.bench.common import parse_size
    from dlcp.errors import DlcpError
    from dlcp.sim.scenario import Scenario
    from dlcp.sim.settings import BACKENDS, Settings
    from dlcp.tc.plan import parse_rate

    try:
        rate = float(parse_rate(a.rate))
        size = parse_size(a.size)
    except DlcpError as exc:
        raise LocalError(str(exc)) from None
    except (ValueError, TypeError):
        raise LocalError(f"bad --rate {a.rate!r}: expected e.g. 200mbit") from None
    backends = [b.strip() for b in a.backends.split(",") if b.strip()]
    bad = [b for b in backends if b not in BACKENDS]
    if bad or not backends:
        raise LocalError(f"--backends: unknown {bad or 'none'}; valid: {', '.join(BACKENDS)}")
    if not math.isfinite(a.loss):
        raise LocalError("--loss must be a finite percentage")
    s = Settings(
        hosts=a.hosts, topology=a.topology, oversub=a.oversub, hosts_per_leaf=a.hosts_per_leaf,
        spines=a.spines, rate_bps=rate, size_bytes=size,
        scenario=Scenario(a.scenario, loss_pct=a.loss, load=a.load), iters=a.iters,
        warmup=a.warmup, mode=a.mode, balance=a.balance, buckets=a.buckets,
        backward_s=a.backward, seed=a.seed, probe_budget=a.probe_budget,
    )  # fmt: skip
    return s, backends


class _Progress:
    """Each round's end on stderr: one line a backend, or with backends run
    at once a line a round (a module's class: it goes to their processes)."""

    def __init__(self, lines: bool) -> None:
        self.lines = lines

    def __call__(self, name: str, done: int, total: int) -> None:
        start = "" if self.lines else "\r"
        end = "\n" if self.lines or done == total else ""
        print(f"{start}{name}: round {done}/{total}", end=end, file=sys.stderr, flush=True)


def main(a: argparse.Namespace) -> int:
    from dlcp.sim.run import simulate

    s, backends = settings_of(a)
    processes = max(1, a.processes if a.processes is not None else (os.cpu_count() or 1))
    progress = None if a.quiet else _Progress(lines=processes > 1 and len(backends) > 1)
    recs = simulate(s, backends, progress, processes=processes)
    for r in recs:
        print(
            f"{r['backend']:<5} {r['mode']:<9} {r['scenario']:<10} hosts {r['hosts']:<4} "
            f"p50 {r['p50_s']:.4f} s  p99 {r['p99_s']:.4f} s  lost {100 * r['loss_frac']:.3f}%  "
            f"drops/class {r['drops_per_class']}  ({r['wall_s']:.0f} s wall)"
        )
    if a.json is not None:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(recs, indent=1) + "\n")
    if a.plot is not None:
        from dlcp.sim.plots import round_times

        round_times(recs, a.plot)
    return 0
