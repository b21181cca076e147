"""Aggregator lane arithmetic: pack/unpack round trips and exact integer sums."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from dlcp.codecs import lanes
from dlcp.errors import Reason, RemoteError
from dlcp.wire.batch import Payloads
from dlcp.wire.header import HEADER_SIZE, LANE_BITS, Codec, lane_bytes

THC = [Codec.THC8, Codec.THC4]
TOP = {Codec.THC8: 255, Codec.THC4: 15}


@pytest.mark.parametrize(
    ("codec", "summed", "dtype"),
    [
        (Codec.FP32, False, "<f4"),
        (Codec.FP32, True, "<f4"),
        (Codec.FP16, False, "<f2"),
        (Codec.FP16, True, "<f2"),
        (Codec.THC8, False, "u1"),
        (Codec.THC8, True, "<u2"),
        (Codec.THC4, True, "<u2"),
    ],
)
def test_wire_dtype_is_little_endian(codec: Codec, summed: bool, dtype: str) -> None:
    values = np.arange(1, 6).astype(dtype)
    payload = lanes.pack(codec, values, summed)
    assert payload == values.astype(np.dtype(dtype).newbyteorder("<")).tobytes()
    assert len(payload) == lane_bytes(codec, 5, summed)
    np.testing.assert_array_equal(lanes.unpack(codec, payload, 5, summed), values)


@given(st.lists(st.integers(0, 15), min_size=1, max_size=301))
def test_thc4_pack_unpack_round_trip(values: list[int]) -> None:
    v = np.array(values, dtype=np.uint8)
    payload = lanes.pack(Codec.THC4, v, summed=False)
    assert len(payload) == lane_bytes(Codec.THC4, v.size, summed=False) == (v.size + 1) // 2
    np.testing.assert_array_equal(lanes.unpack(Codec.THC4, payload, v.size, False), v)


def test_thc4_low_nibble_first() -> None:
    assert lanes.pack(Codec.THC4, np.array([0x1, 0xA, 0x3], dtype=np.uint8), False) == bytes(
        [0xA1, 0x03]
    )


@given(st.lists(st.floats(-6e4, 6e4, width=16), min_size=1, max_size=200))
def test_fp16_lanes_round_trip(values: list[float]) -> None:
    v = np.array(values, dtype=np.float16)
    payload = lanes.pack(Codec.FP16, v, summed=False)
    np.testing.assert_array_equal(lanes.unpack(Codec.FP16, payload, v.size, False), v)


@pytest.mark.parametrize("codec", list(Codec))
def test_unpack_rejects_wrong_length(codec: Codec) -> None:
    payload = bytes(lane_bytes(codec, 10, False) + 1)
    with pytest.raises(RemoteError) as info:
        lanes.unpack(codec, payload, 10, False)
    assert info.value.reason == Reason.BAD_LENGTH


@pytest.mark.parametrize("codec", THC)
@pytest.mark.parametrize("workers", [2, 64, lanes.MAX_CONTRIBUTORS])
def test_integer_sums_are_exact_in_the_worst_case(codec: Codec, workers: int) -> None:
    """Every worker sends the top level in every lane; the sum must not wrap."""
    count = 1001
    top = np.full(count, TOP[codec], dtype=np.uint8)
    payload = lanes.pack(codec, top, summed=False)
    rows = np.stack([lanes.unpack(codec, payload, count, False) for _ in range(workers)])
    sdt = lanes.sum_dtype(codec)
    # as the aggregator does it: one reduction in the sum dtype ...
    total = np.add.reduce(rows.astype(sdt), axis=0, dtype=sdt)
    # ... or packet by packet as they arrive
    running = np.zeros(count, dtype=sdt)
    for row in rows:
        running += row
    exact = workers * TOP[codec]
    assert (total == exact).all() and (running == exact).all()
    # and the sums survive the result lanes
    back = lanes.unpack(codec, lanes.pack(codec, total, summed=True), count, True)
    assert (back.astype(np.int64) == exact).all()


def test_max_contributors_is_the_bound_of_the_summed_lanes() -> None:
    for codec in THC:
        sum_bits = LANE_BITS[codec][1]
        assert lanes.MAX_CONTRIBUTORS * TOP[codec] < 2**sum_bits
        assert np.iinfo(lanes.sum_dtype(codec)).max >= lanes.MAX_CONTRIBUTORS * TOP[codec]
    # thc8 is the binding codec: one more contributor would wrap
    assert 2 ** LANE_BITS[Codec.THC8][1] <= (lanes.MAX_CONTRIBUTORS + 1) * 255
    assert lanes.MAX_CONTRIBUTORS >= 64


@pytest.mark.parametrize("codec", [Codec.FP32, Codec.FP16])
def test_float_sums_accumulate_in_fp32(codec: Codec) -> None:
    assert lanes.sum_dtype(codec) == np.float32


@pytest.mark.parametrize(
    ("codec", "summed"),
    [
        (Codec.FP32, False),
        (Codec.FP32, True),
        (Codec.FP16, False),
        (Codec.FP16, True),
        (Codec.THC8, False),
        (Codec.THC8, True),
        (Codec.THC4, False),
        (Codec.THC4, True),
    ],
)
def test_store_many_is_unpack_and_assign(codec: Codec, summed: bool) -> None:
    """The copy straight into the accumulator (fp32, THC sums) and the general
    path give what unpacking each payload and assigning it gives."""
    rng = np.random.default_rng(int(codec) * 2 + summed)
    dtype = lanes.sum_dtype(codec)
    items = []
    for start, count in ((0, 5), (9, 7), (20, 1)):  # gaps stay untouched
        nbytes = lane_bytes(codec, count, summed)
        items.append((start, count, memoryview(rng.integers(0, 256, nbytes, np.uint8).tobytes())))
    got = np.full(24, 7, dtype=dtype)
    want = got.copy()
    lanes.store_many(got, codec, summed, items)
    for start, count, payload in items:
        want[start : start + count] = lanes.unpack(codec, payload, count, summed)
    np.testing.assert_array_equal(got, want)  # NaN payload bits compare equal too
    assert got[5:9].tolist() == want[5:9].tolist() == [7] * 4
    short = [(0, 5, items[0][2][:-1])]
    with pytest.raises(RemoteError) as err:
        lanes.store_many(got, codec, summed, short)
    assert err.value.reason == Reason.BAD_LENGTH


def _native_lanes() -> bool:
    if lanes._bulk is None:
        assert os.environ.get("DLCP_ALLOW_NO_NATIVE") == "1", "dlcp.wire._bulk was not built"
        return False
    return True


@pytest.mark.parametrize("native", [False, True])
@pytest.mark.parametrize(
    ("codec", "summed"),
    [(Codec.FP32, False), (Codec.FP32, True), (Codec.FP16, False), (Codec.THC8, True)],
)
def test_store_runs_is_store_many(codec: Codec, summed: bool, native: bool) -> None:
    """The C copy loop and the Python one store the same lanes, and a payload of
    the wrong length stops both at the same packet with BAD_LENGTH."""
    if native and not _native_lanes():
        pytest.skip("dlcp.wire._bulk is not built (DLCP_ALLOW_NO_NATIVE=1)")
    rng = np.random.default_rng(int(codec) * 4 + summed * 2 + native)
    dtype = lanes.sum_dtype(codec)
    runs = [(40, 10), (0, 10), (10, 3), (25, 9), (60, 4)]  # any order; gaps untouched
    payloads: list[bytes | memoryview] = []
    for i, (_, count) in enumerate(runs):
        raw = rng.integers(0, 256, lane_bytes(codec, count, summed) + 3, np.uint8).tobytes()
        payloads.append(memoryview(raw)[3:] if i % 2 else raw[3:])  # views and bytes
    starts = np.array([s for s, _ in runs])
    counts = np.array([c for _, c in runs])
    got = np.full(64, 5, dtype=dtype)
    want = got.copy()
    lanes.store_runs(got, codec, summed, starts, counts, payloads, native=native)
    lanes.store_many(
        want, codec, summed, zip(starts.tolist(), counts.tolist(), payloads, strict=True)
    )
    assert got.tobytes() == want.tobytes()
    assert got[13:25].tolist() == [5] * 12
    # the fourth payload one byte short: the first three are stored, then the error
    bad = [*payloads[:3], bytes(payloads[3])[:-1], payloads[4]]
    got[:] = 5
    want[:] = 5
    with pytest.raises(RemoteError) as err:
        lanes.store_runs(got, codec, summed, starts, counts, bad, native=native)
    assert err.value.reason == Reason.BAD_LENGTH
    with pytest.raises(RemoteError):
        lanes.store_many(
            want, codec, summed, zip(starts.tolist(), counts.tolist(), bad, strict=True)
        )
    assert got.tobytes() == want.tobytes() and got[25:34].tolist() == [5] * 9


def test_copy_runs_rejects_bad_arguments() -> None:
    if not _native_lanes():
        pytest.skip("dlcp.wire._bulk is not built (DLCP_ALLOW_NO_NATIVE=1)")
    c = lanes._bulk
    dest = np.zeros(8, np.float32)
    one = np.array([0], np.int64)
    four = bytes(4)
    with pytest.raises(IndexError):  # a run past the end
        c.copy_runs(dest, 4, np.array([8], np.int64), np.array([1], np.int64), [four])
    with pytest.raises(IndexError):  # a negative start
        c.copy_runs(dest, 4, np.array([-1], np.int64), np.array([1], np.int64), [four])
    with pytest.raises(c.LengthError):  # a negative count
        c.copy_runs(dest, 4, one, np.array([-1], np.int64), [b""])
    with pytest.raises(c.LengthError):  # a count whose byte length overflows
        c.copy_runs(dest, 4, one, np.array([2**62], np.int64), [b""])
    with pytest.raises(TypeError):  # starts not int64
        c.copy_runs(dest, 4, np.array([0], np.int32), np.array([1], np.int64), [four])
    with pytest.raises(ValueError):  # lengths disagree
        c.copy_runs(dest, 4, one, np.array([1, 1], np.int64), [four])
    with pytest.raises(TypeError):  # a payload that is not a buffer
        c.copy_runs(dest, 4, one, np.array([1], np.int64), ["abcd"])
    with pytest.raises((TypeError, BufferError)):  # a read-only destination
        c.copy_runs(bytes(32), 4, one, np.array([1], np.int64), [four])
    with pytest.raises(ValueError):
        c.copy_runs(dest, 0, one, np.array([1], np.int64), [four])
    c.copy_runs(dest, 4, np.array([7], np.int64), np.array([1], np.int64), [b"\0\0\x80?"])
    assert dest.tolist() == [0] * 7 + [1.0]


@pytest.mark.parametrize("native", [False, True])
def test_store_runs_from_datagrams_skips_their_headers(native: bool) -> None:
    """A `Payloads` (the receive path's payloads, views made when asked for)
    stores what the list of its payload views stores, whole or sliced."""
    if native and not _native_lanes():
        pytest.skip("dlcp.wire._bulk is not built (DLCP_ALLOW_NO_NATIVE=1)")
    rng = np.random.default_rng(11)
    counts = np.array([6, 6, 6, 2])
    starts = np.array([12, 0, 6, 18])
    dgs: list[bytes | memoryview] = [
        rng.integers(0, 256, HEADER_SIZE + 4 * int(c), np.uint8).tobytes() for c in counts
    ]
    dgs[1] = memoryview(bytearray(dgs[1]))
    tails = Payloads(dgs)
    assert len(tails) == 4 and bytes(tails[2]) == bytes(dgs[2])[HEADER_SIZE:]
    assert [bytes(p) for p in tails[1:3]] == [bytes(d)[HEADER_SIZE:] for d in dgs[1:3]]
    want = np.zeros(20, np.float32)
    lanes.store_many(
        want, Codec.FP32, False, zip(starts.tolist(), counts.tolist(), list(tails), strict=True)
    )
    got = np.zeros(20, np.float32)
    lanes.store_runs(got, Codec.FP32, False, starts, counts, tails, native=native)
    assert got.tobytes() == want.tobytes()
    got[:] = 0
    lanes.store_runs(got, Codec.FP32, False, starts[1:3], counts[1:3], tails[1:3], native=native)
    assert got[:12].tobytes() == want[:12].tobytes() and not got[12:].any()
    short = Payloads([dgs[0], bytes(dgs[1])[:-4]])
    with pytest.raises(RemoteError) as err:
        lanes.store_runs(got, Codec.FP32, False, starts[:2], counts[:2], short, native=native)
    assert err.value.reason == Reason.BAD_LENGTH


def test_heads_gathers_the_first_bytes_of_each_datagram() -> None:
    if not _native_lanes():
        pytest.skip("dlcp.wire._bulk is not built (DLCP_ALLOW_NO_NATIVE=1)")
    c = lanes._bulk
    dgs = [bytes(range(10)), bytearray(b"abc"), memoryview(b"0123456789xyz")[2:], b""]
    heads, lengths = c.heads(dgs, 5)
    assert isinstance(heads, bytearray)
    assert bytes(heads) == bytes(range(5)) + bytes(5) + b"23456" + bytes(5)
    assert np.frombuffer(lengths, np.int64).tolist() == [10, 3, 11, 0]
    assert c.heads([], 64) == (bytearray(), b"")
    assert c.heads(tuple(dgs), 0) == (bytearray(), lengths)
    with pytest.raises(TypeError):
        c.heads([b"ok", "not bytes"], 2)
    with pytest.raises(TypeError):
        c.heads(b"not a list", 2)
    with pytest.raises(ValueError):
        c.heads([b"x"], -1)


@pytest.mark.parametrize("native", [False, True])
@pytest.mark.parametrize("summed", [False, True])
def test_add_runs_sums_own_lanes_and_payloads(native: bool, summed: bool) -> None:
    """add_runs stores own + payload lane by lane (the float32 sums numpy
    computes), from views, bytes or a `Payloads` past the datagrams' headers,
    and leaves the gaps alone; a short payload stops it at that packet with
    BAD_LENGTH, the ones before it stored, in C and in Python alike."""
    if native and not _native_lanes():
        pytest.skip("dlcp.wire._bulk is not built (DLCP_ALLOW_NO_NATIVE=1)")
    rng = np.random.default_rng(17 + summed)
    own = rng.standard_normal(64).astype(np.float32)
    runs = [(40, 10), (0, 13), (13, 3), (25, 9), (60, 4)]  # counts not multiples of 8
    theirs = rng.standard_normal(64).astype(np.float32)
    dgs: list[bytes | memoryview] = []
    for i, (s, c) in enumerate(runs):
        raw = bytes(HEADER_SIZE + 1) + theirs[s : s + c].tobytes()
        dgs.append(memoryview(raw)[1:] if i % 2 else raw[1:])  # unaligned lanes too
    starts = np.array([s for s, _ in runs])
    counts = np.array([c for _, c in runs])
    got = np.full(64, 5, np.float32)
    lanes.add_runs(got, own, Codec.FP32, summed, starts, counts, Payloads(dgs), native=native)
    want = np.full(64, 5, np.float32)
    for s, c in runs:
        want[s : s + c] = own[s : s + c] + theirs[s : s + c]
    assert got.tobytes() == want.tobytes()
    assert got[16:25].tolist() == [5] * 9
    assert lanes.can_add_runs(got, Codec.FP32, summed) == (lanes._bulk is not None)
    assert not lanes.can_add_runs(got, Codec.FP16, summed)
    assert not lanes.can_add_runs(np.zeros(4, np.uint16), Codec.THC8, True)
    bad = Payloads([*dgs[:3], bytes(dgs[3])[:-1], dgs[4]])
    got[:] = 5
    with pytest.raises(RemoteError) as err:
        lanes.add_runs(got, own, Codec.FP32, summed, starts, counts, bad, native=native)
    assert err.value.reason == Reason.BAD_LENGTH
    stored = np.full(64, 5, np.float32)
    for s, c in runs[:3]:
        stored[s : s + c] = want[s : s + c]
    assert got.tobytes() == stored.tobytes()
    with pytest.raises(ValueError):  # own must be as long as dest
        lanes.add_runs(got, own[:8], Codec.FP32, summed, starts, counts, dgs, native=native)
    if native:
        with pytest.raises(IndexError):  # a run past the end
            lanes._bulk.add_runs(got, own, np.array([63]), np.array([2]), [bytes(8)])
        with pytest.raises(ValueError):  # own shorter than dest, given to C directly
            lanes._bulk.add_runs(got, own[:8], np.array([0]), np.array([1]), [bytes(4)])


@pytest.mark.parametrize("dest_offset", [0, 1, 2])
@pytest.mark.parametrize("add", [False, True])
def test_long_runs_store_and_sum_as_short_ones(add: bool, dest_offset: int) -> None:
    """Runs of STREAM_MIN bytes or more go through the C loops' streaming
    stores (dlcp/wire/_bulk.c): at every alignment of the destination and the
    payload, and lengths off the 16- and 64-byte steps, they store (or sum)
    the lanes the Python definitions store, and touch nothing around them; a
    destination off the 4-byte grid (a rank's `out` at an odd offset) too."""
    if not _native_lanes():
        pytest.skip("dlcp.wire._bulk is not built (DLCP_ALLOW_NO_NATIVE=1)")
    rng = np.random.default_rng(41 + add)
    total = 40_000
    own = rng.standard_normal(total).astype(np.float32)
    theirs = rng.standard_normal(total).astype(np.float32)
    theirs[[5, 17_000]] = [np.inf, np.nan]
    # 1024 lanes (4096 bytes, the threshold) and more, each start at another
    # 16-byte alignment, gaps between them
    runs = [(1, 1024), (1030, 1027), (2062, 2227), (4294, 1031), (5331, 2229), (16_000, 4099)]
    dgs: list[bytes | memoryview] = []
    for i, (s, c) in enumerate(runs):
        raw = bytes(HEADER_SIZE + i % 4) + theirs[s : s + c].tobytes()
        dgs.append(memoryview(raw)[i % 4 :])  # payloads at every 4-byte misalignment
    starts = np.array([s for s, _ in runs])
    counts = np.array([c for _, c in runs])
    got = np.frombuffer(bytearray(4 * total + dest_offset), np.float32, total, dest_offset)
    got[:] = 5
    want = np.full(total, 5, np.float32)
    if add:
        lanes.add_runs(got, own, Codec.FP32, False, starts, counts, Payloads(dgs), native=True)
        lanes.add_runs(want, own, Codec.FP32, False, starts, counts, Payloads(dgs), native=False)
    else:
        lanes.store_runs(got, Codec.FP32, False, starts, counts, Payloads(dgs), native=True)
        lanes.store_runs(want, Codec.FP32, False, starts, counts, Payloads(dgs), native=False)
    assert got.tobytes() == want.tobytes()
    mask = np.ones(total, bool)
    for s, c in runs:
        mask[s : s + c] = False
        ref = own[s : s + c] + theirs[s : s + c] if add else theirs[s : s + c]
        assert got[s : s + c].tobytes() == ref.tobytes()
    assert (got[mask] == 5).all()


def _runs_reference(
    dest: np.ndarray, own: np.ndarray | None, runs: list[tuple[int, int]], payloads: list[bytes]
) -> None:
    """copy_runs/add_runs one run after the other, in numpy."""
    for (s, c), p in zip(runs, payloads, strict=True):
        lanes_in = np.frombuffer(p, dest.dtype, c)
        dest[s : s + c] = lanes_in if own is None else own[s : s + c] + lanes_in


@pytest.mark.parametrize("seed", range(12))
def test_runs_that_follow_one_another_store_what_one_at_a_time_stores(seed: int) -> None:
    """Short runs that continue one another in dest (a shard's packets at a
    1500-byte MTU) are written line by line with streaming stores, a line's
    start held until the next run ends it (dlcp/wire/_bulk.c `Lines`). Mixed
    with gaps, runs that go back over lanes already written, long runs, runs
    of a lane or two, every alignment of dest and of the payloads, u16 lanes,
    sums into `own` and into dest itself: the same bytes as storing each run
    in turn, nothing around them touched; and a bad run stops the call with
    the runs before it stored."""
    if not _native_lanes():
        pytest.skip("dlcp.wire._bulk is not built (DLCP_ALLOW_NO_NATIVE=1)")
    c_ = lanes._bulk
    rng = np.random.default_rng(seed)
    add = seed % 3 != 0
    dtype = np.dtype(np.float32 if add or seed % 2 else np.uint16)
    total = 20_000
    offset = int(rng.integers(0, 4)) if not add or seed % 4 else 0  # bytes: off the lane grid too
    runs: list[tuple[int, int]] = []
    s = int(rng.integers(0, 40))
    while len(runs) < 120:
        c = int(rng.choice([1, 2, 3, 15, 16, 17, 352, 353, 1100, 2236]))
        if s + c > total:
            break
        runs.append((s, c))
        r = rng.random()
        if r < 0.7:
            s += c  # the next run follows this one
        elif r < 0.85:
            s += c + int(rng.integers(1, 40))  # a gap
        else:
            s = int(rng.integers(0, max(1, s)))  # back over lanes written before
    payloads: list[bytes] = []
    dgs: list[bytes | memoryview] = []
    for i, (_, c) in enumerate(runs):
        if dtype == np.float32:
            lanes_in = rng.standard_normal(c).astype(np.float32)
        else:
            lanes_in = rng.integers(0, 2**16, c).astype(np.uint16)
        p = lanes_in.tobytes()
        payloads.append(p)
        mis = i % 5
        dgs.append(memoryview(bytes(HEADER_SIZE + mis) + p)[mis:])  # payloads at every misalignment
    starts = np.array([s for s, _ in runs], np.int64)
    counts = np.array([c for _, c in runs], np.int64)

    def fresh() -> np.ndarray:
        a = np.frombuffer(bytearray(dtype.itemsize * total + 64 + offset), dtype, total, offset)
        a[:] = 7 if dtype == np.uint16 else np.float32(7.5)
        return a

    own = rng.standard_normal(total).astype(np.float32) if add else None
    into_itself = add and seed % 2 == 1  # dest is own: each sum reads what the runs before wrote
    got, want = fresh(), fresh()
    if into_itself:
        got[:] = want[:] = rng.standard_normal(total).astype(np.float32)
    if add:
        c_.add_runs(got, got if into_itself else own, starts, counts, dgs, HEADER_SIZE)
        _runs_reference(want, want if into_itself else own, runs, payloads)
    else:
        c_.copy_runs(got, dtype.itemsize, starts, counts, dgs, HEADER_SIZE)
        _runs_reference(want, None, runs, payloads)
    assert got.tobytes() == want.tobytes()
    # a short payload halfway: LengthError, and what the runs before it wrote stays
    half = len(runs) // 2
    bad = list(dgs)
    bad[half] = bytes(bad[half])[:-1]
    got, want = fresh(), fresh()
    with pytest.raises(c_.LengthError):
        if add:
            c_.add_runs(got, own, starts, counts, bad, HEADER_SIZE)
        else:
            c_.copy_runs(got, dtype.itemsize, starts, counts, bad, HEADER_SIZE)
    _runs_reference(want, own, runs[:half], payloads[:half])
    assert got.tobytes() == want.tobytes()


def test_datagrams_read_in_place_are_read_as_their_bytes() -> None:
    """The C loops read bytes objects and live C-contiguous memoryviews in
    place (dlcp/wire/bytes_of.h) and anything else through the buffer
    protocol: the same headers, lengths and lanes as from `bytes(view)`; a
    released view is a ValueError and a strided or Fortran-ordered one a
    BufferError, as before, not a read of memory the view no longer holds."""
    if not _native_lanes():
        pytest.skip("dlcp.wire._bulk is not built (DLCP_ALLOW_NO_NATIVE=1)")
    c_ = lanes._bulk
    raw = bytes(range(256)) * 4
    grid = np.frombuffer(raw, np.uint8).reshape(32, 32)
    same = [
        raw,
        *_segments(raw, 1000)[:1],  # a GRO buffer's datagram (dlcp/wire/segment.h)
        bytearray(raw),
        memoryview(raw)[3:200],
        memoryview(np.frombuffer(raw, np.float32)),  # another format, contiguous
        memoryview(raw).cast("B", (32, 32)),
        memoryview(grid),
    ]
    for dg in same:
        whole = bytes(dg)
        heads, lengths = c_.heads([dg], HEADER_SIZE)
        assert bytes(heads) == whole[:HEADER_SIZE]
        assert np.frombuffer(lengths, np.int64).tolist() == [len(whole)]
        dest = np.zeros(len(whole), np.uint8)
        n = len(whole) - HEADER_SIZE
        c_.copy_runs(dest, 1, np.array([5]), np.array([n]), [dg], HEADER_SIZE)
        assert dest[5 : 5 + n].tobytes() == whole[HEADER_SIZE:]
    released = memoryview(raw)
    released.release()
    one = np.array([0])
    for bad, err in (
        (released, ValueError),
        (memoryview(raw)[::2], BufferError),
        (memoryview(np.asfortranarray(grid)), BufferError),
    ):
        with pytest.raises(err):
            c_.heads([bad], HEADER_SIZE)
        with pytest.raises(err):
            c_.copy_runs(np.zeros(4096, np.uint8), 1, one, one, [bad], HEADER_SIZE)


def _split(data: bytes, seg: int) -> Any:
    """What dlcp.daemon._udp makes of a GRO buffer: a Datagrams (dlcp/wire/datagrams.h)."""
    from dlcp.daemon import transport

    if transport._udp is None:
        pytest.skip("dlcp.daemon._udp is not built (DLCP_ALLOW_NO_NATIVE=1)")
    dgs = transport._udp.split_gro(data, seg)[0]
    assert type(dgs) is lanes._bulk.Datagrams
    return dgs


def _segments(data: bytes, seg: int) -> list:
    """A GRO buffer's datagrams as Segments (each one a Datagrams makes when asked)."""
    segs = list(_split(data, seg))
    assert all(isinstance(s, lanes._bulk.Segment) and s.obj is data for s in segs)
    return segs


def test_datagrams_are_a_sequence_the_c_loops_read_in_place() -> None:
    """A drain's datagrams as one Datagrams (dlcp/wire/datagrams.h): per GRO
    buffer from the C split, joined per drain. In Python a sequence of the
    same bytes (an item a Segment of its buffer, a slice another Datagrams,
    a slice with a step a list); it keeps its buffers alive; and the C loops
    (headers, lane copies and sums, the MAC) read it as they read the list
    of its Segments."""
    if not _native_lanes():
        pytest.skip("dlcp.wire._bulk is not built (DLCP_ALLOW_NO_NATIVE=1)")
    import gc

    from dlcp.wire.mac import GhashAesKey

    c_ = lanes._bulk
    key = GhashAesKey(bytes(range(32)))
    rng = np.random.default_rng(5)

    def buffer(k: int, plen: int) -> bytes:  # k datagrams of a 4-byte lane each
        recs = rng.integers(0, 256, (k, 64), dtype=np.uint8)
        return b"".join(key.encode(recs.tobytes(), [rng.bytes(plen) for _ in range(k)]))

    sizes = [(5, 400), (3, 400), (1, 36), (4, 80)]
    bufs = [buffer(k, plen) for k, plen in sizes]
    parts = [_split(b, HEADER_SIZE + plen) for b, (_, plen) in zip(bufs, sizes, strict=True)]
    want = [
        b[i * (HEADER_SIZE + plen) : (i + 1) * (HEADER_SIZE + plen)]
        for b, (k, plen) in zip(bufs, sizes, strict=True)
        for i in range(k)
    ]
    d0 = parts[0]
    assert len(d0) == 5 and [bytes(x) for x in d0] == want[:5]
    assert bytes(d0[-1]) == want[4] and d0[2].obj is bufs[0]
    with pytest.raises(IndexError):
        d0[5]
    with pytest.raises(TypeError):
        d0["1"]
    with pytest.raises(TypeError):
        hash(d0)
    with pytest.raises(TypeError):
        type(d0)()
    sub = d0[1:4]
    assert type(sub) is type(d0) and [bytes(x) for x in sub] == want[1:4]
    assert [bytes(x) for x in sub[1:]] == want[2:4] and len(d0[4:9]) == 1 and len(d0[3:1]) == 0
    stepped = d0[::2]
    assert isinstance(stepped, list) and [bytes(x) for x in stepped] == want[0:5:2]
    # a drain: the parts joined in order, some of them slices or empty
    joined = c_.join([parts[0][1:], parts[1], parts[2][:0], parts[3], parts[2]])
    order = want[1:5] + want[5:8] + want[9:13] + want[8:9]
    assert [bytes(x) for x in joined] == order
    assert joined[4].obj is bufs[1] and joined[-1].obj is bufs[2]
    with pytest.raises(TypeError):
        c_.join([parts[0], want[0]])
    with pytest.raises(TypeError):
        c_.join(tuple(parts))
    # it holds its buffers: nothing else refers to these bytes
    held = c_.join(
        [_split(buffer(3, 400), HEADER_SIZE + 400)[1:], _split(buffer(2, 80), HEADER_SIZE + 80)]
    )
    copies = [bytes(x) for x in held]
    gc.collect()
    assert [bytes(x) for x in held] == copies and len(held) == 4
    # the C loops read it as the list of its Segments
    segs = list(joined)
    for a, b in ((joined, segs), (joined[2:9], segs[2:9])):
        assert [bytes(x) for x in c_.heads(a, HEADER_SIZE)] == [
            bytes(x) for x in c_.heads(b, HEADER_SIZE)
        ]
        assert key.verify(a).tolist() == key.verify(b).tolist() == [True] * len(b)
        plens = np.array([len(x) - HEADER_SIZE for x in b])
        starts = np.concatenate([[0], np.cumsum(plens)[:-1]])
        for own in (None, rng.standard_normal(int(plens.sum()) // 4).astype(np.float32)):
            got, ref = (np.zeros(int(plens.sum()), np.uint8) for _ in range(2))
            if own is None:
                c_.copy_runs(got, 1, starts, plens, a, HEADER_SIZE)
                c_.copy_runs(ref, 1, starts, plens, b, HEADER_SIZE)
            else:
                got, ref = (np.zeros(own.size, np.float32) for _ in range(2))
                c_.add_runs(got, own, starts // 4, plens // 4, a, HEADER_SIZE)
                c_.add_runs(ref, own, starts // 4, plens // 4, b, HEADER_SIZE)
            assert got.tobytes() == ref.tobytes()
        assert got.any()
    forged = bytearray(bufs[3])
    forged[-1] ^= 1
    bad = c_.join([parts[0], _split(bytes(forged), HEADER_SIZE + 80)])
    assert key.verify(bad).tolist() == [True] * 8 + [False]


def test_segments_are_read_as_the_bytes_they_hold() -> None:
    """A GRO buffer's datagrams are Segments (dlcp/wire/segment.h): read-only
    bytes-like objects that Python reads as memoryviews of the same bytes
    (len, indexing, slicing, ==, bytes, struct, numpy), that keep their
    buffer alive, and that the C loops (headers, lanes, MAC) read in place."""
    if not _native_lanes():
        pytest.skip("dlcp.wire._bulk is not built (DLCP_ALLOW_NO_NATIVE=1)")
    import gc
    import struct

    from dlcp.wire.mac import GhashAesKey

    data = bytes(range(256)) * 12
    segs = _segments(data, 1000)
    assert [len(x) for x in segs] == [1000, 1000, 1000, 72]
    for i, x in enumerate(segs):
        want = data[i * 1000 : (i + 1) * 1000]
        assert bytes(x) == want and x == want and x == memoryview(want)
        assert (x != want) is False
        assert x != want[:-1] + b"?" and x != want[:-1]
        assert x[3] == want[3] and x[-1] == want[-1]
        assert bytes(x[10:20]) == want[10:20] and bytes(x[::7]) == want[::7]
        view = memoryview(x)
        assert view.readonly and view.cast("B")[5] == want[5] and view.obj is x
        assert np.frombuffer(x, np.uint8).tobytes() == want
        assert struct.unpack_from(">I", x, 8) == struct.unpack_from(">I", want, 8)
        with pytest.raises(TypeError):
            view[0] = 1
        with pytest.raises(TypeError):
            hash(x)
    with pytest.raises(IndexError):
        segs[3][72]
    with pytest.raises(TypeError):
        type(segs[0])()
    # a segment holds its buffer: nothing else refers to these bytes
    held = _segments(os.urandom(5000), 1000)[1:3]
    copies = [bytes(x) for x in held]
    gc.collect()
    assert [bytes(x) for x in held] == copies and held[0].obj is held[1].obj
    # the C loops: headers and lengths, lanes, the MAC's verdicts
    c_ = lanes._bulk
    heads, lengths = c_.heads(segs, HEADER_SIZE)
    assert bytes(heads) == b"".join(data[i * 1000 : i * 1000 + HEADER_SIZE] for i in range(4))
    assert np.frombuffer(lengths, np.int64).tolist() == [1000, 1000, 1000, 72]
    dest = np.zeros(4000, np.uint8)
    starts = np.array([0, 1000, 2000, 3000])
    counts = np.array([936, 936, 936, 8])
    c_.copy_runs(dest, 1, starts, counts, segs, HEADER_SIZE)
    for i, x in enumerate(segs):
        assert dest[starts[i] : starts[i] + counts[i]].tobytes() == bytes(x)[HEADER_SIZE:]
    key = GhashAesKey(bytes(range(32)))
    recs = np.frombuffer(bytes(range(64)) * 3, np.uint8).reshape(3, 64).copy()
    dgs = key.encode(recs.tobytes(), [bytes([i]) * 500 for i in range(3)])
    good = _segments(b"".join(dgs), len(dgs[0]))
    forged = _segments(b"".join(dgs[:2]) + dgs[2][:-1] + b"?", len(dgs[0]))
    assert key.verify(good).tolist() == [True] * 3
    assert key.verify(forged).tolist() == [True, True, False]
