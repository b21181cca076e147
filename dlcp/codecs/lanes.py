"""Lane arithmetic: what an aggregator does with payloads without decoding them.

Payload lanes are little-endian. A single contribution travels in the codec's
data lanes (fp32, fp16, 8-bit or packed 4-bit integers, fft's 8-bit range
floats, unpacked through a table to float32); sums travel in summed lanes
(fp32, fp16, uint16). Aggregators unpack both into the accumulator dtype,
add, and pack sums for result packets. The integer sums of THC are exact and
independent of arrival order; 64 contributors of 8 bits fit in 16 bits.

The sketch codec's index union (`Codec.UNION`) has 1-bit lanes, packed LSB
first, in both directions: aggregators add the bits as uint16 counts and pack
the sums as count > 0, so that summing a union is an OR of bitmaps (summed
lanes of several local ranks are bits too, so their OR composes). Its count
sketch (`Codec.SKETCH`) travels and sums exactly as FP32 lanes.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from dlcp.codecs.lanes_native import native_kind, to_halves

# the copies of `store_runs` in C: the extension as dlcp.wire.batch imported it
# (None where it is not built or DLCP_NATIVE_BULK=0; a Python loop then)
from dlcp.codecs.rangefloat import UNIT_VALUES, quantize_unit
from dlcp.errors import Reason, RemoteError
from dlcp.wire.batch import Payloads, _bulk
from dlcp.wire.header import LANE_BITS, NARROW_SUMS, RESULT_ONLY_CODECS, Codec, lane_bytes

__all__ = [
    "MAX_CONTRIBUTORS",
    "NARROW",
    "WIDE",
    "add_runs",
    "can_add_runs",
    "narrow_bytes",
    "narrow_sums",
    "pack",
    "store_many",
    "store_runs",
    "sum_dtype",
    "summed_wire",
    "to_halves",
    "unpack",
]

# Contributions whose sum is guaranteed to fit the summed lanes of every codec.
MAX_CONTRIBUTORS = 257  # 257 * 255 = 65535 for thc8; fp lanes have no such limit

_SUM_DTYPE: dict[int, np.dtype] = {
    Codec.FP32: np.dtype(np.float32),
    Codec.FP16: np.dtype(np.float32),
    Codec.THC8: np.dtype(np.uint16),
    Codec.THC4: np.dtype(np.uint16),
    Codec.UNION: np.dtype(np.uint16),  # counts of the bits set; sent as count > 0
    Codec.SKETCH: np.dtype(np.float32),
    Codec.FFT8: np.dtype(np.float32),
    Codec.THC8_SUM10: np.dtype(np.uint16),
    Codec.THC4_SUM8: np.dtype(np.uint16),
}
# whole-byte lanes only: UNION's 1-bit lanes are packed and unpacked by `_bits`
_WIRE_SUMMED: dict[int, np.dtype] = {
    Codec.FP32: np.dtype("<f4"),
    Codec.FP16: np.dtype("<f2"),
    Codec.THC8: np.dtype("<u2"),
    Codec.THC4: np.dtype("<u2"),
    Codec.SKETCH: np.dtype("<f4"),
    Codec.FFT8: np.dtype("<f4"),
}
_WIRE_DATA: dict[int, np.dtype] = {
    Codec.FP32: np.dtype("<f4"),
    Codec.FP16: np.dtype("<f2"),
    Codec.THC8: np.dtype("u1"),
    Codec.THC8_SUM10: np.dtype("u1"),
    Codec.SKETCH: np.dtype("<f4"),
}
# THC's sums in the bits they need: result packets of a shard whose sums all
# fit (`narrow_sums`) carry the narrow codec, its lanes packed LSB first;
# everywhere else (aggregators' slots, collectors' sums, the shim's out) they
# are uint16 as THC8's and THC4's summed lanes
NARROW: dict[int, int] = NARROW_SUMS
WIDE: dict[int, int] = {v: k for k, v in NARROW.items()}
assert frozenset(WIDE) == RESULT_ONLY_CODECS  # the wire's name for the same codecs
_THC4_DATA = frozenset({Codec.THC4, Codec.THC4_SUM8})
_BIT_LANES = frozenset({Codec.UNION})


def _bits(payload: bytes | memoryview, count: int) -> np.ndarray:
    """1-bit lanes (LSB first) as 0/1 uint8."""
    return np.unpackbits(np.frombuffer(payload, dtype=np.uint8), bitorder="little", count=count)


def sum_dtype(codec: int) -> np.dtype:
    """dtype in which an aggregator accumulates lanes of `codec`."""
    return _SUM_DTYPE[codec]


def unpack(codec: int, payload: bytes | memoryview, count: int, summed: bool) -> np.ndarray:
    """Lanes of a payload as a read-only array; dtype of the wire lanes.

    Raises `RemoteError(BAD_LENGTH)` when the payload does not hold `count` lanes.
    """
    if len(payload) != lane_bytes(codec, count, summed):
        raise RemoteError(Reason.BAD_LENGTH, f"{len(payload)} bytes for {count} lanes")
    if codec in _BIT_LANES:
        return _bits(payload, count)
    if summed and codec in WIDE:
        return _unpack_narrow(codec, payload, count)
    if summed:
        return np.frombuffer(payload, dtype=_WIRE_SUMMED[codec], count=count)
    if codec in _THC4_DATA:
        packed = np.frombuffer(payload, dtype=np.uint8)
        out = np.empty(packed.size * 2, dtype=np.uint8)
        out[0::2] = packed & 0x0F
        out[1::2] = packed >> 4
        return out[:count]
    if codec == Codec.FFT8:  # range-float codes: their values in units of the block's range
        return UNIT_VALUES[np.frombuffer(payload, dtype=np.uint8, count=count)]
    return np.frombuffer(payload, dtype=_WIRE_DATA[codec], count=count)


def store_many(
    dest: np.ndarray,
    codec: int,
    summed: bool,
    items: Iterable[tuple[int, int, bytes | memoryview]],
) -> None:
    """`dest[start : start + count] = unpack(codec, payload, count, summed)` for
    each (start, count, payload), with the same BAD_LENGTH check.

    Where the wire lanes are already `dest`'s dtype (fp32 data and sums, the
    integer sums of THC), each payload's bytes are copied straight into `dest`
    (a memoryview assignment: about half the per-packet cost of making an
    array of each payload and assigning it).
    """
    wire = (_WIRE_SUMMED if summed else _WIRE_DATA).get(codec)
    if wire is not None and wire == dest.dtype and dest.flags.c_contiguous:
        raw = dest.data.cast("B")
        size = dest.itemsize
        for start, count, payload in items:
            if len(payload) != count * size:
                raise RemoteError(Reason.BAD_LENGTH, f"{len(payload)} bytes for {count} lanes")
            raw[start * size : (start + count) * size] = payload
        return
    for start, count, payload in items:
        dest[start : start + count] = unpack(codec, payload, count, summed)


def _raw_items(
    payloads: Sequence[bytes | memoryview],
) -> tuple[Sequence[bytes | memoryview], int]:
    """What the C runs take: the buffers and the bytes to skip in each (the
    datagrams themselves and their header for a `Payloads`)."""
    if isinstance(payloads, Payloads):
        return payloads.datagrams, payloads.skip
    if isinstance(payloads, list | tuple):
        return payloads, 0
    return list(payloads), 0


def store_runs(
    dest: np.ndarray,
    codec: int,
    summed: bool,
    starts: np.ndarray,
    counts: np.ndarray,
    payloads: Sequence[bytes | memoryview],
    native: bool = True,
) -> None:
    """`store_many(dest, codec, summed, zip(starts, counts, payloads))`, the
    same result and the same BAD_LENGTH error. Where the wire lanes are
    `dest`'s dtype, the copies are made by one C call (`_bulk.copy_runs`: no
    Python work per payload; from the datagrams themselves when `payloads` is
    a `dlcp.wire.batch.Payloads`) unless `native` is False. `starts` and
    `counts` are arrays of lanes; a run must lie within `dest` (IndexError)."""
    if native and _wire_in_place(dest, codec, summed):
        _native_runs(_bulk.copy_runs, (dest, dest.itemsize), starts, counts, payloads)
        return
    unpacked = native_kind(dest, codec, summed) if native else None
    if unpacked is not None:
        _native_runs(_bulk.store_lanes, (dest, *unpacked), starts, counts, payloads)
        return
    s, c = _checked_runs(starts, counts, dest.size)
    if summed and codec in WIDE and _store_narrow(dest, codec, s, c, payloads):
        return
    store_many(dest, codec, summed, zip(s, c, payloads, strict=True))


def _native_runs(
    fn: Any,
    first: tuple[Any, ...],
    starts: np.ndarray,
    counts: np.ndarray,
    payloads: Sequence[bytes | memoryview],
) -> None:
    """fn(*first, starts, counts, buffers, skip), one of `_bulk`'s runs; its
    LengthError is BAD_LENGTH."""
    items, skip = _raw_items(payloads)
    try:
        fn(
            *first,
            np.ascontiguousarray(starts, dtype=np.int64),
            np.ascontiguousarray(counts, dtype=np.int64),
            items,
            skip,
        )
    except _bulk.LengthError as exc:
        raise RemoteError(Reason.BAD_LENGTH, str(exc)) from None


def _checked_runs(starts: np.ndarray, counts: np.ndarray, size: int) -> tuple[list, list]:
    """The runs as lists of ints, each within `size` lanes (else IndexError)."""
    s, c = np.asarray(starts, dtype=np.int64), np.asarray(counts, dtype=np.int64)
    if s.size and (s.min() < 0 or (s + c).max() > size):
        raise IndexError(f"lanes outside {size}")
    return s.tolist(), c.tolist()


def _wire_in_place(dest: np.ndarray, codec: int, summed: bool) -> bool:
    """Whether `_bulk` can write `codec`'s wire lanes into `dest` as they are:
    the extension built, the wire dtype `dest`'s, `dest` contiguous and writable."""
    wire = (_WIRE_SUMMED if summed else _WIRE_DATA).get(codec)
    return (
        _bulk is not None
        and wire is not None
        and wire == dest.dtype
        and dest.flags.c_contiguous
        and dest.flags.writeable
    )


def can_add_runs(dest: np.ndarray, codec: int, summed: bool) -> bool:
    """Whether `add_runs` into `dest` is one C call: float32 lanes on the wire
    and in `dest` (fp32 data and sums), the extension built."""
    return dest.dtype == np.float32 and _wire_in_place(dest, codec, summed)


def add_runs(
    dest: np.ndarray,
    own: np.ndarray,
    codec: int,
    summed: bool,
    starts: np.ndarray,
    counts: np.ndarray,
    payloads: Sequence[bytes | memoryview],
    native: bool = True,
) -> None:
    """`dest[s : s + c] = own[s : s + c] + unpack(codec, payload, c, summed)` for
    each run, in order, with `store_runs`' BAD_LENGTH check: one sender's
    packets summed with this node's lanes as they arrive, so that they are not
    first stored and then summed (one pass over the shard instead of two).
    `own` is as long as `dest`. One C call (`_bulk.add_runs`) where
    `can_add_runs`, else a loop that computes the same float32 sums."""
    if own.shape != dest.shape:
        raise ValueError(f"own {own.shape} and dest {dest.shape} differ")
    if native and can_add_runs(dest, codec, summed) and own.dtype == np.float32:
        _native_runs(_bulk.add_runs, (dest, np.ascontiguousarray(own)), starts, counts, payloads)
        return
    s, c = _checked_runs(starts, counts, dest.size)
    for start, count, payload in zip(s, c, payloads, strict=True):
        lanes = unpack(codec, payload, count, summed)
        np.add(own[start : start + count], lanes, out=dest[start : start + count], casting="unsafe")


def wire_summed_dtype(codec: int) -> np.dtype:
    """The little-endian dtype of summed (result) lanes on the wire and in the
    shim's out; uint8 (bytes of packed bits) for UNION, see `summed_wire`;
    the wide dtype (the shim's out) for THC's narrow sums."""
    if codec in _BIT_LANES:
        return np.dtype(np.uint8)
    if codec in WIDE:
        return np.dtype(_WIRE_SUMMED[WIDE[codec]])
    return np.dtype(_WIRE_SUMMED[codec])


def summed_wire(codec: int, sums: np.ndarray) -> np.ndarray:
    """Summed lanes as result packets and the shim's out region hold them:
    `sums` in `wire_summed_dtype` (no copy where they are so already), or, for
    1-bit lanes, the packed bits of sums > 0 as uint8."""
    if codec in _BIT_LANES:
        return np.frombuffer(pack(codec, sums, True), dtype=np.uint8)
    if codec == Codec.FP16:
        return to_halves(sums)
    return np.ascontiguousarray(sums, dtype=_WIRE_SUMMED[codec])


def pack(codec: int, values: np.ndarray, summed: bool) -> bytes:
    """Serialise lanes (summed lanes for results, data lanes for contributions)."""
    if codec in _BIT_LANES:  # a bit per lane: set where the value (a count) is not 0
        return np.packbits(np.asarray(values).reshape(-1) != 0, bitorder="little").tobytes()
    if summed and codec in WIDE:
        return _pack_narrow(codec, np.asarray(values)).tobytes()
    if codec == Codec.FP16:
        return to_halves(values).tobytes()
    if summed:
        return np.ascontiguousarray(values, dtype=_WIRE_SUMMED[codec]).tobytes()
    if codec in _THC4_DATA:
        v = np.ascontiguousarray(values, dtype=np.uint8)
        if v.size % 2:
            v = np.append(v, np.uint8(0))
        return ((v[0::2] & 0x0F) | (v[1::2] << 4)).astype(np.uint8).tobytes()
    if codec == Codec.FFT8:  # unit-scaled values to their nearest codes
        return quantize_unit(np.asarray(values))[0].tobytes()
    return np.ascontiguousarray(values, dtype=_WIRE_DATA[codec]).tobytes()


# --- THC's narrow sums ----------------------------------------------------------


def narrow_sums(
    codec: int, sums: np.ndarray, offsets: np.ndarray, counts: np.ndarray
) -> tuple[int, np.ndarray] | None:
    """A shard's result lanes in the bits they need: (the narrow codec, the
    packed sums as uint8, each packet's lanes starting on a byte) when `codec`
    has a narrow form, every sum fits it and every packet (`offsets` relative
    to the shard, `counts`) starts and ends on whole bytes; else None (the
    wide lanes go). Three hosts' thc8 sums need 10 bits, not 16: the result
    packets of a bucket carry 0.625 of the bytes."""
    narrow = NARROW.get(codec)
    if narrow is None or not sums.size:
        return None
    bits = LANE_BITS[narrow][1]
    if not _fits(narrow, sums) or ((offsets * bits) % 8).any() or ((counts * bits) % 8).any():
        return None
    return narrow, narrow_bytes(narrow, np.asarray(sums).reshape(-1))


def _fits(codec: int, sums: np.ndarray) -> bool:
    """Whether every sum fits `codec`'s narrow lanes."""
    return not sums.size or int(sums.max()) >> LANE_BITS[codec][1] == 0


def _pack_narrow(codec: int, values: np.ndarray) -> np.ndarray:
    """uint16 sums as `codec`'s narrow lanes (uint8 bytes, LSB first)."""
    v = np.asarray(values).reshape(-1)
    if not _fits(codec, v):
        raise ValueError(f"a sum does not fit {LANE_BITS[codec][1]} bits")
    return narrow_bytes(codec, v)


def narrow_bytes(codec: int, v: np.ndarray) -> np.ndarray:
    """`codec`'s narrow lanes (uint8 bytes, LSB first) of uint16 sums known to
    fit them."""
    if codec == Codec.THC4_SUM8:
        return v.astype(np.uint8)
    n = v.size
    if _bulk is not None and v.dtype == np.uint16 and v.flags.c_contiguous:
        out = np.empty((n * 10 + 7) // 8, np.uint8)
        _bulk.pack_u10(v, out)  # the same bytes in one C pass (numpy's: ~20 ns a lane)
        return out
    pad = -n % 4
    w = np.concatenate([v, np.zeros(pad, v.dtype)]) if pad else v
    q = w.astype(np.uint64).reshape(-1, 4)
    word = q[:, 0] | (q[:, 1] << 10) | (q[:, 2] << 20) | (q[:, 3] << 30)  # 40 bits
    out = np.empty((q.shape[0], 5), np.uint8)
    for k in range(5):
        out[:, k] = (word >> (8 * k)) & 0xFF
    return out.reshape(-1)[: (n * 10 + 7) // 8]


def _unpack_narrow(codec: int, payload: bytes | memoryview, count: int) -> np.ndarray:
    """`count` lanes of `codec`'s narrow sums as uint16 (`lane_bytes` checked)."""
    raw = np.frombuffer(payload, dtype=np.uint8)
    if codec == Codec.THC4_SUM8:
        return raw[:count].astype(np.uint16)
    pad = -raw.size % 5
    b = np.concatenate([raw, np.zeros(pad, np.uint8)]) if pad else raw
    q = b.reshape(-1, 5).astype(np.uint64)
    word = q[:, 0] | (q[:, 1] << 8) | (q[:, 2] << 16) | (q[:, 3] << 24) | (q[:, 4] << 32)
    out = np.empty((q.shape[0], 4), np.uint16)
    for k in range(4):
        out[:, k] = (word >> (10 * k)) & 0x3FF
    return out.reshape(-1)[:count]


def _store_narrow(
    dest: np.ndarray, codec: int, starts: list[int], counts: list[int], payloads: Any
) -> bool:
    """A run of narrow result packets into `dest`, unpacked in one pass when
    every packet holds whole bytes (as `narrow_sums` sends them); False (store
    them one by one) otherwise."""
    bits = LANE_BITS[codec][1]
    if any(c * bits % 8 for c in counts):
        return False
    if any(len(p) != c * bits // 8 for p, c in zip(payloads, counts, strict=True)):
        return False  # one of them has the wrong length: store_many says which
    joined = b"".join(payloads)
    lanes = _unpack_narrow(codec, joined, sum(counts))
    at = 0
    for start, count in zip(starts, counts, strict=True):
        dest[start : start + count] = lanes[at : at + count]
        at += count
    return True
