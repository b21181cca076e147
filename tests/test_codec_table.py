"""dlcp.bench.codec_table: `dlcp bench report`'s per-codec table from fixture records."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from dlcp.bench import scorecard
from dlcp.bench.codec_table import codec_rows, markdown_codecs
from dlcp.cli import build_parser

MBIT = 1_000_000


def ar(backend: str, codec: str, p50: float, **extra: Any) -> dict[str, Any]:
    r: dict[str, Any] = {
        "backend": backend,
        "codec": codec,
        "scenario": "clean",
        "hosts": 3,
        "rate_bps": 200 * MBIT,
        "loss_pct": 0.0,
        "size_bytes": 10_000_000,
        "iters": 10,
        "p50_s": p50,
        "p99_s": p50 * 1.1,
        "cpu_bound": False,
    }
    r.update(extra)
    return r


def tr(backend: str, codec: str, tta: float | None, step: float, **extra: Any) -> dict[str, Any]:
    r: dict[str, Any] = {
        "backend": backend,
        "codec": codec,
        "scenario": "clean",
        "hosts": 3,
        "rate_bps": 200 * MBIT,
        "loss_pct": 0.0,
        "target_acc": 0.9,
        "tta_s": tta,
        "final_acc": 0.95,
        "steps": 80,
        "step_p50_s": step,
    }
    r.update(extra)
    return r


def pred(s: float, fp32: float) -> dict[str, Any]:
    return {"predicted_s": s, "predicted_fp32_s": fp32, "predicted_pays": s < fp32}


def step_pred(s: float, fp32: float) -> dict[str, Any]:
    return {"predicted_step_s": s, "predicted_fp32_step_s": fp32, "predicted_pays": s < fp32}


def write(path: Path, recs: list[dict[str, Any]]) -> Path:
    path.write_text(json.dumps(recs))
    return path


def fixture_dir(tmp_path: Path) -> Path:
    d = tmp_path / "codecs"
    d.mkdir()
    write(
        d / "allreduce-clean-fp32.json",
        [
            ar("dlcp", "fp32", 0.62, result_error=0.0004, **pred(0.57, 0.57)),
            ar("gloo", "fp32", 0.57, **pred(0.57, 0.57)),
        ],
    )
    write(
        d / "allreduce-clean-thc8.json",
        [
            ar("dlcp", "thc8", 0.30, result_error=0.12, **pred(0.27, 0.57)),
            ar("gloo", "fp32", 0.60, **pred(0.57, 0.57)),
        ],
    )
    write(
        d / "allreduce-clean-sketch.json",
        [
            ar("dlcp", "sketch", 2.40, result_error=0.0, **pred(1.20, 0.57)),
            ar("gloo", "fp32", 0.58, **pred(0.57, 0.57)),
        ],
    )
    write(
        d / "train-clean-thc8.json",
        [
            tr("dlcp", "thc8", 8.0, 0.16, cpu_bound=True, **step_pred(0.15, 0.28)),
            tr("gloo", "fp32", 12.0, 0.30, **step_pred(0.28, 0.28)),
        ],
    )
    write(
        d / "train-clean-sketch.json",
        [
            tr("dlcp", "sketch", None, 1.0, **step_pred(0.6, 0.28)),
            tr("gloo", "fp32", 12.5, 0.30, **step_pred(0.28, 0.28)),
        ],
    )
    write(d / "allreduce-clean-fft.json", [
        ar("dlcp", "fft", 0.2, error="no round within 60 s"),
        ar("gloo", "fp32", 0.58),
    ])  # fmt: skip
    return d


def line(md: str, codec: str) -> list[str]:
    (row,) = [ln for ln in md.splitlines() if ln.startswith(f"| 200mbit, clean | {codec} |")]
    return [c.strip() for c in row.strip("|").split("|")]


def test_rows_pair_each_codecs_allreduce_and_training(tmp_path: Path) -> None:
    rows = codec_rows(scorecard.load([fixture_dir(tmp_path)]))
    assert [r.codec for r in rows] == ["fp32", "thc8", "fft", "sketch"]  # CODECS order
    thc8 = rows[1]
    assert thc8.allreduce is not None and thc8.allreduce["p50_s"] == 0.30
    assert thc8.allreduce_gloo is not None and thc8.allreduce_gloo["p50_s"] == 0.60
    assert thc8.train is not None and thc8.train_gloo is not None and thc8.has_prediction
    assert rows[0].train is None


def test_table_cells(tmp_path: Path) -> None:
    md = markdown_codecs(scorecard.load([fixture_dir(tmp_path)]))
    header = [c.strip() for c in md.splitlines()[0].strip("|").split("|")]
    fp32, thc8, fft, sketch = (line(md, c) for c in ("fp32", "thc8", "fft", "sketch"))
    cell = dict(zip(header, thc8, strict=True))
    assert cell["dlcp p50 / p99 s"] == "0.300 / 0.330"
    assert cell["baseline p50 s (which)"] == "0.600 (gloo)"  # Gloo of the same invocation
    assert cell["dlcp / baseline"] == "0.50x"
    assert cell["result error (dlcp; baseline)"] == "0.12; -"
    assert cell["predicted s, codec / fp32"] == "0.270 / 0.570"
    assert cell["measured / predicted (dlcp; Gloo fp32)"] == "1.11; 1.05"
    assert cell["TTA s (dlcp; baseline)"] == "8.0; 12.0 (gloo)"
    assert cell["step p50 s, measured / predicted"] == "0.160 / 0.150"
    assert cell["pays by the model (all-reduce; step)"] == "yes; yes"
    assert cell["pays measured (all-reduce; TTA)"] == "yes; yes"
    bound = "CPU-bound (all-reduce dlcp, baseline; train dlcp, baseline)"
    assert cell[bound] == "net, net; cpu, -"
    cell = dict(zip(header, sketch, strict=True))
    assert cell["TTA s (dlcp; baseline)"] == "not reached; 12.5 (gloo)"
    assert cell["pays by the model (all-reduce; step)"] == "no; no"
    assert cell["pays measured (all-reduce; TTA)"] == "no; no"  # never reached: later
    assert cell["result error (dlcp; baseline)"] == "0; -"
    cell = dict(zip(header, fp32, strict=True))
    assert cell["pays by the model (all-reduce; step)"] == "-; -"  # fp32 is the model's
    assert cell["pays measured (all-reduce; TTA)"] == "no; -"
    assert cell["TTA s (dlcp; baseline)"] == "not run; not run"
    assert cell["dlcp / baseline"] == "1.09x"
    cell = dict(zip(header, fft, strict=True))
    assert cell["dlcp p50 / p99 s"] == "failed" and cell["dlcp / baseline"] == "-"
    assert "3 hosts" in md and "10 MB" in md and "90 %" in md


def test_no_table_for_fp32_records_without_predictions(tmp_path: Path) -> None:
    write(tmp_path / "c.json", [ar("dlcp", "fp32", 0.6), ar("gloo", "fp32", 0.57)])
    invocations = scorecard.load([tmp_path])
    assert markdown_codecs(invocations) == ""
    assert "| 200mbit, clean | fp32 |" in markdown_codecs(invocations, always=True)


def test_report_prints_the_table_and_leaves_the_directory_alone(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    d = fixture_dir(tmp_path)
    before = sorted(p.name for p in d.iterdir())
    args = build_parser().parse_args(["bench", "report", str(d)])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "Network-bound, 200 Mbit/s" in out  # the targets first, as before
    assert "Codecs against the fastest no-worse baseline and the cost model" in out
    assert "| 200mbit, clean | thc8 | 0.300 / 0.330 |" in out
    # allreduce-clean-*.json is not a `dlcp bench all` directory: no summary.md, no plots
    assert sorted(p.name for p in d.iterdir()) == before


def hooks_dir(tmp_path: Path) -> Path:
    """dlcp fp16 and thc8 each beside Gloo fp32 and DDP's fp16/bf16 hooks, as
    `dlcp bench allreduce --backends dlcp,gloo,gloo-fp16,gloo-bf16` writes them."""
    d = tmp_path / "hooks"
    d.mkdir()

    def baselines(run: int) -> list[dict[str, Any]]:
        return [
            ar("gloo", "fp32", 0.58, result_error=0.0, run=run),
            ar("gloo-fp16", "fp16", 0.33, result_error=0.0004, run=run),
            ar("gloo-bf16", "bf16", 0.31, result_error=0.0033, run=run),
        ]

    write(d / "ar.json", [
        ar("dlcp", "fp16", 0.35, result_error=0.0024, run=1), *baselines(1),
        ar("dlcp", "thc8", 0.30, result_error=0.015, run=2), *baselines(2),
        ar("dlcp", "fp32", 0.62, result_error=0.0, run=3), *baselines(3),
    ])  # fmt: skip
    write(d / "tr.json", [
        tr("dlcp", "fp16", 6.0, 0.17, final_acc=0.950),
        tr("gloo", "fp32", 10.0, 0.30, final_acc=0.953),
        tr("gloo-fp16", "fp16", 5.0, 0.18, final_acc=0.951),
        tr("gloo-powersgd", "powersgd", 3.0, 0.1, final_acc=0.930),  # 2 points worse
    ])  # fmt: skip
    return d


def test_each_codec_meets_the_fastest_baseline_that_is_no_less_accurate(tmp_path: Path) -> None:
    md = markdown_codecs(scorecard.load([hooks_dir(tmp_path)]))
    header = [c.strip() for c in md.splitlines()[0].strip("|").split("|")]
    fp16, thc8, fp32 = (
        dict(zip(header, line(md, c), strict=True)) for c in ("fp16", "thc8", "fp32")
    )
    # fp16 (error 0.0024): bf16's 0.0033 is worse, so the fp16 hook's 0.33 s
    assert fp16["baseline p50 s (which)"] == "0.330 (gloo-fp16)"
    assert fp16["dlcp / baseline"] == "1.06x"
    assert fp16["result error (dlcp; baseline)"] == "0.0024; 0.0004"
    assert fp16["pays measured (all-reduce; TTA)"] == "no; no"  # slower than both hooks
    # training: PowerSGD was faster but 2 points less accurate; the fp16 hook counts
    assert fp16["TTA s (dlcp; baseline)"] == "6.0; 5.0 (gloo-fp16)"
    # thc8 (error 0.015): every baseline is as accurate; bf16 is the fastest
    assert thc8["baseline p50 s (which)"] == "0.310 (gloo-bf16)"
    assert thc8["pays measured (all-reduce; TTA)"] == "yes; -"
    # fp32 (exact): only Gloo fp32 is as exact
    assert fp32["baseline p50 s (which)"] == "0.580 (gloo)"
    assert "fastest PyTorch baseline" in md
