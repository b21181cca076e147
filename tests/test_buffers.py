"""Spare buffers are reused only once nothing references them (dlcp/core/buffers.py)."""

from __future__ import annotations

import numpy as np
import pytest

from dlcp.core.buffers import ALIGN, SpareBuffers


def test_a_buffer_comes_back_only_when_nothing_holds_it() -> None:
    spare = SpareBuffers(3)
    first = spare.take(1000)
    addr = first.ctypes.data
    del first
    again = spare.take(1000)
    assert again.ctypes.data == addr and spare.reused == 1
    view = again.view(np.float32)[10:]  # an array made from it, e.g. a result's sums
    del again
    busy = spare.take(1000)
    assert busy.ctypes.data != addr
    packet = memoryview(busy)[:8]  # a payload slice still queued
    del busy
    third = spare.take(1000)
    assert third.ctypes.data not in (addr, packet.obj.ctypes.data)  # type: ignore[union-attr]
    del view
    assert spare.take(1000).ctypes.data == addr
    assert spare.take(999).size == 999  # another size: a new buffer
    assert len(spare) == 3 and spare.allocated == 4


def test_a_full_keeper_makes_room_with_a_free_buffer_only() -> None:
    spare = SpareBuffers(2)
    held = [spare.take(64), spare.take(64)]
    extra = spare.take(64)  # both kept ones in use: a new one, not kept
    assert len(spare) == 2 and all(extra.ctypes.data != h.ctypes.data for h in held)
    del held[0]
    other = spare.take(128)  # a free one of another size gives way
    assert len(spare) == 2
    kept = spare.take(128)  # `other` is still referenced here
    assert kept.ctypes.data != other.ctypes.data
    addr, reused = other.ctypes.data, spare.reused
    del other, kept
    assert spare.take(128).ctypes.data == addr and spare.reused == reused + 1  # it was kept
    with pytest.raises(ValueError):
        SpareBuffers(0)


def test_a_buffer_starts_on_a_cache_line() -> None:
    # numpy's allocations start 16 bytes apart at best: 20 aligned by chance
    # would be one chance in 4**20
    spare = SpareBuffers(20)
    bufs = [spare.take(1000 + 48 * i) for i in range(20)]
    assert [b.ctypes.data % ALIGN for b in bufs] == [0] * 20
    assert [b.size for b in bufs] == [1000 + 48 * i for i in range(20)]
    addr = bufs[5].ctypes.data
    bufs[5] = None  # type: ignore[call-overload]
    again = spare.take(1240)
    assert again.ctypes.data == addr and again.ctypes.data % ALIGN == 0
