"""dlcp.bench and dlcp demo: parsing, records, percentiles, plots, targets (no root),
and one small netns smoke run of `dlcp bench allreduce` (root)."""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dlcp.bench import allreduce, train
from dlcp.bench import cli as bench_cli
from dlcp.bench.ar_worker import bucket_spans, make_data, position_scales
from dlcp.bench.cluster import (
    GLOO_PRIO_DSCP,
    PathDown,
    Setup,
    cut_steps,
    dlcp_daemon_config,
    gloo_mark_script,
    require_root_for_bench,
)
from dlcp.bench.common import (
    ALLREDUCE_KEYS,
    TRAIN_KEYS,
    BenchError,
    busbw_gbps,
    format_bytes,
    format_rate,
    parse_backends,
    parse_rate,
    parse_size,
    percentile,
    read_json,
    summarize_times,
    tta_from_curve,
    write_json,
)
from dlcp.bench.plots import plot_latency_cdf, plot_tta
from dlcp.bench.report import markdown_allreduce, markdown_train
from dlcp.bench.suite import allreduce_cases, summary, train_cases

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dlcp")
    sub = p.add_subparsers(dest="command")
    bench_cli.register(sub)
    import dlcp.demo

    dlcp.demo.register(sub)
    return p


# --- parsing -------------------------------------------------------------------------


def test_allreduce_cli_defaults_follow_the_design() -> None:
    args = parser().parse_args(["bench", "allreduce"])
    opts = bench_cli.allreduce_options(args)
    assert opts.setup.hosts == 3
    assert opts.setup.rate_bps == 10**9
    assert opts.setup.scenario == "clean"
    assert opts.size_bytes == 32_000_000
    assert opts.iters == 20
    assert opts.codec == "fp32"
    assert tuple(opts.backends) == ("dlcp", "gloo", "gloo-prio")
    assert args.json is None


def test_allreduce_cli_options() -> None:
    args = parser().parse_args(
        [
            "bench",
            "allreduce",
            "--hosts",
            "4",
            "--rate",
            "200mbit",
            "--scenario",
            "loss",
            "--loss",
            "5",
            "--size",
            "8MiB",
            "--iters",
            "7",
            "--codec",
            "thc8",
            "--backends",
            "gloo,dlcp-nobound",
            "--json",
            "out.json",
            "--bucket",
            "0",
        ]
    )
    opts = bench_cli.allreduce_options(args)
    assert opts.setup.hosts == 4
    assert opts.setup.rate_bps == 200_000_000
    assert (opts.setup.scenario, opts.setup.loss_pct) == ("loss", 5.0)
    assert opts.size_bytes == 8 * 2**20
    assert opts.elements == 2 * 2**20
    assert (opts.iters, opts.codec, opts.bucket_bytes) == (7, "thc8", 0)
    assert tuple(opts.backends) == ("gloo", "dlcp-nobound")
    assert args.json == Path("out.json")


def test_train_fsdp_options() -> None:
    """--fsdp: dlcp as the process group's backend, exact by default, and not
    with DDP's overlap mode."""
    args = parser().parse_args(["bench", "train", "--model", "gpt", "--fsdp", "--steps", "5"])
    opts = bench_cli.train_options(args)
    assert opts.fsdp and opts.model == "gpt" and opts.bound == 0.0
    args = parser().parse_args(["bench", "train", "--fsdp", "--loss-bound", "0.01"])
    assert bench_cli.train_options(args).bound == 0.01
    args = parser().parse_args(["bench", "train", "--fsdp", "--overlap", "on"])
    with pytest.raises(BenchError, match="--overlap"):
        bench_cli.train_options(args)


def test_train_cli_options() -> None:
    args = parser().parse_args(
        [
            "bench",
            "train",
            "--rate",
            "50mbit",
            "--scenario",
            "congested",
            "--target-acc",
            "0.9",
            "--codec",
            "fp16",
            "--backends",
            "dlcp,gloo",
            "--json",
            "t.json",
            "--hidden",
            "64,32",
            "--control-dscp",
            "none",
        ]
    )
    opts = bench_cli.train_options(args)
    assert opts.setup.rate_bps == 50_000_000
    assert opts.setup.scenario == "congested"
    assert opts.target_acc == 0.9
    assert opts.codec == "fp16"
    assert tuple(opts.hidden) == (64, 32)
    assert opts.control_dscp is None


def test_all_cli_quick_and_rates(tmp_path: Path) -> None:
    args = parser().parse_args(["bench", "all", "--out", str(tmp_path), "--rates", "1gbit,none"])
    opts = bench_cli.suite_options(args)
    assert list(opts.rates) == [10**9, None]
    assert opts.out == tmp_path
    args = parser().parse_args(["bench", "all", "--out", str(tmp_path), "--quick"])
    quick = bench_cli.suite_options(args)
    assert list(quick.rates) == [10**9]
    assert quick.size_bytes < opts.size_bytes


@pytest.mark.parametrize(
    "argv",
    [
        "bench allreduce --backends nccl",
        "bench allreduce --scenario wan",
        "bench allreduce --codec fp64",
        "bench train --backends ,",
    ],
)
def test_bad_arguments_exit_with_usage(argv: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        parser().parse_args(argv.split())
    assert exc.value.code == 2
    assert "error" in capsys.readouterr().err


def test_bad_values_are_bench_errors() -> None:
    with pytest.raises(BenchError, match="size"):
        bench_cli.allreduce_options(parser().parse_args(["bench", "allreduce", "--size", "lots"]))
    with pytest.raises(BenchError, match="iters"):
        bench_cli.allreduce_options(parser().parse_args(["bench", "allreduce", "--iters", "0"]))
    with pytest.raises(BenchError, match="hidden"):
        bench_cli.train_options(parser().parse_args(["bench", "train", "--hidden", "a,b"]))
    with pytest.raises(BenchError, match="hosts"):
        Setup(hosts=1)


def test_sizes_rates_and_backends() -> None:
    assert parse_size("32MB") == 32_000_000
    assert parse_size("32MiB") == parse_size("32m") == 32 * 2**20
    assert parse_size("4096") == 4096
    assert parse_size("1.5kb") == 1500
    for bad in ("", "-1MB", "1XB", "0"):
        with pytest.raises(BenchError):
            parse_size(bad)
    assert parse_rate("none") is None
    assert parse_rate("1gbit") == 10**9
    assert parse_rate("200mbit") == 200 * 10**6
    with pytest.raises(BenchError):
        parse_rate("fast")
    assert format_rate(10**9) == "1gbit"
    assert format_rate(2e8) == "200mbit"
    assert format_rate(None) == "none"
    assert format_bytes(32_000_000) == "32MB"
    assert parse_backends("gloo, dlcp,gloo") == ["gloo", "dlcp"]
    with pytest.raises(BenchError, match="unknown backend"):
        parse_backends("dlcp,mpi")


# --- maths -------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 3, 10, 20, 101])
@pytest.mark.parametrize("q", [0, 1, 25, 50, 90, 99, 100])
def test_percentile_matches_numpy(n: int, q: float) -> None:
    xs = list(np.random.default_rng(n).exponential(size=n))
    assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)), rel=1e-12)


def test_percentile_edges() -> None:
    assert math.isnan(percentile([], 50))
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([1.0, 2.0], 50) == 1.5
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_summary_and_bus_bandwidth() -> None:
    s = summarize_times([0.4, 0.5, 0.6, 2.0], 30_000_000, 3)
    assert s["p50_s"] == pytest.approx(0.55)
    assert s["max_s"] == 2.0
    assert s["p99_s"] == pytest.approx(np.percentile([0.4, 0.5, 0.6, 2.0], 99))
    # 2(n-1)/n * 30 MB in 0.55 s
    assert s["busbw_gbps"] == pytest.approx(4 / 3 * 30e6 * 8 / 0.55 / 1e9)
    assert busbw_gbps(1000, 2, 1.0) == pytest.approx(8e-6)
    assert math.isnan(busbw_gbps(1000, 3, 0.0))


def test_tta_from_curve() -> None:
    curve = [[1.0, 0.5], [2.0, 0.91], [3.0, 0.95], [4.0, 0.94], [5.0, 0.97]]
    assert tta_from_curve(curve, 0.95) == 3.0
    assert tta_from_curve(curve, 0.5) == 1.0
    assert tta_from_curve(curve, 0.99) is None
    assert tta_from_curve([], 0.9) is None


# --- records -----------------------------------------------------------------------------


def fake_allreduce(
    backend: str,
    scenario: str,
    p50: float,
    p99: float,
    *,
    codec: str = "fp32",
    loss_pct: float = 0.0,
    run: int = 1,
) -> dict[str, Any]:
    times = [p50] * 19 + [p99]
    rec: dict[str, Any] = {
        "backend": backend,
        "codec": codec,
        "scenario": scenario,
        "hosts": 3,
        "size_bytes": 32_000_000,
        "iters": len(times),
        "times_s": times,
        "cpu_s": 1.0,
        "loss_frac": 0.01 if backend.startswith("dlcp") else 0.0,
        "cpu_bound": False,
        "rate_bps": 10**9,
        "loss_pct": loss_pct,
        "run": run,
    }
    rec.update(summarize_times(times, 32_000_000, 3))
    rec["p99_s"] = p99
    return rec


def fake_train(
    backend: str, scenario: str, tta: float | None, final: float, loss_pct: float = 0.0
) -> dict[str, Any]:
    curve = [[t, min(final, 0.5 + 0.05 * t)] for t in range(1, 12)]
    return {
        "backend": backend,
        "codec": "fp32",
        "scenario": scenario,
        "target_acc": 0.93,
        "tta_s": tta,
        "final_acc": final,
        "steps": 80,
        "curve": curve,
        "cpu_bound": False,
        "hosts": 3,
        "rate_bps": 10**8,
        "loss_pct": loss_pct,
        "step_p50_s": 0.2,
        "wall_s": 11.0,
    }


def test_write_json_orders_keys_and_checks_them(tmp_path: Path) -> None:
    rec = fake_allreduce("dlcp", "clean", 0.4, 0.5)
    rec["p50_s"] = float("nan")
    path = tmp_path / "sub" / "ar.json"
    write_json(path, [rec], ALLREDUCE_KEYS)
    data = json.loads(path.read_text())
    assert isinstance(data, list) and len(data) == 1
    assert list(data[0])[: len(ALLREDUCE_KEYS)] == list(ALLREDUCE_KEYS)
    assert data[0]["p50_s"] is None  # NaN is not JSON
    assert read_json(path) == data
    with pytest.raises(BenchError, match="lacks"):
        write_json(path, [{"backend": "gloo"}], ALLREDUCE_KEYS)
    write_json(tmp_path / "t.json", [fake_train("gloo", "clean", 3.0, 0.95)], TRAIN_KEYS)
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(BenchError):
        read_json(tmp_path / "bad.json")


def test_pathdown_setup_and_the_steps_around_a_cut() -> None:
    s = Setup(scenario="pathdown")
    assert s.n_paths == 2 and s.path_down.path == 0 and s.path_down.length_s > 0
    with pytest.raises(BenchError, match="2 paths"):
        Setup(scenario="pathdown", paths=1)
    with pytest.raises(BenchError, match="down-path 2"):
        Setup(scenario="pathdown", path_down=PathDown(path=2))
    # five steps of 1 s, then a 3 s one across the cut at 5.5 s, then shorter ones
    times = [1.0] * 5 + [3.0, 1.5, 1.5, 1.0, 1.0]
    starts = [sum(times[:i]) for i in range(10)]
    got = cut_steps(starts, times, 5.5, n=3)
    assert got == {
        "steps_before": 3,
        "median_before_s": 1.0,
        "median_after_s": 1.5,
        "max_after_s": 3.0,
    }
    assert cut_steps([], [], 1.0)["max_after_s"] is None


def test_daemon_config_per_variant() -> None:
    setup = Setup(hosts=3, rate_bps=10**9, scenario="multipath")
    cfg = dlcp_daemon_config(setup, "dlcp")
    assert cfg["rate"]["pacing"] is True
    # the daemons are told their link's rate (each path's) and pace by their own
    # defaults: no rate, floor or start per benchmark
    assert cfg["rate"]["link_rate_bps"] == pytest.approx(1e9)
    assert set(cfg["rate"]) == {"pacing", "link_rate_bps"}
    assert "timing" not in cfg or set(cfg["timing"]) == {"timeout"}
    assert cfg["policies"] == {"balance": "spray"}
    one = dlcp_daemon_config(setup, "dlcp-1path")
    assert one["rate"]["link_rate_bps"] == pytest.approx(1e9)
    clean = Setup(hosts=3, rate_bps=200_000_000)
    assert clean.n_paths == 1
    assert dlcp_daemon_config(clean, "dlcp")["rate"]["link_rate_bps"] == pytest.approx(2e8)
    assert dlcp_daemon_config(clean, "dlcp-noprio")["policies"]["priority"] == "flow"
    assert dlcp_daemon_config(clean, "dlcp-nobound")["policies"]["drop"] == "none"
    assert "link_rate_bps" not in dlcp_daemon_config(Setup(rate_bps=None), "dlcp")["rate"]
    # the diagnostic pacing "share" holds the rate at the link over hosts - 1
    share = dlcp_daemon_config(Setup(rate_bps=200_000_000, pacing="share"), "dlcp")["rate"]
    assert share["min_rate_bps"] == pytest.approx(1e8)
    assert share["initial_rate_bps"] == pytest.approx(1e8)
    with pytest.raises(BenchError, match="pacing"):
        Setup(pacing="fast")


def test_gloo_marking_spares_background_traffic() -> None:
    script = gloo_mark_script(GLOO_PRIO_DSCP, 3)
    assert "hook output" in script
    assert "ip dscp set cs5" in script
    assert "tcp sport != 5201-5208" in script and "tcp dport != 5201-5208" in script


def test_require_root_is_one_clear_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(BenchError, match="need root") as exc:
        require_root_for_bench()
    assert "\n" not in str(exc.value)


def test_demo_not_root_fails_cleanly(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from dlcp.cli import main

    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert main(["demo"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("dlcp: error:") and "root" in err
    assert len(err.splitlines()) == 1


def test_demo_options_and_table() -> None:
    import dlcp.demo

    args = parser().parse_args(["demo", "--steps", "30"])
    opts = dlcp.demo.demo_options(args)
    assert opts.setup.scenario == "congested"
    assert opts.setup.name == "demo"
    # gloo-prio and DDP's fp16 hook by default
    assert opts.backends == ("gloo", "gloo-prio", "gloo-fp16", "dlcp")
    assert opts.steps == 30 and opts.time_budget_s == 50.0
    skip = dlcp.demo.demo_options(parser().parse_args(["demo", "--no-prio"]))
    assert skip.backends == ("gloo", "gloo-fp16", "dlcp")
    skip = dlcp.demo.demo_options(parser().parse_args(["demo", "--no-prio", "--no-fp16"]))
    assert skip.backends == ("gloo", "dlcp")
    table = dlcp.demo.side_by_side(
        [
            fake_train("gloo", "congested", 40.0, 0.93),
            fake_train("gloo-prio", "congested", 11.0, 0.94),
            {**fake_train("gloo-fp16", "congested", 20.0, 0.94), "codec": "fp16"},
            fake_train("dlcp", "congested", 10.0, 0.94),
        ]
    )
    lines = table.splitlines()
    assert lines[0].split() == ["gloo", "gloo-prio", "gloo-fp16", "dlcp"]
    assert "4.00x as fast as gloo" in table and "1.10x as fast as gloo-prio" in table
    assert "2.00x as fast as gloo-fp16" in table
    for name in ("gloo", "gloo-prio", "gloo-fp16"):
        assert dlcp.demo.MEANING[name] in table
    assert "CPU-bound" not in table
    busy = fake_train("dlcp", "congested", 10.0, 0.94)
    busy.update(cpu_bound=True, idle_frac=0.03)
    table = dlcp.demo.side_by_side([fake_train("gloo", "congested", 40.0, 0.93), busy])
    assert "note: dlcp's run was CPU-bound (machine 3 % idle)" in table


# --- worker data -------------------------------------------------------------------------


def test_bench_data_sums_exactly_in_any_order() -> None:
    n = 10_000
    scales = position_scales(n, 3)
    xs = [make_data(n, 3, h, scales) for h in range(3)]
    a = (xs[0] + xs[1]) + xs[2]
    b = xs[0] + (xs[1] + xs[2])
    c = (xs[2] + xs[0]) + xs[1]
    assert np.array_equal(a, b) and np.array_equal(a, c)
    assert np.array_equal(a.astype(np.float64), sum(x.astype(np.float64) for x in xs))
    assert not np.array_equal(xs[0], xs[1])


def test_bucket_spans_cover_the_buffer() -> None:
    assert bucket_spans(10, 4) == [(0, 4), (4, 4), (8, 2)]
    assert bucket_spans(10, 10) == [(0, 10)]
    spans = bucket_spans(1_000_003, 250_000)
    assert sum(n for _, n in spans) == 1_000_003
    assert all(o == sum(n for _, n in spans[:i]) for i, (o, _) in enumerate(spans))


def test_allreduce_worker_starts_each_timed_round_on_a_go() -> None:
    """Every rank waits for the orchestrator before each timed round (so rank
    0's check of a result never counts in another rank's round): a worker
    whose orchestrator goes away after the first timed round runs no second."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = [sys.executable, "-m", "dlcp.bench.ar_worker", "--backend", "gloo", "--rank", "0"]
    argv += ["--world", "1", "--elements", "1000", "--iters", "3", "--warmup", "0"]
    argv += ["--master", "127.0.0.1", "--port", str(port), "--timeout", "30"]
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdin is not None and proc.stdout is not None
    import threading

    watchdog = threading.Timer(120.0, proc.kill)  # a worker waiting forever fails the test
    watchdog.start()

    def event() -> dict[str, Any]:
        line = proc.stdout.readline()  # type: ignore[union-attr]
        assert line, "the worker closed its output"
        return dict(json.loads(line))

    try:
        assert event()["event"] == "joined"
        proc.stdin.write("go\n")
        proc.stdin.flush()
        assert event()["event"] == "warm"
        proc.stdin.write("go\n")  # the first timed round only
        proc.stdin.flush()
        first = event()
        assert first["event"] == "iter" and first["i"] == 0
        proc.stdin.close()  # no go for the second round
        rest = [json.loads(line)["event"] for line in proc.stdout if line.startswith("{")]
        proc.wait(timeout=30)
    finally:
        watchdog.cancel()
        proc.kill()
        proc.wait()
    assert "iter" not in rest and "result" not in rest


# --- plots and reports -------------------------------------------------------------------


def suite_records() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    ar = [
        fake_allreduce("dlcp", "clean", 0.35, 0.40),
        fake_allreduce("gloo", "clean", 0.39, 0.42),
        fake_allreduce("gloo-prio", "clean", 0.39, 0.42),
        fake_allreduce("dlcp", "clean", 0.20, 0.22, codec="thc8", run=2),
        fake_allreduce("gloo", "clean", 0.40, 0.42, run=2),
        fake_allreduce("dlcp", "congested", 0.5, 0.6, run=3),
        fake_allreduce("gloo", "congested", 2.63, 3.55, run=3),
        fake_allreduce("gloo-prio", "congested", 0.39, 0.5, run=3),
        fake_allreduce("dlcp", "loss", 0.4, 0.45, loss_pct=1.0, run=4),
        fake_allreduce("gloo", "loss", 0.45, 0.80, loss_pct=1.0, run=4),
        fake_allreduce("dlcp", "loss", 0.5, 0.6, loss_pct=5.0, run=5),
        fake_allreduce("gloo", "loss", 0.64, 1.28, loss_pct=5.0, run=5),
    ]
    ar.append({**fake_allreduce("dlcp-nobound", "loss", 1, 1, loss_pct=5.0), "error": "boom"})
    tr = [
        fake_train("dlcp", "congested", 10.0, 0.950),
        fake_train("gloo", "congested", 30.0, 0.948),
        fake_train("gloo-prio", "congested", 9.0, 0.951),
        fake_train("dlcp", "loss", 12.0, 0.93, loss_pct=5.0),
        fake_train("gloo", "loss", 15.0, 0.95, loss_pct=5.0),
    ]
    return ar, tr


def test_markdown_tables() -> None:
    ar, tr = suite_records()
    md = markdown_allreduce(ar)
    assert "failed: boom" in md
    assert "| congested | dlcp | fp32 | 0.500 | 0.600 |" in md
    assert "0.17x" in md  # p99 vs Gloo under congestion
    mt = markdown_train(tr)
    assert "3.00x" in mt and "0.90x" in mt
    assert "not a network result" not in md + mt
    assert "| net |" in md and "| net |" in mt
    clean_gloo = next(r for r in ar if r["backend"] == "gloo" and r["scenario"] == "clean")
    clean_gloo.update(cpu_bound=True, idle_frac=0.02, runq_wait_frac=0.7)
    md = markdown_allreduce(ar)
    assert md.count("not a network result") == 1
    assert "clean: Gloo's run was CPU-bound (machine 2 % idle" in md
    assert "| cpu |" in md


def test_printed_tables_mark_cpu_bound_runs() -> None:
    gloo = fake_allreduce("gloo", "clean", 0.4, 0.5)
    dlcp = fake_allreduce("dlcp", "clean", 0.5, 0.6)
    gloo.update(cpu_bound=True, idle_frac=0.05, runq_wait_frac=0.6, machine_cpu_s=9.0)
    text = allreduce.format_table([dlcp, gloo])
    rows = text.splitlines()
    assert rows[0].split()[11:14] == ["mCPU", "s", "bound"]
    assert rows[1].split()[9] == "net" and rows[2].split()[9] == "cpu"
    assert rows[-1].startswith("clean: Gloo's run was CPU-bound") and "not a network" in rows[-1]
    tr = [fake_train("gloo", "clean", 3.0, 0.95), fake_train("dlcp", "clean", 2.0, 0.95)]
    assert "not a network result" not in train.format_table(tr)
    tr[0]["cpu_bound"] = True
    assert "not a network result" in train.format_table(tr)


def test_plots_from_fake_data(tmp_path: Path) -> None:
    ar, tr = suite_records()
    cdf = plot_latency_cdf(ar, tmp_path / "cdf.png", title="fake")
    tta = plot_tta(tr, tmp_path / "tta.png", title="fake")
    empty = plot_tta([], tmp_path / "empty.png")
    for png in (cdf, tta, empty):
        assert png.read_bytes()[:8] == PNG_MAGIC
        assert png.stat().st_size > 5000 or png is empty


def test_suite_matrix_and_summary(tmp_path: Path) -> None:
    cases = allreduce_cases()
    assert {c.scenario for c in cases} == {"clean", "loss", "burst", "congested", "multipath"}
    assert all("gloo" in c.backends and "dlcp" in c.backends for c in cases)
    assert {c.loss_pct for c in cases if c.scenario == "loss"} == {1.0, 5.0}
    assert any(c.codec == "thc8" and "gloo-fp16" in c.backends for c in cases)
    assert {"dlcp-noprio", "dlcp-nobound", "dlcp-1path"} <= {b for c in cases for b in c.backends}
    assert not any("-" in b and b.startswith("dlcp") for c in allreduce_cases(ablations=False)
                   for b in c.backends)  # fmt: skip
    assert {c.scenario for c in train_cases()} == {"clean", "loss", "congested"}
    # congestion only where the 2-core machines carry its background
    at = {rate: {c.scenario for c in cases if c.runs_at(rate)} for rate in (10**9, None, 2 * 10**8)}
    assert "congested" not in at[10**9] and "congested" not in at[None]
    assert "congested" in at[2 * 10**8] and "clean" in at[None]
    ar, tr = suite_records()
    write_json(tmp_path / "allreduce-1gbit.json", ar, ALLREDUCE_KEYS)
    write_json(tmp_path / "train.json", tr, TRAIN_KEYS)
    text = summary(tmp_path)
    assert "## All-reduce at 1gbit" in text and "## Time to accuracy" in text
    assert "## Targets" in text and "Network-bound, 200 Mbit/s" in text


def test_report_subcommand_redraws(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ar, tr = suite_records()
    write_json(tmp_path / "allreduce-1gbit.json", ar, ALLREDUCE_KEYS)
    write_json(tmp_path / "train.json", tr, TRAIN_KEYS)
    args = parser().parse_args(["bench", "report", str(tmp_path)])
    assert args.func(args) == 0
    assert (tmp_path / "latency-1gbit.png").read_bytes()[:8] == PNG_MAGIC
    assert (tmp_path / "tta.png").exists() and (tmp_path / "summary.md").exists()
    out = capsys.readouterr().out
    assert "wrote" in out and "summary.md" in out and "Network-bound" in out


# --- one small run through namespaces ---------------------------------------------------------


@pytest.mark.netns
def test_bench_allreduce_smoke(tmp_path: Path) -> None:
    out = tmp_path / "ar.json"
    args = parser().parse_args(
        [
            "bench", "allreduce", "--hosts", "3", "--rate", "200mbit", "--size", "256KB",
            "--iters", "2", "--warmup", "1", "--backends", "dlcp,gloo,gloo-prio,gloo-fp16",
            "--json", str(out), "--plot", str(tmp_path / "cdf.png"), "--no-progress",
            "--name", f"bench-t{os.getpid() % 100000}",
        ]
    )  # fmt: skip
    args.func(args)
    records = json.loads(out.read_text())
    assert [r["backend"] for r in records] == ["dlcp", "gloo", "gloo-prio", "gloo-fp16"]
    # Gloo's results are checked too: fp32 exact, the fp16 cast within its rounding
    assert records[1]["result_error"] == 0.0 and 0 < records[3]["result_error"] < 1e-2
    assert records[3]["codec"] == "fp16" and records[3]["gloo_ifnames"] == "eth0"
    for r in records:
        assert not r.get("error"), r.get("error")
        for key in ALLREDUCE_KEYS:
            assert key in r, key
        assert len(r["times_s"]) == 2
        assert r["p50_s"] > 0 and r["p99_s"] >= r["p50_s"]
        assert r["size_bytes"] == 256_000 and r["hosts"] == 3 and r["iters"] == 2
        assert isinstance(r["cpu_bound"], bool)
        assert 0 <= r["idle_frac"] <= 1 and r["machine_cpu_s"] > 0
    assert records[0]["result_error"] is not None  # dlcp's result was checked
    # dlcp's CPU counts its daemons' (the ranks only hand buffers over)
    assert 0 < records[0]["daemon_cpu_s"] <= records[0]["cpu_s"]
    assert (tmp_path / "cdf.png").read_bytes()[:8] == PNG_MAGIC


@pytest.mark.netns
def test_bench_train_smoke_counts_the_daemons_cpu(tmp_path: Path) -> None:
    out = tmp_path / "train.json"
    args = parser().parse_args(
        [
            "bench", "train", "--hosts", "2", "--rate", "200mbit", "--steps", "6",
            "--eval-every", "3", "--backends", "dlcp,gloo,gloo-powersgd", "--json", str(out),
            "--no-progress", "--name", f"bench-r{os.getpid() % 100000}",
        ]
    )  # fmt: skip
    args.func(args)
    records = json.loads(out.read_text())
    assert [r["backend"] for r in records] == ["dlcp", "gloo", "gloo-powersgd"]
    for r in records:
        assert not r.get("error"), r.get("error")
        assert r["final_acc"] is not None and isinstance(r["cpu_bound"], bool)
    dlcp, gloo, powersgd = records
    assert powersgd["codec"] == "powersgd" and "daemon_cpu_s" not in powersgd
    assert 0 < dlcp["daemon_cpu_s"] <= dlcp["cpu_s"]
    assert "daemon_cpu_s" not in gloo


def _namespaces(prefix: str) -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(prefix)]


def _processes(pattern: str) -> list[str]:
    out = subprocess.run(["pgrep", "-af", pattern], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if "pgrep" not in line]


@pytest.mark.netns
def test_sigterm_mid_bench_removes_everything(tmp_path: Path) -> None:
    """`kill` (SIGTERM) of a running bench: testbed, daemons and workers are gone."""
    name = f"bench-k{os.getpid() % 100000}"
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "dlcp", "bench", "allreduce", "--hosts", "3", "--rate",
            "200mbit", "--size", "1MB", "--iters", "100000", "--backends", "dlcp,gloo",
            "--json", str(tmp_path / "ar.json"), "--no-progress", "--name", name,
        ],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not _processes(f"ar_worker.*{name}"):  # daemons up, workers started
            assert proc.poll() is None, proc.communicate()[0]
            assert time.monotonic() < deadline, "the bench never started its processes"
            time.sleep(0.2)
        assert _namespaces(name)
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, output
    assert _namespaces(name) == []
    assert _processes(name) == []


def test_cli_interrupt_handlers_are_restored_and_skip_forked_children() -> None:
    """The CLI's SIGTERM-as-Ctrl-C handler lives only while a command runs, and
    a child forked meanwhile dies of SIGTERM as usual instead of unwinding into
    its parent's cleanup (it once tore down a test's namespaces from a fork)."""
    from dlcp.cli import INTERRUPTS
    from dlcp.signals import interrupt_on

    if signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
        pytest.skip("SIGTERM already has a handler in this process")
    with interrupt_on(INTERRUPTS, only_default=True):
        assert signal.getsignal(signal.SIGTERM) != signal.SIG_DFL
        pid = os.fork()
        if pid == 0:  # the child
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(10)
            os._exit(3)
        _, status = os.waitpid(pid, 0)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


@pytest.mark.parametrize("command", ["allreduce", "train"])
def test_sketch_is_a_bench_codec(command: str) -> None:
    args = parser().parse_args(["bench", command, "--codec", "sketch"])
    opts = (bench_cli.allreduce_options if command == "allreduce" else bench_cli.train_options)(
        args
    )
    assert opts.codec == "sketch"
