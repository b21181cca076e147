"""Page-locking a segment's mapping for CUDA (cudaHostRegister).

A bucket on a GPU then moves to and from the segment in one DMA each way,
where it would otherwise bounce through a pinned staging buffer and a CPU copy
(dlcp.shim.staging). Registration is best effort: where CUDA refuses it (or
is absent) the shim stages as before.
"""

from __future__ import annotations

import ctypes
import warnings

import numpy as np
import torch

__all__ = ["mapping_address", "pin_mapping", "unpin_mapping"]

_PORTABLE = 1  # cudaHostRegisterPortable


def mapping_address(buf: memoryview) -> int:
    """The address of `buf`'s first byte (no view of it is kept)."""
    view = np.frombuffer(buf, np.uint8)
    return int(view.ctypes.data)


def _cudart() -> object | None:
    try:
        return torch.cuda.cudart()
    except (AssertionError, RuntimeError, AttributeError):
        return None


def _clear_last_error() -> None:
    """Reset the CUDA runtime's last error after a refused registration, so that
    PyTorch's next kernel-launch check does not report it as its own. The
    runtime library PyTorch loaded answers by its soname."""
    version = (torch.version.cuda or "").split(".")[0]
    for name in (f"libcudart.so.{version}", "libcudart.so"):
        try:
            ctypes.CDLL(name).cudaGetLastError()
            return
        except (OSError, AttributeError):
            continue


def pin_mapping(buf: memoryview) -> bool:
    """Page-lock `buf` (a whole mapping) for the CUDA devices; whether it is now."""
    if len(buf) == 0 or not torch.cuda.is_available():
        return False
    rt = _cudart()
    if rt is None:
        return False
    # portable: page-locked for every device's context, not only the current one's
    err = int(rt.cudaHostRegister(mapping_address(buf), len(buf), _PORTABLE))  # type: ignore[attr-defined]
    if err != 0:
        _clear_last_error()
        warnings.warn(
            f"dlcp: CUDA did not page-lock the {len(buf)}-byte segment (cudaError {err}); "
            "GPU buckets go through a staging buffer",
            RuntimeWarning,
            stacklevel=2,
        )
        return False
    return True


def unpin_mapping(buf: memoryview) -> None:
    """Undo `pin_mapping` (before the mapping goes)."""
    rt = _cudart()
    if rt is not None and int(rt.cudaHostUnregister(mapping_address(buf))) != 0:  # type: ignore[attr-defined]
        _clear_last_error()
