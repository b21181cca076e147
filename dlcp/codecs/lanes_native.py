"""The C forms of `dlcp.codecs.lanes`' stores and casts where the wire lanes
are not the accumulator's dtype: which `_bulk.store_lanes` kind (and table)
unpacks a codec's lanes as `lanes.unpack` and numpy's assignment do, and the
fp16 cast of sums (`to_halves`). Each is chosen only where it gives the
Python definition's bits (checked at import where a CPU feature is used).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from dlcp.codecs.rangefloat import UNIT_VALUES
from dlcp.wire.batch import _bulk
from dlcp.wire.header import Codec

__all__ = ["native_kind", "to_halves"]

# `_bulk.store_lanes`' kinds (dlcp/wire/lane_store.h): the wire lanes it
# unpacks, by (codec, summed), with the dtype of the lanes it writes and the
# table it reads codes through (None: none)
_KIND_TABLE16, _KIND_TABLE8, _KIND_U8, _KIND_U4, _KIND_U10, _KIND_BIT, _KIND_F16C = range(7)
# numpy's own cast of every half to float32: the C store of fp16 lanes is
# then numpy's assignment bit for bit, NaN payloads included
_HALF_TO_F32 = np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float32)
_UNIT_F32 = np.ascontiguousarray(UNIT_VALUES, dtype=np.float32)


def _half_kind() -> tuple[int, np.ndarray | None]:
    """fp16 lanes by the CPU's conversion (`_KIND_F16C`, no table: about a
    third of the table's time a lane) where it gives numpy's bits for every
    half, else through `_HALF_TO_F32`."""
    if _bulk is None:
        return _KIND_TABLE16, _HALF_TO_F32
    out = np.empty(1 << 16, np.float32)
    every = [_HALF_TO_F32.view(np.uint16)[:0].tobytes()]  # (an empty run first)
    every.append(np.arange(1 << 16, dtype="<u2").tobytes())
    try:
        _bulk.store_lanes(out, _KIND_F16C, None, np.array([0, 0]), np.array([0, 1 << 16]), every)
    except ValueError:  # not on this CPU
        return _KIND_TABLE16, _HALF_TO_F32
    if out.tobytes() != _HALF_TO_F32.tobytes():
        return _KIND_TABLE16, _HALF_TO_F32
    return _KIND_F16C, None


_HALF_KIND = _half_kind()
_NATIVE_KINDS: dict[tuple[int, bool], tuple[int, np.dtype, np.ndarray | None]] = {
    (Codec.FP16, False): (_HALF_KIND[0], np.dtype(np.float32), _HALF_KIND[1]),
    (Codec.FP16, True): (_HALF_KIND[0], np.dtype(np.float32), _HALF_KIND[1]),
    (Codec.FFT8, False): (_KIND_TABLE8, np.dtype(np.float32), _UNIT_F32),
    (Codec.THC8, False): (_KIND_U8, np.dtype(np.uint16), None),
    (Codec.THC4, False): (_KIND_U4, np.dtype(np.uint16), None),
    (Codec.THC4_SUM8, True): (_KIND_U8, np.dtype(np.uint16), None),
    (Codec.THC8_SUM10, True): (_KIND_U10, np.dtype(np.uint16), None),
    (Codec.UNION, False): (_KIND_BIT, np.dtype(np.uint16), None),
    (Codec.UNION, True): (_KIND_BIT, np.dtype(np.uint16), None),
}


def native_kind(dest: np.ndarray, codec: int, summed: bool) -> tuple[int, Any] | None:
    """`_bulk.store_lanes`' (kind, table) for `codec`'s wire lanes into `dest`
    where that unpacks them as `unpack` and numpy's assignment do (the
    extension built, `dest` contiguous, writable and of the kind's dtype);
    None: the Python loop."""
    if _bulk is None or not (dest.flags.c_contiguous and dest.flags.writeable):
        return None
    entry = _NATIVE_KINDS.get((int(codec), bool(summed)))
    if entry is None or entry[1] != dest.dtype:
        return None
    return entry[0], entry[2]


def _half_checks() -> np.ndarray:
    """float32 values where a cast to fp16 can go wrong: every half's value,
    the ties between neighbours and the floats either side of them, values
    past the largest half and below the smallest, NaNs of many payloads."""
    halves = np.arange(1 << 16, dtype=np.uint16).view(np.float16)
    exact = halves.astype(np.float32).view(np.uint32)
    finite = exact[np.isfinite(halves)]
    mid = ((finite.astype(np.uint64) + np.roll(finite, -1)) // 2).astype(np.uint32)
    nans = np.uint32(0x7F800000) | np.arange(1, 1 << 23, 4097, dtype=np.uint32)
    rng = np.random.default_rng(0)
    every = np.concatenate(
        [exact, mid - 1, mid, mid + 1, nans, nans | np.uint32(1 << 31),
         rng.integers(0, 1 << 32, 1 << 16, dtype=np.uint64).astype(np.uint32)]
    )  # fmt: skip
    return every.view(np.float32)


def _halves_in_c() -> bool:
    """Whether `_bulk.to_halves` (the CPU's conversion) gives numpy's fp16 of
    `_half_checks` (the values where a cast can go wrong)."""
    if _bulk is None:
        return False
    x = _half_checks()
    out = np.empty(x.size, np.uint16)
    try:
        _bulk.to_halves(x, out)
    except ValueError:  # no F16C here
        return False
    with np.errstate(all="ignore"):
        return bool((out == x.astype("<f2").view(np.uint16)).all())


_HALVES_IN_C = _halves_in_c()


def to_halves(values: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """`np.ascontiguousarray(values, dtype="<f2")`; one C pass (F16C) for
    contiguous float32 where `_HALVES_IN_C`: the fp16 codec's sums cast for
    result packets and for the ranks' out, 4 ns a lane in numpy here.
    `out`: a contiguous fp16 array of `values`' size the halves are written
    into (a rank's mapped segment, not a copy made first), and returned."""
    v = np.asarray(values)
    if out is not None and (out.dtype != np.dtype("<f2") or out.size != v.size):
        raise ValueError(f"out of {out.size} {out.dtype}, not {v.size} float16")
    if out is not None and not out.flags.c_contiguous:
        raise ValueError("out must be contiguous")
    native = _bulk is not None and _HALVES_IN_C
    if not native or v.dtype != np.float32 or not v.flags.c_contiguous or not v.size:
        if out is None:
            return np.ascontiguousarray(v, dtype="<f2")
        out.reshape(-1)[:] = v.reshape(-1)
        return out
    if out is None:
        out = np.empty(v.shape, dtype="<f2")
    _bulk.to_halves(v.reshape(-1), out.reshape(-1))
    return out
