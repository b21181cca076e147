"""Payloads given as one buffer and where each lies in it.

The sender's packets of a shard take their payloads from one buffer (the
bucket's lanes, or a shard's packed sums) at computed offsets. A `Slices`
names them without a slice object apiece: the C encoder
(`GhashAesKey.encode`) copies each straight from the buffer, and anything
else sees an ordinary sequence of memoryviews, made when asked for.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import overload

import numpy as np

__all__ = ["Slices"]


class Slices(Sequence[memoryview]):
    """Payload i is `buffer[starts[i] : starts[i] + lengths[i]]` (bytes)."""

    __slots__ = ("buffer", "lengths", "starts")

    def __init__(self, buffer: bytes | memoryview, starts: np.ndarray, lengths: np.ndarray) -> None:
        self.buffer = memoryview(buffer).cast("B")
        self.starts = np.ascontiguousarray(starts, dtype=np.int64)
        self.lengths = np.ascontiguousarray(lengths, dtype=np.int64)
        if self.starts.ndim != 1 or self.starts.shape != self.lengths.shape:
            raise ValueError(
                f"starts {self.starts.shape} and lengths {self.lengths.shape} must be one "
                "length, one dimension"
            )
        n = len(self.buffer)
        if self.starts.size and (
            self.starts.min() < 0
            or self.lengths.min() < 0
            or (self.starts + self.lengths).max() > n
        ):
            raise ValueError(f"a slice lies outside the buffer of {n} bytes")

    def __len__(self) -> int:
        return int(self.starts.size)

    @overload
    def __getitem__(self, i: int) -> memoryview: ...
    @overload
    def __getitem__(self, i: slice) -> Slices: ...
    def __getitem__(self, i: int | slice) -> memoryview | Slices:
        if isinstance(i, slice):
            return Slices(self.buffer, self.starts[i], self.lengths[i])
        a = int(self.starts[i])
        return self.buffer[a : a + int(self.lengths[i])]

    def __iter__(self) -> Iterator[memoryview]:
        buf = self.buffer
        return (
            buf[a : a + k] for a, k in zip(self.starts.tolist(), self.lengths.tolist(), strict=True)
        )
