"""Overlap mode (`dlcp.overlap`) against real dlcpd processes on loopback (no root).

With fp32 and loss bound 0 over two hosts the daemons' sums are exact and in no
order that matters (a + b), so the parameters after N steps of overlap mode
must be bitwise equal to the same per-parameter optimizer applied after each
step without overlap, bitwise equal on every rank, and within float tolerance
of torch.optim on PyTorch's default hook.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

import dlcp.shim as dlcp
from dlcp.errors import LocalError
from tests.daemons import Daemon, loopback_daemons
from tests.test_shim import make_model, spawn

DDP = {"bucket_cap_mb": 0.01}  # several buckets a step
DAEMON_TIMING = {"timing": {"timeout": 2.0}}
STEPS = 6
OPTIMIZERS: dict[str, tuple[type, dict[str, Any]]] = {
    "sgd": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9, "weight_decay": 1e-4}),
    "adamw": (torch.optim.AdamW, {"lr": 1e-3, "weight_decay": 0.01}),
}


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[list[Daemon]]:
    with loopback_daemons(tmp_path, 2, extra=DAEMON_TIMING) as ds:
        yield ds


def _train(ddp: nn.Module, opt: torch.optim.Optimizer, rank: int, steps: int) -> list[float]:
    gen = torch.Generator().manual_seed(1000 + rank)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    losses = []
    for _ in range(steps):
        x = torch.randn(8, 20, generator=gen)
        y = torch.randn(8, 5, generator=gen)
        opt.zero_grad(set_to_none=True)
        loss = (ddp(x) - y).pow(2).mean()
        loss.backward()
        opt.step()
        sched.step()
        losses.append(float(loss.detach()))
    return losses


def _params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def overlap_worker(rank: int, world: int, sockets: list[str], optimizer: str) -> dict[str, Any]:
    """Overlap on and off through the daemons, and torch.optim on the default hook."""
    cls, kw = OPTIMIZERS[optimizer]
    out: dict[str, Any] = {}
    for enabled in (True, False):
        model = make_model()
        ddp = nn.parallel.DistributedDataParallel(model, **DDP)
        state = dlcp.init(
            codec="fp32", socket=sockets[rank], model=model, round_timeout_s=30.0, strict=True
        )
        ddp.register_comm_hook(state, dlcp.hook)
        opt = dlcp.overlap(ddp, state, cls, enabled=enabled, **kw)
        losses = _train(ddp, opt, rank, STEPS)
        in_flight = bool(opt._inflight)
        if enabled:
            with pytest.raises(LocalError, match="flush"):
                opt.state_dict()
        opt.flush()
        saved = opt.state_dict()
        plain = cls(model.parameters(), **kw)  # torch.optim reads the same layout
        plain.load_state_dict(saved)
        out["on" if enabled else "off"] = {
            "params": _params(model),
            "losses": losses,
            "stats": state.stats(),
            "in_flight": in_flight,
            "state_keys": sorted(saved["state"][0]),
        }
        opt.close()
        state.close()
    model = make_model()
    ddp = nn.parallel.DistributedDataParallel(model, **DDP)
    ddp.register_comm_hook(None, allreduce_hook)
    out["torch"] = {"losses": _train(ddp, cls(ddp.parameters(), **kw), rank, STEPS)}
    out["torch"]["params"] = _params(model)
    return out


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_overlap_is_bitwise_the_per_parameter_optimizer_after_each_step(
    pair: list[Daemon], optimizer: str
) -> None:
    sockets = [d.socket for d in pair]
    results = spawn(overlap_worker, 2, pair[0].config.parent, sockets=sockets, optimizer=optimizer)
    for res in results:
        on, off = res["on"], res["off"]
        assert on["in_flight"] and not off["in_flight"]  # updates were left to the next forward
        for a, b in zip(on["params"], off["params"], strict=True):
            assert torch.equal(a, b)
        assert on["losses"] == off["losses"]
        for a, b in zip(on["params"], res["torch"]["params"], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        for s in (on["stats"], off["stats"]):
            assert s["attached"] and s["fallbacks"] == 0 and s["failures"] == 0
        assert on["stats"]["rounds"] == off["stats"]["rounds"] > STEPS
    for a, b in zip(results[0]["on"]["params"], results[1]["on"]["params"], strict=True):
        assert torch.equal(a, b)  # replicas identical


def refusals_worker(rank: int, world: int) -> list[str]:
    model = make_model()
    ddp = nn.parallel.DistributedDataParallel(model)
    state = dlcp.DlcpState(codec="fp32", socket="/nonexistent/dlcp.sock")
    said = []
    for cls, kw in ((torch.optim.LBFGS, {}), (torch.optim.SGD, {"lr": 0.1, "max_grad_norm": 1})):
        with pytest.raises(LocalError, match="flush") as err:
            dlcp.overlap(ddp, state, cls, **kw)
        said.append(str(err.value))
    opt = dlcp.overlap(ddp, state, torch.optim.SGD, lr=0.1)
    for call in (lambda: opt.step(lambda: 0.0), opt.clip_grad_norm_):
        with pytest.raises(LocalError, match="flush"):
            call()
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(torch.ones(()))
    with pytest.raises(LocalError, match="GradScaler"):
        scaler.step(opt)
    with pytest.raises(LocalError, match="auto"):
        dlcp.overlap(ddp, dlcp.DlcpState(codec="auto"), torch.optim.SGD, lr=0.1)
    return said


def test_what_needs_the_whole_gradient_is_refused_pointing_to_flush(tmp_path: Path) -> None:
    said = spawn(refusals_worker, 1, tmp_path)[0]
    assert "LBFGS" in said[0] and "max_grad_norm" in said[1]
