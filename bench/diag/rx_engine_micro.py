"""Wall time of `Engine.receive_many` for one run of data packets, in process.

    python bench/diag/rx_engine_micro.py [--batch 44] [--payload 1408] [--reps 3]

Two engines of a 2-host transpose job submit a 100 MB fp32 bucket (results
into caller arrays, as dlcpd's go into the ranks' segments); engine 0's data
datagrams for node 1 are then handed to engine 1 in calls of `--batch`
datagrams (44: one GRO buffer at MTU 1500; 1540: a large drain), the MAC
included. Prints the median time a call and a datagram over the calls of
each repetition. No sockets; the engine's own fixed cost a call shows at
small batches. Run it alternated with another checkout (PYTHONPATH) as with
any timing.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
if not os.environ.get("PYTHONPATH"):  # else the checkout PYTHONPATH names
    sys.path.insert(0, str(ROOT))

from dlcp.core.engine import Engine, JobSpec  # noqa: E402
from dlcp.daemon.memory import tune_process  # noqa: E402
from dlcp.wire import Codec, PacketType  # noqa: E402

TOTAL = 25_000_000  # fp32 lanes: 100 MB


def one(batch: int, payload: int, lanes: np.ndarray) -> list[float]:
    """Seconds of each receive_many call of one repetition."""
    engines = [Engine(), Engine()]
    for i, e in enumerate(engines):
        e.add_job(JobSpec.transpose(1, b"k" * 32, i, 2, payload=payload, mac="ghash-aes"))
    outs = [np.ones(TOTAL, "<f4") for _ in engines]  # touched: no first-write faults timed
    for i, e in enumerate(engines):
        e.submit(
            job=1,
            round=0,
            bucket=0,
            codec=Codec.FP32,
            total=TOTAL,
            lanes=lanes,
            now=0.0,
            out=outs[i],
        )
    sends = engines[0].datagrams_to_send()
    data = [s.datagram for s in sends if s.node == 1 and s.datagram[3] == PacketType.DATA]
    nodes = np.zeros(batch, np.int64)  # all from node 0
    times = []
    for i in range(0, len(data) - batch + 1, batch):
        t = time.perf_counter()
        engines[1].receive_many(data[i : i + batch], 0.0, nodes)
        times.append(time.perf_counter() - t)
    return times


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--batch", type=int, default=44)
    p.add_argument("--payload", type=int, default=1408, help="dlcp payload (MTU 1500 - 92)")
    p.add_argument("--reps", type=int, default=3)
    a = p.parse_args()
    tune_process()
    lanes = np.random.default_rng(0).standard_normal(TOTAL).astype("<f4").view(np.uint8)
    for _ in range(a.reps):
        t = statistics.median(one(a.batch, a.payload, lanes))
        per = t / a.batch * 1e9
        print(f"batch {a.batch}: median {t * 1e6:.0f} us a call, {per:.0f} ns a datagram")
    return 0


if __name__ == "__main__":
    sys.exit(main())
