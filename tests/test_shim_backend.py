"""dlcp as a torch.distributed backend (`init_process_group("cpu:dlcp")`), against
real dlcpd processes on loopback: the collectives it carries go through the
daemons and equal Gloo's, the ones it delegates work, DDP without a hook trains
as over Gloo, and the group falls back to Gloo without a daemon."""

from __future__ import annotations

import os
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import dlcp.shim as dlcp
from dlcp.errors import LocalError
from dlcp.shim import backend as dlcp_backend
from tests.daemons import free_tcp_port, loopback_daemons
from tests.test_shim import make_model, train_steps

TIMING = {"timing": {"timeout": 2.0}}


def _entry(
    rank: int, world: int, port: int, fn: Callable[..., Any], out: str, kwargs: dict[str, Any]
) -> None:
    os.environ["DLCP_SOCKET"] = kwargs.pop("sockets")[rank]
    dlcp.backend_options(codec=kwargs.pop("codec", "fp32"), round_timeout_s=20.0)
    dist.init_process_group(
        "cpu:dlcp",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=60),
    )
    try:
        result = fn(rank, world, **kwargs)
        torch.save(result, os.path.join(out, f"rank{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()
    dlcp.exit_process(0)


def spawn(fn: Callable[..., Any], world: int, tmp: Path, **kwargs: Any) -> list[Any]:
    mp.spawn(_entry, args=(world, free_tcp_port(), fn, str(tmp), kwargs), nprocs=world, join=True)
    return [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(world)]


def _group_state() -> Any:
    (group,) = dlcp_backend.groups()
    return group.state


def _collectives(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {"backend": dist.get_backend()}
    x = torch.arange(3000.0) * (rank + 1)
    s = x.clone()
    dist.all_reduce(s)  # SUM
    a = x.clone()
    dist.all_reduce(a, op=dist.ReduceOp.AVG)
    w = x.clone()
    work = dist.all_reduce(w, async_op=True)
    assert work is not None
    work.wait()
    f = x.clone()
    fut = dist.all_reduce(f, async_op=True).get_future()  # type: ignore[union-attr]
    fut.wait()
    rs = torch.empty(1000)
    dist.reduce_scatter_tensor(rs, x)
    g = torch.empty(3 * 700)
    mine = torch.randn(700, generator=torch.Generator().manual_seed(rank))
    dist.all_gather_into_tensor(g, mine)
    # delegated to Gloo: integers, MAX, broadcast, object collectives
    i = torch.tensor([rank + 1], dtype=torch.int64)
    dist.all_reduce(i)
    m = torch.tensor([float(rank)])
    dist.all_reduce(m, op=dist.ReduceOp.MAX)
    b = torch.full((4,), float(rank))
    dist.broadcast(b, src=1)
    objs: list[Any] = [None] * world
    dist.all_gather_object(objs, {"rank": rank})
    state = _group_state()
    out.update(
        sum=s, avg=a, async_sum=w, fut_sum=f, rs=rs, gathered=g, int_sum=i, max=m,
        bcast=b, objs=objs, stats=state.stats(),
    )  # fmt: skip
    return out


def test_collectives_go_through_the_daemons_and_equal_gloos(tmp_path: Path) -> None:
    with loopback_daemons(tmp_path, 3, extra=TIMING) as ds:
        results = spawn(_collectives, 3, tmp_path, sockets=[d.socket for d in ds])
    x = torch.arange(3000.0)
    gens = [torch.Generator().manual_seed(r) for r in range(3)]
    gathered = torch.cat([torch.randn(700, generator=g) for g in gens])
    for rank, res in enumerate(results):
        assert res["backend"] == "cpu:dlcp"
        for key in ("sum", "async_sum", "fut_sum"):
            torch.testing.assert_close(res[key], x * 6, rtol=0, atol=0)
        torch.testing.assert_close(res["avg"], x * 2)
        mine = (x * 6)[rank * 1000 : (rank + 1) * 1000]
        torch.testing.assert_close(res["rs"], mine, rtol=0, atol=0)
        assert torch.equal(res["gathered"], gathered)  # the ranks' bytes: lossless
        assert res["int_sum"].item() == 6 and res["max"].item() == 2.0
        assert torch.equal(res["bcast"], torch.full((4,), 1.0))
        assert res["objs"] == [{"rank": r} for r in range(3)]
        stats = res["stats"]
        assert stats["attached"] and stats["fallbacks"] == 0
        assert stats["rounds"] == 6  # sum, avg, async, future, reduce-scatter, all-gather


def _sent() -> dict[str, int]:
    """This rank's daemon's data and result packets made so far."""
    from dlcp.shim.client import DaemonClient

    c = DaemonClient(os.environ["DLCP_SOCKET"])
    try:
        counters = c.call("status")["status"]["counters"]
    finally:
        c.close()
    return {k: int(counters.get(f"{k}_packets_sent", 0)) for k in ("data", "result")}


def _one_leg(rank: int, world: int, n: int) -> dict[str, Any]:
    x = torch.arange(float(n * world)) * (rank + 1)
    before = _sent()
    rs = torch.empty(n)
    dist.reduce_scatter_tensor(rs, x)
    after_rs = _sent()
    mine = torch.randn(n, generator=torch.Generator().manual_seed(rank))
    g = torch.empty(n * world)
    dist.all_gather_into_tensor(g, mine)
    dist.barrier()  # every rank's results are in: this daemon sent its own
    after_ag = _sent()
    legs = {
        "reduce_scatter": {k: after_rs[k] - before[k] for k in before},
        "all_gather": {k: after_ag[k] - after_rs[k] for k in before},
    }
    return {"rs": rs, "gathered": g, "legs": legs}


def test_reduce_scatter_and_all_gather_are_one_leg_each(tmp_path: Path) -> None:
    """A reduce-scatter makes data packets only, an all-gather result packets
    only, each one a packet of a rank's chunk to each other host (a full
    all-reduce makes both: twice the packets)."""
    world, n = 3, 352 * 40 + 5  # a chunk of 41 packets, the last padded
    with loopback_daemons(tmp_path, world, extra=TIMING) as ds:
        results = spawn(_one_leg, world, tmp_path, sockets=[d.socket for d in ds], n=n)
    x = torch.arange(float(n * world))
    gens = [torch.Generator().manual_seed(r) for r in range(world)]
    gathered = torch.cat([torch.randn(n, generator=g) for g in gens])
    for rank, res in enumerate(results):
        total = x * sum(range(1, world + 1))
        torch.testing.assert_close(res["rs"], total[rank * n : (rank + 1) * n], rtol=0, atol=0)
        assert torch.equal(res["gathered"], gathered)
        legs = res["legs"]
        assert legs["reduce_scatter"]["result"] == 0
        assert legs["reduce_scatter"]["data"] >= 41 * (world - 1)
        assert legs["all_gather"]["data"] == 0
        assert legs["all_gather"]["result"] >= 41 * (world - 1)


def _ddp_no_hook(rank: int, world: int, steps: int) -> dict[str, Any]:
    gloo = dist.new_group(backend="gloo")
    ref = reference_grads_on(gloo, rank, steps)
    model = nn.parallel.DistributedDataParallel(make_model(), bucket_cap_mb=0.01)
    grads = train_steps(model, rank, steps)
    return {"grads": grads, "ref": ref, "stats": _group_state().stats()}


def reference_grads_on(group: Any, rank: int, steps: int) -> list[list[torch.Tensor]]:
    ref = nn.parallel.DistributedDataParallel(make_model(), process_group=group, bucket_cap_mb=0.01)
    return train_steps(ref, rank, steps)


def test_ddp_without_a_hook_over_the_backend_equals_gloo(tmp_path: Path) -> None:
    with loopback_daemons(tmp_path, 3, extra=TIMING) as ds:
        results = spawn(_ddp_no_hook, 3, tmp_path, sockets=[d.socket for d in ds], steps=4)
    for res in results:
        for got, want in zip(res["grads"], res["ref"], strict=True):
            for g, w in zip(got, want, strict=True):
                torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
        assert res["stats"]["fallbacks"] == 0 and res["stats"]["rounds"] > 4


def _no_daemon(rank: int, world: int) -> dict[str, Any]:
    t = torch.arange(100.0) * (rank + 1)
    dist.all_reduce(t)
    return {"t": t, "stats": _group_state().stats()}


def test_without_a_daemon_the_collectives_fall_back_to_gloo(tmp_path: Path) -> None:
    sockets = [str(tmp_path / f"none{r}.sock") for r in range(2)]
    results = spawn(_no_daemon, 2, tmp_path, sockets=sockets)
    for res in results:
        torch.testing.assert_close(res["t"], torch.arange(100.0) * 3, rtol=0, atol=0)
        assert res["stats"]["fallbacks"] == 1 and not res["stats"]["attached"]


def test_backend_options_refuse_an_unknown_codec() -> None:
    with pytest.raises(LocalError, match="unknown codec"):
        dlcp.backend_options(codec="fp8")
    assert "dlcp" in dist.Backend.backend_list


def _fsdp_losses(rank: int, mesh: Any, steps: int) -> tuple[list[float], list[torch.Tensor]]:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
    for m in model:
        if isinstance(m, nn.Linear):
            fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank)
    losses = []
    for _ in range(steps):
        loss = model(torch.randn(16, 32, generator=g)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    full = [p.full_tensor().detach().clone() for p in model.parameters()]  # type: ignore[attr-defined]
    return losses, full


def _fsdp(rank: int, world: int, steps: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import DeviceMesh

    gloo = dist.new_group(backend="gloo")
    ref, _ = _fsdp_losses(rank, DeviceMesh.from_group(gloo, "cpu"), steps)
    got, params = _fsdp_losses(rank, None, steps)  # the default group: dlcp
    return {"ref": ref, "got": got, "params": params, "stats": _group_state().stats()}


def test_fsdp2_over_the_backend_trains_as_over_gloo(tmp_path: Path) -> None:
    """FSDP2's all-gathers and reduce-scatters through the daemons: the same
    losses as over Gloo (fp32 summation order aside) and identical replicas."""
    steps = 6
    with loopback_daemons(tmp_path, 2, extra=TIMING) as ds:
        results = spawn(_fsdp, 2, tmp_path, sockets=[d.socket for d in ds], steps=steps)
    for res in results:
        torch.testing.assert_close(
            torch.tensor(res["got"]), torch.tensor(res["ref"]), rtol=1e-4, atol=1e-6
        )
        assert res["stats"]["fallbacks"] == 0
        assert res["stats"]["rounds"] >= steps * 6  # 3 gathers and 3 reductions a step
    for a, b in zip(results[0]["params"], results[1]["params"], strict=True):
        assert torch.equal(a, b)
