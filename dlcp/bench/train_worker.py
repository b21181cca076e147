"""One training rank of `dlcp bench train` (run in a host's namespace; JSON lines).

A model of `dlcp.bench.workloads` (`--model`: the MLP or the CNN on
scikit-learn's digits, the byte-level transformer on the stdlib's sources),
trained with DistributedDataParallel over a Gloo process group. With
`--backend dlcp` the gradients go through dlcp's shim (`dlcp.shim.init` +
`register_comm_hook(state, dlcp.hook)`); with `gloo` through DDP's default
all-reduce, or (`--hook`) PyTorch's fp16, bf16 or PowerSGD hook
(`dlcp.bench.hooks`). Same seed, same data order, same model either way.
`--overlap on` (dlcp only): the optimizer runs through `dlcp.overlap`, layer
by layer in the next forward; every rank flushes before rank 0 evaluates.

Protocol: "ready" -> (go) -> steps; rank 0 sends "step" and "eval" {t, acc,
loss} events -> "result" {curve (t, acc), loss_curve (t, loss), final_acc, ...}.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import resource
import sys
import time
import warnings
from typing import Any

import torch

from dlcp.bench import workloads
from dlcp.bench.backends import HOOK_CODECS

__all__ = ["build_model", "load_data", "main"]


def emit(event: str, **fields: Any) -> None:
    sys.stdout.write(json.dumps({"event": event, **fields}) + "\n")
    sys.stdout.flush()


def load_data(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Digits (8x8 images, 10 classes), features in [0, 1]; 75 % train, 25 % test."""
    return workloads._digits(seed)


def build_model(hidden: list[int], seed: int) -> torch.nn.Sequential:
    return workloads.mlp_model(hidden, seed)


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
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--batch", type=int, default=32, help="per rank")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--hidden", default="512,512,512,512,512")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-every", type=int, default=5)
    p.add_argument("--codec", default="fp32")
    p.add_argument("--mode", choices=("transpose", "switch", "ps"), default="transpose")
    p.add_argument("--servers", default="", help="mode ps: the servers' sockets, comma-separated")
    p.add_argument("--colocate", action="store_true", help="mode ps: the hosts aggregate too")
    p.add_argument("--bound", type=float, default=0.0)
    p.add_argument("--timeout", type=float, default=120.0)
    p.add_argument("--bucket-mb", type=float, default=1.0, help="DDP bucket_cap_mb")
    p.add_argument(
        "--hook",
        choices=tuple(HOOK_CODECS),
        default="default",
        help="gloo: DDP's default hook, or PyTorch's fp16/bf16/PowerSGD hook (dlcp.bench.hooks)",
    )
    p.add_argument("--model", choices=tuple(workloads.MODELS), default="mlp")
    p.add_argument("--overlap", choices=("on", "off"), default="off")
    p.add_argument(
        "--fsdp",
        action="store_true",
        help="FSDP2 instead of DDP (dlcp: its torch.distributed backend, dlcp.shim.backend)",
    )
    a = p.parse_args(argv)
    try:
        run(a)
    except Exception as exc:
        emit("error", error=f"{type(exc).__name__}: {exc}")
        raise SystemExit(1) from None


def init_group(a: argparse.Namespace) -> None:
    """One thread for torch, and the Gloo process group of `a`'s rank (a
    bench worker's --master, --port, --rank, --world, --timeout)."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{a.master}:{a.port}",
        rank=a.rank,
        world_size=a.world,
        timeout=datetime.timedelta(seconds=max(a.timeout, 1800.0)),
    )


def leave_group() -> None:
    """The process group destroyed, its warnings unprinted (the rank's last words)."""
    import torch.distributed as dist

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dist.destroy_process_group()


def _fully_shard(model: torch.nn.Module, a: argparse.Namespace) -> torch.nn.Module:
    """FSDP2 over the model's blocks (the transformer's, else each layer with
    parameters), then the whole; for dlcp on a process group of backend "dlcp"
    (the codec and bound of the run), for gloo on the default group."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    if a.backend == "dlcp":
        import dlcp.shim

        dlcp.shim.backend_options(codec=a.codec, loss_bound=a.bound, round_timeout_s=a.timeout)
        group = dist.new_group(backend="dlcp")
    else:
        group = dist.group.WORLD
    mesh = DeviceMesh.from_group(group, "cpu")
    blocks = getattr(model, "blocks", None)
    units = list(blocks) if blocks is not None else [
        m for m in model.modules() if m is not model and any(m.parameters(recurse=False))
    ]
    for unit in units:
        fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def run(a: argparse.Namespace) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    init_group(a)
    w = workloads.workload(a.model)
    hidden = [int(h) for h in a.hidden.split(",") if h]
    model, data = workloads.build(a.model, rank=a.rank, world=a.world, seed=a.seed, hidden=hidden)
    params = sum(p.numel() for p in model.parameters())
    state = None
    optim_cls = getattr(torch.optim, w.optimizer)
    opt: Any
    # FSDP: no comm hook, the process group carries its collectives
    ddp: Any = _fully_shard(model, a) if a.fsdp else DDP(model, bucket_cap_mb=a.bucket_mb)
    if a.fsdp:
        pass
    elif a.backend == "dlcp":
        import dlcp.shim as dlcp

        ps = {"servers": a.servers or None, "colocate": a.colocate} if a.mode == "ps" else {}
        state = dlcp.init(
            codec=a.codec,
            loss_bound=a.bound,
            model=model,
            round_timeout_s=a.timeout,
            mode=a.mode,
            **ps,
        )
        ddp.register_comm_hook(state, dlcp.hook)
    else:
        from dlcp.bench.hooks import register

        register(ddp, a.hook)
    if a.overlap == "on" and state is not None:
        opt = dlcp.overlap(ddp, state, optim_cls, lr=a.lr)
    else:
        opt = optim_cls(ddp.parameters(), lr=a.lr)
    flush = getattr(opt, "flush", lambda: None)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: 0.5 * (1 + math.cos(math.pi * min(s, a.steps) / a.steps))
    )
    gen = torch.Generator().manual_seed(a.seed * 7919 + a.rank)

    def batch() -> tuple[torch.Tensor, torch.Tensor]:
        return data.batch(a.batch, gen)

    def evaluate() -> tuple[float, float]:
        return data.evaluate(ddp if a.fsdp else model)

    # Warm-up: one backward through the hook (attaches dlcp), no update.
    xb, yb = batch()
    workloads.loss_of(ddp(xb), yb).backward()
    opt.zero_grad(set_to_none=True)
    dist.barrier()
    # FSDP's forward is a collective: every rank evaluates (rank 0 reports)
    evaluates = a.rank == 0 or a.fsdp
    first = evaluate() if evaluates else (None, None)
    emit("ready", params=params, acc0=first[0], loss0=first[1])
    if not sys.stdin.readline():
        raise SystemExit("orchestrator went away")
    dist.barrier()
    curve: list[list[float]] = []
    loss_curve: list[list[float]] = []
    step_times: list[float] = []
    step_starts: list[float] = []  # time.monotonic(): the orchestrator's clock too
    c0 = cpu_s()
    t0 = time.perf_counter()
    for step in range(a.steps):
        ts = time.perf_counter()
        step_starts.append(time.monotonic())
        xb, yb = batch()
        loss = workloads.loss_of(ddp(xb), yb)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        evaluating = (step + 1) % a.eval_every == 0 or step + 1 == a.steps
        if evaluating:
            flush()  # every rank: the updates still in flight, before rank 0 reads them
        step_times.append(time.perf_counter() - ts)
        if a.rank != 0 and a.fsdp and evaluating:
            evaluate()
        if a.rank == 0:
            t = time.perf_counter() - t0
            if evaluating:
                acc, val = evaluate()
                curve.append([t, acc])
                loss_curve.append([t, val])
                emit("eval", step=step + 1, t=t, acc=acc, loss=val)
            emit("step", step=step + 1, t=t, loss=float(loss.detach()))
    flush()
    wall = time.perf_counter() - t0
    cpu = cpu_s() - c0
    stats: dict[str, Any] = {}
    if a.fsdp and a.backend == "dlcp":
        from dlcp.shim import backend

        stats = backend.groups()[0].state.stats()
    if state is not None:
        stats = state.stats()
        dist.barrier()  # leave the daemon's job only when every rank is done
        state.close()
    result: dict[str, Any] = {
        "curve": curve,
        "loss_curve": loss_curve,
        "final_acc": curve[-1][1] if curve else None,
        "final_loss": loss_curve[-1][1] if loss_curve else None,
        "steps": a.steps,
        "wall_s": wall,
        "cpu_s": cpu,
        "step_times_s": step_times,
        "step_starts_s": step_starts,
        "params": params,
        "dlcp": stats,
    }
    emit("result", **result)
    leave_group()


if __name__ == "__main__":
    from dlcp.shim.leave import exit_process

    main()
    exit_process(0)  # not a plain return: see dlcp.shim.leave
