"""The PyTorch baselines of the benches: the backend table and its checks, the
hooks in DDP, the cast all-reduce on loopback, and the "fastest baseline with
no worse accuracy" selection (no root)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from dlcp.bench import cli as bench_cli
from dlcp.bench.backends import HOOK_CODECS, TABLE, gloo_ifnames
from dlcp.bench.common import BACKENDS, BenchError, check_backends, parse_backends
from dlcp.bench.fair import fastest_fair, no_worse, versus
from dlcp.cli import build_parser as parser


def test_every_backend_name_parses_and_the_old_ones_are_kept() -> None:
    for old in ("dlcp", "gloo", "gloo-prio", "dlcp-noprio", "dlcp-nobound", "dlcp-1path"):
        assert old in BACKENDS
    names = "gloo-fp16,gloo-bf16,gloo-powersgd,gloo-fp16-prio,gloo-bf16-prio,gloo-powersgd-prio"
    assert parse_backends(names) == names.split(",")
    assert {TABLE[n].codec("thc8") for n in names.split(",")} == {"fp16", "bf16", "powersgd"}
    assert TABLE["dlcp"].codec("thc8") == "thc8" and TABLE["gloo"].codec("thc8") == "fp32"
    assert all(TABLE[n].prio for n in names.split(",") if n.endswith("-prio"))
    assert {b.hook for b in TABLE.values()} <= set(HOOK_CODECS)


def test_bad_names_and_refused_backends_are_clear_errors() -> None:
    with pytest.raises(BenchError, match="unknown backend 'gloo-fp8'; valid backends: dlcp, "):
        parse_backends("dlcp,gloo-fp8")
    with pytest.raises(BenchError, match="bench allreduce cannot run gloo-powersgd: PowerSGD"):
        check_backends(["dlcp", "gloo-powersgd"], "allreduce")
    check_backends(["dlcp", "gloo-powersgd", "gloo-fp16-prio"], "ddp")
    check_backends(["gloo-powersgd-prio"], "train")


@pytest.mark.parametrize(
    ("bench", "argv", "match"),
    [
        ("allreduce", ["--backends", "dlcp,gloo-powersgd"], "low rank"),
        ("ddp", ["--backends", "dlcp,dlcp-1path"], "ablations"),
    ],
)
def test_the_benches_refuse_what_they_cannot_run(bench: str, argv: list[str], match: str) -> None:
    args = parser().parse_args(["bench", bench, *argv])
    make = {"allreduce": bench_cli.allreduce_options, "ddp": bench_cli.ddp_options}[bench]
    with pytest.raises(BenchError, match=match):
        make(args)


def test_bench_ddp_takes_a_scenario_and_the_baselines() -> None:
    args = parser().parse_args(
        ["bench", "ddp", "--scenario", "loss", "--loss", "5", "--backends",
         "dlcp,gloo,gloo-fp16,gloo-bf16,gloo-powersgd,gloo-fp16-prio"]
    )  # fmt: skip
    opts = bench_cli.ddp_options(args)
    assert opts.setup.scenario == "loss" and opts.setup.loss_pct == 5.0
    from dlcp.bench.ddp import _record, phases

    assert phases(opts.backends) == {
        False: ["dlcp", "gloo", "gloo-fp16", "gloo-bf16", "gloo-powersgd"],
        True: ["gloo-fp16-prio"],
    }
    rec = _record(opts, "gloo-powersgd")
    assert rec["codec"] == "powersgd" and rec["powersgd_rank"] >= 1
    assert rec["loss_pct"] == 5.0 and rec["gloo_ifnames"] == "eth0"
    assert _record(opts, "gloo-fp16-prio")["alternated_with"] == ["gloo-fp16-prio"]
    with pytest.raises(SystemExit):
        parser().parse_args(["bench", "ddp", "--scenario", "pathdown"])


def test_gloo_uses_every_interface_of_a_two_path_testbed() -> None:
    assert gloo_ifnames(1) == "eth0" and gloo_ifnames(2) == "eth0,eth1"
    args = parser().parse_args(["bench", "allreduce", "--scenario", "multipath"])
    from dlcp.bench.allreduce import _record

    rec = _record(bench_cli.allreduce_options(args), "gloo", "fp32")
    assert rec["paths"] == 2 and rec["gloo_ifnames"] == "eth0,eth1"


def _hooks_in_ddp(out: str) -> None:
    """World of one over Gloo in a child process (a process group's Gloo
    threads in pytest's own process abort it when a later test forks), which
    ends without interpreter finalization (Gloo's threads abort that too)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from dlcp.bench.hooks import register

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        grads = {}
        for hook in HOOK_CODECS:
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 4))
            ddp = DDP(model, bucket_cap_mb=0.002)  # several buckets
            register(ddp, hook)
            x = torch.randn(8, 32)
            for _ in range(4):
                ddp.zero_grad()
                ddp(x).square().sum().backward()
            grads[hook] = torch.cat([p.grad.flatten() for p in model.parameters()])
        torch.save(grads, out)
    finally:
        dist.destroy_process_group()
    from dlcp.shim.leave import exit_process

    exit_process(0)  # no finalization racing Gloo's threads (dlcp.shim.leave)


def test_the_hooks_register_and_reduce_in_ddp(tmp_path: Path) -> None:
    """Every hook runs past PowerSGD's start, in DDP over a world of one."""
    import torch.multiprocessing as mp

    out = str(tmp_path / "grads.pt")
    ctx = mp.get_context("spawn")
    child = ctx.Process(target=_hooks_in_ddp, args=(out,))
    child.start()
    child.join(300)
    assert child.exitcode == 0
    grads = torch.load(out)
    exact = grads["default"]
    for hook in ("fp16", "bf16"):
        err = float((grads[hook] - exact).norm() / exact.norm())
        assert 0 < err < (1e-3 if hook == "fp16" else 1e-2), (hook, err)
    assert torch.isfinite(grads["powersgd"]).all() and not torch.equal(grads["powersgd"], exact)
    from dlcp.bench.hooks import register

    with pytest.raises(ValueError, match="unknown hook"):
        register(None, "fp8")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run_cast(cast: str, world: int = 2) -> list[dict[str, Any]]:
    """`world` ar_worker ranks over Gloo on loopback; their "result" events."""
    port = _free_port()
    argv = [
        sys.executable,
        "-m",
        "dlcp.bench.ar_worker",
        "--backend",
        "gloo",
        "--world",
        str(world),
    ]
    argv += ["--elements", "20000", "--iters", "2", "--warmup", "1", "--master", "127.0.0.1"]
    argv += ["--port", str(port), "--timeout", "60", "--cast", cast, "--check"]
    procs = [
        subprocess.Popen(
            [*argv, "--rank", str(r)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        for r in range(world)
    ]
    watchdog = threading.Timer(120.0, lambda: [p.kill() for p in procs])
    watchdog.start()

    def events(name: str) -> list[dict[str, Any]]:
        out = []
        for p in procs:
            msg = json.loads(p.stdout.readline())  # type: ignore[union-attr]
            assert msg["event"] == name, msg
            out.append(msg)
        return out

    def go() -> None:
        for p in procs:
            p.stdin.write("go\n")  # type: ignore[union-attr]
            p.stdin.flush()  # type: ignore[union-attr]

    try:
        events("joined")
        go()
        events("warm")
        for _ in range(2):
            go()
            events("iter")
        results = events("result")
        go()
        for p in procs:
            assert p.wait(timeout=60) == 0
    finally:
        watchdog.cancel()
        for p in procs:
            p.kill()
            p.wait()
    return results


@pytest.mark.parametrize(("cast", "most"), [("none", 0.0), ("fp16", 1e-3), ("bf16", 1e-2)])
def test_the_cast_allreduce_computes_the_mean(cast: str, most: float) -> None:
    """Rank 0 checks the mean of the cast all-reduce against the exact one:
    fp32 exact, fp16 and bf16 within their rounding (and not exact)."""
    results = _run_cast(cast)
    error = results[0]["error"]
    assert error is not None and error <= most
    assert (error > 0) == (cast != "none")
    assert results[1]["error"] is None  # only rank 0 checks
    assert all(len(r["times_s"]) == 2 for r in results)


def _ar(backend: str, codec: str, p50: float, err: float | None, **kw: Any) -> dict[str, Any]:
    rec = {"backend": backend, "codec": codec, "scenario": "clean", "p50_s": p50, "p99_s": p50}
    return {**rec, "size_bytes": 1, "result_error": err, **kw}


def _tr(backend: str, codec: str, tta: float | None, acc: float) -> dict[str, Any]:
    rec = {"backend": backend, "codec": codec, "scenario": "clean", "target_acc": 0.9}
    return {**rec, "tta_s": tta, "final_acc": acc, "step_p50_s": 0.1}


def _ddp(backend: str, codec: str, p50: float) -> dict[str, Any]:
    return {"backend": backend, "codec": codec, "scenario": "clean", "grad_bytes": 1, "p50_s": p50}


def test_allreduce_baseline_is_the_fastest_with_no_larger_error() -> None:
    recs = [
        _ar("dlcp", "fp16", 0.36, 0.0024),
        _ar("gloo", "fp32", 0.58, 0.0),
        _ar("gloo-fp16", "fp16", 0.40, 0.0004),
        _ar("gloo-bf16", "bf16", 0.30, 0.0033),  # fastest, but less accurate
        _ar("gloo-prio", "fp32", 0.20, 0.0, error="boom"),  # failed: never chosen
        _ar("gloo", "fp32", 0.10, 0.0, scenario="loss", loss_pct=5.0),  # another setting
    ]
    base = fastest_fair(recs[0], recs)
    assert base is recs[2]
    assert versus(recs[0], recs) == "0.90x gloo-fp16" and versus(recs[2], recs) == "-"
    assert fastest_fair(_ar("dlcp", "thc8", 0.3, 0.02), recs) is recs[3]
    assert fastest_fair(_ar("dlcp", "fp32", 0.6, 0.0), recs) is recs[1]
    assert fastest_fair(recs[0], [recs[0]]) is None and versus(recs[0], [recs[0]]) == "none"


def test_training_baseline_is_within_half_a_point_of_accuracy() -> None:
    mine = _tr("dlcp", "fp16", 6.0, 0.950)
    recs = [
        mine,
        _tr("gloo", "fp32", 10.0, 0.953),
        _tr("gloo-fp16", "fp16", 7.0, 0.946),  # 0.4 points below: no worse
        _tr("gloo-powersgd", "powersgd", 3.0, 0.940),  # 1 point below
        _tr("gloo-bf16", "bf16", None, 0.960),  # never reached: after every one that did
    ]
    assert fastest_fair(mine, recs) is recs[2]
    assert no_worse(recs[4], mine) and not no_worse(recs[3], mine)
    assert fastest_fair(mine, [mine, recs[4]]) is recs[4]


def test_ddp_baseline_goes_by_the_codecs_significant_bits() -> None:
    recs = [
        _ddp("gloo", "fp32", 0.75),
        _ddp("gloo-fp16", "fp16", 0.40),
        _ddp("gloo-bf16", "bf16", 0.38),
        _ddp("gloo-powersgd", "powersgd", 0.10),  # low rank: judged only by training
    ]
    assert fastest_fair(_ddp("dlcp", "fp32", 0.9), recs) is recs[0]
    assert fastest_fair(_ddp("dlcp", "fp16", 0.5), recs) is recs[1]  # bf16 keeps fewer bits
    assert fastest_fair(_ddp("dlcp", "thc8", 0.3), recs) is recs[2]
    assert fastest_fair(_ddp("dlcp", "fft", 0.3), recs) is recs[3]
