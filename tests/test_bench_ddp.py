"""`dlcp bench ddp`: options, the model's size, records and their JSON (no root),
and one tiny run through namespaces (root)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from dlcp.bench import cli as bench_cli
from dlcp.bench.common import BenchError
from dlcp.bench.ddp import DDP_KEYS, DdpOptions, format_table, save, step_bound, summarize
from dlcp.bench.ddp_worker import build_model, mlp_width
from dlcp.cli import build_parser as parser


def _opts(*argv: str) -> DdpOptions:
    opts: DdpOptions = bench_cli.ddp_options(parser().parse_args(["bench", "ddp", *argv]))
    return opts


def test_defaults_are_two_unshaped_hosts_and_50mb_of_gradients() -> None:
    opts = _opts()
    assert opts.setup.hosts == 2 and opts.setup.rate_bps is None
    assert opts.grad_bytes == 50_000_000 and opts.params == 12_500_000
    assert tuple(opts.backends) == ("dlcp", "gloo")
    assert opts.codec == "fp32" and opts.bucket_mb == 25.0 and opts.with_model


def test_options_reach_the_run() -> None:
    opts = _opts(
        "--hosts", "3", "--rate", "1gbit", "--grad-size", "8MB", "--steps", "5",
        "--warmup", "2", "--codec", "fp16", "--backends", "gloo", "--bucket-cap-mb", "4",
        "--layers", "4", "--batch", "8", "--no-model", "--no-progress",
    )  # fmt: skip
    assert opts.setup.hosts == 3 and opts.setup.rate_bps == 10**9
    assert opts.grad_bytes == 8_000_000 and opts.steps == 5 and opts.warmup == 2
    assert opts.codec == "fp16" and tuple(opts.backends) == ("gloo",)
    assert opts.bucket_mb == 4.0 and opts.layers == 4 and opts.batch == 8
    assert not opts.with_model and not opts.progress
    assert _opts("--params", "1000000").grad_bytes == 4_000_000


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--grad-size", "lots"], "size"),
        (["--params", "0"], "params"),
        (["--steps", "0"], "steps"),
        (["--warmup", "0"], "warmup"),
        (["--bucket-cap-mb", "0"], "bucket"),
        (["--backends", "dlcp-nobound"], "bench ddp cannot run dlcp-nobound: .*ablations"),
        (["--hosts", "1"], "hosts"),
        (["--loss-bound", "0.9"], "loss-bound"),
        (["--grad-size", "1kB"], "grad-size"),
    ],
)
def test_bad_values_are_bench_errors(argv: list[str], match: str) -> None:
    with pytest.raises(BenchError, match=match):
        _opts(*argv)


@pytest.mark.parametrize(
    "argv",
    [
        ["--grad-size", "8MB", "--params", "100"],  # one or the other
        ["--codec", "fp64"],
        ["--backends", "nccl"],
    ],
)
def test_bad_arguments_exit_with_usage(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        parser().parse_args(["bench", "ddp", *argv])
    assert exc.value.code == 2
    assert "error" in capsys.readouterr().err


@pytest.mark.parametrize(("params", "layers"), [(12_500_000, 8), (500_000, 4), (5_000, 1)])
def test_the_mlp_holds_about_the_asked_parameters_in_equal_layers(params: int, layers: int) -> None:
    model = build_model(params, layers, seed=0)
    got = sum(p.numel() for p in model.parameters())
    width = mlp_width(params, layers)
    assert abs(got - params) <= 2 * layers * width + 10  # within one width step
    linears = [m for m in model if hasattr(m, "weight")]
    assert len(linears) == layers + 1


def _run(times: list[float], dlcp: bool) -> dict[str, Any]:
    stats: dict[str, Any] = {"first_step_s": 0.5}
    if dlcp:
        stats.update(
            lost_lanes=0, total_lanes=100, rounds=4, fallbacks=0, segment_grows=0,
            first_segment_grows=0,
            timeline={"phases": {"encode": 0.001, "total": 0.01}, "step": {"in_flight": 2.0}},
            spans={"before_hooks": 0.01, "in_hooks": 0.02, "after_hooks": 0.003},
            daemon_counters={"data_nacks_sent": 1},
        )  # fmt: skip
    return {"step_times_s": times, "cpu_s": 1.0, "stats": stats}


def _record(backend: str) -> dict[str, Any]:
    from dlcp.bench.ddp import _record as make

    return make(_opts(), backend)


def test_a_step_takes_its_slowest_rank_and_dlcp_counts_its_daemons() -> None:
    dlcp, gloo = _record("dlcp"), _record("gloo")
    summarize(dlcp, [_run([0.1, 0.3], True), _run([0.2, 0.1], True)], daemon_cpu=0.5)
    summarize(gloo, [_run([0.1, 0.1], False), _run([0.1, 0.1], False)], daemon_cpu=None)
    assert dlcp["step_times_s"] == [0.2, 0.3]
    assert dlcp["p50_s"] == pytest.approx(0.25) and dlcp["p99_s"] <= 0.3
    assert dlcp["cpu_s"] == 2.5 and dlcp["daemon_cpu_s"] == 0.5
    assert len(dlcp["timeline"]) == 2 and dlcp["daemon_counters"][0] == {"data_nacks_sent": 1}
    assert "daemon_cpu_s" not in gloo and "timeline" not in gloo
    for rec in (dlcp, gloo):
        rec.update(cpu_bound=False, idle_frac=0.5, runq_wait_frac=0.1, machine_cpu_s=3.0)
    table = format_table([dlcp, gloo])
    assert "2.50x" in table and "bucket medians" in table and "in_flight 2" in table


def test_each_backend_is_judged_by_the_machine_within_its_own_steps() -> None:
    """The alternated run was 30 % idle, but within dlcp's steps the machine
    was 2 % idle and within Gloo's 55 %: dlcp's record is CPU-bound, Gloo's not
    (the run's one figure said neither)."""
    recs = []
    for busy, idle in ((9.8, 0.2), (4.5, 5.5)):
        rec: dict[str, Any] = {"idle_frac": 0.3, "runq_wait_frac": 0.1, "cpu_bound": False}
        step_bound(rec, [{"machine_s": [busy, idle]}, {"machine_s": [1.0, 99.0]}])
        recs.append(rec)
    dlcp, gloo = recs
    assert dlcp["cpu_bound"] and dlcp["step_idle_frac"] == pytest.approx(0.02)
    assert not gloo["cpu_bound"] and gloo["step_idle_frac"] == pytest.approx(0.55)
    assert dlcp["run_idle_frac"] == 0.3 and dlcp["step_machine_cpu_s"] == pytest.approx(9.8)
    waited: dict[str, Any] = {"idle_frac": 0.3, "runq_wait_frac": 0.9}
    step_bound(waited, [{"machine_s": [4.5, 5.5]}])
    assert waited["cpu_bound"]  # a process waiting most of the run still says so
    old: dict[str, Any] = {"idle_frac": 0.3, "cpu_bound": False}
    step_bound(old, [{}])
    assert old == {"idle_frac": 0.3, "cpu_bound": False}  # no readings: the run's verdict


def test_records_are_written_with_the_keys_first(tmp_path: Path) -> None:
    rec = _record("gloo")
    summarize(rec, [_run([0.1], False)], daemon_cpu=None)
    rec["cpu_bound"] = False
    save([rec], tmp_path / "ddp.json")
    rows = json.loads((tmp_path / "ddp.json").read_text())
    assert list(rows[0])[: len(DDP_KEYS)] == list(DDP_KEYS)
    broken = dict(rec)
    del broken["p50_s"]
    with pytest.raises(BenchError, match="p50_s"):
        save([broken], tmp_path / "bad.json")


# --- one tiny run through namespaces ----------------------------------------------------


@pytest.mark.netns
def test_bench_ddp_smoke(tmp_path: Path) -> None:
    """Skipped unless root (conftest): it builds a testbed in namespaces."""
    out = tmp_path / "ddp.json"
    args = parser().parse_args(
        [
            "bench", "ddp", "--hosts", "2", "--grad-size", "400kB", "--layers", "3",
            "--steps", "2", "--warmup", "1", "--bucket-cap-mb", "0.5", "--json", str(out),
            "--no-progress", "--name", f"bench-d{os.getpid() % 100000}",
            "--backends", "dlcp,gloo,gloo-fp16,gloo-powersgd",
        ]
    )  # fmt: skip
    assert args.func(args) == 0
    records = json.loads(out.read_text())
    # PowerSGD runs from step 2 on: warm-up 1 + 2 steps reach it, several buckets
    assert [r["backend"] for r in records] == ["dlcp", "gloo", "gloo-fp16", "gloo-powersgd"]
    assert [r["codec"] for r in records[2:]] == ["fp16", "powersgd"]
    for r in records:
        assert not r.get("error"), r.get("error")
        for key in DDP_KEYS:
            assert key in r, key
        assert len(r["step_times_s"]) == 2 and r["p99_s"] >= r["p50_s"] > 0
        assert isinstance(r["cpu_bound"], bool) and r["alternated"]
    dlcp = records[0]
    assert 0 < dlcp["daemon_cpu_s"] <= dlcp["cpu_s"] and dlcp["fallbacks"] == 0
    for tl in dlcp["timeline"]:
        assert tl["steps"] == 2 and tl["buckets"] >= 2
        assert tl["phases"]["daemon"] is not None and tl["phases"]["total"] > 0
    assert dlcp["segment_grows"] == 0  # sized from the model at init


def _sync_worker(rank: int, world: int) -> dict[str, Any]:
    import torch.distributed as dist

    from dlcp.bench.ddp_worker import _sync_group
    from dlcp.shim import sockmark

    before = sockmark.inet_stream_fds()  # the process group's and the store's
    group = _sync_group()
    new = sockmark.inet_stream_fds() - before
    dist.barrier(group=group)
    return {
        "new": sorted(sockmark.tos_of(fd) for fd in new),
        "old": sorted(sockmark.tos_of(fd) for fd in before),
    }


def test_the_steps_barrier_runs_on_a_group_marked_into_the_control_class(tmp_path: Path) -> None:
    # on the process group, unmarked, it queued behind a congested port's
    # background: the ranks started their steps hundreds of ms apart
    from tests.test_shim import spawn

    for res in spawn(_sync_worker, 3, tmp_path):
        assert len(res["new"]) >= 2 and set(res["new"]) == {48 << 2}
        assert set(res["old"]) == {0}  # the backends' own group is left as it was
