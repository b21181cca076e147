"""Every codec on real gradients: compression ratio, error, encode/aggregate/decode
throughput on this host.

    python bench/diag/codecs.py [--hosts 3] [--codecs "fp32;fp16;thc8;thc4;fft;sketch;..."]
        [--repeats 5] [--json codecs.json]

Gradients: one per simulated worker (own minibatch) of the digits MLP
(64-1024-768-256-10, 1.05 M values) after 20 SGD steps; plus, for the sketch
codec, an embedding-style gradient (a 50 000 x 16 table of which each worker's
batch touched 1 % of the rows), the sparse case it is made for.

Columns: push ratio = fp32 bytes / bytes a worker pushes; total ratio = fp32
bytes both ways / bytes pushed + pulled (results of fft-sim are fp32, of fft
fp32 sums of the agreed coefficients, of THC 16-bit sums); error = relative L2
error of the averaged gradient of one round (no error-feedback history; fft:
on the set that a dense round of the same gradients agreed); throughput in
fp32 MB/s of the bucket, one thread, best of `--repeats` rounds (other load on
a shared machine only slows a round down): encode per worker, aggregate per
contribution at the shard owner, decode of the result per worker.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from dlcp.codecs import CodecState  # noqa: E402
from dlcp.costmodel.calibrate import make_codec, measure_steps  # noqa: E402
from dlcp.costmodel.digits import sample_gradients  # noqa: E402
from dlcp.costmodel.exchange import average  # noqa: E402

DEFAULT = (
    "fp32;fp16;thc8;thc4;fft;fft:theta=0.5;fft-sim;fft-sim:theta=0.5;fft-sim:theta=0.95;"
    "sketch;sketch:keep=0.05"
)


def embedding_gradients(
    hosts: int, rows: int = 50_000, dim: int = 16, touched: float = 0.01
) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    out = []
    for _ in range(hosts):
        g = torch.zeros(rows, dim)
        idx = torch.randperm(rows, generator=gen)[: int(rows * touched)]
        g[idx] = torch.randn(idx.numel(), dim, generator=gen)
        out.append(g.reshape(-1))
    return out


def measure(spec: str, grads: list[torch.Tensor], repeats: int, data: str) -> dict[str, Any]:
    n = grads[0].numel()
    truth = torch.stack(grads).mean(dim=0)
    codec = make_codec(spec)
    states = [CodecState() for _ in grads]
    if codec.agreed:  # fft: a round on the set a dense round agreed (bytes of that round)
        average(codec, grads, states, error_feedback=False)
    ex = average(codec, grads, states, error_feedback=False)
    err = float((ex.mean - truth).norm() / truth.norm())
    enc, agg, dec = measure_steps(spec, grads, repeats, best=True)
    mb = 4 * n / 1e6
    return {
        "codec": spec,
        "data": data,
        "values": n,
        "push_bytes": ex.push_bytes,
        "pull_bytes": ex.pull_bytes,
        "push_ratio": 4 * n / ex.push_bytes,
        "total_ratio": 8 * n / (ex.push_bytes + ex.pull_bytes),
        "rel_error": err,
        "encode_MBps": mb / enc,
        "aggregate_MBps": mb * len(grads) / agg,
        "decode_MBps": mb / dec,
        "phases": ex.phases,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hosts", type=int, default=3)
    p.add_argument("--codecs", default=DEFAULT, help="codec specs separated by ';'")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", default="codecs.json")
    p.add_argument(
        "--nice",
        type=int,
        default=0,
        help="niceness increment for this run and its ranks (negative needs root); "
        "on a shared machine -10 keeps other load from dominating the timings",
    )
    a = p.parse_args()
    if a.nice:
        os.nice(a.nice)
    torch.set_num_threads(a.threads)
    specs = [s.strip() for s in a.codecs.split(";") if s.strip()]
    digits = sample_gradients(a.hosts)
    rows = [measure(s, digits, a.repeats, "digits-mlp") for s in specs]
    emb = embedding_gradients(a.hosts)
    rows += [
        measure(s, emb, a.repeats, "embedding") for s in specs if s.startswith(("sketch", "fp32"))
    ]
    print(
        f"{'codec':<18}{'data':<12}{'push x':>8}{'total x':>9}{'error':>9}"
        f"{'enc MB/s':>10}{'agg MB/s':>10}{'dec MB/s':>10}"
    )
    for r in rows:
        print(
            f"{r['codec']:<18}{r['data']:<12}{r['push_ratio']:8.2f}{r['total_ratio']:9.2f}"
            f"{r['rel_error']:9.4f}{r['encode_MBps']:10.0f}{r['aggregate_MBps']:10.0f}"
            f"{r['decode_MBps']:10.0f}"
        )
    meta = {
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "threads": a.threads,
        "load_avg": os.getloadavg()[0],
        "hosts": a.hosts,
        "torch": torch.__version__,
    }
    Path(a.json).write_text(json.dumps({"meta": meta, "results": rows}, indent=1))
    print(f"wrote {a.json} (load average {meta['load_avg']:.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
