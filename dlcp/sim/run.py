"""A simulation's runs and their records: the bench's keys (`dlcp bench
allreduce`'s: backend, mode, scenario, hosts, size_bytes, iters, times_s,
p50_s, p99_s, busbw_gbps, loss_frac), and the network's: drops per class,
per-link utilisation (each link tier's mean and max, and every port's),
the TCP model's counts for the ring."""

from __future__ import annotations

import multiprocessing
import time
from collections.abc import Callable
from typing import Any

from dlcp.bench.common import summarize_times
from dlcp.sim.dlcprun import DlcpRun, daemon_config
from dlcp.sim.fabric import Fabric
from dlcp.sim.ring import RingRun
from dlcp.sim.settings import Settings

__all__ = ["backend_record", "network_stats", "simulate"]

Progress = Callable[[str, int, int], None]


def network_stats(fabric: Fabric, seconds: float) -> dict[str, Any]:
    """Drops per class (queue overflow) and per port, random losses,
    utilisation per link, the deepest queues."""
    drops = [0] * 8
    lost = 0
    tiers: dict[str, list[float]] = {}
    links: dict[str, float] = {}
    port_drops: dict[str, list[int]] = {}
    deepest: dict[str, list[int]] = {}
    for p in fabric.ports():
        if any(p.drops):
            port_drops[p.name] = list(p.drops)
        if p.rate_bps is not None and any(p.depth):
            deepest[p.name] = list(p.depth)
        for c, n in enumerate(p.drops):
            drops[c] += n
        lost += p.lost
        if p.rate_bps is not None:
            u = p.utilisation(seconds)
            links[p.name] = round(u, 4)
            tiers.setdefault(p.tier, []).append(u)
    return {
        "drops_per_class": drops,
        "random_losses": lost,
        "utilisation": {
            t: {"mean": sum(v) / len(v), "max": max(v)} for t, v in sorted(tiers.items())
        },
        "link_utilisation": links,
        "port_drops": port_drops,  # per port with any, per class
        "queue_depth": deepest,  # each shaped port's deepest queue per class
    }


def _base(s: Settings, backend: str) -> dict[str, Any]:
    return {
        "backend": backend,
        "simulated": True,
        "codec": "fp32",
        "mode": s.mode if backend == "dlcp" else "ring",
        "scenario": s.scenario.name,
        "loss_pct": s.scenario.loss_pct if s.scenario.name == "loss" else 0.0,
        "hosts": s.hosts,
        "topology": s.topology,
        "oversub": s.oversub if s.topology == "leafspine" else None,
        "spines": s.spines if s.topology == "leafspine" else None,
        "hosts_per_leaf": min(s.hosts_per_leaf, s.hosts) if s.topology == "leafspine" else None,
        "balance": s.balance if backend == "dlcp" else "ecmp",
        "rate_bps": s.rate_bps,
        "size_bytes": s.size_bytes,
        "iters": s.iters,
        "buckets": s.buckets,
        "backward_s": s.backward_s,
        "loss_bound": s.loss_bound if backend == "dlcp" else 0.0,
        "seed": s.seed,
        "probe_budget": (
            (
                daemon_config(2, s.rate_bps).probe_budget
                if s.probe_budget is None
                else s.probe_budget
            )
            if backend == "dlcp"
            else None
        ),
        "cpu_bound": False,
    }


def simulate(
    s: Settings, backends: list[str], progress: Progress | None = None, processes: int = 1
) -> list[dict[str, Any]]:
    """Run each backend on a fresh network with the same settings. With
    `processes` > 1, up to that many backends at once, each in a process of
    its own (spawned: nothing shared), their records in `backends`' order and
    the same as one after the other; `progress` must then pickle."""
    if processes <= 1 or len(backends) < 2:
        return [backend_record(s, b, progress) for b in backends]
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(min(processes, len(backends))) as pool:
        return pool.starmap(backend_record, [(s, b, progress) for b in backends])


def backend_record(s: Settings, backend: str, progress: Progress | None = None) -> dict[str, Any]:
    """One backend's run on a fresh network and its record."""
    rec = _base(s, backend)
    t0 = time.perf_counter()

    def tick(done: int, total: int) -> None:
        if progress is not None:
            progress(backend, done, total)

    if backend == "dlcp":
        run = DlcpRun(s, tick)
        steps = run.run()
        times = run.times(steps)
        lost = sum(st.lost for st in steps)
        total = sum(st.total for st in steps)
        rec["lost_lanes"], rec["total_lanes"] = lost, total
        rec["loss_frac"] = lost / total if total else 0.0
        rec["failed"] = [f for st in steps for f in st.failed]
        rec["probes"] = run.probe_counts()
        fabric, loop, end = run.fabric, run.loop, run.finished_at
    else:
        ring = RingRun(s, tick)
        times = ring.run()
        rec["loss_frac"] = 0.0
        rec["tcp"] = ring.tcp_counts()
        fabric, loop, end = ring.fabric, ring.loop, ring.finished_at
    rec["times_s"] = times
    rec.update(summarize_times(times, s.size_bytes, s.hosts))
    rec["completed"] = len(times)
    rec.update(network_stats(fabric, end))  # utilisation up to the last round's end
    rec["virtual_s"] = end
    rec["events"] = loop.events
    rec["wall_s"] = time.perf_counter() - t0
    return rec
