"""Float codecs: fp32 lanes as they are, fp16 lanes by conversion.

Sums are float32 at aggregators, so decode only divides by the contributors.
fp16 overflows to inf exactly as torch's fp16 compression hook does (AMP's
grad scaler then skips the step); such values are counted in `saturated`.
With a `CodecState`, fp16 feeds its rounding error back into the next round.
fp32's block maxima are zeros: nothing reads them (they set no scale, and fp32
cannot overflow), and their max and min cost two passes over the bucket in
DDP's backward, more than its copy into the segment.
"""

from __future__ import annotations

import math

import torch

from dlcp.codecs.base import (
    Codec,
    CodecState,
    Encoded,
    Scale,
    check_per_packet,
    contributors_per_lane,
    flat_float,
    le_bytes,
    per_packet_norms,
    per_packet_view,
)
from dlcp.errors import LocalError
from dlcp.wire.header import Codec as WireCodec

__all__ = ["FloatCodec", "Fp16Codec", "Fp32Codec", "mean_of_float_sums"]


class FloatCodec(Codec):
    """Lanes are the values in `dtype`, little-endian; no scale, no seed."""

    dtype: torch.dtype

    def n_lanes(self, numel: int, per_packet: int) -> int:
        check_per_packet(per_packet)
        return numel

    def encode(
        self,
        x: torch.Tensor,
        *,
        per_packet: int,
        seed: int = 0,
        scale: Scale | None = None,
        state: CodecState | None = None,
        generator: torch.Generator | None = None,
    ) -> Encoded:
        check_per_packet(per_packet)
        v = flat_float(x)
        if state is not None:
            v = state.take(v)
        wire = v.to(self.dtype)
        saturated = 0
        if self.dtype == torch.float32:
            block_max = v.new_zeros(-(-v.numel() // per_packet))
        else:
            block_max = per_packet_norms(v, per_packet, math.inf) if v.numel() else v.new_zeros(0)
            # only a bucket whose max exceeds the half range can overflow (one sync)
            if block_max.numel() and float(block_max.max()) > torch.finfo(self.dtype).max:
                saturated = int((torch.isinf(wire) & torch.isfinite(v)).sum())
            if state is not None:
                # rounding error only: an overflow or a non-finite input is not carried
                r = v - wire.to(torch.float32)
                state.residual = torch.where(torch.isfinite(r), r, 0.0)
        if state is not None:
            if self.dtype == torch.float32:
                state.residual = None  # exact: the residual just taken has gone out
            state.rounds += 1
            state.saturated += saturated
        return Encoded(
            lanes=le_bytes(wire),
            n_lanes=v.numel(),
            scale=0.0,
            block_max=block_max,
            saturated=saturated,
        )

    def decode(
        self,
        sums: torch.Tensor,
        contributors: torch.Tensor | int,
        *,
        numel: int,
        per_packet: int,
        seed: int = 0,
        scale: Scale | None = None,
    ) -> torch.Tensor:
        return mean_of_float_sums(sums, contributors, numel=numel, per_packet=per_packet)


def mean_of_float_sums(
    sums: torch.Tensor,
    contributors: torch.Tensor | int,
    *,
    numel: int,
    per_packet: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The mean from float result lanes: each packet's sums over its contributors
    (0 where none contributed). Shared by the codecs whose owner sums floats.

    With one count for every packet (an int) the mean is one division; with a
    count per packet, one division a packet. Either goes into `out` where given
    (1-D float32 of `numel`, e.g. the bucket itself), with no temporaries."""
    check_per_packet(per_packet)
    if sums.numel() != numel:
        raise LocalError(f"{sums.numel()} summed lanes for a bucket of {numel} values")
    s = sums.reshape(-1).to(torch.float32)
    if numel == 0:
        return s
    if isinstance(contributors, int):  # every packet has the same count: one division
        if contributors > 0:
            return torch.div(s, contributors, out=out)
        return torch.zeros_like(s) if out is None else out.zero_()
    if out is not None:
        return _per_packet_mean_into(s, contributors, numel, per_packet, out)
    c = contributors_per_lane(contributors, numel, per_packet, s.device)
    view = per_packet_view(s, per_packet)
    mean = torch.where(c > 0, view / c.clamp(min=1), 0.0)
    return mean.reshape(-1)[:numel]


def _per_packet_mean_into(
    s: torch.Tensor, contributors: torch.Tensor, numel: int, per_packet: int, out: torch.Tensor
) -> torch.Tensor:
    """`s` over one contributor count per packet, written into `out` in one pass
    (no lane-sized temporaries): the same float32 divisions, so the same bits,
    as the general path; packets nobody contributed to are 0."""
    packets = -(-numel // per_packet)
    c = torch.as_tensor(contributors).to(device=s.device, dtype=torch.float32).reshape(-1)
    if c.numel() != packets or out.numel() != numel or out.dim() != 1:
        raise LocalError(
            f"a mean into `out` takes one count per packet ({packets}) and a 1-D out of "
            f"{numel}, not {c.numel()} counts and out of shape {tuple(out.shape)}"
        )
    whole = numel // per_packet
    d = c.clamp(min=1).view(packets, 1)
    if whole:
        n = whole * per_packet
        torch.div(s[:n].view(whole, per_packet), d[:whole], out=out[:n].view(whole, per_packet))
    if whole < packets:
        torch.div(s[whole * per_packet :], d[whole], out=out[whole * per_packet :])
    empty = (c == 0).nonzero().reshape(-1).tolist()
    for k in empty:  # rare: a packet every contribution of which was lost
        out[k * per_packet : (k + 1) * per_packet] = 0.0
    return out


class Fp32Codec(FloatCodec):
    name = "fp32"
    wire = WireCodec.FP32
    dtype = torch.float32


class Fp16Codec(FloatCodec):
    name = "fp16"
    wire = WireCodec.FP16
    dtype = torch.float16
