"""Large byte buffers kept for reuse once nothing references them.

Every round allocates the same few large arrays (a shard's slots, a bucket's
result sums, a rank's copy of its lanes), and the previous round's are often
still alive when the next round's are made (results wait for ACKs, a rank
submits its next bucket as soon as the last one returns). New arrays were then
fresh pages, faulted in and zeroed by the kernel 2 MB at a time as they were
first written: a fifth of dlcpd's CPU with 100 MB buckets (perf,
bench/veth_busbw.py). A buffer is handed out again only when the keeper holds
its last reference, so no array, view or packet can still be using it.
"""

from __future__ import annotations

import sys

import numpy as np

__all__ = ["SpareBuffers"]


class SpareBuffers:
    """Keeps up to `max_buffers` uint8 buffers; `take` reuses a free one of the
    size asked for."""

    def __init__(self, max_buffers: int = 8) -> None:
        if max_buffers < 1:
            raise ValueError(f"max_buffers must be >= 1, got {max_buffers}")
        self.max_buffers = max_buffers
        self._buffers: list[np.ndarray] = []
        self.reused = 0
        self.allocated = 0

    def __len__(self) -> int:
        return len(self._buffers)

    def take(self, nbytes: int) -> np.ndarray:
        """A uint8 buffer of `nbytes`, contents undefined: a kept one that nothing
        else references, else a new one (kept if there is room, or in place of
        a free one of another size)."""
        for buf in self._buffers:
            # references: the list, `buf` and getrefcount's argument; any more
            # is an array, a view or a packet still using it
            if buf.size == nbytes and sys.getrefcount(buf) == 3:
                self.reused += 1
                return buf
        self.allocated += 1
        buf = np.empty(nbytes, np.uint8)
        if len(self._buffers) >= self.max_buffers:
            free = [i for i, b in enumerate(self._buffers) if sys.getrefcount(b) == 2]
            if not free:
                return buf  # every kept one is in use: this one is not kept
            del self._buffers[free[0]]
        self._buffers.append(buf)
        return buf
