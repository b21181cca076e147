"""The shim's segment sized before a step needs it, and its per-bucket timeline.

Unit tests of `dlcp.shim.timeline` and the arena, and DDP steps through two
real dlcpd processes on loopback (no root): a model of known size never grows
its segment in the first step, and a step that outgrew it sizes it for the next.
"""

from __future__ import annotations

import math
import os
import resource
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

import dlcp.shim as dlcp
from dlcp.shim.arena import MIN_SEGMENT, Arena
from dlcp.shim.client import SealedSegment, Segment, memfd_supported
from dlcp.shim.regions import region_sizes
from dlcp.shim.state import segment_for
from dlcp.shim.timeline import PHASES, BucketTimes, StepTimes, Timeline
from tests.daemons import Daemon, loopback_daemons
from tests.test_shim import spawn

# gradients of ~2.4 MB: more than the smallest segment, in several DDP buckets
DDP = {"bucket_cap_mb": 0.5}
DAEMON_TIMING = {"timing": {"timeout": 5.0}}


def big_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(32, 384), nn.ReLU(), nn.Linear(384, 384), nn.ReLU(),
        nn.Linear(384, 384), nn.ReLU(), nn.Linear(384, 384), nn.ReLU(), nn.Linear(384, 4),
    )  # fmt: skip


def steps_of(ddp: nn.Module, gen: torch.Generator, steps: int) -> list[list[torch.Tensor]]:
    grads = []
    for _ in range(steps):
        ddp(torch.randn(4, 32, generator=gen)).pow(2).mean().backward()
        grads.append([p.grad.detach().clone() for p in ddp.parameters()])  # type: ignore[union-attr]
        for p in ddp.parameters():
            p.grad = None
    return grads


# -- timeline ------------------------------------------------------------------------


def _bucket(index: int, t0: float, in_daemon: float = 0.5) -> BucketTimes:
    b = BucketTimes(index, 1000, t0)
    b.encoded, b.written, b.submitted, b.left = t0 + 1, t0 + 2, t0 + 3, t0 + 3.5
    b.replied = t0 + 4
    b.daemon_s = in_daemon
    b.seen, b.decoding, b.decoded, b.completed = t0 + 6, t0 + 7, t0 + 9, t0 + 10
    return b


def test_bucket_phases_add_up_to_its_total() -> None:
    phases = _bucket(0, 100.0).phases()
    assert phases == {
        "encode": 1, "write": 1, "submit": 1, "queue": 0.5, "daemon": 0.5,
        "result": 2, "agree": 1, "decode": 2, "complete": 1, "total": 10,
    }  # fmt: skip
    assert sum(v for k, v in phases.items() if k != "total") == phases["total"]
    assert set(phases) == set(PHASES)


def test_step_phases_count_buckets_in_flight_and_time_in_the_hook() -> None:
    step = StepTimes([_bucket(0, 0.0), _bucket(1, 2.0)], finish_s=4.0)
    got = step.phases()
    assert got["step"] == 12.0  # first handed over at 0, last completed at 12
    assert got["hooks"] == 7.0  # 3.5 in each hook
    assert got["in_flight"] == 1.0  # 3..4 and 5..6 do not overlap
    assert got["finish"] == 4.0
    overlapping = StepTimes([_bucket(0, 0.0), _bucket(1, 0.5)])
    assert overlapping.phases()["in_flight"] == 2.0


def test_timeline_summary_is_medians_and_keeps_the_last_steps() -> None:
    tl = Timeline(keep=2)
    assert tl.summary()["phases"]["total"] is None  # nothing yet
    for step in range(3):
        for index in range(2):
            b = tl.bucket(index, 1000, 10.0 * step)
            b.completed = 10.0 * step + 1 + index  # only the total is known
        tl.end_step(0.1)
    got = tl.summary()
    assert got["steps"] == 2 and got["buckets"] == 4
    assert got["phases"]["total"] == 1.5 and got["phases"]["encode"] is None
    assert got["by_bucket"]["1"]["total"] == 2.0 and got["by_bucket"]["0"]["bytes"] == 1000
    assert tl.summary(last=1)["steps"] == 1
    tl.clear()
    assert tl.summary()["steps"] == 0


# -- segments and the arena ----------------------------------------------------------


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


@pytest.mark.parametrize("kind", ["sealed", "named"])
def test_a_new_segment_is_populated_so_the_first_write_takes_no_page_faults(kind: str) -> None:
    if kind == "sealed" and not memfd_supported():
        pytest.skip("no sealed memfd segments on this kernel")
    size = 8 << 20  # 2048 pages of 4 KiB
    name = f"dlcp-pop{os.getpid()}"
    seg = SealedSegment(name, size) if kind == "sealed" else Segment(name, size)
    try:
        view = np.frombuffer(seg.buf, dtype=np.uint8)
        before = _minor_faults()
        view[:] = 1
        faults = _minor_faults() - before
        del view
    finally:
        seg.close()
    assert faults < size // 4096 // 8, f"{faults} page faults writing a fresh segment"


class _FakeClient:
    def segment(self, seg: Any) -> None:
        pass


def test_arena_counts_a_steps_bytes_and_reserves_between_steps() -> None:
    from dlcp.core.layout import Layout
    from dlcp.wire.header import Codec

    arena = Arena(_FakeClient(), f"dlcp-res{os.getpid()}", sealed=False, unlink=False)
    try:
        sizes = region_sizes(Layout(50_000, Codec.FP32, 2, 1408))
        arena.take(sizes)
        first = arena.step_bytes
        assert first >= sizes.total
        arena.take(sizes)
        assert arena.step_bytes == 2 * first
        taken = arena.step_bytes
        arena.reset()
        assert arena.step_bytes == 0 and arena.grows == 0
        assert arena.segment.size == MIN_SEGMENT >= taken
        assert not arena.reserve(taken)  # large enough already
        assert arena.reserve(3 * taken) and arena.grows == 1
        assert arena.segment.size >= 3 * taken
        assert not arena.reserve(3 * taken)
    finally:
        arena.close()


def test_segment_for_a_model_holds_its_gradients_in_fp32() -> None:
    from dlcp.core.layout import Layout
    from dlcp.wire.header import Codec

    model = big_model()
    numel = sum(p.numel() for p in model.parameters())
    one_bucket = region_sizes(Layout(numel, Codec.FP32, 3, 1408)).total
    assert segment_for(model) >= one_bucket
    frozen = big_model()
    for p in frozen[0].parameters():
        p.requires_grad_(False)
    assert segment_for(frozen) < segment_for(model)


# -- DDP steps through real daemons ----------------------------------------------------


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[list[Daemon]]:
    with loopback_daemons(tmp_path, 2, extra=DAEMON_TIMING) as ds:
        yield ds


def _sizing_worker(rank: int, world: int, sockets: list[str], how: str) -> dict[str, Any]:
    model = big_model()
    state = dlcp.init(
        codec="fp32",
        socket=sockets[rank],
        round_timeout_s=30.0,
        model=model if how == "init" else None,
    )
    ddp = nn.parallel.DistributedDataParallel(model, **DDP)
    if how == "set_model":
        state.set_model(ddp)
    ddp.register_comm_hook(state, dlcp.hook)
    base = state.stats()["segment_grows"]  # set_model sizes it now, before any step
    grows = []
    grads = []
    gen = torch.Generator().manual_seed(500 + rank)
    for _ in range(3):
        grads += steps_of(ddp, gen, 1)
        grows.append(state.stats()["segment_grows"] - base)
    ref = nn.parallel.DistributedDataParallel(big_model(), **DDP)
    ref.register_comm_hook(None, allreduce_hook)
    out = {
        "grows": grows,
        "grads": grads,
        "ref": steps_of(ref, torch.Generator().manual_seed(500 + rank), 3),
        "timeline": state.timeline_summary(),
        "stats": state.stats(),
    }
    state.close()
    return out


@pytest.mark.parametrize("how", ["init", "set_model"])
def test_a_model_of_known_size_never_grows_the_segment(pair: list[Daemon], how: str) -> None:
    sockets = [d.socket for d in pair]
    for res in spawn(_sizing_worker, 2, pair[0].config.parent, sockets=sockets, how=how):
        assert res["stats"]["fallbacks"] == 0, res["stats"]["last_error"]
        assert res["grows"] == [0, 0, 0]  # not even in the first step
        for got, want in zip(res["grads"], res["ref"], strict=True):
            for g, w in zip(got, want, strict=True):
                torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-7)


def test_a_step_that_outgrew_the_segment_sizes_it_for_the_next(pair: list[Daemon]) -> None:
    sockets = [d.socket for d in pair]
    for res in spawn(_sizing_worker, 2, pair[0].config.parent, sockets=sockets, how="none"):
        assert res["stats"]["fallbacks"] == 0, res["stats"]["last_error"]
        grows = res["grows"]
        assert grows[0] >= 1  # unknown size: the first step grows it
        # then sized for the whole step, with room for DDP's rebuilt buckets
        assert grows[2] == grows[1] == grows[0]
        for got, want in zip(res["grads"], res["ref"], strict=True):
            for g, w in zip(got, want, strict=True):
                torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-7)
        tl = res["timeline"]
        assert tl["steps"] == 3 and tl["buckets"] >= 6  # several buckets a step
        for name in PHASES:
            value = tl["phases"][name]
            assert value is not None and math.isfinite(value), name
        for name in ("encode", "write", "submit", "daemon", "decode", "total"):
            assert tl["phases"][name] >= 0, name
        assert tl["step"]["in_flight"] >= 1
