"""How fast a bucket moves between a CUDA device and the shim's segment.

    python bench/diag/cuda_staging.py [--sizes 4MB,25MB,100MB] [--reps 20] [--json out.json]

Per size, the median time of one bucket's trip each way (device to segment, as
a submit writes its lanes; segment to device, as a round's result is read):

- `staged`: dlcp.shim.staging.Staging, the shim's path: a DMA into a pinned
  staging buffer, then a CPU copy into the segment (and back);
- `pageable`: `copy_` straight between the device and the segment's mapping
  (`direct` on a segment not page-locked), which CUDA stages itself;
- `registered`: the segment page-locked with cudaHostRegister
  (`pin_for_cuda`, dlcp.shim.pinning), then one DMA each way: what the shim
  does now.

The segment is a sealed memfd, as the shim makes it. Needs a CUDA device.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from dlcp.shim.client import SealedSegment  # noqa: E402
from dlcp.shim.staging import Staging  # noqa: E402

MB = 1 << 20


def _median_s(fn: Callable[[], None], reps: int) -> float:
    fn()  # warm: allocations, the first DMA
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(size: int, reps: int) -> list[dict[str, object]]:
    dev = torch.device("cuda", 0)
    src = torch.randint(0, 256, (size,), dtype=torch.uint8, device=dev)
    seg = SealedSegment("dlcp-bench-staging", size)
    staging = Staging()
    rows: list[dict[str, object]] = []
    try:
        for path in ("staged", "pageable", "registered"):
            if path == "registered" and not seg.pin_for_cuda():
                print("cudaHostRegister refused the segment", file=sys.stderr)
                break
            direct = path != "staged"
            rows.append(_row(path, seg, src, staging, direct, reps))
    finally:
        seg.close()
    return rows


def _row(
    path: str,
    seg: SealedSegment,
    src: torch.Tensor,
    staging: Staging,
    direct: bool,
    reps: int,
) -> dict[str, object]:
    """One path's times, after checking that its copies are exact both ways."""
    size = src.numel()
    host = np.frombuffer(seg.buf, np.uint8, size)

    def to_segment() -> None:
        staging.write(seg.buf[:size], src, direct=direct)

    def to_device() -> None:
        staging.to_device(host, src.device, direct=direct)

    to_segment()
    assert bytes(host) == src.cpu().numpy().tobytes(), path
    assert torch.equal(staging.to_device(host, src.device, direct=direct), src), path
    d2h, h2d = _median_s(to_segment, reps), _median_s(to_device, reps)
    return {
        "path": path,
        "size_bytes": size,
        "to_segment_s": d2h,
        "to_device_s": h2d,
        "to_segment_gbps": size * 8 / d2h / 1e9,
        "to_device_gbps": size * 8 / h2d / 1e9,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="4MB,25MB,100MB")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--json", type=Path)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    sizes = [int(s.upper().removesuffix("MB")) * MB for s in a.sizes.split(",")]
    rows = [r for size in sizes for r in measure(size, a.reps)]
    print(f"{'size':>8} {'path':>10} {'to segment':>14} {'to device':>14}")
    for r in rows:
        print(
            f"{r['size_bytes'] // MB:>6}MB {r['path']:>10} "
            f"{r['to_segment_s'] * 1e3:>8.2f} ms {r['to_segment_gbps']:>5.0f}G "
            f"{r['to_device_s'] * 1e3:>7.2f} ms {r['to_device_gbps']:>5.0f}G"
        )
    if a.json:
        a.json.write_text(json.dumps({"device": torch.cuda.get_device_name(0), "rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
