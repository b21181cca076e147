"""THC: homomorphic b-bit quantisation of Hadamard-rotated blocks (NSDI 2024).

Encode pads the bucket to whole blocks of B = per_packet lanes, rotates each
block (`hadamard.rotate`, shared seed), and rounds every rotated value y
stochastically and without bias to one of L + 1 = 2^b levels over [-s, s]:

    q = floor((clamp(y, -s, s) + s) * L / (2 s) + U),   U ~ uniform[0, 1)

(U private to the worker: on a CPU a keyed hash of the value's place, keyed
by one draw of the caller's torch generator, `_uniform_` and `noise_of`;
computed in C where it is used, never written out. torch's own CPU
generator, then numpy's SFC64, were a third and then most of an encode.)

On a CPU the rotation, the rounding and the decode run in C a block at a
time (`dlcp.codecs._thc`, `ThcCodec.native`): torch's operations in the same
order, on the butterfly form of the transform (torch's CPU default is a
matmul), tested bit for bit in tests/test_thc_native.py.

so E[q] * 2s/L - s = y wherever |y| <= s. Values beyond the scale are clamped
(counted in `saturated`; error feedback carries what was cut). Aggregators add
the integer lanes; the sum of c contributions decodes to their mean as
sum * 2s / (L c) - s, rotated back. That is exact homomorphism only when all
contributors share the seed and the scale; the scale is one float per bucket,
or one float32 per packet, agreed for instance from the previous round's
maxima with `next_scale`.

With `dither=True` the rounding noise U is not private but shared: one uniform
per lane drawn from the seed (subtractive dither). Decode subtracts it again,
which leaves each value an error uniform on half a step either side: variance
step^2/12 instead of stochastic rounding's step^2/6 on average, about 0.71x the
error. Still unbiased (over the seed, so the seed must change every round) and
still the same integer sums; but workers with identical inputs then make
identical errors, which no longer average out across workers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from dlcp.codecs.base import (
    Codec,
    CodecState,
    Encoded,
    Scale,
    contributors_per_lane,
    flat_float,
    lanes_out,
)
from dlcp.codecs.hadamard import check_block, fwht_, signs
from dlcp.codecs.thc_noise import _native_thc, _noise_key, _shared_dither, _uniform_
from dlcp.errors import LocalError
from dlcp.wire.header import Codec as WireCodec

__all__ = ["ThcCodec"]

# Scales below this are treated as this, so an all-zero bucket still encodes
# (to lanes that decode to ~0) without dividing by zero.
_TINY = 1e-30

_WIRE = {8: WireCodec.THC8, 4: WireCodec.THC4}


@dataclass(frozen=True)
class _Scratch:
    """A codec's bucket-sized float32 scratch tensors (see `ThcCodec._scratch`)."""

    a: torch.Tensor
    b: torch.Tensor
    c: torch.Tensor


def _out_scale(scale: Scale | None, gmax: float) -> Scale:
    """The scale an encode reports: its own max (float32) when it chose it."""
    if scale is None:
        return float(np.float32(gmax))
    if isinstance(scale, torch.Tensor) and scale.dim() > 0:
        return scale
    return float(np.float32(float(scale)))


def _keep(state: CodecState, residual: torch.Tensor, saturated: int) -> None:
    """An encode's new residual made the state's, and the encode counted."""
    state.keep(residual)
    state.rounds += 1
    state.saturated += saturated


class ThcCodec(Codec):
    """THC with `bits` (8 or 4) per lane.

    `rotate=False` skips the rotation (ablation); `dither=True` rounds with the
    shared subtractive dither described in the module docstring. Every worker
    of a job must use the same options.
    """

    def __init__(self, bits: int, *, rotate: bool = True, dither: bool = False) -> None:
        if bits not in _WIRE:
            raise LocalError(f"THC lanes are 8 or 4 bits, not {bits}")
        self.bits = bits
        self.levels = (1 << bits) - 1  # L: the top level
        self.rotate = rotate
        self.dither = dither
        self.name = f"thc{bits}"
        self.wire = _WIRE[bits]
        self._work: dict[torch.device, _Scratch] = {}
        # the rotation, rounding and decode in C on a CPU (the butterflies'
        # bits; False: torch's passes, whose CPU transform is a matmul)
        self.native = _native_thc is not None and rotate and not dither
        # given its scales, the whole encode in one C pass (`_thc.encode`)
        self.fused = self.native

    def n_lanes(self, numel: int, per_packet: int) -> int:
        check_block(per_packet)
        return -(-numel // per_packet) * per_packet

    def _scale(
        self, scale: Scale, blocks: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Scale as float32 on device, shape () or (blocks, 1), raised to at least _TINY.

        For a per-packet tensor also a 0-d flag tensor that is true when a value is
        negative or not finite (read it with the call's other scalars, in one sync).
        """
        if isinstance(scale, torch.Tensor) and scale.dim() > 0:
            raw = scale.to(device=device, dtype=torch.float32).reshape(-1)
            if raw.numel() != blocks:
                raise LocalError(f"{raw.numel()} per-packet scales for {blocks} packets")
            bad = ~(torch.isfinite(raw) & (raw >= 0)).all()
            return raw.clamp(min=_TINY).view(blocks, 1), bad
        value = float(scale)
        if not (math.isfinite(value) and value >= 0):
            raise LocalError(f"THC scale {value} must be finite and >= 0")
        return torch.tensor(max(float(np.float32(value)), _TINY), device=device), None

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
        return self._encode(x, None, per_packet, seed, scale, state, generator)

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
        """`encode` with the lanes written straight into `out` (no lanes tensor)."""
        if out.device != x.device:
            return super().encode_into(
                x,
                out,
                per_packet=per_packet,
                seed=seed,
                scale=scale,
                state=state,
                generator=generator,
            )
        return self._encode(x, out, per_packet, seed, scale, state, generator)

    def _encode(
        self,
        x: torch.Tensor,
        out: torch.Tensor | None,
        per_packet: int,
        seed: int,
        scale: Scale | None,
        state: CodecState | None,
        generator: torch.Generator | None,
    ) -> Encoded:
        """The encode of the module docstring, every bucket-sized step into
        the codec's scratch tensors (`_Scratch`) and the state's spare buffer
        instead of new tensors: the same operations in the same order, so the
        same lanes, maxima and residual bit for bit as their plain form."""
        check_block(per_packet)
        v = flat_float(x)
        numel = v.numel()
        blocks = -(-numel // per_packet)
        n = blocks * per_packet
        if self.fused and scale is not None and v.device.type == "cpu":
            return self._encode_fused(v, blocks, per_packet, seed, scale, out, state, generator)
        work = self._scratch(v.device, n)
        # the padded blocks, with the residual added, into `a`
        a = work.a[:n]
        if state is not None and state.residual is not None:
            state.take(v, into=a[:numel])
        else:
            a[:numel].copy_(v)
        a[numel:].zero_()
        native = self.native and v.device.type == "cpu"
        if native:  # rotated in place, a block at a time, with each block's max
            y = a.view(blocks, per_packet)
            block_max = torch.empty(blocks, dtype=torch.float32)
            d = signs(seed, per_packet)
            _native_thc.rotate(a.numpy(), d.numpy(), block_max.numpy())
        else:
            y = self._rotated_(
                a.view(blocks, per_packet), work.b[:n].view(blocks, per_packet), seed
            )
            t = (work.b if y.data_ptr() == work.a.data_ptr() else work.a)[:n].view(y.shape)
            block_max = torch.abs(y, out=t).amax(dim=1)
        gmax = block_max.max() if blocks else y.new_zeros(())
        bad: torch.Tensor | None = None
        if scale is None:  # this worker's own max
            s = gmax.clamp(min=_TINY)
        else:
            s, bad = self._scale(scale, blocks, y.device)
        # Blocks whose max exceeds the scale: only they can clamp (usually none).
        over = (block_max > s.reshape(-1)).any()
        checks = [gmax, over.to(torch.float32)]
        if bad is not None:
            checks.append(bad.to(torch.float32))
        reported = torch.stack(checks).tolist()  # one device sync for the scalars
        if not math.isfinite(reported[0]):
            raise LocalError(f"{self.name} cannot encode non-finite gradient values")
        if bad is not None and reported[2]:
            raise LocalError("per-packet THC scales must be finite and >= 0")
        if native:
            return self._encode_native(
                y, s, d, out, state, generator, v, block_max, reported[0], scale
            )
        saturated = int((torch.abs(y, out=t) > s).sum()) if reported[1] else 0

        top = float(self.levels)
        if reported[1]:  # some value beyond the scale: clamp (else clamping changes nothing)
            torch.clamp(y, -s, s, out=t)
            t.add_(s)
        else:
            torch.add(y, s, out=t)
        t.mul_(top / (2 * s))
        u = work.c[:n].view(y.shape)
        if self.dither:
            u.copy_(_shared_dither(seed, n, t.device).view(t.shape))
        else:
            _uniform_(u, generator)
        q = t.add_(u).floor_().clamp_(0.0, top)
        if state is not None:
            own = torch.sub(q, u, out=u).add_(0.5) if self.dither else u.copy_(q)
            own.mul_(2 * s / top).sub_(s)
            y.sub_(own)
            residual = state.spare_for(v)
            self._unrotated_into(y, u, seed, residual)  # (u is free again; t holds q)
            _keep(state, residual, saturated)
        lanes = self._pack(q, out)
        return Encoded(
            lanes=lanes,
            n_lanes=n,
            scale=_out_scale(scale, reported[0]),
            block_max=block_max,
            saturated=saturated,
        )

    def _encode_native(
        self,
        y: torch.Tensor,
        s: torch.Tensor,
        d: torch.Tensor,
        out: torch.Tensor | None,
        state: CodecState | None,
        generator: torch.Generator | None,
        v: torch.Tensor,
        block_max: torch.Tensor,
        gmax: float,
        scale: Scale | None,
    ) -> Encoded:
        """The rest of `_encode` in C (`_thc.quantize`, `_thc.unrotate`): the
        same noise, levels, lanes and residual as torch's passes on the
        butterfly transform's `y`."""
        n = y.numel()
        key = _noise_key(generator)
        lanes = self._lanes(n, out)
        scales = s.reshape(-1).contiguous()
        flat = y.reshape(-1)
        saturated = _native_thc.quantize(
            flat.numpy(),
            scales.numpy(),
            key,
            self.levels,
            self.bits,
            lanes.numpy(),
            state is not None,
        )
        if state is not None:
            residual = state.spare_for(v)
            _native_thc.unrotate(flat.numpy(), d.numpy(), residual.numpy())
            _keep(state, residual, saturated)
        return Encoded(
            lanes=lanes,
            n_lanes=n,
            scale=_out_scale(scale, gmax),
            block_max=block_max,
            saturated=saturated,
        )

    def _encode_fused(
        self,
        v: torch.Tensor,
        blocks: int,
        per_packet: int,
        seed: int,
        scale: Scale,
        out: torch.Tensor | None,
        state: CodecState | None,
        generator: torch.Generator | None,
    ) -> Encoded:
        """`_encode` with its scales given, in one C pass a block at a time
        (`_thc.encode`): the lanes, maxima and residual of its passes, bit
        for bit, without the bucket-sized scratch tensors between them."""
        s, bad = self._scale(scale, blocks, v.device)
        if bad is not None and bool(bad):
            raise LocalError("per-packet THC scales must be finite and >= 0")
        r = None if state is None else state.residual
        if r is not None and r.shape != v.shape:
            raise LocalError(
                f"error-feedback state holds {r.numel()} values, bucket has {v.numel()}"
            )
        n = blocks * per_packet
        lanes = self._lanes(n, out)
        block_max = torch.empty(blocks, dtype=torch.float32)
        residual = None if state is None else state.spare_for(v)
        saturated = _native_thc.encode(
            v.contiguous().numpy(),
            None if r is None else r.contiguous().numpy(),
            signs(seed, per_packet).numpy(),
            s.reshape(-1).contiguous().numpy(),
            _noise_key(generator),
            self.levels,
            self.bits,
            lanes.numpy(),
            None if residual is None else residual.numpy(),
            block_max.numpy(),
        )
        gmax = float(block_max.max()) if blocks else 0.0
        if not math.isfinite(gmax):
            raise LocalError(f"{self.name} cannot encode non-finite gradient values")
        if state is not None and residual is not None:
            _keep(state, residual, saturated)
        return Encoded(
            lanes=lanes,
            n_lanes=n,
            scale=_out_scale(scale, gmax),
            block_max=block_max,
            saturated=saturated,
        )

    def _lanes(self, n: int, out: torch.Tensor | None) -> torch.Tensor:
        """Where the C passes write n values' lanes: `out`'s first bytes, or new."""
        nbytes = n if self.bits == 8 else (n + 1) // 2
        return torch.empty(nbytes, dtype=torch.uint8) if out is None else lanes_out(out, nbytes)

    def _pack(self, q: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        """The integer levels `q` as lanes: a byte each (thc8), two a byte low
        nibble first (thc4); into `out` where given."""
        n = q.numel()
        if self.bits == 8:
            if out is None:
                return q.to(torch.uint8).reshape(-1)
            dst = lanes_out(out, n)
            dst.view(q.shape).copy_(q)
            return dst
        lanes = q.to(torch.uint8).reshape(-1)
        if lanes.numel() % 2:
            lanes = torch.nn.functional.pad(lanes, (0, 1))
        if out is None:
            return lanes[0::2] | (lanes[1::2] << 4)
        dst = lanes_out(out, lanes.numel() // 2)
        return torch.bitwise_or(lanes[0::2], lanes[1::2] << 4, out=dst)

    def _rotated_(self, blocks: torch.Tensor, work: torch.Tensor, seed: int) -> torch.Tensor:
        """The padded `blocks` rotated (`hadamard.rotate`) in place: returns
        `blocks` or `work`, whichever holds them."""
        if not self.rotate:
            return blocks
        blocks.mul_(signs(seed, blocks.shape[-1], blocks.device))
        return fwht_(blocks, work)

    def _unrotated_into(
        self, y: torch.Tensor, work: torch.Tensor, seed: int, out: torch.Tensor
    ) -> torch.Tensor:
        """`hadamard.unrotate(y)`, its first `out.numel()` values written into
        the 1-D `out` (y and work overwritten)."""
        numel = out.numel()
        per_packet = y.shape[-1]
        if not self.rotate:
            return out.copy_(y.reshape(-1)[:numel])
        z = fwht_(y, work)
        d = signs(seed, per_packet, y.device)
        whole, tail = divmod(numel, per_packet)
        torch.mul(z[:whole], d, out=out[: whole * per_packet].view(whole, per_packet))
        if tail:
            torch.mul(z[whole, :tail], d[:tail], out=out[whole * per_packet :])
        return out

    def _scratch(self, device: torch.device, n: int) -> _Scratch:
        """Three float32 tensors of at least `n` values on `device`, kept for the
        codec's next encodes and decodes (grown, never shrunk); a codec is used
        by one thread at a time."""
        cur = self._work.get(device)
        if cur is None or cur.a.numel() < n:
            cur = _Scratch(*(torch.empty(n, dtype=torch.float32, device=device) for _ in "abc"))
            self._work[device] = cur
        return cur

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
        out = torch.empty(numel, dtype=torch.float32, device=sums.device)
        return self.decode_into(
            sums, contributors, out, numel=numel, per_packet=per_packet, seed=seed, scale=scale
        )

    def decode_into(
        self,
        sums: torch.Tensor,
        contributors: torch.Tensor | int,
        out: torch.Tensor,
        *,
        numel: int,
        per_packet: int,
        seed: int = 0,
        scale: Scale | None = None,
    ) -> torch.Tensor:
        """`decode` written into `out` (1-D float32 of `numel` on sums' device:
        the bucket itself, say), through the codec's scratch tensors."""
        n_lanes = self.n_lanes(numel, per_packet)
        if scale is None:
            raise LocalError(f"{self.name} decode needs the scale the round was encoded with")
        if sums.numel() != n_lanes:
            raise LocalError(
                f"{sums.numel()} summed lanes; a bucket of {numel} values has {n_lanes}"
            )
        if out.numel() != numel or out.dtype != torch.float32 or out.device != sums.device:
            raise LocalError(f"decode into {out.dtype} of {out.numel()}: want float32 of {numel}")
        device = sums.device
        blocks = n_lanes // per_packet
        work = self._scratch(device, n_lanes)
        total = work.a[:n_lanes].view(blocks, per_packet)
        total.copy_(sums.reshape(blocks, per_packet))
        c = contributors_per_lane(contributors, n_lanes, per_packet, device)
        s, _ = self._scale(scale, blocks, device)
        if (
            self.native
            and device.type == "cpu"
            and out.is_contiguous()
            and c.numel() in (1, blocks)
        ):  # the rest a block at a time in C (`_thc.dequantize`)
            _native_thc.dequantize(
                total.reshape(-1).numpy(),
                c.reshape(-1).contiguous().numpy(),
                s.reshape(-1).contiguous().numpy(),
                self.levels,
                signs(seed, per_packet).numpy(),
                out.numpy(),
            )
            return out
        mean = total.div_(c.clamp(min=1))
        if self.dither:
            mean.sub_(_shared_dither(seed, n_lanes, device).view(blocks, per_packet)).add_(0.5)
        y = mean.mul_(2 * s / self.levels).sub_(s)
        if c.numel() > 1 or not bool(c > 0):  # some packets nobody sent: 0 there
            y = torch.where(c > 0, y, 0.0)
        self._unrotated_into(y.contiguous(), work.b[:n_lanes].view(blocks, per_packet), seed, out)
        return out
