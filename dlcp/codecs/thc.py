"""THC: homomorphic b-bit quantisation of Hadamard-rotated blocks (NSDI 2024).

Encode pads the bucket to whole blocks of B = per_packet lanes, rotates each
block (`hadamard.rotate`, shared seed), and rounds every rotated value y
stochastically and without bias to one of L + 1 = 2^b levels over [-s, s]:

    q = floor((clamp(y, -s, s) + s) * L / (2 s) + U),   U ~ uniform[0, 1)

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
from functools import lru_cache

import numpy as np
import torch

from dlcp.codecs.base import (
    Codec,
    CodecState,
    Encoded,
    Scale,
    contributors_per_lane,
    flat_float,
    per_packet_view,
)
from dlcp.codecs.hadamard import check_block, rotate, unrotate
from dlcp.errors import LocalError
from dlcp.wire.header import Codec as WireCodec

__all__ = ["ThcCodec"]

# Scales below this are treated as this, so an all-zero bucket still encodes
# (to lanes that decode to ~0) without dividing by zero.
_TINY = 1e-30

_WIRE = {8: WireCodec.THC8, 4: WireCodec.THC4}
_DITHER_SALT = 0x9E3779B97F4A7C15


@lru_cache(maxsize=2)
def _shared_dither(seed: int, n: int, device: torch.device) -> torch.Tensor:
    """n uniforms in [0, 1) from `seed`, the same on every device (drawn on the CPU)."""
    gen = torch.Generator(device="cpu")
    gen.manual_seed((seed + _DITHER_SALT) % 2**64)
    return torch.rand(n, generator=gen).to(device)


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

    def n_lanes(self, numel: int, per_packet: int) -> int:
        check_block(per_packet)
        return -(-numel // per_packet) * per_packet

    def _to_rotated(self, v: torch.Tensor, per_packet: int, seed: int) -> torch.Tensor:
        blocks = per_packet_view(v, per_packet)
        return rotate(blocks, seed) if self.rotate else blocks.clone()

    def _from_rotated(self, y: torch.Tensor, numel: int, seed: int) -> torch.Tensor:
        x = unrotate(y, seed) if self.rotate else y
        return x.reshape(-1)[:numel]

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
        check_block(per_packet)
        v = flat_float(x)
        numel = v.numel()
        if state is not None:
            v = state.take(v)
        y = self._to_rotated(v, per_packet, seed)
        blocks = y.shape[0]
        block_max = y.abs().amax(dim=1)
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
        saturated = int((y.abs() > s).sum()) if reported[1] else 0

        top = float(self.levels)
        t = torch.clamp(y, -s, s).add_(s).mul_(top / (2 * s))
        if self.dither:
            u = _shared_dither(seed, t.numel(), t.device).view(t.shape)
        else:
            u = torch.rand(t.shape, device=t.device, generator=generator)
        q = t.add_(u).floor_().clamp_(0.0, top)
        if state is not None:
            own = (q - u).add_(0.5) if self.dither else q.clone()
            own.mul_(2 * s / top).sub_(s)
            state.residual = self._from_rotated(y.sub_(own), numel, seed)
            state.rounds += 1
            state.saturated += saturated
        lanes = q.to(torch.uint8).reshape(-1)
        if self.bits == 4:
            if lanes.numel() % 2:
                lanes = torch.nn.functional.pad(lanes, (0, 1))
            lanes = lanes[0::2] | (lanes[1::2] << 4)
        out_scale: Scale
        if scale is None:
            out_scale = float(np.float32(reported[0]))
        elif isinstance(scale, torch.Tensor) and scale.dim() > 0:
            out_scale = scale
        else:
            out_scale = float(np.float32(float(scale)))
        return Encoded(
            lanes=lanes,
            n_lanes=y.numel(),
            scale=out_scale,
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
        n_lanes = self.n_lanes(numel, per_packet)
        if scale is None:
            raise LocalError(f"{self.name} decode needs the scale the round was encoded with")
        if sums.numel() != n_lanes:
            raise LocalError(
                f"{sums.numel()} summed lanes; a bucket of {numel} values has {n_lanes}"
            )
        device = sums.device
        blocks = n_lanes // per_packet
        total = sums.reshape(blocks, per_packet).to(torch.float32, copy=True)
        c = contributors_per_lane(contributors, n_lanes, per_packet, device)
        s, _ = self._scale(scale, blocks, device)
        mean = total.div_(c.clamp(min=1))
        if self.dither:
            mean.sub_(_shared_dither(seed, n_lanes, device).view(blocks, per_packet)).add_(0.5)
        y = torch.where(c > 0, mean.mul_(2 * s / self.levels).sub_(s), 0.0)
        return self._from_rotated(y, numel, seed)
