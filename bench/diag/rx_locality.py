"""What a receive drain costs when its MACs and its sums are two passes over it.

    python bench/diag/rx_locality.py [--buffers 807] [--reps 7]

35,500 datagrams of 1472 bytes (1408 payload bytes of fp32 lanes), in GRO
buffers of 44 (as `_udp.recv_gro` splits them), are verified (ghash-aes, C)
and summed into a 50 MB destination (`_bulk.add_runs`, as a data run is):
- in two passes over 256 buffers at a time (16 MB: a whole drain, as
  `Engine.receive_many` takes it: all its MACs, then its runs' sums),
- in two passes over 16 buffers at a time (1 MB: within a core's L2),
- buffer by buffer (44 datagrams: two calls each).
Round 21 (BENCHMARKS.md) tried the 1 MB slices in `receive_many` and dropped
them: the gain here is a few percent, less than a slice's fixed cost there.
A 64 MB array is written before each timing, so the datagrams start in
memory, not in cache, as a drain that the kernel wrote many megabytes ago.
Prints the median time of each. Run it alternated with others, as any timing.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from dlcp.daemon import _udp  # type: ignore[attr-defined]
from dlcp.daemon.memory import tune_process
from dlcp.wire import _bulk  # type: ignore[attr-defined]
from dlcp.wire.mac import GhashAesKey

PAYLOAD, PER_BUFFER = 1408, 44


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--buffers", type=int, default=807)  # 35,508 datagrams
    ap.add_argument("--reps", type=int, default=7)
    a = ap.parse_args()
    tune_process()
    key = GhashAesKey(os.urandom(32))
    lanes = PAYLOAD // 4
    # random bytes: the MACs fail, which costs the same as when they pass
    segs = [
        _udp.split_gro(os.urandom(PER_BUFFER * (PAYLOAD + 64)), PAYLOAD + 64)[0]
        for _ in range(a.buffers)
    ]
    total = a.buffers * PER_BUFFER * lanes
    own = np.random.default_rng(0).standard_normal(total).astype(np.float32)
    dest = np.zeros(total, np.float32)
    starts = np.arange(a.buffers * PER_BUFFER, dtype=np.int64) * lanes
    counts = np.full(a.buffers * PER_BUFFER, lanes, np.int64)
    junk = np.zeros(64 << 20, np.uint8)

    def passes(per: int) -> Callable[[], None]:
        def run() -> None:
            for lo in range(0, a.buffers, per):
                hi = min(lo + per, a.buffers)
                dgs = [d for s in segs[lo:hi] for d in s]
                key.verify(dgs)
                at = slice(lo * PER_BUFFER, hi * PER_BUFFER)
                _bulk.add_runs(dest, own, starts[at], counts[at], dgs, 64)

        return run

    cases = (
        ("two passes over 16 MB", passes(256)),
        ("two passes over 1 MB", passes(16)),
        ("buffer by buffer", passes(1)),
    )
    times: dict[str, list[float]] = {name: [] for name, _ in cases}
    for _ in range(a.reps):
        for name, run in cases:  # alternated: the same load for each
            junk[::64] += 1
            t = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - t)
    n = a.buffers * PER_BUFFER
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"{name:22s} {1e3 * med:6.2f} ms for {n} datagrams ({1e9 * med / n:.0f} ns each)")


if __name__ == "__main__":
    main()
