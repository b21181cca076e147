"""THC's rounding noise and shared dither (`dlcp.codecs.thc`), and its C passes.

On a CPU each value's rounding noise is a keyed hash of its place in the
bucket (`noise_of`), keyed by one draw of the caller's torch generator
(`_noise_key`); `dlcp.codecs._thc` computes it where it rounds, never
writing it out. The shared (subtractive) dither is drawn from the seed.
"""

from __future__ import annotations

import os
from functools import lru_cache

import numpy as np
import torch

try:  # THC's passes a block at a time (dlcp/codecs/_thc.c); off with DLCP_NATIVE_THC=0
    from dlcp.codecs import _thc as _native_thc
except ImportError:  # pragma: no cover - the extension is optional
    _native_thc = None
if os.environ.get("DLCP_NATIVE_THC", "1") == "0":
    _native_thc = None

__all__ = ["noise_of"]

_DITHER_SALT = 0x9E3779B97F4A7C15


@lru_cache(maxsize=2)
def _shared_dither(seed: int, n: int, device: torch.device) -> torch.Tensor:
    """n uniforms in [0, 1) from `seed`, the same on every device (drawn on the CPU)."""
    gen = torch.Generator(device="cpu")
    gen.manual_seed((seed + _DITHER_SALT) % 2**64)
    return torch.rand(n, generator=gen).to(device)


_MIX1, _MIX2 = np.uint32(0x7FEB352D), np.uint32(0x846CA68B)


def _mix32(x: np.ndarray) -> np.ndarray:
    """The lowbias32 mix (Wellons) of uint32 `x`, in place."""
    x ^= x >> np.uint32(16)
    x *= _MIX1
    x ^= x >> np.uint32(15)
    x *= _MIX2
    x ^= x >> np.uint32(16)
    return x


def _noise_key(generator: torch.Generator | None) -> int:
    """The 64-bit key of one encode's rounding noise: one draw of `generator`
    (default: torch's global one)."""
    return int(torch.randint(0, 2**62, (1,), generator=generator))


def noise_of(key: int, n: int) -> np.ndarray:
    """The rounding noise of the values 0..n-1 under `key`: uniforms in [0, 1)
    of 24 bits, each a keyed hash of its place (two rounds of lowbias32, the
    key's low half added before the first, its high half xored before the
    second). What `_thc.quantize` computes per value (numpy's form of it)."""
    i = np.arange(n, dtype=np.uint32)
    i += np.uint32(key & 0xFFFFFFFF)
    h = _mix32(_mix32(i) ^ np.uint32(key >> 32))
    return (h >> np.uint32(8)).astype(np.float32) * np.float32(1.0 / 16777216.0)


def _uniform_(u: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Fill `u` with uniforms in [0, 1), independent per call, from `generator`.

    On a CPU the keyed hash of each value's place (`noise_of`, in C by
    `_thc.uniforms` where built), keyed by one draw of `generator`: the same
    noise `_thc.quantize` makes without writing it, and 24-bit float32
    uniforms as torch's are; the rounding stays unbiased and private to the
    worker. CUDA tensors draw on their device."""
    if u.device.type != "cpu" or not u.is_contiguous():
        return u.uniform_(0.0, 1.0, generator=generator)
    key = _noise_key(generator)
    if _native_thc is not None:
        _native_thc.uniforms(u.numpy().reshape(-1), key)
    else:
        u.numpy().reshape(-1)[:] = noise_of(key, u.numel())
    return u
