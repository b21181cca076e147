"""How fast a bucket is handed from a training rank to the daemon through shared memory.

    python bench/diag/shm_handoff.py [--size 100MB] [--iters 10] [--json out.json]

Measures, on one machine, medians over `iters`:
- memcpy: one in-process copy of the bucket (torch `copy_`, the floor);
- shim write: the shim copying the encoded bucket into its mapped /dev/shm
  segment (`dlcp.shim.staging.Staging.write`), warm pages and first touch;
- hand-off: shim write + a message over a Unix socket + a second process
  (standing in for dlcpd, which takes the region in place when it takes a submit)
  copying the region out of its own mapping + its reply; the full cost of
  giving a bucket to the daemon;
- read back: the shim parsing an fp32 out region of the same size into a tensor
  (`dlcp.shim.regions.read_out` + `Staging.to_device`, zero-copy on the CPU).
Prints a table (GB/s = 10^9 bytes/s) and optionally writes JSON.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import statistics
import sys
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from dlcp.core.layout import Layout  # noqa: E402
from dlcp.shim.client import Segment  # noqa: E402
from dlcp.shim.regions import read_out  # noqa: E402
from dlcp.shim.staging import Staging  # noqa: E402
from dlcp.wire.header import Codec  # noqa: E402


def parse_size(text: str) -> int:
    """'100MB', '32MiB', '4096' -> bytes (MB = 10**6, MiB = 2**20)."""
    t = text.strip().upper()
    units = (("GIB", 2**30), ("MIB", 2**20), ("KIB", 2**10), ("GB", 10**9), ("MB", 10**6))
    for unit, mult in (*units, ("KB", 10**3), ("B", 1)):
        if t.endswith(unit):
            return int(float(t[: -len(unit)]) * mult)
    return int(t)


def timed(fn: Callable[[], None], iters: int) -> list[float]:
    fn()  # warm up
    out = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def _daemon_side(name: str, size: int, conn: Connection, sock: socket.socket) -> None:
    """Map the segment by name and take the region on every request as dlcpd does:
    a view in place (no copy; the daemon reads it when it packetises)."""
    fd = os.open(f"/dev/shm/{name}", os.O_RDWR)
    import mmap

    mm = mmap.mmap(fd, size)
    os.close(fd)
    conn.send("ready")
    while True:
        msg = sock.recv(16)
        if not msg or msg == b"quit":
            break
        data = np.frombuffer(mm, np.uint8, size, 0)
        del data
        sock.sendall(b"ok")
    mm.close()


def run(size: int, iters: int) -> dict[str, Any]:
    src = torch.randint(0, 255, (size,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    staging = Staging()
    results: dict[str, list[float]] = {}

    def memcpy() -> None:
        dst.copy_(src)

    results["memcpy"] = timed(memcpy, iters)

    seg = Segment(f"dlcp-bench-{os.getpid()}", size)
    try:
        region = seg.buf[:size]
        results["shim write"] = timed(lambda: staging.write(region, src), iters)
        cold = []
        for i in range(max(1, min(iters, 3))):
            fresh = Segment(f"dlcp-bench-{os.getpid()}-cold{i}", size)
            t0 = time.perf_counter()
            staging.write(fresh.buf[:size], src)
            cold.append(time.perf_counter() - t0)
            fresh.close()
        results["shim write, first touch"] = cold

        ctx = mp.get_context("fork")
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_daemon_side, args=(seg.name, size, child, theirs))
        proc.start()
        assert parent.recv() == "ready"

        def handoff() -> None:
            staging.write(region, src)
            ours.sendall(b"submit")
            assert ours.recv(16) == b"ok"

        results["hand-off (write + socket + daemon view)"] = timed(handoff, iters)
        ours.sendall(b"quit")
        proc.join(10)

        layout = Layout(size // 4, Codec.FP32, 1, 1408)
        out = np.zeros(size + 6 * layout.packets, np.uint8)
        view = memoryview(out)

        def read_back() -> None:
            parsed = read_out(view, layout)
            t = staging.to_device(parsed.sums, torch.device("cpu"))
            float(t[-1])

        results["read back (zero-copy view)"] = timed(read_back, iters)
        region.release()
    finally:
        seg.close()

    table = {}
    for name, times in results.items():
        med = statistics.median(times)
        table[name] = {"median_s": med, "gbps": size / med / 1e9, "times_s": times}
    return {"size_bytes": size, "iters": iters, "results": table}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="100MB")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    size = parse_size(args.size)
    report = run(size, args.iters)
    print(f"bucket of {size / 1e6:.0f} MB, median of {args.iters}:")
    for name, r in report["results"].items():
        print(f"  {name:34s} {r['median_s'] * 1e3:9.2f} ms  {r['gbps']:7.2f} GB/s")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
