"""BufferPool hands a block out again only once nothing refers to it."""

from __future__ import annotations

import numpy as np

from dlcp.core.buffers import BufferPool


def _block_of(a: np.ndarray) -> int:
    """Which block `a` lies on (its address: holding the block would keep it busy)."""
    base = a.base
    assert isinstance(base, np.ndarray)
    return int(base.__array_interface__["data"][0])


def test_a_block_is_reused_only_when_every_view_is_gone() -> None:
    p = BufferPool(min_bytes=1024)
    a = p.empty((4, 1000), np.float32)
    a[:] = 7.0
    block = _block_of(a)
    view = a[2:, 10:20]  # a view of the view: still the block's
    mem = memoryview(a[1])  # an exported buffer
    del a
    b = p.empty(4000, np.float32)
    assert _block_of(b) != block  # the view and the export keep it busy
    del view
    c = p.empty(4000, np.float32)
    assert _block_of(c) != block and _block_of(c) != _block_of(b)
    del mem
    d = p.zeros(4000, np.float32)
    assert _block_of(d) == block  # now free: reused, and zeroed
    assert not d.any()
    assert p.reused == 1 and p.allocated == 3


def test_sizes_small_requests_and_the_free_limit() -> None:
    p = BufferPool(min_bytes=1024, max_free_bytes=10_000)
    small = p.empty(10, np.float64)
    assert small.base is None and p.allocated == 0  # plain numpy below min_bytes
    big = p.empty(8000, np.uint8)
    blk = _block_of(big)
    del big
    # far smaller than the free block (less than half of it): a block of its own
    half = p.empty(3000, np.uint8)
    assert _block_of(half) != blk
    del half
    # a request that pushes the free bytes past the limit lets old free blocks go
    p.empty(9000, np.uint8)
    assert p.held_bytes <= 10_000 + 9000


def test_arrays_from_the_pool_behave_like_numpy_ones() -> None:
    p = BufferPool(min_bytes=64)
    a = p.zeros((3, 50), np.int64)
    assert a.shape == (3, 50) and a.dtype == np.int64 and a.flags.c_contiguous
    a += np.arange(50)
    np.testing.assert_array_equal(a.sum(axis=0), 3 * np.arange(50))
