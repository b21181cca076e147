"""dlcp.shim against real dlcpd processes on loopback (127.0.0.x; no root needed).

Each rank talks to "its" daemon, so three daemons are three hosts; the ranks'
gradients must match PyTorch's default all-reduce hook.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import dlcp.shim as dlcp
from tests.daemons import Daemon, loopback_daemons
from tests.test_shim import NO_DAEMON, make_model, reference_grads, spawn, train_steps

DDP = {"bucket_cap_mb": 0.01}
DAEMON_TIMING = {"timing": {"timeout": 2.0}}


@pytest.fixture
def trio(tmp_path: Path) -> Iterator[list[Daemon]]:
    with loopback_daemons(tmp_path, 3, extra=DAEMON_TIMING) as ds:
        yield ds


def _assert_grads_close(res: dict[str, Any], rtol: float = 1e-6, atol: float = 1e-7) -> None:
    for step, (got, want) in enumerate(zip(res["grads"], res["ref"], strict=True)):
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(
                g, w, rtol=rtol, atol=atol, msg=lambda m, s=step: f"{s}: {m}"
            )


def _ddp_worker(
    rank: int, world: int, sockets: list[str], codecs: list[str], steps: int
) -> dict[str, Any]:
    out: dict[str, Any] = {"ref": reference_grads(rank, steps, **DDP)}
    for codec in codecs:
        state = dlcp.init(codec=codec, socket=sockets[rank], round_timeout_s=30.0)
        model = nn.parallel.DistributedDataParallel(make_model(), **DDP)
        model.register_comm_hook(state, dlcp.hook)
        grads = train_steps(model, rank, steps)
        t = torch.arange(1000.0) * (rank + 1)
        dlcp.all_reduce(t)
        out[codec] = {"grads": grads, "ref": out["ref"], "mean": t, "stats": state.stats()}
        state.close()
    return out


def test_fp32_hook_equals_the_default_hook_over_three_daemons(trio: list[Daemon]) -> None:
    sockets = [d.socket for d in trio]
    results = spawn(
        _ddp_worker, 3, trio[0].config.parent, sockets=sockets, codecs=["fp32"], steps=6
    )
    for res in (r["fp32"] for r in results):
        _assert_grads_close(res)
        torch.testing.assert_close(res["mean"], torch.arange(1000.0) * 2)
        stats = res["stats"]
        assert stats["attached"] and stats["attaches"] == 1
        assert stats["fallbacks"] == 0 and stats["failures"] == 0
        assert stats["rounds"] > 6  # several buckets per step
        assert stats["lost_lanes"] == 0
        assert not stats["segment_pinned"]  # CPU buckets: nothing page-locked


def test_two_ranks_per_host_are_summed_by_their_daemon(tmp_path: Path) -> None:
    with loopback_daemons(tmp_path, 2, extra=DAEMON_TIMING) as ds:
        sockets = [ds[0].socket, ds[1].socket, ds[0].socket, ds[1].socket]
        results = spawn(_ddp_worker, 4, tmp_path, sockets=sockets, codecs=["fp32"], steps=3)
        status = ds[0].client().status()
    for res in (r["fp32"] for r in results):
        _assert_grads_close(res)
        assert res["stats"]["attached"] and res["stats"]["fallbacks"] == 0
    assert status["counters"]["fallbacks"] == 0


def test_compressed_codecs_stay_close_to_the_default_hook(trio: list[Daemon]) -> None:
    sockets = [d.socket for d in trio]
    tolerance = {"fp16": 2e-3, "thc8": 0.05, "thc4": 0.5}
    results = spawn(
        _ddp_worker, 3, trio[0].config.parent, sockets=sockets, codecs=list(tolerance), steps=4
    )
    for codec, tol in tolerance.items():
        for res in (r[codec] for r in results):
            for got, want in zip(res["grads"], res["ref"], strict=True):
                g = torch.cat([t.reshape(-1) for t in got])
                w = torch.cat([t.reshape(-1) for t in want])
                assert float((g - w).norm() / w.norm()) < tol, codec
            assert res["stats"]["fallbacks"] == 0
        # every replica applies the same update
        first = results[0][codec]["grads"]
        for res in results[1:]:
            for a, b in zip(res[codec]["grads"], first, strict=True):
                assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True)), codec


def _one_bad_socket_worker(rank: int, world: int, sockets: list[str]) -> dict[str, Any]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        state = dlcp.init(codec="fp32", socket=sockets[rank], connect_timeout_s=2.0)
    model = nn.parallel.DistributedDataParallel(make_model(), **DDP)
    model.register_comm_hook(state, dlcp.hook)
    grads = train_steps(model, rank, 3)
    return {"grads": grads, "ref": reference_grads(rank, 3, **DDP), "stats": state.stats()}


def test_one_rank_without_its_daemon_sends_every_rank_to_the_fallback(
    trio: list[Daemon],
) -> None:
    sockets = [trio[0].socket, NO_DAEMON, trio[2].socket]
    results = spawn(_one_bad_socket_worker, 3, trio[0].config.parent, sockets=sockets)
    for res in results:
        _assert_grads_close(res, rtol=0, atol=0)
        assert not res["stats"]["attached"]
        assert "rank 1" in res["stats"]["last_error"]


def _late_failure_worker(
    rank: int, world: int, sockets: list[str], fail_at: int, steps: int
) -> dict[str, Any]:
    """Rank 2 takes its round for failed after its reply came, in step
    `fail_at` (as a reply over the loss bound would be), while ranks 0 and 1
    have theirs: they decode ahead of the agreement, which says the step
    failed, so every rank must send its untouched gradients over Gloo."""
    from dlcp.shim.stepstate import StepBuckets

    ends = [0]
    wait = StepBuckets.wait

    def forced(self: StepBuckets, deadline: float, timeout_s: float) -> None:
        wait(self, deadline, timeout_s)  # the step's end: every reply is in
        ends[0] += 1
        if rank == 2 and ends[0] == fail_at + 1:
            next(iter(self)).error = "forced: this rank's round failed after its reply"

    StepBuckets.wait = forced  # type: ignore[method-assign]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        state = dlcp.init(codec="fp32", socket=sockets[rank], retry_steps=1)
    model = nn.parallel.DistributedDataParallel(make_model(), **DDP)
    model.register_comm_hook(state, dlcp.hook)
    grads = train_steps(model, rank, steps)
    return {
        "grads": grads,
        "ref": reference_grads(rank, steps, **DDP),
        "stats": state.stats(),
        "ahead": len(state._parts.finisher._scratch),
    }


def test_a_step_failed_on_another_rank_falls_back_with_the_untouched_gradients(
    trio: list[Daemon],
) -> None:
    """The ranks whose rounds succeeded decoded their buckets while the
    agreement ran, into tensors of their own: the fallback of a step another
    rank failed still sends the gradients as backward left them (a decode
    into the bucket would have averaged the mean with rank 2's own gradient)."""
    sockets = [d.socket for d in trio]
    results = spawn(_late_failure_worker, 3, trio[0].config.parent, sockets=sockets,
                    fail_at=2, steps=5)  # fmt: skip
    for rank, res in enumerate(results):
        assert res["stats"]["failures"] == 1
        assert res["stats"]["fallbacks"] >= 1
        if rank < 2:
            assert res["ahead"] > 0  # the ranks that had their rounds decoded ahead
        _assert_grads_close(res)
        step2 = zip(res["grads"][2], res["ref"][2], strict=True)
        assert all(torch.equal(g, w) for g, w in step2)  # the fallback is the default hook


def _daemon_dies_worker(
    rank: int,
    world: int,
    daemons: list[Daemon],
    victim_pid: int,
    steps: int,
    kill_at: int,
    restart_at: int,
) -> dict[str, Any]:
    victim = daemons[1]
    state = dlcp.init(
        codec="fp32", socket=daemons[rank].socket, retry_steps=2, round_timeout_s=20.0
    )
    model = nn.parallel.DistributedDataParallel(make_model(), **DDP)
    model.register_comm_hook(state, dlcp.hook)
    attached: list[bool] = []

    def between(step: int) -> None:
        attached.append(state.attached)
        if rank == 0 and step == kill_at:
            os.kill(victim_pid, signal.SIGKILL)
        if rank == 0 and step == restart_at:
            os.unlink(victim.socket)  # left behind by the killed daemon
            victim.start()
        torch.distributed.barrier()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        grads = train_steps(model, rank, steps, between=between)
    attached.append(state.attached)
    if rank == 0:
        victim.stop()
    return {
        "grads": grads,
        "ref": reference_grads(rank, steps, **DDP),
        "stats": state.stats(),
        "attached": attached,
        "warnings": sum("dlcp" in str(w.message) for w in caught),
    }


def test_daemon_killed_mid_training_falls_back_and_reattaches(tmp_path: Path) -> None:
    with loopback_daemons(tmp_path, 3, extra=DAEMON_TIMING) as ds:
        assert ds[1].proc is not None
        results = spawn(
            _daemon_dies_worker,
            3,
            tmp_path,
            daemons=[dataclasses.replace(d, proc=None) for d in ds],
            victim_pid=ds[1].proc.pid,
            steps=10,
            kill_at=3,
            restart_at=5,
        )
    for res in results:
        _assert_grads_close(res)
        stats = res["stats"]
        # attached at first; the step after the kill falls back; back by the end
        assert res["attached"][:4] == [True] * 4
        assert not any(res["attached"][4:6])
        assert res["attached"][-1]
        assert stats["attaches"] == 2 and stats["fallbacks"] > 0
        assert res["warnings"] == 1
    assert len({str(r["attached"]) for r in results}) == 1  # every rank took the same path


def _nan_worker(rank: int, world: int, sockets: list[str]) -> dict[str, Any]:
    state = dlcp.init(codec="thc8", socket=sockets[rank], retry_steps=2)
    model = nn.parallel.DistributedDataParallel(make_model(), **DDP)
    model.register_comm_hook(state, dlcp.hook)
    attached: list[bool] = []

    def between(step: int) -> None:
        attached.append(state.attached)
        if rank == 1 and step == 2:  # one rank's gradients turn non-finite
            with torch.no_grad():
                next(model.parameters())[0, 0] = float("nan")
        if rank == 1 and step == 3:
            with torch.no_grad():
                next(model.parameters())[0, 0] = 0.0

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        grads = train_steps(model, rank, 7, between=between)
    attached.append(state.attached)
    return {"grads": grads, "attached": attached, "stats": state.stats()}


def test_non_finite_gradients_on_one_rank_fall_back_on_every_rank(trio: list[Daemon]) -> None:
    sockets = [d.socket for d in trio]
    results = spawn(_nan_worker, 3, trio[0].config.parent, sockets=sockets)
    for rank, res in enumerate(results):
        # THC cannot encode NaN: the step goes over Gloo (NaN, as the default hook
        # gives), every rank agrees, and dlcp is back two steps later
        assert any(torch.isnan(g).any() for g in res["grads"][2])
        assert all(torch.isfinite(g).all() for g in res["grads"][5])
        assert res["attached"] == [True, True, True, False, False, True, True, True]
        assert res["stats"]["failures"] == 1
        # rank 1 knows why; the others saw their rounds fail (nothing came from host 1)
        assert "encode" in res["stats"]["last_error"] if rank == 1 else res["stats"]["last_error"]
