"""One bucket through the daemon: encode, write data and metadata, submit; then
read the out region and decode the average.

Everything a round needs that must be equal on every rank (layout, rotation
seed, THC scale) is in `RoundPlan`, computed from values all ranks share.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from dlcp.codecs import Codec, CodecState, block_norms
from dlcp.codecs.fp import FloatCodec, mean_of_float_sums
from dlcp.codecs.thc import ThcCodec
from dlcp.core.layout import Layout
from dlcp.errors import LocalError
from dlcp.shim.arena import Region
from dlcp.shim.client import DaemonClient
from dlcp.shim.regions import read_out, region_sizes, write_meta
from dlcp.shim.staging import Staging
from dlcp.shim.timeline import BucketTimes

__all__ = [
    "Decoded",
    "RoundPlan",
    "Submitted",
    "decode_round",
    "encode_into",
    "round_seed",
    "submit_round",
]

_MASK64 = (1 << 64) - 1


def round_seed(round_: int, bucket: int) -> int:
    """The rotation seed of (round, bucket): splitmix64 of both, the same on every rank."""
    z = ((round_ & 0xFFFFFFFF) << 32 | (bucket & 0xFFFFFFFF)) + 0x9E3779B97F4A7C15
    z &= _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


@dataclass(frozen=True, eq=False)
class RoundPlan:
    """One bucket's round as every rank sees it."""

    codec: Codec
    numel: int
    layout: Layout
    round: int
    bucket: int
    seed: int
    scale: torch.Tensor | None  # THC: per-packet quantisation range (float32, CPU)
    union: torch.Tensor | None = None  # sketch: the index union (dlcp.shim.sketch_round)

    @classmethod
    def make(
        cls,
        codec: Codec,
        numel: int,
        *,
        shards: int,
        payload: int,
        round_: int,
        bucket: int,
        scale: torch.Tensor | None = None,
    ) -> RoundPlan:
        per_packet = codec.per_packet(payload)
        layout = Layout(codec.n_lanes(numel, per_packet), codec.wire, shards, payload)
        return cls(
            codec=codec,
            numel=numel,
            layout=layout,
            round=round_ & 0xFFFFFFFF,
            bucket=bucket,
            seed=round_seed(round_, bucket),
            scale=scale,
        )

    @property
    def scaled(self) -> bool:
        """Whether the codec quantises to a shared scale (THC)."""
        return self.codec.name.startswith("thc")

    @property
    def header_scale(self) -> float:
        """The `scale` field of the submit: the largest per-packet scale (0 for fp)."""
        return float(self.scale.max()) if self.scale is not None and self.scale.numel() else 0.0

    @property
    def per_packet(self) -> int:
        return self.layout.per_packet

    @property
    def packets(self) -> int:
        return self.layout.packets


@dataclass
class Submitted:
    """A submit in flight: where its result will land and what the encode saw."""

    plan: RoundPlan
    region: Region
    reply: Future[dict[str, Any]]
    block_max: torch.Tensor  # per packet, this rank's max |value| as encoded (CPU float32)
    saturated: int


def submit_round(
    client: DaemonClient,
    region: Region,
    plan: RoundPlan,
    x: torch.Tensor,
    *,
    job: int,
    bound: float,
    layers: npt.NDArray[np.uint16],
    state: CodecState | None,
    generator: torch.Generator | None,
    staging: Staging,
    times: BucketTimes | None = None,
    n_layers: int | None = None,
    kind: str = "allreduce",
) -> Submitted:
    """Encode the flat bucket `x` (left unchanged), write it and its metadata into
    `region`, and submit it. The reply future completes when the round ends.
    `times`: stamped as the bucket is encoded, written, submitted and replied.
    `n_layers`: the model's layer count, which the daemon ranks `layers` against.
    `kind`: what the round moves (a one-leg round's: docs/shim-protocol.md)."""
    block_max, saturated = encode_into(
        region,
        plan,
        x,
        layers=layers,
        state=state,
        generator=generator,
        staging=staging,
        times=times,
    )
    extra: dict[str, Any] = {} if n_layers is None else {"layers": int(n_layers)}
    if kind != "allreduce":
        extra["kind"] = kind
    reply = client.submit(
        **extra,
        job=job,
        round=plan.round,
        bucket=plan.bucket,
        codec=plan.codec.name,
        total=plan.layout.total,
        bound=bound,
        scale=plan.header_scale,
        **region.submit_fields(),
    )
    if times is not None:
        times.submitted = time.perf_counter()
        reply.add_done_callback(lambda _: _stamp_replied(times))
    return Submitted(plan, region, reply, block_max, saturated)


def encode_into(
    region: Region,
    plan: RoundPlan,
    x: torch.Tensor,
    *,
    layers: npt.NDArray[np.uint16],
    state: CodecState | None,
    generator: torch.Generator | None,
    staging: Staging,
    times: BucketTimes | None = None,
) -> tuple[torch.Tensor, int]:
    """Encode `x` (left unchanged) and write its lanes and metadata into
    `region`: the rank's side of a submit. Returns the block maxima (CPU
    float32) and the values saturated. `times`: encoded and written stamped."""
    if region.sizes != region_sizes(plan.layout):
        raise ValueError("region was cut for another layout")
    if plan.scaled and plan.scale is None:
        raise ValueError(f"{plan.codec.name} needs the agreed per-packet scale")
    args: dict[str, Any] = {
        "per_packet": plan.per_packet,
        "seed": plan.seed,
        "scale": plan.scale,
        "state": state,
        "generator": generator,
    }
    if x.is_cuda:
        enc = plan.codec.encode(x, **args)
    else:  # the lanes straight into the segment (fp: the cast is the copy)
        data = torch.from_numpy(np.frombuffer(region.data_view(), dtype=np.uint8))
        enc = plan.codec.encode_into(x, data, **args)
    block_max = enc.block_max.detach().to("cpu", torch.float32)
    norms = (enc.norms if enc.norms is not None else block_norms(x, plan.per_packet)).cpu().numpy()
    if times is not None:
        times.encoded = time.perf_counter()
    if x.is_cuda:
        direct = enc.lanes.is_cuda and region.segment.pin_for_cuda()
        staging.write(region.data_view(), enc.lanes, direct=direct)
    write_meta(region.meta_view(), layers, norms, block_max.numpy())
    if times is not None:
        times.written = time.perf_counter()
    return block_max, enc.saturated


def _stamp_replied(times: BucketTimes) -> None:
    times.replied = time.perf_counter()


@dataclass(frozen=True)
class Decoded:
    """The averaged bucket (float32, `numel` values, on the bucket's device) and
    what the round reported."""

    mean: torch.Tensor
    counts: npt.NDArray[np.uint16]
    maxima: npt.NDArray[np.float32]
    sums: npt.NDArray[Any] | None = None  # the summed lanes, in the segment (codec.learn)


def decode_round(
    plan: RoundPlan,
    region: Region,
    device: torch.device,
    staging: Staging,
    into: torch.Tensor | None = None,
    *,
    average: bool = True,
) -> Decoded:
    """Read the out region of a finished round and average each packet's sums by
    its contributor count (packets nobody contributed to decode to 0).

    `into` (the bucket, say): where the mean may be written instead of a new
    tensor, when that is a division a packet (a float codec: the usual round,
    every packet with the same count, or lanes lost within the bound);
    `Decoded.mean` is then `into`. A new tensor
    of a bucket's size costs its page faults on a CPU, and a copy after.

    `average` False: the sums themselves (a float codec only: what dlcp's
    torch.distributed backend's SUM and all-gather need, exact in fp32)."""
    out = read_out(region.out_view(), plan.layout)
    sums = staging.to_device(out.sums, device, direct=region.segment.pinned)
    if not average:
        if not isinstance(plan.codec, FloatCodec):
            raise LocalError(f"sums of a {plan.codec.name} round are not values to hand out")
        flat = sums.reshape(-1)[: plan.numel].to(torch.float32)
        if into is not None and into.dtype == torch.float32 and into.numel() == plan.numel:
            into.view(-1).copy_(flat)
            return Decoded(mean=into, counts=out.counts, maxima=out.maxima, sums=out.sums)
        return Decoded(mean=flat.clone(), counts=out.counts, maxima=out.maxima, sums=out.sums)
    uniform = out.counts.size > 0 and out.counts.min() == out.counts.max()
    counts: torch.Tensor | int = (
        int(out.counts[0]) if uniform else torch.from_numpy(out.counts.astype(np.int32)).to(device)
    )
    if (
        into is not None
        and isinstance(plan.codec, FloatCodec)
        and into.dtype == torch.float32
        and into.device == sums.device
        and into.is_contiguous()
        and into.numel() == plan.numel == sums.numel()
    ):
        mean_of_float_sums(
            sums, counts, numel=plan.numel, per_packet=plan.per_packet, out=into.view(-1)
        )
        return Decoded(mean=into, counts=out.counts, maxima=out.maxima, sums=out.sums)
    if (
        into is not None
        and isinstance(plan.codec, ThcCodec)
        and into.dtype == torch.float32
        and into.device == sums.device
        and into.is_contiguous()
        and into.numel() == plan.numel
    ):  # THC: rotated back straight into the bucket
        plan.codec.decode_into(
            sums,
            counts,
            into.view(-1),
            numel=plan.numel,
            per_packet=plan.per_packet,
            seed=plan.seed,
            scale=plan.scale,
        )
        return Decoded(mean=into, counts=out.counts, maxima=out.maxima, sums=out.sums)
    extra = {} if plan.union is None else {"union": plan.union}  # sketch
    mean = plan.codec.decode(
        sums,
        counts,
        numel=plan.numel,
        per_packet=plan.per_packet,
        seed=plan.seed,
        scale=plan.scale,
        **extra,
    )
    if mean.data_ptr() == sums.data_ptr():  # never hand out memory of the segment
        mean = mean.clone()
    return Decoded(mean=mean, counts=out.counts, maxima=out.maxima, sums=out.sums)
