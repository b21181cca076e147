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
import os
import sys

import torch

from dlcp.codecs.base import (
    Codec,
    CodecState,
    Encoded,
    Scale,
    check_per_packet,
    contributors_per_lane,
    flat_float,
    lanes_out,
    le_bytes,
    per_packet_norms,
    per_packet_view,
)
from dlcp.errors import LocalError
from dlcp.wire.header import Codec as WireCodec

try:  # the fp16 encode in one pass (dlcp/codecs/_fp16.c); off with DLCP_NATIVE_FP16=0
    from dlcp.codecs import _fp16 as _native_fp16

    if not _native_fp16.available() or os.environ.get("DLCP_NATIVE_FP16", "1") == "0":
        _native_fp16 = None
except ImportError:  # pragma: no cover - the extension is optional
    _native_fp16 = None

__all__ = ["FloatCodec", "Fp16Codec", "Fp32Codec", "mean_of_float_sums"]


class FloatCodec(Codec):
    """Lanes are the values in `dtype`, little-endian; no scale, no seed."""

    dtype: torch.dtype

    def n_lanes(self, numel: int, per_packet: int) -> int:
        check_per_packet(per_packet)
        return numel

    def _wide(self, like: torch.Tensor) -> torch.Tensor:
        """A float32 scratch tensor of like's size on its device, kept for the
        next encodes (grown, never shrunk; a codec is used by one thread at a time)."""
        cache: dict[torch.device, torch.Tensor] = self.__dict__.setdefault("_scratch", {})
        cur = cache.get(like.device)
        if cur is None or cur.numel() < like.numel():
            cur = cache[like.device] = torch.empty(
                like.numel(), dtype=torch.float32, device=like.device
            )
        return cur[: like.numel()]

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
        return self._encode(x, None, per_packet, state)

    def encode_into(
        self,
        x: torch.Tensor,
        out: torch.Tensor,
        *,
        per_packet: int,
        seed: int = 0,
        scale: Scale | None = None,
        state: CodecState | None = None,
        generator: torch.Generator | None = None,
    ) -> Encoded:
        """`encode` with the cast written straight into `out` (one pass, no
        lanes tensor); little-endian hosts only, else through `encode`."""
        if sys.byteorder != "little" or out.device != x.device:
            return super().encode_into(x, out, per_packet=per_packet, state=state)
        nbytes = x.numel() * self.dtype.itemsize
        return self._encode(x, lanes_out(out, nbytes).view(self.dtype), per_packet, state)

    def _encode(
        self,
        x: torch.Tensor,
        wire: torch.Tensor | None,
        per_packet: int,
        state: CodecState | None,
    ) -> Encoded:
        """The lanes of `x` (plus the residual) in `dtype`, into `wire` where given.

        With error feedback, x + residual goes into the state's spare buffer and
        the new residual is computed in place there (`CodecState.spare_for`):
        no bucket-sized tensor is allocated after the first rounds."""
        check_per_packet(per_packet)
        v = flat_float(x)
        if self.dtype == torch.float16 and self._native_ok(v, wire, state):
            return self._encode_native(v, wire, per_packet, state)
        own = False  # whether v is a buffer of ours, free to overwrite
        if state is not None and state.residual is not None:
            v = state.take(v, into=state.spare_for(v))
            own = True
        if wire is None:
            wire = v.to(self.dtype)
        else:
            wire.copy_(v)
        saturated = 0
        if self.dtype == torch.float32:
            block_max = v.new_zeros(-(-v.numel() // per_packet))
        else:
            block_max = per_packet_norms(v, per_packet, math.inf) if v.numel() else v.new_zeros(0)
            # only a bucket whose max exceeds the half range can overflow (one
            # sync); NaN, inf or overflow: the only buckets whose residual is
            # not finite everywhere
            top = float(block_max.max()) if block_max.numel() else 0.0
            clean = top <= torch.finfo(self.dtype).max
            if top > torch.finfo(self.dtype).max:
                saturated = int((torch.isinf(wire) & torch.isfinite(v)).sum())
            if state is not None:
                # rounding error only: an overflow or a non-finite input is not carried
                # v - wire, the halves widened into scratch memory first (a
                # mixed-dtype sub would make a bucket-sized float32 copy each time)
                wide = self._wide(v)
                wide.copy_(wire)
                r = v.sub_(wide) if own else torch.sub(v, wide, out=state.spare_for(v))
                if not clean:
                    r = torch.where(torch.isfinite(r), r, 0.0)
                state.keep(r)
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

    # the fp16 encode in C where it can run: a CPU bucket, F16C, little-endian
    native = True

    def _native_ok(
        self, v: torch.Tensor, wire: torch.Tensor | None, state: CodecState | None
    ) -> bool:
        r = None if state is None else state.residual
        return (
            self.native
            and _native_fp16 is not None
            and sys.byteorder == "little"
            and v.device.type == "cpu"
            and v.is_contiguous()
            and (wire is None or wire.is_contiguous())
            and (r is None or (r.shape == v.shape and r.is_contiguous()))
        )

    def _encode_native(
        self,
        v: torch.Tensor,
        wire: torch.Tensor | None,
        per_packet: int,
        state: CodecState | None,
    ) -> Encoded:
        """`_encode` for fp16 in one C pass (`_fp16.encode`): the same lanes,
        residual and counts; the maxima the same values."""
        n = v.numel()
        if wire is None:
            wire = torch.empty(n, dtype=torch.float16)
        block_max = torch.empty(-(-n // per_packet) if n else 0, dtype=torch.float32)
        r = None if state is None else state.residual
        r_out = None if state is None else state.spare_for(v)
        assert _native_fp16 is not None
        overflowed = _native_fp16.encode(
            v.detach().numpy(),
            None if r is None else r.numpy(),
            wire.view(torch.int16).numpy(),
            None if r_out is None else r_out.numpy(),
            per_packet,
            block_max.numpy(),
        )
        top = float(block_max.max()) if n else 0.0
        saturated = overflowed if top > torch.finfo(self.dtype).max else 0
        if state is not None:
            assert r_out is not None
            state.keep(r_out)
            state.rounds += 1
            state.saturated += saturated
        return Encoded(
            lanes=le_bytes(wire),
            n_lanes=n,
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
    if out is not None and isinstance(contributors, int) and sums.dtype != torch.float32:
        # fp16 sums: widened into `out` and divided there (no float32 copy of them)
        out.copy_(sums.reshape(-1))
        return out.div_(contributors) if contributors > 0 else out.zero_()
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
