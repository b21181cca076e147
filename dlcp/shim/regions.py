"""What one submit puts in the segment, byte for byte (docs/shim-protocol.md).

data: the encoded lanes; meta: P u16 layers, P f32 norms, then P f32 block
maxima (max |lane value| before quantisation; the daemon carries them in its
headers and returns the maxima over all contributors); out: the summed
lanes, then P u16 contributor counts, then P f32 block maxima (all
little-endian, packed). `read_out` parses an out region; `write_meta` fills a
meta region.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from dlcp.core.layout import Layout
from dlcp.errors import DlcpError, LocalError
from dlcp.wire.header import Codec, lane_bytes

__all__ = [
    "ALIGN",
    "SUM_DTYPES",
    "OutBuffer",
    "RegionSizes",
    "align",
    "meta_size",
    "read_out",
    "region_sizes",
    "write_meta",
]

ALIGN = 64  # regions start on cache lines, so the summed lanes are aligned for any dtype

# Little-endian dtype of the summed lanes in `out`, per codec.
SUM_DTYPES: dict[Codec, np.dtype] = {
    Codec.FP32: np.dtype("<f4"),
    Codec.FP16: np.dtype("<f2"),
    Codec.THC8: np.dtype("<u2"),
    Codec.THC4: np.dtype("<u2"),
    Codec.UNION: np.dtype("u1"),  # bytes of 1-bit lanes (LSB first): `sums` holds the bytes
    Codec.SKETCH: np.dtype("<f4"),
    Codec.FFT8: np.dtype("<f4"),
    Codec.THC8_SUM10: np.dtype("<u2"),  # result packets' narrow sums: out holds them wide
    Codec.THC4_SUM8: np.dtype("<u2"),
}
_LAYER = np.dtype("<u2")
_NORM = np.dtype("<f4")
_COUNT = np.dtype("<u2")
_MAX = np.dtype("<f4")


def align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def meta_size(packets: int) -> int:
    return packets * (_LAYER.itemsize + _NORM.itemsize + _MAX.itemsize)


@dataclass(frozen=True)
class RegionSizes:
    """Byte sizes of the three regions of one submit (each unaligned)."""

    data: int
    meta: int
    sums: int
    out: int

    @property
    def total(self) -> int:
        """Bytes to reserve for all three, each region aligned."""
        return align(self.data) + align(self.meta) + align(self.out)


def region_sizes(layout: Layout) -> RegionSizes:
    p = layout.packets
    sums = lane_bytes(layout.codec, layout.total, summed=True)
    return RegionSizes(
        data=lane_bytes(layout.codec, layout.total, summed=False),
        meta=meta_size(p),
        sums=sums,
        out=sums + p * (_COUNT.itemsize + _MAX.itemsize),
    )


def write_meta(
    dst: memoryview, layers: npt.ArrayLike, norms: npt.ArrayLike, maxima: npt.ArrayLike
) -> None:
    """Fill a meta region: P layers (u16), P norms (f32), P block maxima (f32)."""
    lay = np.asarray(layers).astype(_LAYER, copy=False).reshape(-1)
    nrm = np.asarray(norms).astype(_NORM, copy=False).reshape(-1)
    mxs = np.asarray(maxima).astype(_MAX, copy=False).reshape(-1)
    if not lay.size == nrm.size == mxs.size:
        raise LocalError(f"{lay.size} layers, {nrm.size} norms and {mxs.size} maxima")
    need = meta_size(lay.size)
    if len(dst) < need:
        raise LocalError(f"meta region of {len(dst)} bytes, need {need}")
    view = np.frombuffer(dst, dtype=np.uint8, count=need)
    a = lay.size * _LAYER.itemsize
    b = a + nrm.size * _NORM.itemsize
    view[:a] = lay.view(np.uint8)
    view[a:b] = nrm.view(np.uint8)
    view[b:] = mxs.view(np.uint8)


@dataclass(frozen=True)
class OutBuffer:
    """A parsed out region. `sums` may share memory with the segment."""

    sums: np.ndarray
    counts: npt.NDArray[np.uint16]
    maxima: npt.NDArray[np.float32]


def read_out(src: memoryview, layout: Layout, *, copy_sums: bool = False) -> OutBuffer:
    """Parse the out region of a finished round of `layout`.

    The counts and maxima are copied (they are small, and may be unaligned);
    the sums are a zero-copy view unless `copy_sums`.
    """
    sizes = region_sizes(layout)
    if len(src) < sizes.out:
        raise DlcpError(f"out region of {len(src)} bytes, the round needs {sizes.out}")
    p = layout.packets
    dtype = SUM_DTYPES[layout.codec]
    sums = np.frombuffer(src, dtype=dtype, count=sizes.sums // dtype.itemsize)
    if copy_sums:
        sums = sums.copy()
    counts = np.frombuffer(src, dtype=_COUNT, count=p, offset=sizes.sums).astype(np.uint16)
    maxima = np.frombuffer(
        src, dtype=_MAX, count=p, offset=sizes.sums + p * _COUNT.itemsize
    ).astype(np.float32)
    return OutBuffer(sums=sums, counts=counts, maxima=maxima)
