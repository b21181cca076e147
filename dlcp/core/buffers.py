"""Large byte buffers kept for reuse once nothing references them.

Every round allocates the same few large arrays (a shard's slots, a bucket's
result sums, a rank's copy of its lanes), and the previous round's are often
still alive when the next round's are made (results wait for ACKs, a rank
submits its next bucket as soon as the last one returns). New arrays were then
fresh pages, faulted in and zeroed by the kernel 2 MB at a time as they were
first written: a fifth of dlcpd's CPU with 100 MB buckets (perf,
bench/diag/veth_busbw.py). A buffer is handed out again only when the keeper holds
its last reference, so no array, view or packet can still be using it.

A buffer handed out starts on a cache line (ALIGN): a packet's payload is a
whole number of lines past its shard's start at MTU 1500 and 9000 (1408 and
8960 bytes), so every payload sent from it is aligned too. The kernel copies a
payload that starts 16 or 48 bytes past a line into its socket buffer more
slowly: about 45 ns a datagram more in one process (bench/diag/send_path.py, with
the lanes placed at each offset), where numpy's allocator gives 16-byte steps.
"""

from __future__ import annotations

import sys

import numpy as np

__all__ = ["ALIGN", "SpareBuffers"]

ALIGN = 64  # bytes: where a buffer handed out starts


class SpareBuffers:
    """Keeps up to `max_buffers` uint8 buffers; `take` reuses a free one of the
    size asked for."""

    def __init__(self, max_buffers: int = 8) -> None:
        if max_buffers < 1:
            raise ValueError(f"max_buffers must be >= 1, got {max_buffers}")
        self.max_buffers = max_buffers
        # the arrays that own the memory, each ALIGN bytes longer than the
        # buffer made of it; a view of a buffer (any array made from it)
        # references its owner, so the owner's references count them all
        self._buffers: list[np.ndarray] = []
        self.reused = 0
        self.allocated = 0

    def __len__(self) -> int:
        return len(self._buffers)

    def take(self, nbytes: int) -> np.ndarray:
        """A uint8 buffer of `nbytes`, contents undefined: a kept one that nothing
        else references, else a new one (kept if there is room, or in place of
        a free one of another size)."""
        for owner in self._buffers:
            # references: the list, `owner` and getrefcount's argument; any more
            # is an array, a view or a packet still using it
            if owner.size == nbytes + ALIGN and sys.getrefcount(owner) == 3:
                self.reused += 1
                return _aligned(owner, nbytes)
        self.allocated += 1
        owner = np.empty(nbytes + ALIGN, np.uint8)
        if len(self._buffers) >= self.max_buffers:
            # references: the list and getrefcount's argument (no loop variable,
            # nor enumerate's tuple, that would hold one more)
            free = [i for i in range(len(self._buffers)) if sys.getrefcount(self._buffers[i]) == 2]
            if not free:
                return _aligned(owner, nbytes)  # every kept one is in use: not kept
            del self._buffers[free[0]]
        self._buffers.append(owner)
        return _aligned(owner, nbytes)


def _aligned(owner: np.ndarray, nbytes: int) -> np.ndarray:
    """The `nbytes` of `owner` from its first byte on an ALIGN boundary (a view:
    it, and every array made from it, references `owner`)."""
    skip = -owner.ctypes.data % ALIGN
    return owner[skip : skip + nbytes]
