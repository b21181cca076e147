"""Copies between tensors (CPU or CUDA) and the shared-memory segment.

CPU tensors are copied straight into / out of the mapping. CUDA tensors go
through a page-locked (pinned) staging buffer, so the device copy is a DMA
transfer; the buffer is reused and grows as needed.
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

    def write(self, dst: memoryview, src: torch.Tensor) -> None:
        """Copy the bytes of the contiguous uint8 tensor `src` into `dst`."""
        n = src.numel()
        if len(dst) < n:
            raise ValueError(f"region of {len(dst)} bytes for {n} bytes")
        host = np.frombuffer(dst, dtype=np.uint8, count=n)
        if src.is_cuda:
            pinned = self._pinned_bytes(n)
            pinned.copy_(src, non_blocking=True)
            torch.cuda.current_stream(src.device).synchronize()
            host[:] = pinned.numpy()
        else:
            host[:] = src.detach().contiguous().numpy()

    def to_device(self, host: np.ndarray, device: torch.device) -> torch.Tensor:
        """`host` (a view of the segment) as a tensor on `device`.

        On the CPU the tensor shares memory with `host` (read it before the
        region is reused); on CUDA it is a copy made through pinned memory.
        """
        t = torch.from_numpy(host)
        if device.type != "cuda":
            return t
        raw = host.view(np.uint8)
        pinned = self._pinned_bytes(raw.size)
        pinned.numpy()[:] = raw
        out = pinned.to(device, non_blocking=True)
        # the pinned buffer is reused by the next call: wait for the DMA first
        torch.cuda.current_stream(device).synchronize()
        return out.view(t.dtype)
