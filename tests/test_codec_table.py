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
    assert cell["Gloo fp32 p50 s"] == "0.600"  # Gloo of the same invocation
    assert cell["dlcp / Gloo"] == "0.50x"
    assert cell["result error"] == "0.12"
    assert cell["predicted s, codec / fp32"] == "0.270 / 0.570"
    assert cell["measured / predicted (dlcp; Gloo)"] == "1.11; 1.05"
    assert cell["TTA s (dlcp; Gloo)"] == "8.0; 12.0"
    assert cell["step p50 s, measured / predicted"] == "0.160 / 0.150"
    assert cell["pays by the model (all-reduce; step)"] == "yes; yes"
    assert cell["pays measured (all-reduce; TTA)"] == "yes; yes"
    assert cell["CPU-bound (all-reduce dlcp, Gloo; train dlcp, Gloo)"] == "net, net; cpu, -"
    cell = dict(zip(header, sketch, strict=True))
    assert cell["TTA s (dlcp; Gloo)"] == "not reached; 12.5"
    assert cell["pays by the model (all-reduce; step)"] == "no; no"
    assert cell["pays measured (all-reduce; TTA)"] == "no; no"  # never reached: later
    assert cell["result error"] == "0"
    cell = dict(zip(header, fp32, strict=True))
    assert cell["pays by the model (all-reduce; step)"] == "-; -"  # fp32 is the baseline
    assert cell["TTA s (dlcp; Gloo)"] == "not run; not run"
    assert cell["dlcp / Gloo"] == "1.09x"
    cell = dict(zip(header, fft, strict=True))
    assert cell["dlcp p50 / p99 s"] == "failed" and cell["dlcp / Gloo"] == "-"
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
    assert "Codecs against Gloo fp32 and the cost model" in out
    assert "| 200mbit, clean | thc8 | 0.300 / 0.330 |" in out
    # allreduce-clean-*.json is not a `dlcp bench all` directory: no summary.md, no plots
    assert sorted(p.name for p in d.iterdir()) == before
