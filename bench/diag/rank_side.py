"""The rank's side of a round, per MB: each codec's encode and decode through the
shim's own code, against DDP's `fp16_compress_hook` on the same tensor.

    python bench/diag/rank_side.py [--size 10MB] [--codecs fp32,fp16,thc8,thc4]
        [--world 3] [--reps 9] [--threads default,1] [--payload 1408] [--json F]
    DLCP_ROOT=/other/checkout python bench/diag/rank_side.py ...   (that tree's code)

For one flat float32 bucket of `--size` bytes (gradient-like values):

- fp16 hook, encode: `buffer.to(float16).div_(world)`, what the hook does in
  DDP's backward before its all-reduce; decode: `buffer.copy_(result)`, its
  `decompress` callback.
- dlcp, encode: `dlcp.shim.exchange.encode_into`, what the hook does before
  its SUBMIT: the codec's encode (error feedback included, as DDP buckets
  have it), the block norms, the lanes and metadata written into a region
  of a real shared-memory segment (the shim timeline's encode and write).
- dlcp, decode: an out region holding `world` ranks' sums, then what the
  step's end does with it: `decode_round` into the bucket, and the copy into
  the bucket where the codec's mean is a new tensor.

Prints CPU ms (the process's, all threads: a shared machine's load does
not count, or little) per MB of the fp32 bucket (10^6 bytes), the best of
`--reps` after one warm-up (other load on a shared machine only adds),
for each `--threads` setting (`default`: torch's own, as DDP runs; `1`:
one thread, as the benches' ranks run, sharing a host's cores), and each
codec's encode+decode over the hook's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# DLCP_ROOT=/other/checkout measures that tree's codecs and shim (before/after)
ROOT = Path(os.environ.get("DLCP_ROOT") or Path(__file__).resolve().parents[2])
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from dlcp.codecs import CodecState, get_codec, lanes, next_scale  # noqa: E402
from dlcp.shim.arena import Region  # noqa: E402
from dlcp.shim.client import SealedSegment, Segment, memfd_supported  # noqa: E402
from dlcp.shim.exchange import RoundPlan, decode_round  # noqa: E402
from dlcp.shim.regions import SUM_DTYPES, align, region_sizes, write_meta  # noqa: E402
from dlcp.shim.staging import Staging  # noqa: E402

try:
    from dlcp.shim.exchange import encode_into
except ImportError:  # a tree from before encode_into: what its submit_round did

    def encode_into(  # type: ignore[misc]
        region: Region,
        plan: RoundPlan,
        x: torch.Tensor,
        *,
        layers: np.ndarray,
        state: CodecState | None,
        generator: torch.Generator | None,
        staging: Staging,
    ) -> tuple[torch.Tensor, int]:
        from dlcp.codecs import block_norms

        enc = plan.codec.encode(
            x,
            per_packet=plan.per_packet,
            seed=plan.seed,
            scale=plan.scale,
            state=state,
            generator=generator,
        )
        block_max = enc.block_max.detach().to("cpu", torch.float32)
        norms = enc.norms if enc.norms is not None else block_norms(x, plan.per_packet)
        staging.write(region.data_view(), enc.lanes)
        write_meta(region.meta_view(), layers, norms.cpu().numpy(), block_max.numpy())
        return block_max, enc.saturated


def parse_size(text: str) -> int:
    """'10MB', '32MiB', '4096' -> bytes (MB = 10**6, MiB = 2**20)."""
    t = text.strip().upper()
    units = (("GIB", 2**30), ("MIB", 2**20), ("KIB", 2**10), ("GB", 10**9), ("MB", 10**6))
    for unit, mult in (*units, ("KB", 10**3), ("B", 1)):
        if t.endswith(unit):
            return int(float(t[: -len(unit)]) * mult)
    return int(t)


def best_s(fn: Callable[[], Any], reps: int) -> float:
    fn()  # warm up: first touch, caches, lazily built tables
    out = []
    for _ in range(reps):
        t0 = time.process_time()
        fn()
        out.append(time.process_time() - t0)
    return min(out)


class Bench:
    """One bucket, one segment, and the shim's encode and decode of a codec."""

    def __init__(self, numel: int, world: int, payload: int) -> None:
        gen = torch.Generator().manual_seed(5)
        self.x = torch.randn(numel, generator=gen).mul_(1e-3)
        self.bucket = self.x.clone()
        self.world = world
        self.payload = payload
        self.staging = Staging()
        self.generator = torch.Generator().manual_seed(11)
        kind = SealedSegment if memfd_supported() else Segment
        self.segment = kind("dlcp-rankside-bench", align(3 * 4 * numel + (1 << 20)))

    def close(self) -> None:
        self.segment.close()

    def hook_encode(self) -> torch.Tensor:
        return self.bucket.to(torch.float16).div_(self.world)

    def hook_decode(self, result: torch.Tensor) -> None:
        self.bucket.copy_(result)

    def plan(self, name: str) -> tuple[RoundPlan, Region]:
        codec = get_codec(name)
        plan = RoundPlan.make(
            codec, self.x.numel(), shards=1, payload=self.payload, round_=1, bucket=0
        )
        if plan.scaled:  # the scale DDP's steady state agrees: last round's maxima
            probe = codec.encode(self.x, per_packet=plan.per_packet, seed=plan.seed)
            scale = next_scale(probe.block_max.float(), 1.25)
            plan = RoundPlan(**{**plan.__dict__, "scale": scale})
        sizes = region_sizes(plan.layout)
        data = 0
        meta = align(sizes.data)
        out = meta + align(sizes.meta)
        return plan, Region(self.segment, data, meta, out, sizes)

    def encode(self, plan: RoundPlan, region: Region, state: CodecState | None) -> None:
        layers = np.zeros(plan.packets, np.uint16)
        encode_into(
            region,
            plan,
            self.x,
            layers=layers,
            state=state,
            generator=self.generator,
            staging=self.staging,
        )

    def fill_out(self, plan: RoundPlan, region: Region) -> None:
        """The out region as `world` ranks sending this rank's lanes leave it."""
        wire = plan.layout.codec
        n = plan.layout.total
        one = lanes.unpack(wire, region.data_view(), n, summed=False)
        sums = (one.astype(np.float64) * self.world).astype(SUM_DTYPES[wire])
        out = np.frombuffer(region.out_view(), np.uint8)
        raw = sums.view(np.uint8)
        out[: raw.size] = raw
        p = plan.packets
        counts = np.full(p, self.world, "<u2").view(np.uint8)
        out[raw.size : raw.size + counts.size] = counts
        out[raw.size + counts.size : raw.size + counts.size + 4 * p] = 0

    def decode(self, plan: RoundPlan, region: Region) -> None:
        dec = decode_round(plan, region, self.bucket.device, self.staging, self.bucket)
        if dec.mean is not self.bucket:  # as the step's end does
            self.bucket.copy_(dec.mean.to(self.bucket.dtype))


def measure(bench: Bench, names: list[str], reps: int) -> dict[str, dict[str, float]]:
    mb = 4 * bench.x.numel() / 1e6
    rows: dict[str, dict[str, float]] = {}
    half = bench.hook_encode()
    rows["fp16 hook"] = {
        "encode": best_s(bench.hook_encode, reps) * 1e3 / mb,
        "decode": best_s(lambda: bench.hook_decode(half), reps) * 1e3 / mb,
    }
    for name in names:
        plan, region = bench.plan(name)
        state = None if name == "fp32" else CodecState()  # DDP buckets keep error feedback
        enc = best_s(lambda p=plan, r=region, s=state: bench.encode(p, r, s), reps)
        bench.fill_out(plan, region)
        dec = best_s(lambda p=plan, r=region: bench.decode(p, r), reps)
        rows[name] = {"encode": enc * 1e3 / mb, "decode": dec * 1e3 / mb}
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--size", default="10MB", help="bucket bytes as fp32 (default 10MB)")
    ap.add_argument("--codecs", default="fp32,fp16,thc8,thc4")
    ap.add_argument("--world", type=int, default=3, help="ranks whose sums decode (default 3)")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--threads", default="default,1", help="torch threads settings to run")
    ap.add_argument("--payload", type=int, default=1408, help="datagram payload bytes")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    numel = parse_size(args.size) // 4
    names = [c for c in args.codecs.split(",") if c]
    default_threads = torch.get_num_threads()
    bench = Bench(numel, args.world, args.payload)
    report: dict[str, Any] = {"size_bytes": 4 * numel, "world": args.world, "runs": {}}
    try:
        for setting in args.threads.split(","):
            threads = default_threads if setting == "default" else int(setting)
            torch.set_num_threads(threads)
            rows = measure(bench, names, args.reps)
            report["runs"][str(threads)] = rows
            hook = rows["fp16 hook"]["encode"] + rows["fp16 hook"]["decode"]
            print(f"\n{4 * numel / 1e6:g} MB fp32 bucket, torch threads {threads} ({setting})")
            print(f"{'CPU ms/MB':10} {'encode':>7} {'decode':>7} {'both':>7} {'/hook':>6}")
            for name, r in rows.items():
                both = r["encode"] + r["decode"]
                cells = f"{r['encode']:7.3f} {r['decode']:7.3f} {both:7.3f}"
                print(f"{name:10} {cells} {both / hook:6.2f}")
    finally:
        bench.close()
        torch.set_num_threads(default_threads)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
