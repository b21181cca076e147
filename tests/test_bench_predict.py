"""dlcp.bench.predict: the cost model's prediction stored beside bench records,
on a fixed calibration (no timing, no root)."""

from __future__ import annotations

import math
from typing import Any

import pytest

from dlcp.bench.predict import (
    allreduce_profile,
    annotate,
    model_codec,
    predict_pair,
)
from dlcp.costmodel.calibrate import Calibration, CodecCost, Linear
from dlcp.costmodel.profile import ModelProfile
from dlcp.errors import LocalError

RATE = 200_000_000
GOODPUT = RATE * 0.95 / 8  # bytes/s: Network.from_rate's default efficiency
PUSH_S, PULL_S = 1e-3, 2e-3  # its fixed times
FREE = Linear(0.0, 0.0)


def cost(spec: str, bytes_per_value: float, per_value_s: float = 0.0) -> CodecCost:
    work = Linear(0.0, per_value_s)
    return CodecCost(
        spec=spec,
        push=(bytes_per_value,),
        pull=(bytes_per_value,),
        encode=work,
        aggregate=FREE,
        decode=work,
        rel_error=0.0 if spec == "fp32" else 0.1,
        hosts=3,
    )


CAL = Calibration(
    codecs={
        "fp32": cost("fp32", 4.0),
        "thc8": cost("thc8", 1.0, per_value_s=1e-8),  # a quarter of the bytes, some CPU
        "sketch": cost("sketch", 4.0, per_value_s=1e-6),  # no fewer bytes, much CPU
    }
)


def exchange_s(values: int, bytes_per_value: float, hosts: int = 3) -> float:
    """A push and a pull of `values` through the model's 200 Mbit/s link."""
    share = values * bytes_per_value * (hosts - 1) / hosts
    return PUSH_S + PULL_S + 2 * share / GOODPUT


@pytest.mark.parametrize(
    ("backend", "codec", "want"),
    [
        ("gloo", "fp32", "fp32"),
        ("gloo-prio", "fp32", "fp32"),
        ("gloo-fp16", "fp16", None),  # PyTorch's hook: the model has no Gloo but fp32
        ("dlcp", "thc8", "thc8"),
        ("dlcp-nobound", "fft", "fft"),
        ("dlcp", "auto", None),
        ("dlcp", "nonsense", None),
    ],
)
def test_model_codec(backend: str, codec: str, want: str | None) -> None:
    assert model_codec({"backend": backend, "codec": codec}) == want


@pytest.mark.parametrize(
    ("size", "bucket", "sizes"),
    [
        (10_000_000, 0, [2_500_000]),
        (10_000_000, 4_000_000, [1_000_000, 1_000_000, 500_000]),
        (8, 4_000_000, [2]),
        (2, 0, [1]),
    ],
)
def test_allreduce_profile(size: int, bucket: int, sizes: list[int]) -> None:
    p = allreduce_profile(size, bucket)
    assert [b.numel for b in p.buckets] == sizes
    assert p.compute_s == 0.0 and all(b.ready_s == 0.0 for b in p.buckets)


def test_predict_pair_is_the_models_arithmetic() -> None:
    n = 2_500_000
    prof = allreduce_profile(4 * n)
    fp32 = predict_pair(prof, CAL, "fp32", RATE, 3)
    assert fp32.codec_s == pytest.approx(exchange_s(n, 4.0))
    assert fp32.fp32_s == fp32.codec_s and fp32.pays("fp32") is None
    thc8 = predict_pair(prof, CAL, "thc8", RATE, 3, cores=3)
    cpu = 2 * 3 * 1e-8 * n / 3  # encode and decode: each host's shard of n / 3, 3 hosts' worth
    assert thc8.codec_s == pytest.approx(exchange_s(n, 1.0) + cpu)
    assert thc8.codec_cpu_s == pytest.approx(cpu)
    assert thc8.fp32_s == pytest.approx(fp32.codec_s)
    assert thc8.pays("thc8") is True
    assert thc8.shared_s == pytest.approx(thc8.codec_s)  # 3 hosts on 3 cores: a core each
    shared = predict_pair(prof, CAL, "thc8", RATE, 3, cores=1)
    assert shared.shared_s == pytest.approx(exchange_s(n, 1.0) + 3 * cpu)
    assert predict_pair(prof, CAL, "sketch", RATE, 3).pays("sketch") is False


def test_predict_pair_unknown_codec() -> None:
    with pytest.raises(LocalError, match="not calibrated"):
        predict_pair(allreduce_profile(400), CAL, "fp16", RATE, 3)


def rec(backend: str, codec: str, **extra: Any) -> dict[str, Any]:
    return {"backend": backend, "codec": codec, "hosts": 3, "rate_bps": RATE, **extra}


def test_annotate_allreduce_records() -> None:
    records = [
        rec("dlcp", "thc8"),
        rec("gloo", "fp32"),
        rec("gloo-prio", "fp32", error="no round within 180 s"),
        rec("dlcp", "fp16"),  # not in this calibration
    ]
    annotate(records, lambda: allreduce_profile(10_000_000), kind="allreduce", calibration=CAL)
    dl, gl, failed, fp16 = records
    assert dl["predicted_s"] < dl["predicted_fp32_s"] == gl["predicted_s"]
    assert dl["predicted_pays"] is True and gl["predicted_pays"] is None
    assert dl["prediction"]["codec"] == "thc8" and gl["prediction"]["codec"] == "fp32"
    assert dl["prediction"]["link_bps"] == RATE and dl["prediction"]["calibration"] == "given"
    assert math.isfinite(dl["predicted_shared_s"])
    assert "predicted_s" not in failed and "prediction_error" not in failed
    assert "fp16" in fp16["prediction_error"] and "predicted_s" not in fp16


def test_annotate_train_records_step_fields() -> None:
    prof = ModelProfile.from_bucket_sizes([250_000, 250_000], backward_s=0.01, forward_s=0.002)
    records = [rec("dlcp", "sketch"), rec("gloo", "fp32")]
    annotate(records, lambda: prof, kind="train", calibration=CAL)
    dl, gl = records
    assert "predicted_s" not in dl
    assert dl["predicted_step_s"] > dl["predicted_fp32_step_s"] == gl["predicted_step_s"]
    assert dl["predicted_pays"] is False
    assert dl["prediction"]["compute_s"] == pytest.approx(0.012)
    assert gl["predicted_step_s"] >= prof.compute_s


def test_annotate_without_a_profile_or_a_codec() -> None:
    def broken() -> ModelProfile:
        raise LocalError("no sklearn here")

    records = [rec("dlcp", "thc8"), rec("gloo", "fp32")]
    annotate(records, broken, kind="train", calibration=CAL)
    assert all("no sklearn here" in r["prediction_error"] for r in records)

    def unused() -> ModelProfile:
        raise AssertionError("profiled although no record needs a prediction")

    auto = [rec("dlcp", "auto"), rec("gloo", "fp32", error="failed")]
    annotate(auto, unused, kind="train", calibration=CAL)
    assert "auto" in auto[0]["prediction_error"] and "prediction_error" not in auto[1]
    with pytest.raises(LocalError, match="kind"):
        annotate(records, broken, kind="ddp", calibration=CAL)
