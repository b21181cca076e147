"""Randomized Hadamard rotation of power-of-two blocks (THC, OptiReduce).

`rotate` maps each block x of B values to H(D x)/sqrt(B), where H is the
B x B Walsh-Hadamard matrix (Sylvester order) and D a diagonal of random
signs drawn from `seed`. The map is orthonormal, so it keeps every block's L2
norm, and `unrotate` inverts it. One sign vector of length B serves every block
of a call; it is drawn on the CPU from a `torch.Generator`, so every device and
every worker with the same seed gets the same rotation.

The transform is vectorised over blocks: on devices where float32 matmul is
exact IEEE float32 it multiplies by small Hadamard factors (H_B is a Kronecker
product of H_k, k <= 64); otherwise (TF32 or bf16 matmul allowed) it runs the
add/subtract butterflies, which are exact float32 everywhere.
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch

from dlcp.errors import LocalError

__all__ = ["check_block", "fwht", "fwht_", "rotate", "signs", "unrotate"]

_MAX_FACTOR_BITS = 6  # Hadamard factors of at most 64 x 64


def check_block(block: int) -> None:
    """Raise `LocalError` unless `block` is a power of two (1 included)."""
    if not isinstance(block, int) or block < 1 or block & (block - 1):
        raise LocalError(f"Hadamard block of {block} values is not a power of two")


@lru_cache(maxsize=64)
def _cpu_signs(seed: int, block: int) -> torch.Tensor:
    gen = torch.Generator(device="cpu")
    gen.manual_seed(seed)
    bits = torch.randint(0, 2, (block,), generator=gen, dtype=torch.int64)
    return (1 - 2 * bits).to(torch.float32)


def signs(seed: int, block: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The ±1 float32 diagonal D of the rotation for `seed`, on `device`."""
    check_block(block)
    if not 0 <= seed < 2**64:
        raise LocalError(f"rotation seed {seed} outside 0..2**64-1")
    return _cpu_signs(seed, block).to(device)


@lru_cache(maxsize=32)
def _factor(k: int, device: torch.device) -> torch.Tensor:
    """Orthonormal H_k / sqrt(k) as float32 on `device`."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < k:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / math.sqrt(k)).to(device=device, dtype=torch.float32)


def _exact_matmul(device: torch.device) -> bool:
    """True when float32 matmul on `device` is plain IEEE float32 (no TF32/bf16)."""
    if torch.get_float32_matmul_precision() != "highest":
        return False
    backend = torch.backends.cuda if device.type == "cuda" else torch.backends.mkldnn
    matmul = getattr(backend, "matmul", None)
    return getattr(matmul, "fp32_precision", "none") in ("none", "ieee")


def _split_bits(bits: int) -> list[int]:
    """log2 of the Kronecker factors: balanced pieces of at most 6 bits."""
    pieces = -(-bits // _MAX_FACTOR_BITS) if bits else 0
    return [bits // pieces + (i < bits % pieces) for i in range(pieces)]


def _fwht_matmul(x: torch.Tensor) -> torch.Tensor:
    rows, n = x.shape
    y = x
    left = rows
    right = n
    for b in _split_bits(n.bit_length() - 1):
        k = 1 << b
        right //= k
        h = _factor(k, x.device)
        if right == 1:
            y = (y.reshape(-1, k) @ h).reshape(rows, n)
        else:
            y = torch.matmul(h, y.reshape(left, k, right)).reshape(rows, n)
        left *= k
    return y


def _fwht_matmul_(x: torch.Tensor, work: torch.Tensor) -> torch.Tensor:
    """`_fwht_matmul` with no new tensor: each factor's product goes into the
    other of `x` and `work` (same shape; both overwritten); returns the one
    that holds the transform. The same products, so the same bits."""
    rows, n = x.shape
    src, dst = x, work
    left = rows
    right = n
    for b in _split_bits(n.bit_length() - 1):
        k = 1 << b
        right //= k
        h = _factor(k, x.device)
        if right == 1:
            torch.matmul(src.view(-1, k), h, out=dst.view(-1, k))
        else:
            torch.matmul(h, src.view(left, k, right), out=dst.view(left, k, right))
        left *= k
        src, dst = dst, src
    return src


def _fwht_butterfly(x: torch.Tensor) -> torch.Tensor:
    return _fwht_butterfly_(x.clone())


def _fwht_butterfly_(y: torch.Tensor) -> torch.Tensor:
    rows, n = y.shape
    h = 1
    while h < n:
        v = y.view(rows, n // (2 * h), 2, h)
        lo, hi = v[:, :, 0], v[:, :, 1]
        diff = lo - hi
        lo.add_(hi)
        hi.copy_(diff)
        h *= 2
    return y.mul_(1.0 / math.sqrt(n))


def fwht(x: torch.Tensor, *, method: str = "auto") -> torch.Tensor:
    """Orthonormal Walsh-Hadamard transform H x / sqrt(B) over the last dimension.

    `x` is float32 with a power-of-two last dimension B; returns a new tensor of
    the same shape. The transform is its own inverse. `method` is "auto",
    "matmul" or "butterfly" (the latter two for tests and benchmarks).
    """
    if x.dtype != torch.float32:
        raise LocalError(f"Hadamard transform wants float32, got {x.dtype}")
    n = x.shape[-1]
    check_block(n)
    if method == "auto":
        method = "matmul" if _exact_matmul(x.device) else "butterfly"
    flat = x.reshape(-1, n)
    if method == "matmul":
        out = _fwht_matmul(flat)
    elif method == "butterfly":
        out = _fwht_butterfly(flat)
    else:
        raise LocalError(f"unknown Hadamard method {method!r}: auto, matmul or butterfly")
    return out.reshape(x.shape)


def fwht_(x: torch.Tensor, work: torch.Tensor) -> torch.Tensor:
    """`fwht` of the contiguous float32 (rows, B) `x` without new tensors: `x`
    and `work` (of x's shape) are overwritten; returns the one holding the
    transform (bit for bit `fwht(x)`)."""
    if x.dtype != torch.float32 or x.dim() != 2 or not x.is_contiguous():
        raise LocalError("fwht_ wants a contiguous 2-D float32 tensor")
    check_block(x.shape[-1])
    if _exact_matmul(x.device):
        return _fwht_matmul_(x, work.view(x.shape))
    return _fwht_butterfly_(x)


def rotate(x: torch.Tensor, seed: int) -> torch.Tensor:
    """H(D x)/sqrt(B) for each block in the last dimension of float32 `x`."""
    return fwht(x * signs(seed, x.shape[-1], x.device))


def unrotate(y: torch.Tensor, seed: int) -> torch.Tensor:
    """Inverse of `rotate`: D H y / sqrt(B)."""
    return fwht(y).mul_(signs(seed, y.shape[-1], y.device))
