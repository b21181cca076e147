"""Parameter and array validation shared by the policies (LocalError on misuse)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import numpy.typing as npt

from dlcp.errors import LocalError

__all__ = [
    "as_1d",
    "check_bound",
    "check_float",
    "check_int",
    "check_same_length",
    "density",
]


def check_float(
    value: Any,
    name: str,
    *,
    lo: float | None = None,
    hi: float | None = None,
    lo_open: bool = False,
) -> float:
    """`value` as a finite float within [lo, hi] (or (lo, hi] with lo_open)."""
    if isinstance(value, bool) or not isinstance(value, int | float | np.integer | np.floating):
        raise LocalError(f"{name} must be a number, got {value!r}")
    x = float(value)
    if not math.isfinite(x):
        raise LocalError(f"{name} must be finite, got {x}")
    if lo is not None and (x <= lo if lo_open else x < lo):
        raise LocalError(f"{name} must be {'>' if lo_open else '>='} {lo}, got {x}")
    if hi is not None and x > hi:
        raise LocalError(f"{name} must be <= {hi}, got {x}")
    return x


def check_int(value: Any, name: str, *, lo: int | None = None, hi: int | None = None) -> int:
    """`value` as an int within [lo, hi]."""
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise LocalError(f"{name} must be an integer, got {value!r}")
    x = int(value)
    if lo is not None and x < lo:
        raise LocalError(f"{name} must be >= {lo}, got {x}")
    if hi is not None and x > hi:
        raise LocalError(f"{name} must be <= {hi}, got {x}")
    return x


def check_bound(value: Any, name: str = "bound", hi: float = 1.0) -> float:
    """A loss bound: a fraction of lanes in [0, hi]."""
    return check_float(value, name, lo=0.0, hi=hi)


def as_1d(value: Any, name: str, dtype: npt.DTypeLike) -> np.ndarray:
    """`value` as a one-dimensional array of `dtype` (no copy when it already is)."""
    arr = np.asarray(value)
    if arr.ndim != 1:
        raise LocalError(f"{name} must be one-dimensional, got shape {arr.shape}")
    if arr.dtype != dtype:
        arr = arr.astype(dtype)
    return arr


def check_same_length(**arrays: np.ndarray) -> int:
    """The common length of `arrays`; LocalError when they differ."""
    lengths = {k: len(v) for k, v in arrays.items()}
    if len(set(lengths.values())) > 1:
        shown = ", ".join(f"{k}={n}" for k, n in lengths.items())
        raise LocalError(f"per-packet arrays differ in length: {shown}")
    return next(iter(lengths.values()), 0)


def density(norms: Any, counts: Any) -> tuple[np.ndarray, np.ndarray]:
    """Per-packet magnitude density `norm / sqrt(count)` (the slice's RMS) and counts.

    Orders packets as energy per lane (norm**2 / count) does, but stays in the
    units of the norm. Non-finite norms (an exploding gradient) count as the
    largest magnitude so that they are never dropped and travel first.
    """
    n = as_1d(norms, "norms", np.float64)
    c = as_1d(counts, "counts", np.int64)
    check_same_length(norms=n, counts=c)
    if c.size:
        if c.min() < 1:
            raise LocalError("counts must be >= 1 lane per packet")
        if (n < 0).any():  # NaN compares False and is handled below
            raise LocalError("norms must be >= 0")
    d = n / np.sqrt(c)
    if not np.isfinite(d).all():
        d = np.where(np.isfinite(d), d, np.inf)
    return d, c
