"""Time per packet of `encode_batch` (ghash-aes MAC and the datagram copy) for
one shard's packets: in C (dlcp.wire._ghash, where built), and in Python by how
many packets each MAC call takes (mac.ENCODE_CHUNK).

    python bench/diag/encode_micro.py [--packets 5700] [--payload 8908] [--reps 8]

The payloads are views of a source four shards long, a different shard each
repetition, so they come from memory, not from the cache, as the lanes of a
100 MB bucket do in dlcpd. The variants are measured in turn and the median
of each is printed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from dlcp.daemon.memory import tune_process
from dlcp.wire import batch, mac
from dlcp.wire.mac import GhashAesKey


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--packets", type=int, default=5700, help="packets per shard (50 MB at 8908)")
    p.add_argument("--payload", type=int, default=8908)
    p.add_argument("--reps", type=int, default=8)
    p.add_argument("--chunks", default="0,16,64,256", help="0: the whole shard in one call")
    a = p.parse_args()
    tune_process()
    n, size = a.packets, a.payload
    variants: list[tuple[str, GhashAesKey, int]] = []
    if mac.NATIVE:
        variants.append(("C", GhashAesKey(b"k" * 32, native=True), n))
    py = GhashAesKey(b"k" * 32, native=False)
    variants += [(f"Python, chunk {int(c) or n}", py, int(c) or n) for c in a.chunks.split(",")]
    src = memoryview(np.frombuffer(os.urandom(4 * n * size), np.uint8))
    times: dict[str, list[float]] = {name: [] for name, _, _ in variants}
    for rep in range(a.reps + 1):  # the first repetition warms the allocator up
        for k, (name, key, c) in enumerate(variants):
            off = (rep * len(variants) + k) % 4 * n * size
            payloads = [src[off + i * size : off + (i + 1) * size] for i in range(n)]
            heads = np.zeros(n, batch.HEADER_DTYPE)
            mac.ENCODE_CHUNK = c
            t = time.perf_counter()
            out = batch.encode_batch(heads, payloads, key)
            dt = time.perf_counter() - t
            del out
            if rep:
                times[name].append(dt)
    print(f"{'variant':>20} {'us/packet':>10}")
    for name, ts in times.items():
        print(f"{name:>20} {statistics.median(ts) / n * 1e6:10.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
