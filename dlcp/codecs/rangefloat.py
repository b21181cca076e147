"""The 8-bit range float of fft's wire lanes (wire codec FFT8), without torch.

A lane is one real or imaginary part of a kept FFT coefficient, divided by
2**e, where e is its block's exponent that every worker derives from the
previous round's result (`dlcp.codecs.fft_wire`), so all contributions of a
lane share one range. The code is HPDC 2020's range-based float with 3
exponent and 4 mantissa bits relative to that range:

    code = sign << 7 | f << 4 | m          (f: 0..7, m: 0..15)
    |value| = (16 + m) * 2**(f - 11)   for f >= 1     (0.0078125 .. 1.9375)
            = m * 2**-10               for f == 0     (gradual underflow to 0)

so `UNIT_VALUES[code]` is the lane's value in units of 2**e. Aggregators add
`UNIT_VALUES[code]` in float32: every such value is a multiple of 2**-10 below
2, so sums of up to 2**13 contributions are exact and do not depend on the
order they arrive in. Workers multiply the sums by 2**e and divide by the
contributor count.
"""

from __future__ import annotations

import numpy as np

__all__ = ["MAX_UNIT", "UNIT_VALUES", "quantize_unit"]

EXP_BITS = 3
MAN_BITS = 4
_EMIN = -(2**EXP_BITS - 2)  # the lowest normal binade: 2**-6


def _unit_values() -> np.ndarray:
    code = np.arange(256, dtype=np.int64)
    mag = code & 0x7F
    f, m = mag >> MAN_BITS, mag & ((1 << MAN_BITS) - 1)
    mant = np.where(f > 0, m + (1 << MAN_BITS), m).astype(np.float64)
    ex = np.where(f > 0, _EMIN + f - 1, _EMIN) - MAN_BITS
    value = np.ldexp(mant, ex)
    out = np.where(code >> 7, -value, value).astype(np.float32)
    out.flags.writeable = False
    return out


UNIT_VALUES: np.ndarray = _unit_values()
MAX_UNIT = float(UNIT_VALUES[0x7F])  # 1.9375: larger magnitudes are clamped to it


def quantize_unit(y: np.ndarray) -> tuple[np.ndarray, int]:
    """Codes (uint8) of the unit-scaled values `y`, rounded to nearest, and how
    many were clamped to +-MAX_UNIT. Non-finite values are an error."""
    v = np.asarray(y, dtype=np.float64)
    if v.size and not np.isfinite(v).all():
        raise ValueError("range-float lanes must be finite")
    mag = np.abs(v)
    clamped = int((mag > MAX_UNIT).sum())
    mag = np.minimum(mag, MAX_UNIT)
    _, e = np.frexp(mag)  # mag = frac * 2**e, frac in [0.5, 1)
    ex = np.where(mag > 0, np.maximum(e - 1, _EMIN), _EMIN)
    n = np.rint(np.ldexp(mag, MAN_BITS - ex)).astype(np.int64)
    code = (ex - _EMIN) * (1 << MAN_BITS) + n
    code = np.minimum(code, 0x7F)
    sign = (v < 0) & (code > 0)
    return (code | (sign.astype(np.int64) << 7)).astype(np.uint8), clamped
