"""The cost model's prediction beside each bench record (`dlcp plan`'s model).

After a bench's runs (never inside a timed region), every record that did
not fail gets what `dlcp.costmodel` predicts for its codec, hosts and link
rate, from the cached codec calibration that `dlcp plan` uses (made on first
use, which takes seconds: `calibrated_now_s` says how many):

- all-reduce: `predicted_s`, one all-reduce of the record's buffer (in its
  buckets, nothing to overlap with), against `p50_s`;
- train: `predicted_step_s`, one training step of the bench's MLP (its
  forward, backward and step timed on this host now, the buckets' exchanges
  overlapping backward), against `step_p50_s`. The model has no convergence
  term, so it predicts no time to accuracy.

Gloo records get the model's fp32 prediction (its transpose all-reduce moves
a ring's bytes). Beside each: the same for fp32 (`predicted_fp32_s`,
`predicted_fp32_step_s`), whether the codec pays by the model
(`predicted_pays`: faster than fp32; None for fp32 itself), and the same with the emulated hosts
sharing this machine's cores (`dlcp plan --sharing HOSTS`: `predicted_shared_s`
or `predicted_shared_step_s`). `prediction` holds the inputs.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from dlcp.costmodel.calibrate import Calibration
from dlcp.costmodel.model import Network, cpu_share_for, predict
from dlcp.costmodel.profile import Bucket, ModelProfile
from dlcp.errors import LocalError

__all__ = [
    "Predicted",
    "allreduce_profile",
    "annotate",
    "model_codec",
    "predict_pair",
    "train_profile",
]

Rec = dict[str, Any]
Say = Callable[[str], None]
BASELINE = "fp32"


def model_codec(rec: Rec) -> str | None:
    """The codec the model predicts a record by: Gloo's is fp32; None for `auto`
    (its codec changes during the run), a codec the model does not know, or
    PyTorch's compression hooks over Gloo (gloo-fp16, ...: the model has no
    Gloo but fp32's)."""
    from dlcp.costmodel.calibrate import DEFAULT_CODECS

    if not str(rec.get("backend", "")).startswith("dlcp"):
        return BASELINE if rec.get("codec", BASELINE) == BASELINE else None
    codec = str(rec.get("codec", BASELINE))
    return codec if codec in DEFAULT_CODECS else None


def allreduce_profile(size_bytes: int, bucket_bytes: int = 0) -> ModelProfile:
    """One all-reduce of `size_bytes` of float32 as the model sees it: its buckets
    (`bucket_bytes` each, 0: one), all ready at once, no compute."""
    values = max(1, size_bytes // 4)
    per = bucket_bytes // 4 if bucket_bytes >= 4 else values
    sizes = [min(per, values - at) for at in range(0, values, per)]
    return ModelProfile(
        name=f"allreduce-{size_bytes}",
        buckets=tuple(Bucket(n, 0.0) for n in sizes),
        forward_s=0.0,
        backward_s=0.0,
    )


def train_profile(hidden: Sequence[int], bucket_mb: float, batch: int) -> ModelProfile:
    """The bench's digits MLP, timed on this host now (`dlcp plan --model digits-mlp`)."""
    from dlcp.costmodel.digits import digits_profile

    return digits_profile(bucket_mb=bucket_mb, batch=batch, hidden=tuple(hidden))


@dataclass(frozen=True)
class Predicted:
    """A codec's and fp32's predicted times on one link, a host to a core or sharing."""

    codec_s: float
    fp32_s: float
    shared_s: float
    codec_cpu_s: float
    network_s: float
    rel_error: float

    def pays(self, codec: str) -> bool | None:
        """Whether `codec` beats fp32 by the model (None for fp32 itself)."""
        return None if codec == BASELINE else self.codec_s < self.fp32_s


def predict_pair(
    profile: ModelProfile,
    calibration: Calibration,
    codec: str,
    rate_bps: float | None,
    hosts: int,
    *,
    cores: int | None = None,
) -> Predicted:
    """`codec` and fp32 on `profile` over `hosts` hosts at `rate_bps` (None:
    unthrottled), as `dlcp plan --link RATE --hosts N` predicts them, and
    `codec` again with the hosts sharing `cores` cores (`--sharing N`)."""
    net = Network.from_rate(rate_bps)
    mine = predict(profile, calibration[codec], net, hosts)
    base = mine if codec == BASELINE else predict(profile, calibration[BASELINE], net, hosts)
    share = cpu_share_for(hosts, cores)
    shared = predict(profile, calibration[codec], net, hosts, cpu_share=share)
    return Predicted(
        codec_s=mine.iteration_s,
        fp32_s=base.iteration_s,
        shared_s=shared.iteration_s,
        codec_cpu_s=mine.encode_s,
        network_s=mine.network_s,
        rel_error=mine.rel_error,
    )


def _calibration(codecs: Sequence[str], hosts: int) -> tuple[Calibration, float, str]:
    """The cached calibration (what `dlcp plan` reads), completed now if it lacks
    a codec; the seconds spent calibrating, and the cache's path."""
    from dlcp.costmodel.calibrate import default_cache
    from dlcp.shim.auto_model import host_calibration

    t0 = time.monotonic()
    cal = host_calibration(codecs, hosts)
    return cal, time.monotonic() - t0, str(default_cache(max(hosts, 2)))


def _fields(kind: str, codec: str, p: Predicted) -> Rec:
    step = "_step" if kind == "train" else ""
    return {
        f"predicted{step}_s": p.codec_s,
        f"predicted_fp32{step}_s": p.fp32_s,
        f"predicted_shared{step}_s": p.shared_s,
        "predicted_pays": p.pays(codec),
    }


def annotate(
    records: Sequence[Rec],
    profile: Callable[[], ModelProfile],
    *,
    kind: str,
    say: Say | None = None,
    calibration: Calibration | None = None,
    cores: int | None = None,
) -> None:
    """Add the model's prediction to each record that did not fail (in place).

    kind: "allreduce" or "train" (which fields, see the module's docstring).
    profile: builds the model profile (called once, only if some record needs it).
    A prediction that cannot be made leaves `prediction_error` instead; the
    records stay valid either way.
    """
    if kind not in ("allreduce", "train"):
        raise LocalError(f"kind {kind!r}: want allreduce or train")
    todo: list[tuple[Rec, str]] = []
    for r in records:
        if r.get("error"):
            continue
        codec = model_codec(r)
        if codec is None:
            r["prediction_error"] = f"the model predicts no single codec for {r.get('codec')!r}"
        else:
            todo.append((r, codec))
    if not todo:
        return
    wanted = sorted({c for _, c in todo} | {BASELINE})
    hosts = int(todo[0][0].get("hosts") or 2)
    try:
        if calibration is None:
            calibration, spent, source = _calibration(wanted, hosts)
        else:
            spent, source = 0.0, "given"
        if spent > 1.0 and say is not None:
            say(f"cost model: calibrated the codecs in {spent:.0f} s (now cached in {source})")
        prof = profile()
    except (LocalError, ImportError, OSError) as exc:
        for r, _ in todo:
            r["prediction_error"] = f"{type(exc).__name__}: {exc}"
        return
    for r, codec in todo:
        rate = r.get("rate_bps")
        try:
            p = predict_pair(
                prof, calibration, codec, rate, int(r.get("hosts") or hosts), cores=cores
            )
        except LocalError as exc:
            r["prediction_error"] = str(exc)
            continue
        r.update(_fields(kind, codec, p))
        r["prediction"] = {
            "codec": codec,
            "link_bps": rate,
            "hosts": r.get("hosts"),
            "codec_cpu_s": p.codec_cpu_s,
            "network_s": p.network_s,
            "rel_error": p.rel_error,
            "profile": prof.name,
            "compute_s": prof.compute_s,
            "calibration": source,
            "calibrated_at": calibration.created,
            "calibrated_now_s": spent,
        }
