"""dlcp.shim on the emulated cluster: one rank per namespace host, one dlcpd each.

(a) fp32 with loss bound 0 gives the default hook's gradients; (b) thc8 with 5 %
loss on one link trains digits to within a point of Gloo, replicas identical;
(c) a daemon killed mid-training: the job goes on over Gloo, reattaches once
the daemon is back, and ends cleanly. Needs root (CI); skipped otherwise.

The ranks run this module: `python -m tests.test_shim_netns --out DIR ...`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
HOSTS = 3
MASTER_PORT = 29517

pytestmark = pytest.mark.netns


# -- the rank (runs inside a host namespace) ---------------------------------------


def _rank_main(argv: Sequence[str]) -> int:
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    import dlcp.shim as dlcp
    from tests.test_shim import make_model

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--max-steps", type=int, default=400)
    ap.add_argument("--control", default=None, help="stop when this file exists (rank 0)")
    ap.add_argument("--codec", default="fp32")
    ap.add_argument("--bound", type=float, default=0.0)
    args = ap.parse_args(argv)

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    state = dlcp.init(codec=args.codec, loss_bound=args.bound, retry_steps=3, round_timeout_s=30)
    ddp = {"bucket_cap_mb": 0.01}
    ours = nn.parallel.DistributedDataParallel(make_model(), **ddp)
    ours.register_comm_hook(state, dlcp.hook)
    ref = nn.parallel.DistributedDataParallel(make_model(), **ddp)
    ref.register_comm_hook(None, allreduce_hook)
    gen = torch.Generator().manual_seed(1000 + rank)
    grads: list[list[torch.Tensor]] = []
    want: list[list[torch.Tensor]] = []
    attached: list[bool] = []
    step = 0
    while True:
        if args.control is None:
            stop = step >= args.steps
        else:
            flag = torch.tensor([float(os.path.exists(args.control) or step >= args.max_steps)])
            dist.broadcast(flag, 0)
            stop = bool(flag.item())
        if stop:
            break
        attached.append(state.attached)
        if rank == 0 and args.control is not None:
            progress = {"step": step, "attached": state.attached, "attaches": state.attaches}
            Path(args.control + ".progress").write_text(json.dumps(progress))
        x = torch.randn(8, 20, generator=gen)
        for model, out in ((ours, grads), (ref, want)):
            model(x).pow(2).mean().backward()
            out.append([p.grad.detach().clone() for p in model.parameters()])  # type: ignore[union-attr]
            model.zero_grad(set_to_none=True)
        step += 1
    torch.save(
        {"grads": grads, "ref": want, "attached": attached, "stats": state.stats()},
        os.path.join(args.out, f"rank{rank}.pt"),
    )
    state.close()
    dist.destroy_process_group()
    return 0


# -- the test side ------------------------------------------------------------------


@contextlib.contextmanager
def _cluster(round_timeout_s: float) -> Iterator[Any]:
    from dlcp.testbed import Testbed, TestbedSpec

    root = Path(tempfile.mkdtemp(prefix="dlcp-shim-", dir="/tmp"))
    tb = Testbed.up(TestbedSpec(hosts=HOSTS, name="shimnet"), state_root=root)
    try:
        tb.start_daemons({"timing": {"timeout": round_timeout_s}, "daemon": {"metrics_port": 0}})
        yield tb
    finally:
        tb.down()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def cluster() -> Iterator[Any]:
    """Daemons with the default round timeout: a round that fails here is a
    fault, not a scheduling hiccup of this shared VM."""
    with _cluster(10.0) as tb:
        yield tb


@pytest.fixture
def quick_cluster() -> Iterator[Any]:
    """Daemons whose rounds time out after 3 s: a dead peer daemon is noticed soon."""
    with _cluster(3.0) as tb:
        yield tb


def _env(tb: Any, rank: int) -> dict[str, str]:
    return {
        "MASTER_ADDR": tb.address(0),
        "MASTER_PORT": str(MASTER_PORT),
        "RANK": str(rank),
        "WORLD_SIZE": str(HOSTS),
        "LOCAL_RANK": "0",
        "GLOO_SOCKET_IFNAME": tb.hosts[rank].interfaces[0],
        "PYTHONPATH": str(ROOT),
        "OMP_NUM_THREADS": "1",
    }


def _start_ranks(tb: Any, argv: list[str], logs: Path) -> list[subprocess.Popen[Any]]:
    procs = []
    for i in range(HOSTS):
        with open(logs / f"rank{i}.log", "wb") as log:
            procs.append(tb.popen(i, argv, env=_env(tb, i), cwd=str(ROOT), stdout=log, stderr=log))
    return procs


def _wait(procs: list[subprocess.Popen[Any]], logs: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for i, p in enumerate(procs):
        try:
            rc = p.wait(max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"rank {i} timed out:\n{(logs / f'rank{i}.log').read_text()[-3000:]}")
        assert rc == 0, f"rank {i} exited {rc}:\n{(logs / f'rank{i}.log').read_text()[-3000:]}"


def _load(out: Path) -> list[dict[str, Any]]:
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(HOSTS)]


def _assert_equal_to_reference(res: dict[str, Any]) -> None:
    assert len(res["grads"]) == len(res["ref"]) > 0
    for step, (got, want) in enumerate(zip(res["grads"], res["ref"], strict=True)):
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, msg=lambda m, s=step: f"step {s}: {m}")


def test_fp32_hook_equals_the_default_hook_across_namespaces(cluster: Any, tmp_path: Path) -> None:
    argv = [sys.executable, "-m", "tests.test_shim_netns", "--out", str(tmp_path), "--steps", "10"]
    _wait(_start_ranks(cluster, argv, tmp_path), tmp_path, 300)
    for res in _load(tmp_path):
        _assert_equal_to_reference(res)
        stats = res["stats"]
        assert all(res["attached"]) and stats["fallbacks"] == 0 and stats["failures"] == 0
        assert stats["rounds"] >= 10


def _digits(tb: Any, tmp: Path, name: str, args: list[str]) -> dict[str, Any]:
    out = tmp / f"{name}.json"
    procs = []
    for i in range(HOSTS):
        argv = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nnodes={HOSTS}",
            f"--node-rank={i}",
            "--nproc-per-node=1",
            f"--master-addr={tb.address(0)}",
            f"--master-port={MASTER_PORT}",
            str(ROOT / "examples" / "train_digits.py"),
            "--epochs=20",
            f"--json={out}",
            *args,
        ]
        env = {k: v for k, v in _env(tb, i).items() if k not in ("RANK", "WORLD_SIZE")}
        env["TMPDIR"] = str(tmp)  # torchrun leaves a torchelastic_* folder behind
        with open(tmp / f"{name}{i}.log", "wb") as log:
            procs.append(tb.popen(i, argv, env=env, cwd=str(ROOT), stdout=log, stderr=log))
    for i, p in enumerate(procs):
        rc = p.wait(900)
        assert rc == 0, f"{name} rank {i}: {(tmp / f'{name}{i}.log').read_text()[-3000:]}"
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def _warnings(tb: Any, tmp: Path, name: str) -> list[str]:
    """The ranks' and daemons' log lines that say why the shim left its daemon."""
    logs = [(f"rank {i}", tmp / f"{name}{i}.log") for i in range(HOSTS)]
    logs += [(f"dlcpd {i}", tb.hosts[i].log) for i in range(HOSTS)]
    return [
        f"{who}: {line}"
        for who, path in logs
        if path.exists()
        for line in path.read_text(errors="replace").splitlines()
        if any(w in line for w in ("Warning", "WARNING", "ERROR", "failed"))
    ][-40:]


def test_thc8_with_five_percent_loss_trains_digits_like_gloo(cluster: Any, tmp_path: Path) -> None:
    gloo = _digits(cluster, tmp_path, "gloo", ["--backend=gloo"])
    cluster.set_loss(1, 5.0)
    ours = _digits(
        cluster, tmp_path, "dlcp", ["--backend=dlcp", "--codec=thc8", "--loss-bound=0.05"]
    )
    assert ours["replicas_identical"] and gloo["replicas_identical"]
    assert ours["final_acc"] >= gloo["final_acc"] - 0.01, (ours["final_acc"], gloo["final_acc"])
    shim = ours["shim"]
    why = "\n".join([json.dumps(shim), *_warnings(cluster, tmp_path, "dlcp")])
    assert shim["attached"] and shim["fallbacks"] == 0, why
    assert ours["steps"] == gloo["steps"]


def _progress(control: Path) -> dict[str, Any]:
    try:
        data: dict[str, Any] = json.loads(Path(str(control) + ".progress").read_text())
    except (OSError, ValueError):
        return {"step": -1, "attached": False, "attaches": 0}
    return data


def _until(control: Path, cond: Any, procs: list[subprocess.Popen[Any]], what: str) -> None:
    deadline = time.monotonic() + 240
    while not cond(_progress(control)):
        if any(p.poll() is not None for p in procs):
            pytest.fail(f"a rank exited while waiting for {what}")
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}: {_progress(control)}")
        time.sleep(0.05)


def test_daemon_killed_mid_training_falls_back_and_reattaches(
    quick_cluster: Any, tmp_path: Path
) -> None:
    tb = quick_cluster
    control = tmp_path / "stop"
    argv = [sys.executable, "-m", "tests.test_shim_netns", "--out", str(tmp_path)]
    procs = _start_ranks(tb, [*argv, "--control", str(control)], tmp_path)
    _until(control, lambda p: p["step"] >= 5, procs, "step 5")
    victim = next(p for p in tb.processes("daemon") if p["host"] == 1)
    os.kill(victim["pid"], signal.SIGKILL)
    _until(control, lambda p: not p["attached"], procs, "the fallback")
    fell_back_at = _progress(control)["step"]
    _until(control, lambda p: p["step"] >= fell_back_at + 4, procs, "steps on the fallback")
    host = tb.hosts[1]
    host.socket.unlink(missing_ok=True)
    with open(host.log, "ab") as log:
        tb.popen(
            1,
            [sys.executable, "-m", "dlcp.daemon", "--config", str(host.config)],
            env={"PYTHONPATH": str(ROOT)},
            stdout=log,
            stderr=log,
            start_new_session=True,
        )
    _until(control, lambda p: p["attached"] and p["attaches"] >= 2, procs, "the reattach")
    _until(control, lambda p: p["step"] >= fell_back_at + 12, procs, "steps after the reattach")
    control.touch()
    _wait(procs, tmp_path, 120)
    results = _load(tmp_path)
    for res in results:
        _assert_equal_to_reference(res)
        stats = res["stats"]
        assert res["attached"][0] and res["attached"][-1]
        assert not all(res["attached"])
        assert stats["attaches"] >= 2 and stats["fallbacks"] > 0
    assert len({str(r["attached"]) for r in results}) == 1  # every rank took the same path


if __name__ == "__main__":
    from dlcp.shim.leave import exit_process

    exit_process(_rank_main(sys.argv[1:]))  # not sys.exit: see dlcp.shim.leave
