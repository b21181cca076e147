"""dlcp.shim on CUDA tensors, against real dlcpd processes on loopback.

The shim encodes on the tensor's device and moves bytes between the GPU and the
shared-memory segment through a pinned staging buffer (dlcp.shim.staging). These
tests need a CUDA device and skip without one: CI has none, so they are run on a
GPU machine by hand (the closing notes say where and when). Two ranks share GPU 0,
each talking to its own daemon, in one Gloo group (Gloo all-reduces CUDA tensors,
so PyTorch's default hook over the same group is the reference).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

import dlcp.shim as dlcp
from dlcp.shim.client import SealedSegment, Segment
from dlcp.shim.pinning import pin_mapping, unpin_mapping
from dlcp.shim.staging import Staging
from tests.daemons import loopback_daemons
from tests.test_shim import make_model, spawn, train_steps

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device (run on a GPU machine)"
)

DDP = {"bucket_cap_mb": 0.01}
DAEMON_TIMING = {"timing": {"timeout": 5.0}}
# relative error of a whole step's gradient against the default hook's
TOLERANCE = {"fp32": 1e-6, "fp16": 2e-3, "thc8": 0.05}
TOLERANCE["sketch"] = 0.05  # peeled exactly, but for a stalled core's few estimates
# a tensor larger than the staging buffer's first 1 MiB, so it must grow
BIG = (1 << 22) + 3


def _cuda_ddp(hook_state: Any, hook: Any) -> nn.Module:
    model = nn.parallel.DistributedDataParallel(make_model().to("cuda:0"), device_ids=[0], **DDP)
    model.register_comm_hook(hook_state, hook)
    return model


def _flat(grads: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([g.reshape(-1) for g in grads])


def _vector(rank: int) -> torch.Tensor:
    """Rank `rank`'s input to `all_reduce`: normal values, well inside fp16's range."""
    return torch.randn(BIG, generator=torch.Generator().manual_seed(rank))


def _cuda_worker(
    rank: int, world: int, sockets: list[str], codecs: list[str], steps: int
) -> dict[str, Any]:
    torch.cuda.set_device(0)
    ref = train_steps(_cuda_ddp(None, allreduce_hook), rank, steps)
    out: dict[str, Any] = {"ref": [[g.cpu() for g in step] for step in ref]}
    for codec in codecs:
        state = dlcp.init(codec=codec, socket=sockets[rank], round_timeout_s=30.0)
        grads = train_steps(_cuda_ddp(state, dlcp.hook), rank, steps)
        t = _vector(rank).to("cuda:0")
        dlcp.all_reduce(t)
        torch.cuda.synchronize()
        out[codec] = {
            "devices": sorted({g.device.type for step in grads for g in step}),
            "grads": [[g.cpu() for g in step] for step in grads],
            "mean_device": t.device.type,
            "mean": t.cpu(),
            "stats": state.stats(),
        }
        state.close()
    return out


def test_ddp_hook_on_cuda_matches_the_default_hook(tmp_path: Path) -> None:
    with loopback_daemons(tmp_path, 2, extra=DAEMON_TIMING) as ds:
        results = spawn(
            _cuda_worker,
            2,
            tmp_path,
            sockets=[d.socket for d in ds],
            codecs=list(TOLERANCE),
            steps=4,
        )
    want_mean = (_vector(0) + _vector(1)) / 2
    for codec, tol in TOLERANCE.items():
        for res in results:
            got = res[codec]
            assert got["devices"] == ["cuda"], codec
            assert got["mean_device"] == "cuda", codec
            stats = got["stats"]
            assert stats["attached"] and stats["fallbacks"] == 0, (codec, stats)
            assert stats["failures"] == 0 and stats["lost_lanes"] == 0, (codec, stats)
            for step, (g, w) in enumerate(zip(got["grads"], res["ref"], strict=True)):
                err = float((_flat(g) - _flat(w)).norm() / _flat(w).norm())
                assert err < tol, (codec, step, err)
            if codec == "fp32":
                torch.testing.assert_close(got["mean"], want_mean, rtol=0, atol=0)
            else:
                rel = float((got["mean"] - want_mean).norm() / want_mean.norm())
                assert rel < tol, (codec, rel)
        # every replica applies the same update, to the bit
        first = results[0][codec]["grads"]
        for res in results[1:]:
            for a, b in zip(res[codec]["grads"], first, strict=True):
                assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True)), codec
        assert torch.equal(results[0][codec]["mean"], results[1][codec]["mean"]), codec


@pytest.mark.parametrize("direct", [False, True])
@pytest.mark.parametrize("n", [1, 1000, (1 << 20) + 1, 3 << 20])
def test_staging_round_trips_cuda_bytes(n: int, direct: bool) -> None:
    """Through the staging buffer, and (`direct`) straight to and from a
    page-locked segment, at an offset inside it as a region is."""
    staging = Staging()
    src = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda:0")
    seg = SealedSegment("dlcp-test-staging", n + 4096)
    try:
        assert seg.pin_for_cuda() or not direct
        region = seg.buf[4096 - 8 : 4096 - 8 + n]  # not page-aligned
        staging.write(region, src, direct=direct)
        host = np.frombuffer(region, dtype=np.uint8)
        assert bytes(region) == src.cpu().numpy().tobytes()
        floats = host[: n - n % 4].view(np.float32)
        for view, want in ((host, src), (floats, src[: floats.size * 4].view(torch.float32))):
            back = staging.to_device(view, torch.device("cuda:0"), direct=direct)
            assert back.is_cuda and back.dtype == want.dtype
            # bit for bit (random bytes as floats hold NaNs, which equal nothing)
            assert torch.equal(back.view(torch.uint8), want.view(torch.uint8))
        # the result is a copy: the region may be reused at once
        back = staging.to_device(host, torch.device("cuda:0"), direct=direct)
        region[:] = bytes(n)
        assert torch.equal(back, src)
        del host, floats, view, region
    finally:
        seg.close()
    assert not seg.pinned


@pytest.mark.parametrize("kind", [Segment, SealedSegment])
def test_segments_are_page_locked_once_and_released_on_close(kind: type) -> None:
    seg = kind("dlcp-test-pin", 1 << 20)
    try:
        assert seg.pin_for_cuda() and seg.pinned
        assert seg.pin_for_cuda()  # tried once: no second registration
    finally:
        seg.close()
    assert not seg.pinned


def test_a_refused_registration_warns_and_leaves_cuda_working() -> None:
    """Registering a mapping twice is refused (cudaErrorHostMemoryAlreadyRegistered):
    the shim warns, stages instead, and the runtime's last error is cleared, so
    PyTorch's next kernel launch does not fail on it."""
    seg = SealedSegment("dlcp-test-pin-twice", 1 << 20)
    try:
        assert pin_mapping(seg.buf)
        with pytest.warns(RuntimeWarning, match="did not page-lock"):
            assert not pin_mapping(seg.buf)
        x = torch.arange(1000, device="cuda:0", dtype=torch.float32)
        assert float((x * 2).sum()) == 999_000.0
        unpin_mapping(seg.buf)
    finally:
        seg.close()
