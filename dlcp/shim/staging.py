"""Copies between tensors (CPU or CUDA) and the shared-memory segment.

CPU tensors are copied straight into / out of the mapping. CUDA tensors move
in one DMA where the segment is page-locked (`direct`: the shim registers
it with CUDA, dlcp.shim.pinning), and otherwise through a page-locked
staging buffer (a DMA, then a CPU copy); the buffer is reused and grows as
needed.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["Staging"]


class Staging:
    """Host <-> device transfers through the segment; one per state (not thread-safe)."""

    def __init__(self) -> None:
        self._pinned: torch.Tensor | None = None

    def _pinned_bytes(self, n: int) -> torch.Tensor:
        if self._pinned is None or self._pinned.numel() < n:
            self._pinned = torch.empty(max(n, 1 << 20), dtype=torch.uint8, pin_memory=True)
        return self._pinned[:n]

    def write(self, dst: memoryview, src: torch.Tensor, *, direct: bool = False) -> None:
        """Copy the bytes of the contiguous uint8 tensor `src` into `dst`
        (`direct`: `dst` is page-locked memory, a GPU copies into it itself)."""
        n = src.numel()
        if len(dst) < n:
            raise ValueError(f"region of {len(dst)} bytes for {n} bytes")
        host = np.frombuffer(dst, dtype=np.uint8, count=n)
        if src.is_cuda and direct:
            torch.from_numpy(host).copy_(src)  # blocking: done when it returns
        elif src.is_cuda:
            pinned = self._pinned_bytes(n)
            pinned.copy_(src, non_blocking=True)
            torch.cuda.current_stream(src.device).synchronize()
            host[:] = pinned.numpy()
        else:
            host[:] = src.detach().contiguous().numpy()

    def to_device(
        self, host: np.ndarray, device: torch.device, *, direct: bool = False
    ) -> torch.Tensor:
        """`host` (a view of the segment) as a tensor on `device`.

        On the CPU the tensor shares memory with `host` (read it before the
        region is reused); on CUDA it is a copy, made straight from `host`
        where that is page-locked (`direct`), else through pinned memory.
        """
        t = torch.from_numpy(host)
        if device.type != "cuda":
            return t
        raw = host.view(np.uint8)
        if direct:
            # blocking: the region may be reused once this returns
            return torch.from_numpy(raw).to(device).view(t.dtype)
        pinned = self._pinned_bytes(raw.size)
        pinned.numpy()[:] = raw
        out = pinned.to(device, non_blocking=True)
        # the pinned buffer is reused by the next call: wait for the DMA first
        torch.cuda.current_stream(device).synchronize()
        return out.view(t.dtype)
