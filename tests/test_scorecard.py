"""`dlcp bench report`: the issues' targets against records of one invocation
each, rows found by what was measured, never by file name."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from dlcp.bench import scorecard
from dlcp.bench.common import BenchError
from dlcp.cli import build_parser

MBIT = 1_000_000


def rec(backend: str, scenario: str, p50: float, p99: float, **extra: Any) -> dict[str, Any]:
    r: dict[str, Any] = {
        "backend": backend,
        "codec": "fp32",
        "scenario": scenario,
        "hosts": 3,
        "rate_bps": 200 * MBIT,
        "loss_pct": 0.0,
        "p50_s": p50,
        "p99_s": p99,
        "cpu_s": 10.0,
        "machine_cpu_s": 12.0,
        "cpu_bound": False,
        "loss_frac": 0.0,
    }
    r.update(extra)
    return r


def train(
    backend: str, scenario: str, tta: float | None, acc: float, **extra: Any
) -> dict[str, Any]:
    r = rec(backend, scenario, 0.1, 0.1, tta_s=tta, final_acc=acc, target_acc=0.9)
    for k in ("p50_s", "p99_s"):
        del r[k]
    r.update(extra)
    return r


def write(path: Path, recs: list[dict[str, Any]]) -> Path:
    path.write_text(json.dumps(recs))
    return path


def line(md: str, label: str) -> str:
    (row,) = [ln for ln in md.splitlines() if ln.startswith(f"| {label} |")]
    return row


def test_rows_are_found_by_what_was_measured(tmp_path: Path) -> None:
    write(tmp_path / "zz-any-name.json", [
        rec("dlcp", "clean", 0.60, 0.70, loss_frac=0.0005),
        rec("gloo", "clean", 0.58, 0.67),
        rec("gloo-prio", "clean", 0.58, 0.70),
    ])  # fmt: skip
    write(tmp_path / "a.json", [
        rec("dlcp", "loss", 0.65, 0.70, loss_pct=1.0),
        rec("gloo", "loss", 0.60, 1.00, loss_pct=1.0),
    ])  # fmt: skip
    md = scorecard.markdown(scorecard.load([tmp_path]))
    clean = line(md, "clean")
    assert "0.600 / 0.700" in clean and "0.580 / 0.670" in clean
    assert "p50 vs gloo 1.03 (<= 1.05): met" in clean
    assert "p99 vs gloo 1.04 (<= 1.1): met" in clean
    assert "lost 0.05% (<= 0.1%): met" in clean
    loss1 = line(md, "loss 1 %")
    assert "p99 vs gloo 0.70 (<= 0.8): met" in loss1
    assert "not run" in line(md, "loss 1 %").split("|")[4]  # no gloo-prio in that invocation
    assert line(md, "loss 5 %") == "| loss 5 % | not run | | | | | | | |"


def test_ratios_stay_within_one_invocation_and_the_last_counts(tmp_path: Path) -> None:
    # the later file's dlcp is compared with the later file's Gloo only
    write(tmp_path / "1.json", [rec("dlcp", "burst", 0.7, 0.9), rec("gloo", "burst", 0.6, 3.0)])
    write(tmp_path / "2.json", [rec("dlcp", "burst", 0.7, 0.9), rec("gloo", "burst", 0.6, 1.0)])
    by = scorecard.find(scorecard.NET_ROWS[3], scorecard.load([tmp_path]))
    assert by is not None and by["gloo"]["p99_s"] == 1.0
    verdicts = scorecard.verdicts(scorecard.NET_ROWS[3], by)
    assert verdicts[0] == "p99 vs gloo 0.90 (<= 0.6): **not met**"
    assert verdicts[1] == "p99 vs gloo-prio: not run"
    assert verdicts[2] == "p99/p50 1.29 (<= 1.25): **not met**"
    # a ratio that rounds onto its bar is shown with the digits that miss it
    close = {"dlcp": rec("dlcp", "clean", 0.628, 0.7), "gloo": rec("gloo", "clean", 0.596, 0.7)}
    assert scorecard.verdicts(scorecard.NET_ROWS[0], close)[0] == (
        "p50 vs gloo 1.0537 (<= 1.05): **not met**"
    )


def test_runs_within_one_file_are_separate_invocations(tmp_path: Path) -> None:
    write(tmp_path / "allreduce-200mbit.json", [
        rec("dlcp", "congested", 0.6, 0.7, run=1),
        rec("gloo-prio", "congested", 0.3, 0.35, run=1),
        rec("dlcp", "congested", 0.6, 0.7, run=2),
        rec("gloo-prio", "congested", 0.6, 0.7, run=2),
        rec("gloo", "congested", 4.0, 8.0, run=2, cpu_bound=True),
        rec("dlcp", "congested", 0.1, 0.1, run=3, error="boom"),
        rec("gloo", "congested", None, None, run=4, error="sent nothing for 180 s"),
        rec("dlcp", "congested", 0.6, 0.7, run=4),
    ])  # fmt: skip
    invocations = scorecard.load([tmp_path])
    assert len(invocations) == 4
    row = scorecard.NET_ROWS[4]
    # the last invocation whose dlcp ran, with a baseline that failed
    failed = scorecard.markdown(invocations)
    assert "| congested | 0.600 / 0.700 | failed | not run |" in failed
    assert "p50 vs gloo-prio: not run" in failed
    by = scorecard.find(row, invocations[:2])
    assert by is not None
    verdicts = scorecard.verdicts(row, by)
    assert verdicts[:2] == [
        "p50 vs gloo-prio 1.00 (<= 1.05): met",
        "p99 vs gloo-prio 1.00 (<= 1.05): met",
    ]
    assert "Gloo CPU-bound: not a network result" in verdicts


def test_other_rates_codecs_and_failed_records_do_not_match(tmp_path: Path) -> None:
    write(tmp_path / "x.json", [
        rec("dlcp", "clean", 0.1, 0.1, rate_bps=1000 * MBIT),
        rec("dlcp", "clean", 0.1, 0.1, codec="thc8"),
        rec("dlcp", "clean", 0.1, 0.1, hosts=2),
        rec("dlcp", "clean", 0.1, 0.1, error="boom"),
    ])  # fmt: skip
    invocations = scorecard.load([tmp_path])
    assert scorecard.find(scorecard.NET_ROWS[0], invocations) is None
    cpu = scorecard.markdown(invocations).split("CPU on the testbed path")[1]
    assert "0.100 / 0.100" in line(cpu, "1 Gbit/s clean, 3 hosts")


def test_training_rows(tmp_path: Path) -> None:
    write(tmp_path / "t.json", [
        train("dlcp", "loss", 12.0, 0.940, loss_pct=5.0),
        train("gloo", "loss", 16.0, 0.944, loss_pct=5.0),
        train("gloo-prio", "loss", None, 0.80, loss_pct=5.0),
    ])  # fmt: skip
    md = scorecard.markdown(scorecard.load([tmp_path]))
    row = line(md, "train, loss 5 %")
    assert "TTA 12.0 (0.940)" in row and "not reached (0.800)" in row
    assert "TTA vs gloo 0.75 (<= 0.8): met" in row
    assert "TTA vs gloo-prio: no value" in row
    assert "accuracy +0.4 points below Gloo (<= 0.5): met" in row
    assert "| train, burst | not run |" in md


def test_report_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = write(tmp_path / "c.json", [rec("dlcp", "clean", 0.6, 0.7), rec("gloo", "clean", 0.6, 0.7)])
    args = build_parser().parse_args(["bench", "report", str(f), str(tmp_path)])
    assert args.func(args) == 0
    assert "p50 vs gloo 1.00 (<= 1.05): met" in capsys.readouterr().out
    for bad in (tmp_path / "missing", tmp_path / "empty"):
        if bad.name == "empty":
            bad.mkdir()
        args = build_parser().parse_args(["bench", "report", str(bad)])
        with pytest.raises(BenchError):
            args.func(args)
    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "j.json").write_text("{not json")
    args = build_parser().parse_args(["bench", "report", str(junk)])
    with pytest.raises(BenchError, match="cannot read"):
        args.func(args)


def test_path_failure_and_ddp_rows(tmp_path: Path) -> None:
    """The worst round over dlcp's own median; a thc8 training's steps around
    a cut (dlcp's codec matched, Gloo's fp32 record beside it), and the
    longest one against 3 s; a DDP step against Gloo's."""
    write(tmp_path / "a.json", [
        rec("dlcp", "pathdown", 0.50, 0.80, max_s=1.40),
        rec("gloo", "pathdown", 0.60, 7.0, max_s=7.2),
    ])  # fmt: skip
    write(tmp_path / "b.json", [
        train("dlcp", "pathdown", 9.0, 0.95, codec="thc8", cut_median_before_s=0.20,
              cut_median_after_s=0.28, cut_max_after_s=3.5),
        train("gloo", "pathdown", 11.0, 0.95),
    ])  # fmt: skip
    ddp = {"hosts": 2, "rate_bps": None, "grad_bytes": 50_000_000}
    write(tmp_path / "c.json", [
        rec("dlcp", "clean", 0.150, 0.2, **ddp),
        rec("gloo", "clean", 0.126, 0.16, **ddp),
    ])  # fmt: skip
    md = scorecard.markdown(scorecard.load([tmp_path]))
    assert "worst/p50 2.80 (<= 3): met" in line(md, "path down, all-reduce")
    cut = line(md, "path down, DDP thc8")
    assert "steps after/before cut 1.40 (<= 1.3): **not met**" in cut
    assert "longest step after cut, s 3.50 (<= 3): **not met**" in cut
    assert "| 11.0 (0.950) |" in cut  # Gloo's record found beside dlcp's thc8 one
    assert "p50 vs gloo 1.19 (<= 1.2): met" in line(md, "DDP step, 2 hosts unshaped, 50 MB")
    # an fp32 training under a path cut is not the thc8 row's
    write(tmp_path / "b.json", [train("dlcp", "pathdown", 9.0, 0.95)])
    assert line(scorecard.markdown(scorecard.load([tmp_path])), "path down, DDP thc8").startswith(
        "| path down, DDP thc8 | not run"
    )
