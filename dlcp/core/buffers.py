"""Large arrays reused across rounds, once nothing refers to them any more.

Every round needs the same large buffers again: the rank's input, each
sender's lanes of an owned shard, the shard's sums, the bucket's results. Taken
fresh, each is a new mapping whose pages the kernel zeroes at first touch (a
tenth of a daemon's CPU at 1-2 Gbit/s, `clear_page` in perf). `BufferPool`
hands out views of blocks it keeps, and gives a block out again only when no
array, view or exported buffer of it is alive: numpy points every view (of a
view, too) and every memoryview export at the block that owns the memory, so
the block's reference count is exactly the pool's own while nothing uses it.
Nothing has to be returned explicitly, and a block still referred to anywhere
is never handed out twice.

Requests below `min_bytes` are ordinary numpy allocations (malloc reuses small
blocks well); free blocks beyond `max_free_bytes` are let go.
"""

from __future__ import annotations

import math
import sys

import numpy as np
from numpy.typing import DTypeLike

__all__ = ["BufferPool", "pool"]


class BufferPool:
    def __init__(self, *, min_bytes: int = 1 << 20, max_free_bytes: int = 1 << 30) -> None:
        self.min_bytes = min_bytes
        self.max_free_bytes = max_free_bytes
        self._blocks: list[np.ndarray] = []
        # stats
        self.reused = 0
        self.allocated = 0

    def empty(self, shape: int | tuple[int, ...], dtype: DTypeLike) -> np.ndarray:
        """An uninitialised array, on a free block of the pool where one fits."""
        dt = np.dtype(dtype)
        dims = (shape,) if isinstance(shape, int) else tuple(shape)
        nbytes = math.prod(dims) * dt.itemsize
        if nbytes < self.min_bytes:
            return np.empty(dims, dt)
        block = self._free_block(nbytes)
        return block[:nbytes].view(dt).reshape(dims)

    def zeros(self, shape: int | tuple[int, ...], dtype: DTypeLike) -> np.ndarray:
        out = self.empty(shape, dtype)
        out.fill(0)
        return out

    def _free_block(self, nbytes: int) -> np.ndarray:
        blocks = self._blocks
        best = -1
        free_bytes = 0
        for i in range(len(blocks)):
            # references now: the list's, and getrefcount's argument
            if sys.getrefcount(blocks[i]) > 2:
                continue
            size = blocks[i].nbytes
            free_bytes += size
            # a fitting block, not more than twice the size asked for
            if nbytes <= size <= 2 * nbytes and (best < 0 or size < blocks[best].nbytes):
                best = i
        if best >= 0:
            self.reused += 1
            return blocks[best]
        if free_bytes + nbytes > self.max_free_bytes:
            self._trim(self.max_free_bytes - nbytes)
        block = np.empty(nbytes, np.uint8)
        blocks.append(block)
        self.allocated += 1
        return block

    def _trim(self, keep_free: int) -> None:
        """Let go of free blocks, oldest first, until at most `keep_free` bytes are free."""
        free = [i for i in range(len(self._blocks)) if sys.getrefcount(self._blocks[i]) <= 2]
        total = sum(self._blocks[i].nbytes for i in free)
        drop = set()
        for i in free:
            if total <= keep_free:
                break
            total -= self._blocks[i].nbytes
            drop.add(i)
        self._blocks = [b for i, b in enumerate(self._blocks) if i not in drop]

    @property
    def held_bytes(self) -> int:
        """Bytes of all blocks the pool keeps (in use or free)."""
        return sum(b.nbytes for b in self._blocks)


pool = BufferPool()  # the process's pool (the daemon is one process, one thread)
