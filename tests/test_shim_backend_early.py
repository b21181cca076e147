"""The backend's one-leg collectives hand their results over before the ranks'
agreement answers (`StepFinisher.finish_early`), against real dlcpd processes
on loopback: FSDP's next collective, which waits for this one, no longer
waits for the agreement too; and when another rank's round failed, the
results already handed over stand, the failed rank gets its own from the
process group's fallback, and every rank detaches."""

from __future__ import annotations

import threading
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dlcp.shim import pg
from tests.daemons import loopback_daemons
from tests.test_shim_backend import TIMING, _group_state, spawn

N = 1000  # each rank's chunk


def _held_agreement(rank: int, world: int) -> dict[str, Any]:
    """Every agreement's answer waits for `gate`, which this rank opens only
    once its collective's work completed (or after 30 s, to fail, not
    hang, where the work waits for the agreement)."""
    gate = threading.Event()
    start = pg.agree_start

    def held(failed: bool, maxima: Any, group: Any) -> Any:
        answer = start(failed, maxima, group)

        def later() -> tuple[bool, torch.Tensor]:
            gate.wait()
            return answer()

        return later

    pg.agree_start = held  # type: ignore[assignment]
    x = torch.arange(float(N * world)) * (rank + 1)
    rs = torch.empty(N)
    mine = torch.full((N,), float(rank))
    g = torch.empty(N * world)
    done: dict[str, bool] = {}
    for name, issue in (
        ("reduce_scatter", lambda: dist.reduce_scatter_tensor(rs, x, async_op=True)),
        ("all_gather", lambda: dist.all_gather_into_tensor(g, mine, async_op=True)),
    ):
        gate.clear()
        work = issue()
        deadline = time.monotonic() + 30.0
        while not work.is_completed() and time.monotonic() < deadline:
            time.sleep(0.01)
        done[name] = work.is_completed()
        gate.set()
        work.wait()
    dist.barrier()  # (waits for the worker: the agreements answered)
    pg.agree_start = start  # type: ignore[assignment]
    return {"done": done, "rs": rs, "g": g, "stats": _group_state().stats()}


def test_one_leg_results_are_handed_over_before_the_agreement_answers(tmp_path: Path) -> None:
    world = 3
    with loopback_daemons(tmp_path, world, extra=TIMING) as ds:
        results = spawn(_held_agreement, world, tmp_path, sockets=[d.socket for d in ds])
    total = torch.arange(float(N * world)) * sum(range(1, world + 1))
    gathered = torch.cat([torch.full((N,), float(r)) for r in range(world)])
    for rank, res in enumerate(results):
        assert res["done"] == {"reduce_scatter": True, "all_gather": True}
        assert torch.equal(res["rs"], total[rank * N : (rank + 1) * N])
        assert torch.equal(res["g"], gathered)
        assert res["stats"]["attached"] and res["stats"]["fallbacks"] == 0


def _late_failure(rank: int, world: int) -> dict[str, Any]:
    """Rank 2 takes its first reduce-scatter's round for failed after its
    reply came; ranks 0 and 1 have handed theirs over by then."""
    from dlcp.shim.stepstate import StepBuckets

    wait = StepBuckets.wait
    waits = [0]

    def forced(self: StepBuckets, deadline: float, timeout_s: float) -> None:
        wait(self, deadline, timeout_s)
        waits[0] += 1
        if rank == 2 and waits[0] == 1:
            next(iter(self)).error = "forced: this rank's round failed after its reply"

    StepBuckets.wait = forced  # type: ignore[method-assign]
    x = torch.arange(float(N * world)) * (rank + 1)
    first, second = torch.empty(N), torch.empty(N)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dist.reduce_scatter_tensor(first, x)
        dist.reduce_scatter_tensor(second, x * 2)  # detached: over the fallback
        dist.barrier()
    return {"first": first, "second": second, "stats": _group_state().stats()}


def test_another_ranks_failed_round_leaves_the_results_handed_over(tmp_path: Path) -> None:
    world = 3
    with loopback_daemons(tmp_path, world, extra=TIMING) as ds:
        results = spawn(_late_failure, world, tmp_path, sockets=[d.socket for d in ds])
    total = torch.arange(float(N * world)) * sum(range(1, world + 1))
    for rank, res in enumerate(results):
        mine = total[rank * N : (rank + 1) * N]
        assert torch.equal(res["first"], mine)  # ranks 0, 1: their round; 2: the fallback
        assert torch.equal(res["second"], mine * 2)
        stats = res["stats"]
        assert stats["failures"] == 1 and not stats["attached"]
        assert stats["fallbacks"] == 2  # the first (for rank 2) and the second
        assert "forced" in stats["last_error"] or rank != 2
