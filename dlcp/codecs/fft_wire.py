"""fft on the wire: FFT sparsification over a coefficient set every worker agrees on.

Why an agreed set: the real FFT is linear, so the sum of the workers' spectra
is the spectrum of their sum, but only coefficient by coefficient. If every
worker sends the same coefficients in the same order, a data packet is just a
run of lanes that the shard owner adds like any other codec's (no bitmap, no
decode to the time domain), and the result packets carry the sums of those
lanes only: both legs are compressed (HPDC 2020's own scheme decodes at the
owner, so its results are dense fp32: `dlcp.codecs.fft.FftCodec`).

How the set is agreed, with no exchange of its own: every rank receives the
same result bytes, so each derives the next round's set from them with the
same deterministic rule (`FftWireCodec.agree_dense`, `agree_sparse`):

* The bucket's first round (or any round without an agreement: a new state,
  one loaded with `load_state_dict`) goes dense: plain fp32 lanes (`FftDenseRound`). Its
  mean's spectrum, block by block, gives the top k coefficients by energy.
* Later rounds (`FftSparseRound`) keep k = `keep_count(block, theta_t)` per
  block: the top k - x of the previous result's coefficients by energy (ties
  to the lower index) plus x = ceil(`explore` * k) coefficients from a sweep
  that moves through the rest of the spectrum round by round, so that what
  error feedback piles up outside the set is sent within c / x rounds and, if
  it is large, stays in the set.

Range floats: lanes are `dlcp.codecs.rangefloat` codes (8 bits, E3M4) in
units of 2**e_b, with one exponent per block that every rank derives from the
same result: the top exponent of the largest part any contribution held in
the block's packets last round (`Encoded.block_max` per packet; data packets
carry it and results carry its maximum back, as for THC's scale) plus
`headroom` binades; after the dense round, of the mean's largest part plus
one binade more. Sharing the exponent makes the codes' values exact dyadic
numbers in one range, so the owner adds them as float32 through a 256-entry
table (`dlcp.codecs.lanes.unpack`), exactly and in any order, and results are
fp32 sums. Values beyond the range are clamped (counted in `saturated`) and
the rest carried by error feedback, as is everything outside the set.

Loss: a lost droppable packet takes some coefficients of some blocks out of
the sum; its per-packet contributor count divides what arrived, and a packet
nobody delivered decodes to zero coefficients (not zero values: its blocks
keep their other frequencies). The agreement uses the counts the same way,
so it stays identical on every rank.
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
    check_per_packet,
    flat_float,
    per_packet_norms,
)
from dlcp.codecs.fft import ThetaSchedule, keep_count
from dlcp.codecs.fp import Fp32Codec, mean_of_float_sums
from dlcp.codecs.rangefloat import EXP_BITS, MAN_BITS, MAX_UNIT, UNIT_VALUES
from dlcp.errors import LocalError
from dlcp.wire.header import Codec as WireCodec

__all__ = ["Agreement", "FftDenseRound", "FftSparseRound", "FftWireCodec"]

DEFAULT_BLOCK = 1024
DEFAULT_THETA = 0.9
DEFAULT_EXPLORE = 0.25
DEFAULT_HEADROOM = 1
_EXP_LIMIT = 120  # block exponents stay where 2**e and 2**-e are normal float32
_EMIN = -(2**EXP_BITS - 2)


@dataclass(frozen=True, eq=False)
class Agreement:
    """The coefficient set and block exponents of a bucket's next fft round.

    The bucket (`numel` values, zero-padded to whole blocks) is cut into
    blocks of `block` values; row b of `index` lists block b's kept
    coefficients in increasing order, `exponent[b]` its range. Lane 2j of a
    block is coefficient index[b, j]'s real part, lane 2j + 1 its imaginary
    part; blocks follow one another.
    """

    numel: int
    block: int
    index: np.ndarray  # (blocks, k) int64
    exponent: np.ndarray  # (blocks,) int64

    @property
    def blocks(self) -> int:
        return int(self.index.shape[0])

    @property
    def k(self) -> int:
        return int(self.index.shape[1])

    @property
    def n_lanes(self) -> int:
        return self.blocks * 2 * self.k


def _weights(block: int) -> np.ndarray:
    """Energy weight of each rfft coefficient: 1 for DC (and Nyquist), else 2."""
    w = np.full(block // 2 + 1, 2.0)
    w[0] = 1.0
    w[-1] = 1.0  # blocks are powers of two: the last coefficient is Nyquist
    return w


def _top_exponent(top: np.ndarray) -> np.ndarray:
    """floor(log2(top)) per value (int64); the int64 minimum where top is 0."""
    _, e = np.frexp(top)
    return np.where(top > 0, e.astype(np.int64) - 1, np.iinfo(np.int64).min)


def _exponents(worst: np.ndarray | None, mean_top: np.ndarray, headroom: int) -> np.ndarray:
    """Block exponents: the top exponent of `worst` (each block's largest part
    over all contributions) plus `headroom`, or where that is unknown or 0, of
    `mean_top` (the mean's largest part) plus one binade more (the mean of H
    workers understates each one's coefficients); blocks with neither take
    the largest other block's (0 when the whole bucket is zero)."""
    ex = _top_exponent(mean_top)
    ex = np.where(ex > np.iinfo(np.int64).min, ex + headroom + 1, ex)
    if worst is not None:
        ew = _top_exponent(worst)
        ex = np.where(ew > np.iinfo(np.int64).min, ew + headroom, ex)
    known = ex > np.iinfo(np.int64).min
    fill = int(ex[known].max()) if known.any() else 0
    return np.clip(np.where(known, ex, fill), -_EXP_LIMIT, _EXP_LIMIT)


def _row_top(parts: np.ndarray) -> np.ndarray:
    return np.abs(parts).max(axis=1) if parts.shape[1] else np.zeros(parts.shape[0])


def _quantize(unit: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Range-float codes (uint8) of unit-scaled float32 values and the clamped
    count (0-d); `rangefloat.quantize_unit` on the tensor's device."""
    mag = unit.abs()
    clamped = (mag > MAX_UNIT).sum()
    mag = mag.clamp(max=MAX_UNIT)
    _, e = torch.frexp(mag)
    ex = torch.where(mag > 0, torch.clamp(e - 1, min=_EMIN), torch.full_like(e, _EMIN))
    n = torch.round(torch.ldexp(mag, (MAN_BITS - ex).to(torch.float32))).to(torch.int32)
    code = ((ex - _EMIN) * (1 << MAN_BITS) + n).clamp(max=0x7F)
    sign = ((unit < 0) & (code > 0)).to(torch.int32)
    return (code | (sign << 7)).to(torch.uint8), clamped


_TABLES: dict[torch.device, torch.Tensor] = {}


def _unit_table(device: torch.device) -> torch.Tensor:
    """`UNIT_VALUES` as a float32 tensor on `device`."""
    t = _TABLES.get(device)
    if t is None:
        t = _TABLES[device] = torch.tensor(UNIT_VALUES, device=device)
    return t


class FftWireCodec(Codec):
    """The `fft` wire codec: builds each round's codec from the bucket's state.

    theta: the fraction of each block's coefficients left out, a float
        (default 0.9), a `ThetaSchedule`, or "diminishing" for the paper's
        schedule (`ThetaSchedule()`: 0.9 falling to 0.5, evaluated at the
        bucket's round count).
    block: values per FFT block, a power of two in 16..32768 (default 1024).
    explore: the share of each block's set swept through the coefficients the
        last result did not hold (0..0.9, default 0.25).
    headroom: binades between last round's largest part in a block's packets
        and the top of the block's range (0..4, default 1).

    Use `for_round(state)` for each round and `learn` with its result; the
    codec itself does not encode (which lanes it sends depends on the state).
    """

    name = "fft"
    wire = WireCodec.FFT8
    agreed = True

    def __init__(
        self,
        theta: float | str | ThetaSchedule = DEFAULT_THETA,
        *,
        block: int = DEFAULT_BLOCK,
        explore: float = DEFAULT_EXPLORE,
        headroom: int = DEFAULT_HEADROOM,
    ) -> None:
        if isinstance(theta, str):
            if theta != "diminishing":
                raise LocalError(f"fft theta {theta!r}: a number, or 'diminishing'")
            theta = ThetaSchedule()
        elif not isinstance(theta, ThetaSchedule):
            t = float(theta)
            if not 0.0 <= t < 1.0:
                raise LocalError(f"fft theta {theta} outside [0, 1)")
            theta = ThetaSchedule(start=t, end=t, half_life=0.0)
        if not (isinstance(block, int) and 16 <= block <= 1 << 15 and block & (block - 1) == 0):
            raise LocalError(f"fft block {block!r} is not a power of two in 16..32768")
        if not (isinstance(explore, int | float) and 0.0 <= explore <= 0.9):
            raise LocalError(f"fft explore {explore!r} outside 0..0.9")
        if not (isinstance(headroom, int) and 0 <= headroom <= 4):
            raise LocalError(f"fft headroom {headroom!r} outside 0..4")
        self.schedule = theta
        self.block = block
        self.explore = float(explore)
        self.headroom = headroom

    # -- the agreement ------------------------------------------------------------
    def keep(self, round_: int) -> int:
        """Coefficients kept per block in the bucket's round `round_`."""
        return keep_count(self.block, self.schedule(round_))

    def agree_dense(self, mean: np.ndarray, round_: int) -> Agreement:
        """The set of round `round_` from a dense round's mean (float values):
        each block's top coefficients by energy, ties to the lower index."""
        numel = int(mean.size)
        if numel == 0:
            raise LocalError("fft cannot agree on an empty bucket")
        blocks = -(-numel // self.block)
        x = np.zeros(blocks * self.block)
        x[:numel] = mean
        spec = np.fft.rfft(x.reshape(blocks, self.block), axis=1, norm="ortho")
        energy = (spec.real**2 + spec.imag**2) * _weights(self.block)
        k = self.keep(round_)
        top = np.sort(np.argsort(-energy, axis=1, kind="stable")[:, :k], axis=1)
        kept = np.take_along_axis(spec, top, axis=1)
        parts = np.stack([kept.real, kept.imag], axis=2).reshape(blocks, 2 * k)
        return Agreement(numel, self.block, top, _exponents(None, _row_top(parts), self.headroom))

    def agree_sparse(
        self, prev: Agreement, values: np.ndarray, round_: int, worst: np.ndarray | None = None
    ) -> Agreement:
        """The set of round `round_` from the previous round's mean coefficients
        `values` ((blocks, k) complex, in `prev.index` order): its top ones by
        energy and a sweep through the others. `worst`: per block, the largest
        part any contribution held in the previous round (the ranges' base)."""
        c = self.block // 2 + 1
        k = self.keep(round_)
        explore = min(c - min(k, prev.k), math.ceil(self.explore * k)) if k < c else 0
        exploit = min(k - explore, prev.k)
        explore = k - exploit
        energy = (values.real**2 + values.imag**2) * _weights(self.block)[prev.index]
        order = np.argsort(-energy, axis=1, kind="stable")[:, :exploit]
        kept = np.take_along_axis(prev.index, order, axis=1)
        vals = np.take_along_axis(values, order, axis=1)
        parts = np.stack([vals.real, vals.imag], axis=2).reshape(prev.blocks, 2 * exploit)
        if explore:
            # the first `explore` coefficients outside the kept ones, cyclically
            # from an offset that moves on every round
            start = (round_ * explore) % c
            key = np.broadcast_to((np.arange(c) - start) % c, (prev.blocks, c)).copy()
            np.put_along_axis(key, kept, c + np.take_along_axis(key, kept, axis=1), axis=1)
            swept = np.argpartition(key, explore - 1, axis=1)[:, :explore]
            kept = np.concatenate([kept, swept], axis=1)
        index = np.sort(kept, axis=1)
        exps = _exponents(worst, _row_top(parts), self.headroom)
        if not exploit and worst is None:  # nothing known about the new set: keep the ranges
            exps = prev.exponent
        return Agreement(prev.numel, self.block, index, exps)

    # -- rounds -------------------------------------------------------------------
    def for_round(self, state: CodecState | None) -> Codec:
        """Dense fp32 without an agreement in `state`, else the sparse round."""
        shared = state.shared if state is not None else None
        if isinstance(shared, Agreement):
            return FftSparseRound(self, shared)
        return FftDenseRound(self)

    def n_lanes(self, numel: int, per_packet: int) -> int:
        raise LocalError("fft's lanes depend on the bucket's state: use for_round(state)")

    def encode(self, x: torch.Tensor, **kwargs: object) -> Encoded:
        raise LocalError("fft encodes a round with for_round(state).encode")

    def decode(
        self, sums: torch.Tensor, contributors: torch.Tensor | int, **kwargs: object
    ) -> torch.Tensor:
        raise LocalError("fft decodes a round with for_round(state).decode")


class FftDenseRound(Fp32Codec):
    """A bucket's first fft round: fp32 lanes (so `name` is fp32, what the
    daemon carries); `learn` takes the coefficient set from its mean."""

    def __init__(self, parent: FftWireCodec) -> None:
        self.parent = parent

    def learn(
        self,
        state: CodecState,
        sums: np.ndarray,
        counts: np.ndarray,
        *,
        per_packet: int,
        maxima: np.ndarray | None = None,
    ) -> None:
        mean = _mean_lanes(sums, counts, per_packet, np.asarray(sums).size)
        state.shared = self.parent.agree_dense(mean, state.rounds)


class FftSparseRound(Codec):
    """An fft round over an agreed coefficient set (wire codec FFT8)."""

    name = "fft"
    wire = WireCodec.FFT8

    def __init__(self, parent: FftWireCodec, agreement: Agreement) -> None:
        self.parent = parent
        self.agreement = agreement
        self._cache: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def _device_tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The index (int64) and each block's 2**e (float32, (blocks, 1)) on `device`."""
        got = self._cache.get(device)
        if got is None:
            a = self.agreement
            idx = torch.from_numpy(a.index).to(device)
            scale = torch.from_numpy(np.ldexp(1.0, a.exponent).astype(np.float32)).to(device)
            got = self._cache[device] = (idx, scale.view(-1, 1))
        return got

    def n_lanes(self, numel: int, per_packet: int) -> int:
        check_per_packet(per_packet)
        if numel != self.agreement.numel:
            raise LocalError(
                f"fft agreement is for {self.agreement.numel} values, the bucket has {numel}"
            )
        return self.agreement.n_lanes

    def packet_span(self, per_packet: int) -> int:
        """Bucket values a packet's coefficients stand for (their blocks')."""
        a = self.agreement
        return -(-per_packet * a.block // (2 * a.k))

    def _spectrum(self, parts: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """Time-domain blocks (blocks, B) of the kept coefficients `parts` (blocks, 2k)."""
        a = self.agreement
        spec = torch.zeros((a.blocks, a.block // 2 + 1), dtype=torch.complex64, device=parts.device)
        spec.scatter_(1, idx, torch.view_as_complex(parts.view(a.blocks, a.k, 2).contiguous()))
        return torch.fft.irfft(spec, n=a.block, norm="ortho")

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
        """Codes of the agreed coefficients of x (plus the residual) in their
        blocks' ranges; seed, scale and generator are not used."""
        a = self.agreement
        self.n_lanes(x.numel(), per_packet)
        v = flat_float(x)
        if state is not None:
            v = state.take(v)
        idx, unit = self._device_tables(v.device)
        padded = torch.nn.functional.pad(v, (0, a.blocks * a.block - v.numel()))
        spec = torch.fft.rfft(padded.view(a.blocks, a.block), norm="ortho")
        parts = torch.view_as_real(torch.gather(spec, 1, idx)).reshape(a.blocks, 2 * a.k)
        codes, clamped_t = _quantize(parts / unit)
        own = _unit_table(v.device)[codes.long()] * unit
        flat_parts = parts.reshape(-1)
        checks = torch.stack([torch.isfinite(v).all().float(), clamped_t.float()]).tolist()
        if not checks[0]:
            raise LocalError("fft cannot encode non-finite gradient values")
        clamped = int(checks[1])
        if state is not None:
            state.residual = v - self._spectrum(own, idx).reshape(-1)[: v.numel()]
            state.rounds += 1
            state.saturated += clamped
        return Encoded(
            lanes=codes.reshape(-1),
            n_lanes=a.n_lanes,
            scale=0.0,
            block_max=per_packet_norms(flat_parts, per_packet, math.inf),
            saturated=clamped,
            norms=per_packet_norms(flat_parts, per_packet),
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
        """The mean: each lane's sum over its packet's count, times its block's
        range, back to the time domain (a packet nobody sent decodes to 0)."""
        a = self.agreement
        n = self.n_lanes(numel, per_packet)
        if sums.numel() != n:
            raise LocalError(f"{sums.numel()} summed lanes; the fft round has {n}")
        mean = mean_of_float_sums(sums, contributors, numel=n, per_packet=per_packet)
        idx, unit = self._device_tables(mean.device)
        parts = mean.view(a.blocks, 2 * a.k) * unit
        return self._spectrum(parts, idx).reshape(-1)[:numel]

    def learn(
        self,
        state: CodecState,
        sums: np.ndarray,
        counts: np.ndarray,
        *,
        per_packet: int,
        maxima: np.ndarray | None = None,
    ) -> None:
        """The next set from the mean coefficients, the ranges from `maxima`
        (per packet, the largest |part| of any contribution: what the result
        carries back) where given."""
        a = self.agreement
        n = a.n_lanes
        mean = _mean_lanes(sums, counts, per_packet, n)
        parts = mean.reshape(a.blocks, a.k, 2) * np.ldexp(1.0, a.exponent)[:, None, None]
        values = parts[..., 0] + 1j * parts[..., 1]
        worst = None
        if maxima is not None:  # each block's lanes lie in one or two packets
            lane_max = np.repeat(np.asarray(maxima, dtype=np.float64), per_packet)[:n]
            worst = lane_max.reshape(a.blocks, 2 * a.k).max(axis=1)
        state.shared = self.parent.agree_sparse(a, values, state.rounds, worst)


def _mean_lanes(sums: np.ndarray, counts: np.ndarray, per_packet: int, n: int) -> np.ndarray:
    """The first `n` summed lanes over their packets' contributor counts, in
    float64 (0 where none contributed): what `learn` agrees the next set from."""
    s = np.asarray(sums, dtype=np.float64)[:n]
    per_lane = np.repeat(np.asarray(counts, dtype=np.float64), per_packet)[:n]
    return np.where(per_lane > 0, s / np.maximum(per_lane, 1.0), 0.0)
