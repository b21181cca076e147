"""FFT sparsification with a range-based float (Wang et al., HPDC 2020).

Each packet-sized block of the bucket (B values, the last block possibly
short) goes through a real FFT (orthonormal, so energy is kept); the largest
(1 - theta) of its n//2 + 1 coefficients by energy are kept and their real and
imaginary parts quantised to a range-based float: a sign bit, `exp_bits` of
exponent biased to the block's own top exponent, `man_bits` of mantissa,
round to nearest, gradual underflow to zero. Error feedback carries what was
cut and rounded into the next round; theta diminishes over rounds
(`ThetaSchedule`), which is what makes the method converge.

This is not homomorphic: the shard owner decodes every contribution to fp32
with `fft_lanes_to_float` and sums floats, and result packets carry fp32 sums
of time-domain values (worker-side `decode` is the fp32 one). So only the push
leg is compressed; the pull leg costs as much as fp32.

Payload of one block (one data packet), little-endian:

    0  u16 n      values in the block (time domain); header `count` of the packet
    2  u16 k      kept coefficients
    4  u8  E      exponent bits (1..6)
    5  u8  M      mantissa bits (0..10)
    6  i8  emax   top exponent: parts lie below 2**(emax + 1)
    7  u8  flags  0 (reserved)
    8  bitmap     n//2 + 1 bits, LSB first, bit j set iff coefficient j is kept
    .. values     2k codes of 1 + E + M bits (re, im of each kept coefficient in
                  increasing j), packed LSB first; code = sign << (E+M) | mag

With field e = mag >> M and m = mag & (2^M - 1), emin = emax - (2^E - 2):
|value| = (2^M + m) * 2^(emin + e - 1 - M) for e >= 1, m * 2^(emin - M) for
e = 0. Blocks are self-describing: decoding needs neither theta nor the bucket.

Registered as `fft-sim`: the daemon does not carry this format. `fft` on
the wire (`dlcp.codecs.fft_wire`) has every worker send one agreed
coefficient set instead, so that both legs are compressed. What carrying this
format would need: a codec id for FFT data packets (`PROPOSED_WIRE_CODE`, the
id kept free for it); a data packet carries one block, header `offset` and
`count` in values (`count` = n, all packets but the last `per_packet()`
values) and a payload of variable length, checked by `fft_lanes_to_float`
(not by `lane_bytes`). The shard owner adds `fft_lanes_to_float(payload,
count)` into float32 sums and counts contributors per packet as for fp32
(droppable packets work unchanged); result packets are FP32 summed lanes of
the same values, so `Layout(total=numel, codec=FP32)` cut at the fft block
describes the result leg, and workers decode them with `FftCodec.decode`.
Priorities use `Encoded.block_max` / `block_norms(x, per_packet())`.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import numpy as np
import torch

from dlcp.codecs.base import (
    Codec,
    CodecState,
    Encoded,
    Scale,
    check_per_packet,
    flat_float,
    per_packet_norms,
)
from dlcp.codecs.fp import mean_of_float_sums
from dlcp.core.layout import DEFAULT_PAYLOAD
from dlcp.errors import LocalError, Reason, RemoteError
from dlcp.wire.header import Codec as WireCodec

__all__ = [
    "FFT_HEADER",
    "PROPOSED_WIRE_CODE",
    "FftCodec",
    "ThetaSchedule",
    "block_payload_bytes",
    "fft_lanes_to_float",
    "fft_payloads_to_float",
    "keep_count",
    "split_payloads",
]

FFT_HEADER = struct.Struct("<HHBBbB")  # n, k, exp_bits, man_bits, emax, flags
PROPOSED_WIRE_CODE = 7  # the `dlcp.wire.header.Codec` value kept for FFT block payloads
MAX_BLOCK = 1 << 15  # n is a u16; blocks are powers of two up to this
_EMAX_MIN, _EMAX_MAX = -126, 127  # i8 header field; blocks below 2**-126 decode to 0
_EXP_BITS = range(1, 7)
_MAN_BITS = range(0, 11)


@dataclass(frozen=True)
class ThetaSchedule:
    """Fraction of coefficients dropped in round t: diminishing from `start` to `end`.

    theta_t = end + (start - end) * 2 ** (-t / half_life); half_life 0 is constant
    `start`. Diminishing theta is the HPDC 2020 convergence condition: later
    rounds keep more of the spectrum.
    """

    start: float = 0.9
    end: float = 0.5
    half_life: float = 500.0

    def __post_init__(self) -> None:
        if not (0.0 <= self.end <= self.start < 1.0):
            raise LocalError(f"theta schedule needs 0 <= end <= start < 1, got {self}")
        if not (math.isfinite(self.half_life) and self.half_life >= 0):
            raise LocalError(f"theta half-life {self.half_life} must be >= 0")

    @property
    def lowest(self) -> float:
        """The smallest theta ever used (the largest payload)."""
        return self.start if self.half_life == 0 else self.end

    def __call__(self, round: int) -> float:
        if self.half_life == 0:
            return self.start
        return self.end + (self.start - self.end) * 2.0 ** (-max(round, 0) / self.half_life)


def keep_count(n: int, theta: float) -> int:
    """Coefficients kept of a block of `n` values at drop fraction `theta`."""
    c = n // 2 + 1
    return min(c, max(1, math.ceil((1.0 - theta) * c - 1e-9)))


def block_payload_bytes(n: int, k: int, exp_bits: int, man_bits: int) -> int:
    """Bytes of one block's payload (header, bitmap, packed codes)."""
    return FFT_HEADER.size + -(-(n // 2 + 1) // 8) + -(-2 * k * (1 + exp_bits + man_bits) // 8)


# -- range-based float ------------------------------------------------------


def _quantize(parts: torch.Tensor, exp_bits: int, man_bits: int) -> tuple[torch.Tensor, ...]:
    """Codes (int64), emax per row (int64) and clamped count of float `parts` (rows, m)."""
    mag = parts.double().abs()
    top = mag.amax(dim=1) if mag.shape[1] else mag.new_zeros(mag.shape[0])
    _, top_exp = torch.frexp(top)  # top = f * 2**top_exp, f in [0.5, 1)
    emax = torch.where(top > 0, top_exp.long() - 1, _EMAX_MIN).clamp(_EMAX_MIN, _EMAX_MAX)
    emin = (emax - ((1 << exp_bits) - 2)).unsqueeze(1)
    _, e = torch.frexp(mag)
    # exponent of the value's binade, at least emin (zero: emin, so code 0)
    ex = torch.where(mag > 0, torch.maximum(e.long() - 1, emin), emin)
    n = torch.round(torch.ldexp(mag, (man_bits - ex).double()))
    code = (ex - emin) * (1 << man_bits) + n.long()
    top_code = (1 << (exp_bits + man_bits)) - 1
    clamped = (code > top_code).sum()
    code = code.clamp_(max=top_code)
    sign = ((parts < 0) & (code > 0)).long()
    return code | (sign << (exp_bits + man_bits)), emax, clamped


def _dequantize(
    codes: torch.Tensor, emax: torch.Tensor, exp_bits: int, man_bits: int
) -> torch.Tensor:
    """float64 values of `codes` (rows, m) with per-row `emax` (rows,)."""
    mask = (1 << man_bits) - 1
    mag = codes & ((1 << (exp_bits + man_bits)) - 1)
    e = mag >> man_bits
    m = mag & mask
    emin = (emax - ((1 << exp_bits) - 2)).unsqueeze(1)
    mant = torch.where(e > 0, m + (1 << man_bits), m).double()
    ex = torch.where(e > 0, emin + e - 1, emin) - man_bits
    value = torch.ldexp(mant, ex.double())
    return torch.where((codes >> (exp_bits + man_bits)) > 0, -value, value)


def _np_dequantize(codes: np.ndarray, emax: np.ndarray, exp_bits: int, man_bits: int) -> np.ndarray:
    mag = codes & ((1 << (exp_bits + man_bits)) - 1)
    e = mag >> man_bits
    m = mag & ((1 << man_bits) - 1)
    emin = (emax.astype(np.int64) - ((1 << exp_bits) - 2))[:, None]
    mant = np.where(e > 0, m + (1 << man_bits), m).astype(np.float64)
    ex = np.where(e > 0, emin + e - 1, emin) - man_bits
    value = np.ldexp(mant, ex)
    return np.where((codes >> (exp_bits + man_bits)) > 0, -value, value)


# -- bit packing (LSB first, as np.packbits(bitorder="little")) --------------

_BIT_WEIGHTS = [float(1 << i) for i in range(8)]


def _pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """(rows, nbits) 0/1 tensor -> (rows, ceil(nbits / 8)) uint8, LSB first."""
    rows, nbits = bits.shape
    pad = -nbits % 8
    if pad:
        bits = torch.nn.functional.pad(bits, (0, pad))
    w = torch.tensor(_BIT_WEIGHTS, dtype=torch.float32, device=bits.device)
    return (bits.view(rows, -1, 8).to(torch.float32) @ w).to(torch.uint8)


def _pack_codes(codes: torch.Tensor, width: int) -> torch.Tensor:
    """(rows, m) int64 codes of `width` bits -> (rows, ceil(m * width / 8)) uint8."""
    rows, m = codes.shape
    if width % 8 == 0:  # whole bytes: the codes' little-endian low bytes
        b = torch.stack([(codes >> (8 * i)) & 0xFF for i in range(width // 8)], dim=2)
        return b.reshape(rows, -1).to(torch.uint8)
    shifts = torch.arange(width, device=codes.device, dtype=torch.int32)
    bits = (codes.to(torch.int32).unsqueeze(-1) >> shifts) & 1
    return _pack_bits(bits.to(torch.uint8).reshape(rows, m * width))


def _np_unpack_codes(packed: np.ndarray, m: int, width: int) -> np.ndarray:
    """Inverse of `_pack_codes`: (rows, bytes) uint8 -> (rows, m) int64."""
    rows = packed.shape[0]
    if width % 8 == 0:
        b = packed[:, : m * width // 8].reshape(rows, m, width // 8).astype(np.int64)
        return (b << (8 * np.arange(width // 8, dtype=np.int64))).sum(axis=2)
    bits = np.unpackbits(packed, axis=1, bitorder="little")[:, : m * width]
    weights = np.int64(1) << np.arange(width, dtype=np.int64)
    return bits.reshape(rows, m, width).astype(np.int64) @ weights


# -- the worker-side codec --------------------------------------------------


@dataclass
class _Batch:
    payload: torch.Tensor  # (rows, bytes) uint8
    decoded: torch.Tensor  # (rows, n) float32: what the payload decodes to
    clamped: int


class FftCodec(Codec):
    """FFT top-(1 - theta) sparsification with range-based floats, per packet block.

    theta: a fixed drop fraction or a `ThetaSchedule` (default) evaluated at
        `state.rounds` (round 0 without a state); `encode(theta=...)` overrides.
    exp_bits, man_bits: the range-based float (default 3 and 4: 8 bits a part).
    block: values per block; default `per_packet()` (the largest power of two
        whose payload at the schedule's lowest theta fits one packet).

    `wire` is FP32: the lanes that aggregators sum and results carry. Data packets
    need their own wire codec (`PROPOSED_WIRE_CODE`) with `fft_lanes_to_float`.
    """

    name = "fft"
    wire = WireCodec.FP32

    def __init__(
        self,
        theta: float | ThetaSchedule | None = None,
        *,
        exp_bits: int = 3,
        man_bits: int = 4,
        block: int | None = None,
    ) -> None:
        if exp_bits not in _EXP_BITS or man_bits not in _MAN_BITS:
            raise LocalError(
                f"fft float needs exp_bits 1..6 and man_bits 0..10, got {exp_bits}, {man_bits}"
            )
        if theta is None:
            theta = ThetaSchedule()
        elif not isinstance(theta, ThetaSchedule):
            theta = ThetaSchedule(start=float(theta), end=float(theta), half_life=0.0)
        if block is not None and not (
            isinstance(block, int) and 2 <= block <= MAX_BLOCK and block & (block - 1) == 0
        ):
            raise LocalError(f"fft block {block} is not a power of two in 2..{MAX_BLOCK}")
        self.schedule = theta
        self.exp_bits = exp_bits
        self.man_bits = man_bits
        self.block = block

    @property
    def part_bits(self) -> int:
        return 1 + self.exp_bits + self.man_bits

    def theta(self, round: int) -> float:
        return self.schedule(round)

    def per_packet(self, payload: int = DEFAULT_PAYLOAD) -> int:
        """Block length: `block`, or the largest power of two that fits `payload` bytes."""
        if self.block is not None:
            return self.block
        n = MAX_BLOCK
        while n > 2 and self.max_payload_bytes(n) > payload:
            n //= 2
        return n

    def max_payload_bytes(self, n: int) -> int:
        """The largest payload of a block of `n` values under this codec's schedule."""
        k = keep_count(n, self.schedule.lowest)
        return block_payload_bytes(n, k, self.exp_bits, self.man_bits)

    def lane_bytes(self, n_lanes: int) -> int:
        """Upper bound of the encoded bytes of `n_lanes` values (lowest theta)."""
        b = self.per_packet()
        full, rest = divmod(n_lanes, b)
        return full * self.max_payload_bytes(b) + (self.max_payload_bytes(rest) if rest else 0)

    def n_lanes(self, numel: int, per_packet: int) -> int:
        check_per_packet(per_packet)
        return numel

    def _encode_batch(self, blocks: torch.Tensor, k: int) -> _Batch:
        rows, n = blocks.shape
        spec = torch.fft.rfft(blocks, norm="ortho")
        c = spec.shape[1]
        weight = torch.full((c,), 2.0, device=blocks.device)
        weight[0] = 1.0
        if n % 2 == 0:
            weight[-1] = 1.0
        energy = torch.view_as_real(spec).square().sum(dim=2) * weight
        idx = torch.topk(energy, k, dim=1, sorted=False).indices.sort(dim=1).values
        kept = torch.gather(spec, 1, idx)
        parts = torch.view_as_real(kept).reshape(rows, 2 * k)
        codes, emax, clamped = _quantize(parts, self.exp_bits, self.man_bits)
        values = _dequantize(codes, emax, self.exp_bits, self.man_bits).to(torch.float32)
        sparse = torch.zeros_like(spec)
        sparse.scatter_(1, idx, torch.view_as_complex(values.view(rows, k, 2).contiguous()))
        decoded = torch.fft.irfft(sparse, n=n, norm="ortho")
        bitmap = torch.zeros((rows, c), dtype=torch.uint8, device=blocks.device)
        bitmap.scatter_(1, idx, 1)
        head = torch.tensor(
            list(FFT_HEADER.pack(n, k, self.exp_bits, self.man_bits, 0, 0)),
            dtype=torch.uint8,
            device=blocks.device,
        ).repeat(rows, 1)
        head[:, 6] = (emax & 0xFF).to(torch.uint8)
        payload = torch.cat([head, _pack_bits(bitmap), _pack_codes(codes, self.part_bits)], dim=1)
        return _Batch(payload, decoded, int(clamped))

    def encode(
        self,
        x: torch.Tensor,
        *,
        per_packet: int,
        seed: int = 0,
        scale: Scale | None = None,
        state: CodecState | None = None,
        generator: torch.Generator | None = None,
        theta: float | None = None,
    ) -> Encoded:
        """Encode `x` block by block; `Encoded.lanes` is the blocks' payloads back to back.

        `split_payloads` cuts them into one payload per data packet. seed, scale
        and generator are not used (the codec is deterministic).
        """
        check_per_packet(per_packet)
        if per_packet > MAX_BLOCK or per_packet < 2:
            raise LocalError(f"fft blocks hold 2..{MAX_BLOCK} values, not {per_packet}")
        v = flat_float(x)
        if state is not None:
            v = state.take(v)
        numel = v.numel()
        if theta is None:
            theta = self.schedule(state.rounds if state is not None else 0)
        if not 0.0 <= theta < 1.0:
            raise LocalError(f"fft theta {theta} outside [0, 1)")
        if numel and not bool(torch.isfinite(v).all()):
            raise LocalError("fft cannot encode non-finite gradient values")
        full, rest = divmod(numel, per_packet)
        batches: list[_Batch] = []
        if full:
            blocks = v[: full * per_packet].view(full, per_packet)
            batches.append(self._encode_batch(blocks, keep_count(per_packet, theta)))
        if rest:
            tail = v[full * per_packet :].view(1, rest)
            batches.append(self._encode_batch(tail, keep_count(rest, theta)))
        lanes = (
            torch.cat([b.payload.reshape(-1) for b in batches])
            if batches
            else torch.zeros(0, dtype=torch.uint8, device=v.device)
        )
        clamped = sum(b.clamped for b in batches)
        if state is not None:
            decoded = torch.cat([b.decoded.reshape(-1) for b in batches]) if batches else v.clone()
            state.residual = v - decoded
            state.rounds += 1
            state.saturated += clamped
        block_max = per_packet_norms(v, per_packet, math.inf) if numel else v.new_zeros(0)
        return Encoded(
            lanes=lanes, n_lanes=numel, scale=0.0, block_max=block_max, saturated=clamped
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
        """Mean from fp32 sums of decoded blocks (result lanes), as the fp32 codec."""
        return mean_of_float_sums(sums, contributors, numel=numel, per_packet=per_packet)

    def decode_lanes(self, lanes: torch.Tensor | bytes | memoryview) -> torch.Tensor:
        """One contribution's payloads back to float32 values (what the aggregator adds)."""
        buf = lanes.cpu().numpy().tobytes() if isinstance(lanes, torch.Tensor) else bytes(lanes)
        return torch.from_numpy(fft_payloads_to_float(buf))


# -- aggregator side (numpy, no torch) ---------------------------------------


def _header(payload: bytes | memoryview, at: int = 0) -> tuple[int, int, int, int, int, int]:
    if len(payload) - at < FFT_HEADER.size:
        raise RemoteError(Reason.BAD_LENGTH, "fft payload shorter than its header")
    n, k, eb, mb, emax, flags = FFT_HEADER.unpack_from(payload, at)
    if eb not in _EXP_BITS or mb not in _MAN_BITS or flags:
        raise RemoteError(Reason.BAD_CODEC, f"fft float E{eb}M{mb} flags {flags:#x}")
    if n < 1 or not 1 <= k <= n // 2 + 1:
        raise RemoteError(Reason.BAD_RANGE, f"fft block of {n} values keeps {k}")
    return n, k, eb, mb, emax, block_payload_bytes(n, k, eb, mb)


def split_payloads(lanes: bytes | memoryview) -> list[memoryview]:
    """Cut an encoded bucket (`Encoded.lanes` bytes) into its blocks' payloads."""
    view = memoryview(lanes).cast("B")
    out: list[memoryview] = []
    at = 0
    while at < len(view):
        size = _header(view, at)[5]
        if at + size > len(view):
            raise RemoteError(Reason.BAD_LENGTH, "fft payload cut short")
        out.append(view[at : at + size])
        at += size
    return out


def _decode_rows(rows: np.ndarray, n: int, k: int, eb: int, mb: int) -> np.ndarray:
    """Decode same-shaped payloads (r, size) uint8 -> (r, n) float32."""
    c = n // 2 + 1
    r = rows.shape[0]
    map_bytes = -(-c // 8)
    head = FFT_HEADER.size
    bitmap = np.unpackbits(rows[:, head : head + map_bytes], axis=1, bitorder="little")
    if bitmap[:, c:].any() or not (bitmap[:, :c].sum(axis=1) == k).all():
        raise RemoteError(Reason.BAD_RANGE, f"fft bitmap does not mark {k} coefficients")
    idx = np.nonzero(bitmap[:, :c])[1].reshape(r, k)
    codes = _np_unpack_codes(rows[:, head + map_bytes :], 2 * k, 1 + eb + mb)
    values = _np_dequantize(codes, rows[:, 6].view(np.int8), eb, mb).reshape(r, k, 2)
    spec = np.zeros((r, c), dtype=np.complex128)
    np.put_along_axis(spec, idx, values[..., 0] + 1j * values[..., 1], axis=1)
    return np.fft.irfft(spec, n=n, axis=1, norm="ortho").astype(np.float32)


def fft_lanes_to_float(payload: bytes | memoryview, count: int | None = None) -> np.ndarray:
    """One data packet's payload -> its block's float32 values (length n, or `count`).

    What a shard owner calls for every FFT data packet before adding it to its
    float32 sums. Raises `RemoteError` for a malformed payload or, when `count`
    (the header's element count) is given, a block of another length.
    """
    n, k, eb, mb, _, size = _header(payload)
    if len(payload) != size:
        raise RemoteError(Reason.BAD_LENGTH, f"fft payload of {len(payload)} bytes, want {size}")
    if count is not None and count != n:
        raise RemoteError(Reason.MISMATCH, f"fft block of {n} values in a packet of {count}")
    rows = np.frombuffer(payload, dtype=np.uint8).reshape(1, size)
    return _decode_rows(rows, n, k, eb, mb)[0]


def fft_payloads_to_float(lanes: bytes | memoryview) -> np.ndarray:
    """Blocks' payloads back to back -> all their values (float32), batched by shape."""
    view = memoryview(lanes).cast("B")
    arr = np.frombuffer(view, dtype=np.uint8)
    out: list[np.ndarray] = []
    at = 0
    while at < len(view):
        n, k, eb, mb, _, size = _header(view, at)
        run = 1
        while at + (run + 1) * size <= len(view):  # same-shaped blocks that follow
            nxt = _header(view, at + run * size)
            if nxt[:4] != (n, k, eb, mb):
                break
            run += 1
        if at + run * size > len(view):
            raise RemoteError(Reason.BAD_LENGTH, "fft payload cut short")
        rows = arr[at : at + run * size].reshape(run, size)
        out.append(_decode_rows(rows, n, k, eb, mb).reshape(-1))
        at += run * size
    return np.concatenate(out) if out else np.zeros(0, dtype=np.float32)
