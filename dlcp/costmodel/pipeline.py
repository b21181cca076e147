"""Each codec's exchange of one shard as the steps workers and the shard owner take.

Per phase (sketch has two: the index union, then the cells; the others one):

    worker:  payload = encode(ctx, phase)            -> pushed to the shard owner
    owner:   result = aggregate(phase, payloads)     -> pulled by every worker
    worker:  absorb(ctx, phase, result)              (sketch: learns the union)

and finally `decode(ctx, result, contributors)` gives the mean. Payloads and
results are bytes as they would travel (lanes of `dlcp.codecs.lanes`, fft-sim
block payloads, bitmaps; fft's rounds follow from each worker's state, which
`decode`, and `learn` for the workers that do not decode, update). THC appends
its block maximum (f32) to the payload, and the owner the maximum of those to
the result, so the next round's shared scale comes back with the result
(`next_scale`); the first round needs the workers' maxima agreed another way
(`ShardContext.scale`).

Used in-process (`dlcp.costmodel.exchange`, calibration) and over Gloo
(`dlcp.costmodel.emulate`), so both run the same codec steps.
"""

from __future__ import annotations

import struct
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from dlcp.codecs import lanes
from dlcp.codecs.base import Codec, CodecState, next_scale
from dlcp.codecs.fft import FftCodec, fft_payloads_to_float
from dlcp.codecs.fft_wire import FftWireCodec
from dlcp.codecs.sketch import (
    SketchCodec,
    SketchInput,
    bitmap_to_counts,
    counts_to_bitmap,
    union_from_bitmap,
)
from dlcp.codecs.thc import ThcCodec
from dlcp.wire.header import Codec as WireCodec
from dlcp.wire.header import lane_bytes, narrow_fits

__all__ = ["Pipeline", "ShardContext", "pipeline_for"]

_F32 = struct.Struct("<f")
_U32 = struct.Struct("<I")
Buffer = bytes | memoryview


def _bytes(t: torch.Tensor) -> bytes:
    return t.detach().cpu().contiguous().numpy().tobytes()


@dataclass
class ShardContext:
    """A worker's view of one shard of one bucket, kept across rounds."""

    numel: int
    state: CodecState = field(default_factory=CodecState)
    seed: int = 0
    values: torch.Tensor | None = None  # this round's input
    scale: float | None = None  # THC: the shared scale of this round
    prep: SketchInput | None = None
    union: torch.Tensor | None = None


class Pipeline(ABC):
    phases = 1

    def __init__(self, codec: Codec, *, error_feedback: bool = True) -> None:
        self.codec = codec
        self.per_packet = codec.per_packet()
        self.error_feedback = error_feedback

    def begin(self, ctx: ShardContext, x: torch.Tensor, seed: int) -> None:
        """Start a round with the shard's values `x`."""
        ctx.values = x
        ctx.seed = seed

    def local_max(self, ctx: ShardContext) -> float | None:
        """A value the workers must agree on (max) before encoding, or None."""
        return None

    @abstractmethod
    def encode(self, ctx: ShardContext, phase: int) -> bytes: ...

    @abstractmethod
    def aggregate(self, phase: int, payloads: Sequence[Buffer], numel: int) -> bytes: ...

    def absorb(self, ctx: ShardContext, phase: int, result: Buffer) -> None:
        """A worker reads a non-final phase's result (none by default)."""
        return None

    def learn(self, ctx: ShardContext, result: Buffer, contributors: int) -> None:
        """A worker that does not decode takes what the final result says about
        the next round (fft: the agreed set; `decode` does it too; none by default)."""
        return None

    @abstractmethod
    def result_bytes(self, ctx: ShardContext, phase: int, contributors: int = 0) -> int:
        """Length of the owner's result of `phase` (any worker can compute it)."""

    @abstractmethod
    def decode(self, ctx: ShardContext, result: Buffer, contributors: int) -> torch.Tensor: ...

    def _state(self, ctx: ShardContext) -> CodecState | None:
        return ctx.state if self.error_feedback else None


class LanePipeline(Pipeline):
    """fp32, fp16, thc8, thc4: homomorphic lanes summed in `lanes.sum_dtype`."""

    def _n_lanes(self, numel: int) -> int:
        return self.codec.n_lanes(numel, self.per_packet)

    def local_max(self, ctx: ShardContext) -> float | None:
        if not isinstance(self.codec, ThcCodec) or ctx.scale is not None:
            return None
        assert ctx.values is not None
        st = self._state(ctx)
        v = st.take(ctx.values) if st is not None else ctx.values
        bm = self.codec.encode(v, per_packet=self.per_packet, seed=ctx.seed).block_max
        return float(bm.max()) if bm.numel() else 0.0

    def encode(self, ctx: ShardContext, phase: int) -> bytes:
        assert ctx.values is not None
        enc = self.codec.encode(
            ctx.values,
            per_packet=self.per_packet,
            seed=ctx.seed,
            scale=ctx.scale,
            state=self._state(ctx),
        )
        data = _bytes(enc.lanes)
        if isinstance(self.codec, ThcCodec):
            top = float(enc.block_max.max()) if enc.block_max.numel() else 0.0
            data += _F32.pack(top)
        return data

    def _sums_codec(self, contributors: int) -> int:
        """How the sums of `contributors` go back: THC's in the bits they need
        where every possible sum fits (the daemons send a shard's sums so when
        they all fit: `lanes.narrow_sums`), else the codec's summed lanes."""
        wire = self.codec.wire
        return lanes.NARROW[wire] if narrow_fits(wire, contributors) else wire

    def aggregate(self, phase: int, payloads: Sequence[Buffer], numel: int) -> bytes:
        wire = self.codec.wire
        n = self._n_lanes(numel)
        size = lane_bytes(wire, n, summed=False)
        total = np.zeros(n, dtype=lanes.sum_dtype(wire))
        for p in payloads:
            total += lanes.unpack(wire, p[:size], n, summed=False)
        out = lanes.pack(self._sums_codec(len(payloads)), total, summed=True)
        if isinstance(self.codec, ThcCodec):
            out += _F32.pack(max(_F32.unpack_from(p, size)[0] for p in payloads))
        return out

    def result_bytes(self, ctx: ShardContext, phase: int, contributors: int = 0) -> int:
        extra = _F32.size if isinstance(self.codec, ThcCodec) else 0
        sums = self._sums_codec(contributors)
        return lane_bytes(sums, self._n_lanes(ctx.numel), summed=True) + extra

    def decode(self, ctx: ShardContext, result: Buffer, contributors: int) -> torch.Tensor:
        wire = self._sums_codec(contributors)
        n = self._n_lanes(ctx.numel)
        size = lane_bytes(wire, n, summed=True)
        sums = lanes.unpack(wire, result[:size], n, summed=True)
        mean = self.codec.decode(
            torch.from_numpy(sums.copy()),
            contributors,
            numel=ctx.numel,
            per_packet=self.per_packet,
            seed=ctx.seed,
            scale=ctx.scale if ctx.scale is not None else 0.0,
        )
        if isinstance(self.codec, ThcCodec):  # the next round's scale came back
            ctx.scale = next_scale(_F32.unpack_from(result, size)[0])
        return mean


class FftPipeline(Pipeline):
    """fft: block payloads decoded to float at the owner, fp32 sums back."""

    def encode(self, ctx: ShardContext, phase: int) -> bytes:
        assert ctx.values is not None
        st = self._state(ctx)
        return _bytes(self.codec.encode(ctx.values, per_packet=self.per_packet, state=st).lanes)

    def aggregate(self, phase: int, payloads: Sequence[Buffer], numel: int) -> bytes:
        total = np.zeros(numel, dtype=np.float32)
        for p in payloads:
            total += fft_payloads_to_float(p)
        return total.tobytes()

    def result_bytes(self, ctx: ShardContext, phase: int, contributors: int = 0) -> int:
        return 4 * ctx.numel

    def decode(self, ctx: ShardContext, result: Buffer, contributors: int) -> torch.Tensor:
        sums = torch.from_numpy(np.frombuffer(result, dtype=np.float32).copy())
        return self.codec.decode(sums, contributors, numel=ctx.numel, per_packet=self.per_packet)


class FftWirePipeline(Pipeline):
    """fft on the wire: each worker's round from its state (a dense fp32 round
    first, then the agreed coefficients), lanes summed like any codec's. As in
    the daemon, a payload carries its packets' maxima (f32 each, after a u32
    lane count, the wire codec byte and the lanes: what the headers carry) and
    the result their maximum over the workers, after the float32 sums; the
    result tells every worker the next set and ranges."""

    codec: FftWireCodec

    def _round(self, ctx: ShardContext) -> tuple[Codec, int, int]:
        """The round's codec, its lanes per packet and its lanes."""
        rc = self.codec.for_round(ctx.state)
        pp = rc.per_packet()
        return rc, pp, rc.n_lanes(ctx.numel, pp)

    def encode(self, ctx: ShardContext, phase: int) -> bytes:
        assert ctx.values is not None
        rc, pp, n = self._round(ctx)
        enc = rc.encode(ctx.values, per_packet=pp, state=self._state(ctx))
        head = _U32.pack(n) + bytes([rc.wire])
        return head + _bytes(enc.lanes) + _bytes(enc.block_max.to(torch.float32))

    def aggregate(self, phase: int, payloads: Sequence[Buffer], numel: int) -> bytes:
        (n,) = _U32.unpack_from(payloads[0])
        wire = WireCodec(payloads[0][4])
        at = _U32.size + 1
        data = lane_bytes(wire, n, False)
        total = np.zeros(n, dtype=np.float32)
        top = np.zeros((len(payloads[0]) - at - data) // 4, dtype=np.float32)
        for p in payloads:
            total += lanes.unpack(wire, p[at : at + data], n, summed=False)
            np.maximum(top, np.frombuffer(p, dtype="<f4", offset=at + data), out=top)
        return total.tobytes() + top.tobytes()

    def result_bytes(self, ctx: ShardContext, phase: int, contributors: int = 0) -> int:
        _, pp, n = self._round(ctx)
        return 4 * n + 4 * -(-n // pp)

    def _learn(self, ctx: ShardContext, rc: Codec, pp: int, n: int, result: Buffer, c: int) -> None:
        sums = np.frombuffer(result, dtype=np.float32, count=n)
        maxima = np.frombuffer(result, dtype="<f4", offset=4 * n)
        counts = np.full(maxima.size, c)
        rc.learn(ctx.state, sums, counts, per_packet=pp, maxima=maxima)

    def decode(self, ctx: ShardContext, result: Buffer, contributors: int) -> torch.Tensor:
        rc, pp, n = self._round(ctx)
        sums = np.frombuffer(result, dtype=np.float32, count=n).copy()
        mean = rc.decode(torch.from_numpy(sums), contributors, numel=ctx.numel, per_packet=pp)
        self._learn(ctx, rc, pp, n, result, contributors)
        return mean

    def learn(self, ctx: ShardContext, result: Buffer, contributors: int) -> None:
        rc, pp, n = self._round(ctx)
        self._learn(ctx, rc, pp, n, result, contributors)


class SketchPipeline(Pipeline):
    """sketch: phase 0 the bitmap union (counts summed), phase 1 the fp32 cells."""

    phases = 2
    codec: SketchCodec

    def begin(self, ctx: ShardContext, x: torch.Tensor, seed: int) -> None:
        super().begin(ctx, x, seed)
        ctx.prep = self.codec.prepare(x, self._state(ctx))
        ctx.union = None

    def encode(self, ctx: ShardContext, phase: int) -> bytes:
        assert ctx.prep is not None
        if phase == 0:
            return _bytes(ctx.prep.bitmap)
        assert ctx.union is not None
        enc = self.codec.encode_prepared(
            ctx.prep, ctx.union, seed=ctx.seed, per_packet=self.per_packet
        )
        return _bytes(enc.lanes)

    def aggregate(self, phase: int, payloads: Sequence[Buffer], numel: int) -> bytes:
        if phase == 0:
            counts = np.zeros(numel, dtype=np.uint16)
            for p in payloads:
                counts += bitmap_to_counts(p, numel)
            return counts_to_bitmap(counts)
        n = len(payloads[0]) // 4
        cells = np.zeros(n, dtype=np.float32)
        for p in payloads:
            cells += lanes.unpack(self.codec.wire, p, n, summed=False)
        return cells.tobytes()

    def absorb(self, ctx: ShardContext, phase: int, result: Buffer) -> None:
        ctx.union = union_from_bitmap(result, ctx.numel)

    def result_bytes(self, ctx: ShardContext, phase: int, contributors: int = 0) -> int:
        if phase == 0:
            return -(-ctx.numel // 8)
        assert ctx.union is not None
        return 4 * self.codec.cells_for(ctx.union.numel())

    def decode(self, ctx: ShardContext, result: Buffer, contributors: int) -> torch.Tensor:
        cells = torch.from_numpy(np.frombuffer(result, dtype=np.float32).copy())
        return self.codec.decode(
            cells,
            contributors,
            numel=ctx.numel,
            per_packet=self.per_packet,
            seed=ctx.seed,
            union=ctx.union,
        )


def pipeline_for(codec: Codec, *, error_feedback: bool = True) -> Pipeline:
    """The exchange steps of `codec`."""
    if isinstance(codec, SketchCodec):
        return SketchPipeline(codec, error_feedback=error_feedback)
    if isinstance(codec, FftCodec):
        return FftPipeline(codec, error_feedback=error_feedback)
    if isinstance(codec, FftWireCodec):
        return FftWirePipeline(codec, error_feedback=error_feedback)
    return LanePipeline(codec, error_feedback=error_feedback)
