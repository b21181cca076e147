"""Fuzz targets of the receive path's lane stores and datagram picks: a run of
packets' lanes unpacked by one C call (`_bulk.store_lanes`: fp16 halves, fft
codes, 8-, 4-, 10- and 1-bit lanes into the accumulator's dtype) against the
Python loop (`lanes.store_runs(native=False)`), and a drain's datagrams taken
at positions (`_bulk.pick`) against the list comprehension it stands in for."""

from __future__ import annotations

import numpy as np

from dlcp.codecs.lanes_native import native_kind
from dlcp.wire import batch as batch_mod
from dlcp.wire.header import Codec, lane_bytes
from fuzz.harness import Input, pack_datagrams, target
from fuzz.targets_wire import _as_datagrams, _lane_seeds, _outside, _same_error, _store

# (codec, summed, accumulator dtype) where a run's lanes are unpacked in C
_UNPACKED = [
    (c, s, d)
    for c in Codec
    for s in (False, True)
    for d in (np.dtype(np.float32), np.dtype(np.uint16))
    if native_kind(np.zeros(1, d), c, s) is not None
]


def _runs(inp: Input, size: int, codec: int, summed: bool) -> tuple[np.ndarray, np.ndarray, list]:
    """Up to 16 runs into `size` lanes (some outside it, some with a payload
    of the wrong length), each payload the wire bytes of its lanes.

    Each run reads, as `Input` would: `chance(16)`: start `-uint(1)`, else
    `below(size + 3)`; count `below(min(size, 600) + 2)`; `chance(8)`: the
    payload `uint(1) % 5 - 2` bytes off its length; then the payload (`take`).
    The reads are written out on locals, as in targets_wire._runs."""
    d, at, end = inp.data, inp.at, inp.size
    k = 0
    if at < end:
        k, at = d[at] % 17, at + 1
    span, most = size + 3, min(size, 600) + 2
    starts, counts, payloads = [], [], []
    for _ in range(k):
        if at >= end or d[at] % 16 == 0:  # chance(16); past the end: True
            at += at < end
            start = 0
            if at < end:
                start, at = -d[at], at + 1
        elif at + 3 <= end:  # the chance byte, then below(span)
            start, at = (d[at + 1] | d[at + 2] << 8) % span, at + 3
        else:  # 1 byte left after the chance byte: as Input reads it
            inp.at = at + 1
            start, at = inp.below(span), inp.size
        if at + 2 <= end:
            count, at = (d[at] | d[at + 1] << 8) % most, at + 2
        elif at < end:  # one byte left: below's two-byte read gets it alone
            count, at = d[at] % most, end
        else:
            count = 0
        n = lane_bytes(codec, count, summed)
        if at >= end or d[at] % 8 == 0:  # chance(8)
            at += at < end
            if at < end:
                n, at = n + d[at] % 5 - 2, at + 1
            else:
                n -= 2
        else:
            at += 1
        n = max(n, 0)
        payload = d[at : at + n]
        at += len(payload)
        starts.append(start)
        counts.append(count)
        payloads.append(payload.ljust(n, b"\x5a"))
    inp.at = at
    return np.array(starts, np.int64), np.array(counts, np.int64), payloads


@target("bulk_store_lanes", covers=("_bulk.store_lanes",), seeds=lambda: _lane_seeds(2))
def bulk_store_lanes(inp: Input) -> None:
    if not _UNPACKED:
        return
    codec, summed, dtype = _UNPACKED[inp.uint(1) % len(_UNPACKED)]
    size = inp.uint(2) % 3000 + 1
    s, c, payloads = _runs(inp, size, codec, summed)
    p = _as_datagrams(inp, payloads)
    fast = np.zeros(size, dtype)
    ref = fast.copy()
    outside = _outside(s, c, size)
    wrong = any(
        len(x) != lane_bytes(codec, k, summed) for x, k in zip(payloads, c.tolist(), strict=True)
    )
    e_fast = _store(fast, codec, summed, s, c, p, True)
    _same_error(e_fast, _store(ref, codec, summed, s, c, p, False), outside and wrong)
    if e_fast is None:
        # NaNs compared by their bits: the C keeps numpy's (a quieted signalling NaN)
        assert fast.tobytes() == ref.tobytes()


def _pick_seeds() -> list[bytes]:
    rng = np.random.default_rng(5)
    return [
        pack_datagrams([rng.integers(0, 256, int(n), dtype=np.uint8).tobytes() for n in ns])
        for ns in (rng.integers(1, 200, k) for k in (1, 3, 8, 20))
    ]


# (hi << 8) % m for each m a pick can have (2 .. 34) and each high byte: under
# ASan with PYTHONMALLOC=malloc every int over 256 is a malloc (two a position)
_HIGH = [[(hi << 8) % m if m else 0 for hi in range(256)] for m in range(35)]


@target("bulk_pick", covers=("_bulk.pick",), seeds=_pick_seeds)
def bulk_pick(inp: Input) -> None:
    dgs = inp.datagrams(limit=32, longest=300)
    n = len(dgs)
    # up to 40 positions, 3 bytes each: below(n + 2), less 1 for one byte in
    # 16 (the reads of `Input.below` and `Input.chance`, one slice for all)
    k = inp.uint(1) % 40
    r = inp.take(3 * k).ljust(3 * k, b"\0")
    m = n + 2
    high = _HIGH[m]  # (the two bytes' int, mod m, made without an int over 289)
    positions = [(r[i] + high[r[i + 1]]) % m - (r[i + 2] % 16 == 0) for i in range(0, 3 * k, 3)]
    order = np.array(positions, np.int64)
    items: list[bytes] | tuple[bytes, ...] = dgs if inp.chance(2) else tuple(dgs)
    outside = bool(positions) and (min(positions) < 0 or max(positions) >= n)
    want = None if outside else [items[i] for i in positions]
    try:
        got = list(batch_mod.picked(items, order))  # (each compared with == to its bytes)
    except IndexError:
        got = None
    assert got == want
