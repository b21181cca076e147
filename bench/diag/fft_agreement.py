"""How fft's coefficient set is agreed, measured: convergence and bytes.

    python bench/diag/fft_agreement.py [--epochs 8] [--seeds 3] [--workers 3] [--json out.json]

Digits MLP (hidden 128), `workers` simulated data-parallel workers, SGD with
momentum, error feedback on (`dlcp.costmodel.digits.train_simulated`). Per
variant: test accuracy after each epoch, and bytes a worker pushes and pulls
per gradient value in a steady round (fp32: 4 and 4):

  * fp32: the exact mean.
  * fft-sim: HPDC 2020's format, each worker its own top coefficients (a
    bitmap per block), the owner decodes to floats and sums, results fp32.
  * fft explore=X: the wire codec, the set agreed from the previous result
    (top coefficients by energy) with a share X of it swept through the rest.
  * fft theta=diminishing: the paper's schedule (0.9 falling to 0.5).

Each variant trains with `--seeds` seeds; the mean accuracy is reported.

Then the range of the 8-bit floats (`range` rows), on two consecutive steps'
gradients of the digits MLP (1.05 M values): the set and block exponents
agreed from step t's mean, step t+1's coefficients quantised, relative L2
error of their mean and the share of parts clamped: with each worker's own
exponent per block (what decoding at the owner would allow: a range per
contribution, so the owner could no longer add codes through one table), and
with a shared exponent: from the previous mean's largest part per block, or
(what the wire does) from the per-packet maxima over all workers that the
result carries back, plus `headroom` binades.

A union of the workers' own sets (what a lossless index agreement would use)
is not run: it needs an exchange of every worker's bitmap before each round
(a collective round trip and ~c/8 bytes a block per worker) and its set is up
to H times as large, so both legs grow with H.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from dlcp.codecs import CodecState  # noqa: E402
from dlcp.codecs.fft_wire import FftWireCodec  # noqa: E402
from dlcp.codecs.rangefloat import UNIT_VALUES, quantize_unit  # noqa: E402
from dlcp.costmodel.calibrate import make_codec  # noqa: E402
from dlcp.costmodel.digits import sample_gradients, train_simulated  # noqa: E402
from dlcp.costmodel.exchange import average  # noqa: E402

VARIANTS = (
    "fp32",
    "fft-sim:theta=0.9",
    "fft:explore=0",
    "fft:explore=0.125",
    "fft:explore=0.25",
    "fft:explore=0.5",
    "fft:theta=diminishing",
)


def steady_bytes(spec: str, workers: int) -> tuple[float, float]:
    """Bytes per value a worker pushes and pulls in a round after the first."""
    grads = sample_gradients(workers, hidden=(128,))
    codec = make_codec(spec)
    states = [CodecState() for _ in grads]
    average(codec, grads, states)
    ex = average(codec, grads, states)
    n = grads[0].numel()
    return ex.push_bytes / n, ex.pull_bytes / n


def _parts(g: torch.Tensor, block: int, index: np.ndarray) -> np.ndarray:
    """The agreed coefficients' parts of one gradient, (blocks, 2k) float64."""
    x = np.zeros(index.shape[0] * block)
    x[: g.numel()] = g.double().numpy()
    spec = np.fft.rfft(x.reshape(-1, block), axis=1, norm="ortho")
    kept = np.take_along_axis(spec, index, axis=1)
    return np.stack([kept.real, kept.imag], axis=2).reshape(index.shape[0], -1)


def _own_range(p: np.ndarray) -> np.ndarray:
    """Each row quantised in its own range (its top exponent, no headroom)."""
    top = np.abs(p).max(axis=1, keepdims=True)
    e = np.where(top > 0, np.frexp(top)[1] - 1, 0)
    codes, _ = quantize_unit(p / np.ldexp(1.0, e))
    return UNIT_VALUES[codes].astype(np.float64) * np.ldexp(1.0, e)


def range_rows(workers: int) -> list[dict[str, Any]]:
    prev = sample_gradients(workers, warm_steps=20)
    cur = sample_gradients(workers, warm_steps=21)
    prev_mean = torch.stack(prev).mean(0).double().numpy()
    rows: list[dict[str, Any]] = []
    base = FftWireCodec().agree_dense(prev_mean, 1)
    parts = [_parts(g, base.block, base.index) for g in cur]
    exact = np.mean(parts, axis=0)
    # what the result carries: per packet of 1408 lanes, the largest |part| of any worker
    flat = np.max([np.abs(_parts(g, base.block, base.index)).reshape(-1) for g in prev], axis=0)
    pp = 1408
    packet_max = np.maximum.reduceat(flat, np.arange(0, flat.size, pp))
    block_worst = np.repeat(packet_max, pp)[: flat.size].reshape(exact.shape).max(axis=1)
    mean_top = np.abs(_parts(torch.from_numpy(prev_mean), base.block, base.index)).max(axis=1)

    def row(name: str, mean: np.ndarray, clamped: float) -> dict[str, Any]:
        err = float(np.linalg.norm(mean - exact) / np.linalg.norm(exact))
        print(f"range {name:34s} error {err:.4f}  clamped {clamped:.4%}", flush=True)
        return {"variant": f"range {name}", "rel_error": err, "clamped_frac": clamped}

    def shared(top: np.ndarray, h: int) -> tuple[np.ndarray, float]:
        unit = np.ldexp(1.0, (np.frexp(top)[1] - 1 + h)[:, None])
        got, clamped = [], 0
        for p in parts:
            codes, c = quantize_unit(p / unit)
            got.append(UNIT_VALUES[codes].astype(np.float64) * unit)
            clamped += c
        return np.mean(got, axis=0), clamped / (len(parts) * exact.size)

    rows.append(row("own exponent per worker", np.mean([_own_range(p) for p in parts], 0), 0.0))
    for h in (1, 2, 3):
        rows.append(row(f"shared, previous mean + {h}", *shared(mean_top, h)))
    for h in (0, 1, 2):
        rows.append(row(f"shared, result maxima + {h} (wire)", *shared(block_worst, h)))
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--workers", type=int, default=3)
    p.add_argument("--variants", default=";".join(VARIANTS))
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    torch.set_num_threads(1)
    rows: list[dict[str, Any]] = []
    for spec in a.variants.split(";"):
        codec = None if spec == "fp32" else make_codec(spec)
        runs = [
            train_simulated(codec, workers=a.workers, epochs=a.epochs, seed=seed)
            for seed in range(a.seeds)
        ]
        acc = float(np.mean([r.accuracy for r in runs]))
        push, pull = (4.0, 4.0) if codec is None else steady_bytes(spec, a.workers)
        row = {
            "variant": spec,
            "accuracy": acc,
            "accuracies": [r.accuracy for r in runs],
            "curve": runs[0].curve,
            "push_bytes_per_value": push,
            "pull_bytes_per_value": pull,
        }
        rows.append(row)
        print(
            f"{spec:24s} acc {acc:.4f} ({' '.join(f'{r.accuracy:.3f}' for r in runs)})"
            f"  push {push:.3f} B/value  pull {pull:.3f} B/value",
            flush=True,
        )
    rows += range_rows(a.workers)
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
