"""One rank of `dlcp bench ddp` (run in a host's namespace; JSON lines).

An MLP of about `--params` parameters in `--layers` equal layers, trained
with DistributedDataParallel over a Gloo process group on random data. With
`--backend dlcp` the gradients go through dlcp's shim (`dlcp.shim.init` +
`register_comm_hook(state, dlcp.hook)`); with `gloo` through DDP's default
all-reduce; with `gloo-fp16`, `gloo-bf16`, `gloo-powersgd` (and their -prio
names) through PyTorch's hooks (`dlcp.bench.hooks`). DDP cuts the gradients
into buckets of `--bucket-mb` that become ready one after another during the
backward pass, so communication overlaps the computation of the layers in
front.

With both (`--backend dlcp,gloo`) each rank holds one such model per backend
(same seed) and alternates their steps, so both meet the same machine.
A step is forward, backward (all-reduce included) and an SGD update; its time
is measured on every rank (the orchestrator takes the slowest rank's).

The steps start together: a barrier after each, on a Gloo group of the
worker's own (`_sync_group`) whose TCP is marked into the control class
for every backend alike. On the process group it rode with the backend's
traffic: Gloo's marked with -prio, dlcp's not, and behind a congested
port's best-effort queue (100 Mbit/s, 117 ms of background) the ranks left
the barrier up to hundreds of milliseconds apart, which dlcp's rounds, and
not gloo-prio's, then waited out inside the timed step.

Protocol: "ready" {params, width} -> (go) -> "step" events (rank 0) ->
"result" {runs: {backend: {step_times_s, cpu_s, stats}}}; for dlcp, stats are
the shim's counters, its timeline and the daemon's counters.
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import statistics
import sys
import time
from typing import Any

import torch

from dlcp.bench.backends import TABLE
from dlcp.bench.cpuload import machine_s
from dlcp.shim.timeline import StepTimes

__all__ = ["build_model", "main", "mlp_width"]

OUTPUTS = 10


def emit(event: str, **fields: Any) -> None:
    sys.stdout.write(json.dumps({"event": event, **fields}) + "\n")
    sys.stdout.flush()


def mlp_width(params: int, layers: int) -> int:
    """The width w of `layers` w x w linear layers (with biases) and a w x 10
    head that together hold about `params` parameters."""
    if params < 1 or layers < 1:
        raise ValueError("params and layers must be >= 1")
    # layers * (w^2 + w) + 10 w + 10 = params
    a, b, c = layers, layers + OUTPUTS, OUTPUTS - params
    return max(1, round((-b + math.sqrt(b * b - 4 * a * c)) / (2 * a)))


def build_model(params: int, layers: int, seed: int) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    width = mlp_width(params, layers)
    mods: list[torch.nn.Module] = []
    for _ in range(layers):
        mods += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    mods.append(torch.nn.Linear(width, OUTPUTS))
    return torch.nn.Sequential(*mods)


SPANS = ("before_hooks", "in_hooks", "after_hooks")


def step_spans(tl: StepTimes, start: float, end: float) -> dict[str, float]:
    """A dlcp step cut at its buckets (seconds): the forward pass and the
    backward until DDP hands over the first bucket; from then until the last
    bucket's future completes; the rest (DDP's finalisation, the update)."""
    first = min(b.handed for b in tl.buckets)
    last = max(b.completed for b in tl.buckets)
    return {"before_hooks": first - start, "in_hooks": last - first, "after_hooks": end - last}


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument(
        "--backend",
        required=True,
        help="dlcp, gloo, gloo-fp16, ...; several: alternated step by step",
    )
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--master", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--params", type=int, required=True)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--batch", type=int, default=16, help="per rank")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--codec", default="fp32")
    p.add_argument("--bound", type=float, default=0.0)
    p.add_argument("--timeout", type=float, default=120.0)
    p.add_argument("--bucket-mb", type=float, default=25.0, help="DDP bucket_cap_mb")
    p.add_argument(
        "--no-model", action="store_true", help="dlcp.init without model= (the segment grows)"
    )
    a = p.parse_args(argv)
    backends = a.backend.split(",")
    if not backends or any(b not in TABLE or b.startswith("dlcp-") for b in backends):
        p.error(f"--backend takes dlcp and Gloo baselines (e.g. dlcp,gloo), not {a.backend!r}")
    try:
        run(a)
    except Exception as exc:
        emit("error", error=f"{type(exc).__name__}: {exc}")
        raise SystemExit(1) from None


class _Trainer:
    """One backend's DDP model, optimiser and timings in this rank."""

    def __init__(self, a: argparse.Namespace, backend: str) -> None:
        from torch.nn.parallel import DistributedDataParallel as DDP

        self.backend = backend
        self.model = build_model(a.params, a.layers, a.seed)  # the same for every backend
        self.ddp = DDP(self.model, bucket_cap_mb=a.bucket_mb)
        self.state: Any = None
        if backend == "dlcp":
            import dlcp.shim as dlcp

            self.state = dlcp.init(
                codec=a.codec,
                loss_bound=a.bound,
                model=None if a.no_model else self.model,
                round_timeout_s=a.timeout,
            )
            self.ddp.register_comm_hook(self.state, dlcp.hook)
        else:
            from dlcp.bench.hooks import register

            register(self.ddp, TABLE[backend].hook)  # the name's hook; -prio is the orchestrator's
        self.opt = torch.optim.SGD(self.ddp.parameters(), lr=1e-4)
        self.times: list[float] = []
        self.cpu = 0.0
        self.machine = [0.0, 0.0]  # busy and idle CPU seconds of the machine in the steps
        self.spans: list[dict[str, float]] = []

    def step(self, xb: torch.Tensor, yb: torch.Tensor) -> float:
        m0 = machine_s()
        c0, ts = cpu_s(), time.perf_counter()
        loss = torch.nn.functional.cross_entropy(self.ddp(xb), yb)
        self.opt.zero_grad(set_to_none=False)
        loss.backward()
        self.opt.step()
        te = time.perf_counter()
        self.cpu += cpu_s() - c0
        m1 = machine_s()  # the machine within this backend's step: its own load
        self.machine[0] += m1[0] - m0[0]
        self.machine[1] += m1[1] - m0[1]
        if self.state is not None and self.state.timeline.steps:
            self.spans.append(step_spans(self.state.timeline.steps[-1], ts, te))
        return te - ts

    def reset(self) -> None:
        self.times, self.cpu, self.spans = [], 0.0, []
        self.machine = [0.0, 0.0]
        if self.state is not None:
            self.state.timeline.clear()


def _sync_group() -> Any:
    """A new Gloo group of every rank for the bench's own barriers, its TCP
    connections marked into the control class (`dlcp.shim.sockmark`)."""
    import torch.distributed as dist

    from dlcp.shim import sockmark

    group, _ = sockmark.mark_new(lambda: dist.new_group(backend="gloo"), sockmark.CONTROL_DSCP)
    return group


def run(a: argparse.Namespace) -> None:
    import torch.distributed as dist

    from dlcp.bench.train_worker import init_group, leave_group

    init_group(a)
    sync = _sync_group()
    width = mlp_width(a.params, a.layers)
    trainers = [_Trainer(a, b) for b in a.backend.split(",")]
    params = sum(p.numel() for p in trainers[0].model.parameters())
    gen = torch.Generator().manual_seed(a.seed * 7919 + a.rank)
    xb = torch.randn(a.batch, width, generator=gen)
    yb = torch.randint(0, OUTPUTS, (a.batch,), generator=gen)

    first: dict[str, dict[str, Any]] = {}
    for t in trainers:  # the first step: DDP's buckets, the daemon's first rounds
        took = t.step(xb, yb)
        first[t.backend] = {"first_step_s": took}
        if t.state is not None:
            first[t.backend].update(
                first_timeline=t.state.timeline_summary(last=1),
                first_spans=t.spans[-1] if t.spans else None,
                first_segment_grows=t.state.stats()["segment_grows"],
            )
    for _ in range(max(0, a.warmup - 1)):
        for t in trainers:
            t.step(xb, yb)
    for t in trainers:
        t.reset()
    counters0 = {t.backend: t.state.daemon_counters() for t in trainers if t.state is not None}
    dist.barrier()
    emit("ready", params=params, width=width)
    if not sys.stdin.readline():
        raise SystemExit("orchestrator went away")
    dist.barrier()
    t0 = time.perf_counter()
    for i in range(a.steps):
        for t in trainers:  # alternated: both see the same machine, step by step
            t.times.append(t.step(xb, yb))
            dist.barrier(group=sync)  # steps start together: no step times a neighbour's wait
        if a.rank == 0:
            emit("step", step=i + 1, t=time.perf_counter() - t0)
    results: dict[str, Any] = {}
    for t in trainers:
        stats: dict[str, Any] = dict(first[t.backend])
        if t.state is not None:
            stats.update(t.state.stats())
            stats["timeline"] = t.state.timeline_summary()
            stats["spans"] = {k: statistics.median(s[k] for s in t.spans) for k in SPANS}
            before, after = counters0[t.backend], t.state.daemon_counters()
            # what the timed steps cost the daemon (NACKs, retransmissions, ...)
            stats["daemon_counters"] = {
                k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)
            }
        results[t.backend] = {
            "step_times_s": t.times,
            "cpu_s": t.cpu,
            "machine_s": t.machine,
            "stats": stats,
        }
    dist.barrier()  # leave the daemon's job only when every rank is done
    for t in trainers:
        if t.state is not None:
            t.state.close()
    emit("result", steps=a.steps, wall_s=time.perf_counter() - t0, params=params, runs=results)
    leave_group()


if __name__ == "__main__":
    from dlcp.shim.leave import exit_process

    main()
    exit_process(0)  # not a plain return: see dlcp.shim.leave
