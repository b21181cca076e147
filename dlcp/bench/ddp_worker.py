"""One rank of `dlcp bench ddp` (run in a host's namespace; JSON lines).

An MLP of about `--params` parameters in `--layers` equal layers, trained
with DistributedDataParallel over a Gloo process group on random data. With
`--backend dlcp` the gradients go through dlcp's shim (`dlcp.shim.init` +
`register_comm_hook(state, dlcp.hook)`); with `gloo` through DDP's default
all-reduce. DDP cuts the gradients into buckets of `--bucket-mb` that become
ready one after another during the backward pass, so communication overlaps
the computation of the layers in front.

A step is forward, backward (all-reduce included) and an SGD update; its time
is measured on every rank and the step's time is the slowest rank's.

Protocol: "ready" {params, buckets} -> (go) -> "step" events (rank 0) ->
"result" {step_times_s, cpu_s, dlcp: stats and timeline}.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import resource
import statistics
import sys
import time
import warnings
from typing import Any

import torch

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
    p.add_argument("--backend", choices=("gloo", "dlcp"), required=True)
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
    try:
        run(a)
    except Exception as exc:
        emit("error", error=f"{type(exc).__name__}: {exc}")
        raise SystemExit(1) from None


def run(a: argparse.Namespace) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{a.master}:{a.port}",
        rank=a.rank,
        world_size=a.world,
        timeout=datetime.timedelta(seconds=max(a.timeout, 1800.0)),
    )
    model = build_model(a.params, a.layers, a.seed)
    params = sum(p.numel() for p in model.parameters())
    width = mlp_width(a.params, a.layers)
    ddp = DDP(model, bucket_cap_mb=a.bucket_mb)
    state = None
    if a.backend == "dlcp":
        import dlcp.shim as dlcp

        state = dlcp.init(
            codec=a.codec,
            loss_bound=a.bound,
            model=None if a.no_model else model,
            round_timeout_s=a.timeout,
        )
        ddp.register_comm_hook(state, dlcp.hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(a.seed * 7919 + a.rank)
    xb = torch.randn(a.batch, width, generator=gen)
    yb = torch.randint(0, OUTPUTS, (a.batch,), generator=gen)

    spans: list[dict[str, float]] = []

    def step() -> float:
        ts = time.perf_counter()
        loss = torch.nn.functional.cross_entropy(ddp(xb), yb)
        opt.zero_grad(set_to_none=False)
        loss.backward()
        opt.step()
        te = time.perf_counter()
        if state is not None and state.timeline.steps:
            spans.append(step_spans(state.timeline.steps[-1], ts, te))
        return te - ts

    first = step()  # the first step: attaching, the segment, DDP's rebuilt buckets
    first_timeline = state.timeline_summary(last=1) if state is not None else None
    first_spans = spans[-1] if spans else None
    first_grows = state.stats()["segment_grows"] if state is not None else None
    for _ in range(max(0, a.warmup - 1)):
        step()
    if state is not None:
        state.timeline.clear()
    spans.clear()
    counters0 = state.daemon_counters() if state is not None else {}
    dist.barrier()
    emit("ready", params=params, width=width, first_step_s=first)
    if not sys.stdin.readline():
        raise SystemExit("orchestrator went away")
    dist.barrier()
    step_times: list[float] = []
    c0 = cpu_s()
    t0 = time.perf_counter()
    for i in range(a.steps):
        step_times.append(step())
        dist.barrier()  # steps start together: a step's time is not a neighbour's wait
        if a.rank == 0:
            emit("step", step=i + 1, t=time.perf_counter() - t0)
    wall = time.perf_counter() - t0
    cpu = cpu_s() - c0
    stats: dict[str, Any] = {}
    if state is not None:
        stats = state.stats()
        stats["timeline"] = state.timeline_summary()
        stats["first_timeline"] = first_timeline
        stats["first_spans"] = first_spans
        stats["spans"] = {k: statistics.median(s[k] for s in spans) for k in SPANS if spans}
        stats["first_segment_grows"] = first_grows
        after = state.daemon_counters()
        # what the timed steps cost the daemon (NACKs, retransmissions, ...)
        stats["daemon_counters"] = {
            k: v - counters0.get(k, 0) for k, v in after.items() if v != counters0.get(k, 0)
        }
        dist.barrier()  # leave the daemon's job only when every rank is done
        state.close()
    emit(
        "result",
        steps=a.steps,
        wall_s=wall,
        cpu_s=cpu,
        step_times_s=step_times,
        first_step_s=first,
        params=params,
        dlcp=stats,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dist.destroy_process_group()


if __name__ == "__main__":
    from dlcp.shim.leave import exit_process

    main()
    exit_process(0)  # not a plain return: see dlcp.shim.leave
