"""Time per packet of `encode_batch` (ghash-aes MAC and the datagram copy) for
one shard's packets, by how many packets each MAC call takes (ENCODE_CHUNK).

    python bench/encode_micro.py [--packets 5700] [--payload 8908] [--reps 8]

The payloads are views of a source four shards long, a different shard each
repetition, so they come from memory, not from the cache, as the lanes of a
100 MB bucket do in dlcpd. Chunk sizes are measured in turn and the median
per chunk size is printed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dlcp.daemon.memory import tune_process
from dlcp.wire import batch
from dlcp.wire.mac import mac_state


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--packets", type=int, default=5700, help="packets per shard (50 MB at 8908)")
    p.add_argument("--payload", type=int, default=8908)
    p.add_argument("--reps", type=int, default=8)
    p.add_argument("--chunks", default="0,16,64,256", help="0: the whole shard in one call")
    a = p.parse_args()
    tune_process()
    key = mac_state(b"k" * 32, "ghash-aes")
    n, size = a.packets, a.payload
    chunks = [int(c) or n for c in a.chunks.split(",")]
    src = memoryview(np.frombuffer(os.urandom(4 * n * size), np.uint8))
    times: dict[int, list[float]] = {c: [] for c in chunks}
    for rep in range(a.reps + 1):  # the first repetition warms the allocator up
        for c in chunks:
            off = (rep * len(chunks) + chunks.index(c)) % 4 * n * size
            payloads = [src[off + i * size : off + (i + 1) * size] for i in range(n)]
            heads = np.zeros(n, batch.HEADER_DTYPE)
            batch.ENCODE_CHUNK = c
            t = time.perf_counter()
            out = batch.encode_batch(heads, payloads, key)
            dt = time.perf_counter() - t
            del out
            if rep:
                times[c].append(dt)
    print(f"{'chunk':>6} {'us/packet':>10}")
    for c, ts in times.items():
        print(f"{c:6d} {statistics.median(ts) / n * 1e6:10.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
