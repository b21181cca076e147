"""dlcp as a torch.distributed backend on the emulated cluster: one rank per
namespace host, one dlcpd each, 5 % random loss on one host's port.

The ranks `init_process_group("cpu:dlcp")` and run the collectives the backend
carries through the daemons (all-reduce SUM and AVG, reduce-scatter,
all-gather, async) and DDP without a hook; every answer is compared in the
rank with the same collective over a Gloo group of the same ranks. fp32 with
loss bound 0 (the backend's default) is lossless, so the sums of integer-valued
floats are exact despite the loss. Needs root (CI); skipped otherwise.

The ranks run this module: `python -m tests.test_backend_netns --out DIR`.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.test_shim_netns import HOSTS, _load, _start_ranks, _wait, cluster  # noqa: F401

pytestmark = pytest.mark.netns

N = 40_003  # lanes of a rank's chunk: 114 packets at MTU 1500, the last one short


def _rank_main(argv: Sequence[str]) -> int:
    import torch.distributed as dist
    from torch import nn

    import dlcp.shim as dlcp
    from dlcp.shim import backend as dlcp_backend
    from tests.test_shim import make_model, train_steps

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    dlcp.backend_options(round_timeout_s=30.0)
    dist.init_process_group("cpu:dlcp")
    rank, world = dist.get_rank(), dist.get_world_size()
    gloo = dist.new_group(backend="gloo")
    gen = torch.Generator().manual_seed(100 + rank)
    got: dict[str, list[torch.Tensor]] = {}
    want: dict[str, list[torch.Tensor]] = {}

    def keep(name: str, mine: torch.Tensor, ref: torch.Tensor) -> None:
        got.setdefault(name, []).append(mine)
        want.setdefault(name, []).append(ref)

    for _ in range(3):
        x = torch.randint(-1000, 1000, (world * N,), generator=gen).float()
        s, r = x.clone(), x.clone()
        dist.all_reduce(s)
        dist.all_reduce(r, group=gloo)
        keep("sum", s, r)
        a = x.clone()
        work = dist.all_reduce(a, op=dist.ReduceOp.AVG, async_op=True)
        assert work is not None
        work.wait()
        keep("avg", a, r / world)
        rs = torch.empty(N)
        dist.reduce_scatter_tensor(rs, x)
        keep("reduce_scatter", rs, r[rank * N : (rank + 1) * N])
        mine = torch.randn(N, generator=gen)
        g = torch.empty(world * N)
        dist.all_gather_into_tensor(g, mine)
        parts = [torch.empty(N) for _ in range(world)]
        dist.all_gather(parts, mine, group=gloo)
        keep("all_gather", g, torch.cat(parts))
    ref = nn.parallel.DistributedDataParallel(make_model(), process_group=gloo, bucket_cap_mb=0.01)
    ours = nn.parallel.DistributedDataParallel(make_model(), bucket_cap_mb=0.01)  # no hook
    want["ddp"] = [g for step in train_steps(ref, rank, 4) for g in step]
    got["ddp"] = [g for step in train_steps(ours, rank, 4) for g in step]
    (group,) = dlcp_backend.groups()
    torch.save(
        {"got": got, "want": want, "stats": group.state.stats()},
        os.path.join(args.out, f"rank{rank}.pt"),
    )
    dist.barrier(group=gloo)
    dist.destroy_process_group()
    return 0


def test_the_backend_s_collectives_and_ddp_equal_gloo_s_under_loss(
    cluster: Any,  # noqa: F811
    tmp_path: Path,
) -> None:
    cluster.set_loss(1, 5.0)
    argv = [sys.executable, "-m", "tests.test_backend_netns", "--out", str(tmp_path)]
    _wait(_start_ranks(cluster, argv, tmp_path), tmp_path, 300)
    results = _load(tmp_path)
    assert len(results) == HOSTS
    for res in results:
        got, want = res["got"], res["want"]
        for name in ("sum", "reduce_scatter", "all_gather"):  # exact: lossless fp32
            for g, w in zip(got[name], want[name], strict=True):
                assert torch.equal(g, w), name
        for g, w in zip(got["avg"], want["avg"], strict=True):
            torch.testing.assert_close(g, w)
        for g, w in zip(got["ddp"], want["ddp"], strict=True):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
        stats = res["stats"]
        assert stats["attached"] and stats["fallbacks"] == 0, stats
        assert stats["rounds"] >= 12  # 4 collectives x 3, then DDP's buckets
    assert all(torch.equal(results[0]["got"]["all_gather"][i], r["got"]["all_gather"][i])
               for r in results for i in range(3))  # fmt: skip


if __name__ == "__main__":
    from dlcp.shim.leave import exit_process

    exit_process(_rank_main(sys.argv[1:]))  # not sys.exit: see dlcp.shim.leave
