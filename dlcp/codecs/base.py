"""The worker-side codec interface (torch, sans-IO, on the tensor's own device).

A codec turns a flattened gradient bucket into data lanes exactly as they go
on the wire (`encode`), and turns the aggregated sums of those lanes back into
the mean gradient (`decode`). Aggregators never decode: they add lanes with
`dlcp.codecs.lanes`. Nothing here copies to the host except the few scalars
an `Encoded` reports (one device sync per encode).

Packets: a bucket of `n_lanes` lanes is cut into packets of `per_packet` lanes
(`dlcp.core.layout.Layout.per_packet`); per-packet quantities (`block_max`,
`block_norms`, contributors) follow that cut, the last packet possibly short.
"""

from __future__ import annotations

import math
import sys
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import overload

import numpy as np
import torch

from dlcp.core.layout import DEFAULT_PAYLOAD, lanes_per_packet
from dlcp.errors import LocalError
from dlcp.wire.header import Codec as WireCodec
from dlcp.wire.header import lane_bytes

__all__ = [
    "Codec",
    "CodecState",
    "Encoded",
    "Scale",
    "block_norms",
    "le_bytes",
    "next_scale",
    "per_packet_norms",
    "per_packet_view",
]

# A codec scale: one float for the bucket, or one per packet (float32 tensor).
Scale = float | torch.Tensor


@dataclass
class Encoded:
    """One worker's encoded bucket.

    lanes: uint8, the data lanes as they go on the wire (little-endian fp32 or
        fp16, one byte per thc8 lane, two thc4 lanes per byte low nibble first);
        `lane_bytes(codec, n_lanes, summed=False)` long; on the input's device.
        fp32 lanes may share memory with a float32 input: copy them out before
        the bucket is overwritten.
    n_lanes: lanes in the bucket (THC pads numel up to a whole block).
    scale: the scale the lanes were quantised with (THC; 0.0 for fp codecs): a
        float32-representable float, or the per-packet tensor the caller gave.
    block_max: float32, per packet, max |value| before quantisation (THC: in
        the rotated domain, error feedback included); what the next round's
        scale is agreed from (see `next_scale`). fp32: zeros, which nothing
        reads (no scale to agree, no overflow to detect).
    saturated: values clamped to the scale (THC) or overflowed to inf (fp16).
    norms: float32, per packet, the L2 norm of what the packet carries, for
        codecs whose packets are not slices of the bucket (fft: coefficients);
        None: the priority policies rank packets by `block_norms` of the input.
    """

    lanes: torch.Tensor
    n_lanes: int
    scale: Scale
    block_max: torch.Tensor
    saturated: int
    norms: torch.Tensor | None = None


@dataclass(slots=True)
class CodecState:
    """Per-bucket worker state for error feedback; created and kept by the caller.

    `residual` (float32, the bucket's numel, on the gradient's device) is what
    earlier rounds failed to send; encode adds it to the gradient and stores the
    new residual. Plain tensors and ints, so it pickles and `torch.save`s as is.
    """

    residual: torch.Tensor | None = None
    rounds: int = 0
    saturated: int = 0  # values clamped over all rounds
    # what every rank derived alike from the bucket's last result (fft: the
    # agreed coefficient set); not checkpointed: a restored state starts over
    shared: object | None = None
    # the residual before the last encode's: a codec writes the next residual
    # into it instead of a new tensor (`spare_for`), so a bucket's rounds do
    # not allocate (and page-fault) a bucket-sized tensor each. A residual is
    # overwritten only by the second encode after it replaced: a caller may
    # keep it over one encode to restore the state (the shim does when a step
    # fails). Not checkpointed.
    spare: torch.Tensor | None = None

    def take(self, x: torch.Tensor, into: torch.Tensor | None = None) -> torch.Tensor:
        """x plus the residual (x itself on the first round), written into
        `into` where given (1-D float32 of x's size, not the residual)."""
        r = self.residual
        if r is None:
            return x
        if r.shape != x.shape:
            raise LocalError(
                f"error-feedback state holds {r.numel()} values, bucket has {x.numel()}"
            )
        if into is not None:
            return torch.add(x, r.to(x.device), out=into)
        return x + r.to(x.device)

    def spare_for(self, like: torch.Tensor, numel: int | None = None) -> torch.Tensor:
        """A float32 buffer of `numel` values (like's) on like's device for the
        next residual: the previous residual's, where it fits and is not the
        current one; a new tensor else."""
        n = like.numel() if numel is None else numel
        b, r = self.spare, self.residual
        self.spare = None
        if (
            b is None
            or b.numel() < n
            or b.dtype != torch.float32
            or b.device != like.device
            or not b.is_contiguous()
            or (r is not None and _shares_memory(b, r))
        ):
            return torch.empty(n, dtype=torch.float32, device=like.device)
        return b.reshape(-1)[:n]

    def keep(self, residual: torch.Tensor) -> None:
        """Make `residual` the state's, the one it replaces the next spare."""
        old, self.residual = self.residual, residual
        if old is not None and not _shares_memory(old, residual):
            self.spare = old

    def reset(self) -> None:
        self.residual = None
        self.rounds = 0
        self.saturated = 0
        self.shared = None
        self.spare = None

    def state_dict(self) -> dict[str, object]:
        # a copy: the codec reuses the residual's memory two rounds later
        r = self.residual
        return {
            "residual": None if r is None else r.clone(),
            "rounds": self.rounds,
            "saturated": self.saturated,
        }

    def load_state_dict(self, d: dict[str, object]) -> None:
        residual = d["residual"]
        if residual is not None and not isinstance(residual, torch.Tensor):
            raise LocalError("error-feedback residual is not a tensor")
        self.residual = residual
        self.rounds = int(d["rounds"])  # type: ignore[call-overload]
        self.saturated = int(d["saturated"])  # type: ignore[call-overload]
        self.shared = None
        self.spare = None


def _shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors use the same storage (a view of the other, say)."""
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


class Codec(ABC):
    """A worker-side codec; see the module docstring for the data path.

    Homomorphism: the sum of several workers' data lanes (in
    `lanes.sum_dtype(codec.wire)`) decodes to their mean. For THC this holds only
    if every contributor encoded with the same `seed` and the same `scale`.
    """

    name: str
    wire: WireCodec
    # Rounds depend on what every rank learns from the bucket's results (fft):
    # the caller keeps a CodecState per bucket, encodes each round with
    # `for_round(state)` and hands that codec the result with `learn`.
    agreed: bool = False

    def for_round(self, state: CodecState | None) -> Codec:
        """The codec that encodes and decodes the bucket's next round (self,
        but for agreed codecs)."""
        return self

    def learn(
        self,
        state: CodecState,
        sums: np.ndarray,
        counts: np.ndarray,
        *,
        per_packet: int,
        maxima: np.ndarray | None = None,
    ) -> None:
        """Take what the bucket's result says about the next round: `sums` the
        summed lanes, `counts` the contributor counts of each packet of
        `per_packet` lanes and `maxima` its largest `Encoded.block_max` over
        the contributions, the bytes every rank received (nothing for most codecs)."""
        return None

    def packet_span(self, per_packet: int) -> int:
        """Bucket values that a data packet of `per_packet` lanes stands for
        (where priorities look up its layer): `per_packet`, but for fft."""
        return per_packet

    def per_packet(self, payload: int = DEFAULT_PAYLOAD) -> int:
        """Lanes in a full data packet of `payload` bytes (`Layout.per_packet`)."""
        return lanes_per_packet(self.wire, payload)

    def lane_bytes(self, n_lanes: int) -> int:
        """Bytes of `n_lanes` data lanes (single contributions)."""
        return lane_bytes(self.wire, n_lanes, summed=False)

    @abstractmethod
    def n_lanes(self, numel: int, per_packet: int) -> int:
        """Lanes that a bucket of `numel` values takes on the wire."""

    @abstractmethod
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
        """Encode the flattened floating tensor `x` (not modified).

        seed: shared rotation seed (THC): every worker uses the same seed for
            the same round and bucket.
        scale: shared quantisation range (THC): a float, or a float32 tensor with
            one value per packet; None uses this worker's own max |value|, which
            is only homomorphic if no other worker contributes.
        state: error feedback; x + state.residual is encoded and the residual
            updated.
        generator: source of the stochastic-rounding randomness, on x's device
            (default: torch's global generator). Must be independent per worker.
        """

    @abstractmethod
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
        """Mean of the contributions: float32 of length `numel` on sums' device.

        sums: the summed lanes (n_lanes values in `lanes.sum_dtype`, any real
            dtype; `torch.from_numpy` of the result array works).
        contributors: contributions summed, per packet (length = packets), per
            lane (length n_lanes) or one int for all; lanes with 0 decode to 0.
        seed, scale: those of the round's encode (THC; ignored by fp codecs).
        """

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
        """`encode`, its lanes written into `out` (a uint8 tensor of at least
        the lanes' bytes on x's device: a view of the shim's shared-memory
        segment, say); the `Encoded.lanes` returned are `out`'s first bytes.
        Codecs that can write their lanes there directly (no lanes tensor and
        copy after) override it."""
        enc = self.encode(
            x, per_packet=per_packet, seed=seed, scale=scale, state=state, generator=generator
        )
        dst = lanes_out(out, enc.lanes.numel())
        dst.copy_(enc.lanes)
        enc.lanes = dst
        return enc

    def __repr__(self) -> str:
        return f"<codec {self.name}>"


def lanes_out(out: torch.Tensor, nbytes: int) -> torch.Tensor:
    if out.dtype != torch.uint8 or out.dim() != 1 or not out.is_contiguous():
        raise LocalError("encode_into wants a contiguous 1-D uint8 tensor")
    if out.numel() < nbytes:
        raise LocalError(f"{out.numel()} bytes for {nbytes} bytes of lanes")
    return out[:nbytes]


def check_per_packet(per_packet: int) -> None:
    if not isinstance(per_packet, int) or per_packet < 1:
        raise LocalError(f"per_packet must be a positive int, got {per_packet!r}")


def flat_float(x: torch.Tensor) -> torch.Tensor:
    """x as a 1-D float32 tensor on its device (no copy when already so)."""
    if not x.is_floating_point():
        raise LocalError(f"cannot encode a {x.dtype} tensor; gradients are floating point")
    return x.detach().reshape(-1).to(torch.float32)


def per_packet_view(v: torch.Tensor, per_packet: int) -> torch.Tensor:
    """1-D `v` zero-padded to whole packets, as (packets, per_packet)."""
    n = v.numel()
    packets = -(-n // per_packet)
    pad = packets * per_packet - n
    if pad:
        v = torch.nn.functional.pad(v, (0, pad))
    return v.view(packets, per_packet)


def per_packet_norms(v: torch.Tensor, per_packet: int, ord: float = 2.0) -> torch.Tensor:
    """The `ord` vector norm of each packet-sized slice of 1-D `v` (the last
    may be short), as `vector_norm(per_packet_view(v, per_packet), ord, dim=1)`
    gives it but without the padded copy: the whole packets are a view, the
    short tail a norm of its own. `ord=inf` is each packet's max |value|."""
    n = v.numel()
    whole = n // per_packet
    norms = _norm(v[: whole * per_packet].view(whole, per_packet), ord, dim=1)
    if whole * per_packet == n:
        return norms
    tail = _norm(v[whole * per_packet :], ord, dim=0).reshape(1)
    return torch.cat([norms, tail])


def _norm(t: torch.Tensor, ord: float, dim: int) -> torch.Tensor:
    if ord == math.inf:
        # max |value| as the larger of max and -min: two vectorised passes and no
        # temporary (abs() then amax, or vector_norm's inf, are 10-18x slower on a CPU)
        return torch.maximum(t.amax(dim), t.amin(dim).neg())
    return torch.linalg.vector_norm(t, ord, dim=dim)


def block_norms(x: torch.Tensor, per_packet: int) -> torch.Tensor:
    """L2 norm (float32) of each packet-sized slice of the flattened, unencoded `x`.

    A THC packet's block keeps this norm through the rotation, so priority
    policies can rank packets by it before (and without) encoding.
    """
    check_per_packet(per_packet)
    return per_packet_norms(flat_float(x), per_packet)


def contributors_per_lane(
    contributors: torch.Tensor | int, n_lanes: int, per_packet: int, device: torch.device
) -> torch.Tensor:
    """Contributors as float32, broadcastable per packet: (packets, 1|per_packet) or ()."""
    packets = -(-n_lanes // per_packet)
    c = torch.as_tensor(contributors).to(device=device, dtype=torch.float32)
    if c.numel() == 1:
        return c.reshape(())
    if c.dim() == 1 and c.numel() == packets:
        return c.view(packets, 1)
    if c.dim() == 1 and c.numel() == n_lanes:
        return per_packet_view(c, per_packet)
    raise LocalError(
        f"contributors of shape {tuple(c.shape)}: want one per packet ({packets}), "
        f"one per lane ({n_lanes}) or a single count"
    )


def le_bytes(t: torch.Tensor) -> torch.Tensor:
    """The little-endian bytes of a contiguous 1-D tensor, as uint8 (no copy on LE hosts)."""
    t = t.contiguous()
    b = t.view(torch.uint8)
    if sys.byteorder == "little" or t.element_size() == 1:
        return b
    return b.view(-1, t.element_size()).flip(-1).reshape(-1)


@overload
def next_scale(prev_max: float, margin: float = ...) -> float: ...
@overload
def next_scale(prev_max: torch.Tensor | np.ndarray, margin: float = ...) -> torch.Tensor: ...
def next_scale(
    prev_max: float | torch.Tensor | np.ndarray, margin: float = 1.25
) -> float | torch.Tensor:
    """The THC scale of the next round: the previous round's global max times `margin`.

    `prev_max` is the max over all contributors of `Encoded.block_max` (result
    packets carry it back), either one float for the bucket or one per packet.
    Rounded to float32, as the header carries it, so every worker that computes
    it from the same result gets bit-identical scales. Values above the scale
    are clamped and counted in `Encoded.saturated`.
    """
    if not (math.isfinite(margin) and margin >= 1.0):
        raise LocalError(f"scale margin {margin} must be a finite number >= 1")
    if isinstance(prev_max, torch.Tensor | np.ndarray):
        t = torch.as_tensor(prev_max).to(torch.float32)
        if not bool(torch.isfinite(t).all()) or bool((t < 0).any()):
            raise LocalError("previous maxima must be finite and >= 0")
        return (t.double() * margin).to(torch.float32)
    if not (math.isfinite(prev_max) and prev_max >= 0):
        raise LocalError(f"previous max {prev_max} must be finite and >= 0")
    return float(np.float32(prev_max * margin))
