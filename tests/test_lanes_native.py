"""The C lane stores of the codecs whose wire lanes are not the sums' dtype
(`_bulk.store_lanes`, dlcp/wire/lane_store.h) and the C pick of a drain's
datagrams (`_bulk.pick`) against their Python definitions:
`dlcp.codecs.lanes.store_many` and list indexing."""

from __future__ import annotations

import os

import numpy as np
import pytest

from dlcp.codecs import lanes
from dlcp.codecs import lanes_native as ln
from dlcp.core.accumulator import ShardAccumulator
from dlcp.errors import Reason, RemoteError
from dlcp.wire import Codec
from dlcp.wire.batch import Payloads, picked
from dlcp.wire.header import HEADER_SIZE, lane_bytes

try:
    from dlcp.daemon import _udp  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover
    _udp = None

KINDS = sorted(ln._NATIVE_KINDS, key=lambda k: (int(k[0]), k[1]))


def _native() -> bool:
    if lanes._bulk is None:
        assert os.environ.get("DLCP_ALLOW_NO_NATIVE") == "1", "dlcp.wire._bulk was not built"
        return False
    return True


def _payload(codec: int, summed: bool, count: int, rng: np.random.Generator) -> bytes:
    """Random wire lanes: every bit pattern (fp16 NaNs and infinities, codes
    past fft's, bits past the last lane) as the network may bring them."""
    raw = rng.integers(0, 256, lane_bytes(codec, count, summed), np.uint8)
    if codec == Codec.FP16 and raw.size >= 4:
        raw[:4] = [0x01, 0x7C, 0x01, 0xFE]  # a signalling NaN and a quiet one
    return raw.tobytes()


@pytest.mark.parametrize(("codec", "summed"), KINDS)
def test_store_lanes_is_store_many(codec: int, summed: bool) -> None:
    """Each codec's runs, counts odd and even (4-, 10- and 1-bit lanes that end
    inside a byte), from bytes, views and datagrams (`Payloads`): the C store
    writes the Python one's lanes bit for bit, leaves the gaps alone, and a
    payload one byte short stops both after the packets before it."""
    if not _native():
        pytest.skip("dlcp.wire._bulk is not built (DLCP_ALLOW_NO_NATIVE=1)")
    rng = np.random.default_rng(int(codec) * 2 + summed)
    dtype = ln._NATIVE_KINDS[(codec, summed)][1]
    runs = [(200, 37), (0, 64), (64, 3), (90, 101), (300, 1), (301, 8), (400, 13)]
    payloads = [_payload(codec, summed, c, rng) for _, c in runs]
    starts = np.array([s for s, _ in runs], np.int64)
    counts = np.array([c for _, c in runs], np.int64)
    views: list[bytes | memoryview] = [
        memoryview(p) if i % 2 else p for i, p in enumerate(payloads)
    ]
    datagrams = [bytes(HEADER_SIZE) + p for p in payloads]
    for given in (views, Payloads(datagrams)):
        got = np.full(512, 3, dtype=dtype)
        want = got.copy()
        lanes.store_runs(got, codec, summed, starts, counts, given, native=True)
        lanes.store_runs(want, codec, summed, starts, counts, given, native=False)
        assert got.tobytes() == want.tobytes()
        assert got[67:90].tolist() == [3] * 23
    bad = [*payloads[:3], payloads[3][:-1], *payloads[4:]]
    for native in (True, False):
        out = np.full(512, 3, dtype=dtype)
        with pytest.raises(RemoteError) as err:
            lanes.store_runs(out, codec, summed, starts, counts, bad, native=native)
        assert err.value.reason == Reason.BAD_LENGTH
        if native:
            got = out
    assert got.tobytes() == out.tobytes() and got[90:191].tolist() == [3] * 101


@pytest.mark.parametrize(("codec", "summed"), KINDS)
def test_the_own_shard_is_held_as_numpy_assigns_it(codec: int, summed: bool) -> None:
    """A node's own lanes of a shard (`ShardAccumulator.hold`, the start of
    every round it owns a shard of) end in its row as `unpack` and numpy's
    assignment put them, every bit pattern; lanes already in the sums' dtype
    are held by reference, not copied; a short payload is BAD_LENGTH."""
    n = 1 << 16 if codec == Codec.FP16 else 1001
    rng = np.random.default_rng(int(codec) * 2 + summed + 7)
    payload = _payload(codec, summed, n, rng)
    if codec == Codec.FP16:  # every half, NaNs and infinities among them
        payload = np.arange(n, dtype="<u2").tobytes()
    acc = ShardAccumulator(
        shard=0,
        codec=codec,
        lanes=n,
        received=np.zeros((2, 1), bool),
        counts=np.array([n], np.int64),
    )
    acc.hold(1, summed, memoryview(payload))
    want = np.empty(n, lanes.sum_dtype(codec))
    want[:] = lanes.unpack(codec, payload, n, summed)
    got = acc.held.get(1, acc.slots[1])
    assert got.dtype == want.dtype and got.tobytes() == want.tobytes()
    with pytest.raises(RemoteError) as err:
        acc.hold(0, summed, memoryview(payload)[:-1])
    assert err.value.reason == Reason.BAD_LENGTH


def test_fp32_own_lanes_are_held_by_reference() -> None:
    lanes32 = np.arange(10, dtype=np.float32)
    acc = ShardAccumulator(
        shard=0,
        codec=Codec.FP32,
        lanes=10,
        received=np.zeros((2, 1), bool),
        counts=np.array([10], np.int64),
    )
    acc.hold(0, False, memoryview(lanes32).cast("B"))
    assert np.shares_memory(acc.held[0], lanes32)


def test_every_non_native_store_still_goes_through_python() -> None:
    """A destination of another dtype, or not contiguous, is left to the
    Python loop (which casts as numpy does)."""
    rng = np.random.default_rng(1)
    p = _payload(Codec.FP16, False, 10, rng)
    for dest in (np.zeros(10, np.float64), np.zeros(20, np.float32)[::2]):
        assert ln.native_kind(dest, Codec.FP16, False) is None
        lanes.store_runs(dest, Codec.FP16, False, np.array([0]), np.array([10]), [p])
        want = np.frombuffer(p, "<f2").astype(dest.dtype)
        assert np.array_equal(dest, want, equal_nan=True)


def test_store_lanes_rejects_bad_arguments() -> None:
    if not _native():
        pytest.skip("dlcp.wire._bulk is not built (DLCP_ALLOW_NO_NATIVE=1)")
    c = lanes._bulk
    u16 = np.zeros(16, np.uint16)
    f32 = np.zeros(16, np.float32)
    half = ln._HALF_TO_F32
    zero, one, two = (np.array([v], np.int64) for v in (0, 1, 2))
    with pytest.raises(ValueError):  # no such kind
        c.store_lanes(u16, 6, None, zero, one, [b"\0"])
    with pytest.raises(ValueError):  # a table kind without its table
        c.store_lanes(f32, ln._KIND_TABLE16, None, zero, one, [b"\0\0"])
    with pytest.raises(ValueError):  # a table of the wrong size
        c.store_lanes(f32, ln._KIND_TABLE16, half[:256], zero, one, [b"\0\0"])
    with pytest.raises(ValueError):  # a table where none is read
        c.store_lanes(u16, ln._KIND_U8, half, zero, one, [b"\0"])
    with pytest.raises(ValueError):  # dest not of whole lanes
        c.store_lanes(np.zeros(3, np.uint8), ln._KIND_U8, None, zero, one, [b"\0"])
    with pytest.raises(ValueError):  # starts and payloads differ in number
        c.store_lanes(u16, ln._KIND_U8, None, np.array([0, 1], np.int64), one, [b"\0"])
    with pytest.raises(ValueError):
        c.store_lanes(u16, ln._KIND_U8, None, zero, one, [b"\0"], -1)
    with pytest.raises(IndexError):  # past the end, negative
        c.store_lanes(u16, ln._KIND_U8, None, np.array([16], np.int64), one, [b"\0"])
    with pytest.raises(IndexError):
        c.store_lanes(u16, ln._KIND_U8, None, np.array([-1], np.int64), one, [b"\0"])
    with pytest.raises(c.LengthError):  # negative, huge and mismatched counts
        c.store_lanes(u16, ln._KIND_U8, None, zero, np.array([-1], np.int64), [b""])
    with pytest.raises(c.LengthError):
        c.store_lanes(u16, ln._KIND_U10, None, zero, np.array([2**62], np.int64), [b"\0"])
    with pytest.raises(c.LengthError):  # 2 lanes of 10 bits are 3 bytes
        c.store_lanes(u16, ln._KIND_U10, None, zero, two, [b"\0\0"])
    with pytest.raises(c.LengthError):  # a skip longer than the datagram
        c.store_lanes(u16, ln._KIND_U8, None, zero, zero, [b"\0"], 2)
    with pytest.raises(TypeError):
        c.store_lanes(u16, ln._KIND_U8, None, zero, one, 5)
    with pytest.raises(BufferError):  # a read-only dest
        c.store_lanes(b"\0\0", ln._KIND_U8, None, zero, one, [b"\0"])
    assert not u16.any() and not f32.any()


def test_pick_takes_the_datagrams_at_the_positions() -> None:
    """`_bulk.pick` of a list, a tuple or a `Datagrams` is indexing each
    position (repeats and any order); of a Datagrams another Datagrams over
    the same buffers; a position out of range is an IndexError."""
    if not _native():
        pytest.skip("dlcp.wire._bulk is not built (DLCP_ALLOW_NO_NATIVE=1)")
    c = lanes._bulk
    items = [bytes([i]) * (70 + i) for i in range(6)]
    order = np.array([5, 0, 0, 3, 2], np.int64)
    want = [items[i] for i in order.tolist()]
    assert c.pick(items, order) == want and c.pick(tuple(items), order) == want
    assert picked(items, order) == want
    if _udp is not None:
        dgs = c.join([_udp.split_gro(d, 0)[0] for d in items])
        got = c.pick(dgs, order)
        assert type(got) is c.Datagrams and [bytes(g) for g in got] == want
        assert [bytes(g) for g in c.pick(got, np.array([4, 1], np.int64))] == [want[4], want[1]]
        assert len(c.pick(dgs, np.zeros(0, np.int64))) == 0
        with pytest.raises(IndexError):
            c.pick(dgs, np.array([6], np.int64))
    for bad in (np.array([6], np.int64), np.array([-1], np.int64)):
        with pytest.raises(IndexError):
            c.pick(items, bad)
    with pytest.raises(TypeError):
        c.pick(iter(items), order)


def test_the_cpu_conversion_of_halves_is_numpys_cast() -> None:
    """Where the CPU converts fp16 (`_KIND_F16C`), it gives numpy's float32
    for every half, signalling NaNs included, in runs of any length (the last
    lanes of a run go through a padded copy); fp16 stores take it only then."""
    if not _native():
        pytest.skip("dlcp.wire._bulk is not built (DLCP_ALLOW_NO_NATIVE=1)")
    c = lanes._bulk
    halves = np.arange(1 << 16, dtype="<u2")
    try:
        c.store_lanes(np.empty(1, np.float32), ln._KIND_F16C, None, np.array([0]),
                      np.array([1]), [bytes(2)])  # fmt: skip
    except ValueError:
        assert ln._HALF_KIND == (ln._KIND_TABLE16, ln._HALF_TO_F32)
        pytest.skip("no F16C on this CPU")
    assert ln._HALF_KIND == (ln._KIND_F16C, None)
    rng = np.random.default_rng(3)
    order = rng.permutation(halves)
    counts = np.array([1, 7, 8, 9, 15, 16, 17, 3, (1 << 16) - 76], np.int64)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    parts = [order[s : s + n].tobytes() for s, n in zip(starts, counts, strict=True)]
    got = np.full(1 << 16, 9, np.float32)
    c.store_lanes(got, ln._KIND_F16C, None, starts, counts, parts)
    assert got.view(np.uint32).tolist() == ln._HALF_TO_F32[order].view(np.uint32).tolist()


def test_to_halves_is_numpys_cast() -> None:
    """The fp16 cast of sums in C (`_bulk.to_halves`, F16C) is numpy's
    astype("<f2") for every value where one can go wrong (ties, overflow,
    subnormals, NaN payloads), in runs of any length; `lanes.to_halves`
    takes it only where so, and gives numpy's array either way."""
    if not _native():
        pytest.skip("dlcp.wire._bulk is not built (DLCP_ALLOW_NO_NATIVE=1)")
    x = ln._half_checks()
    with np.errstate(all="ignore"):
        want = x.astype("<f2")
    for n in (x.size, 1, 7, 9, 17):
        got = ln.to_halves(x[:n])
        assert (
            got.dtype == np.dtype("<f2")
            and got.view(np.uint16).tolist() == want[:n].view(np.uint16).tolist()
        )
        into = np.full(n, 5, "<f2")  # into a given array (a rank's mapped out region)
        assert ln.to_halves(x[:n], out=into) is into
        assert into.view(np.uint16).tolist() == want[:n].view(np.uint16).tolist()
        plain = np.full(n, 5, "<f2")  # numpy's cast where the C one is not taken
        with np.errstate(all="ignore"):  # numpy's cast warns of what overflows
            ln.to_halves(np.repeat(x[:n], 2)[::2], out=plain)  # not contiguous
        assert plain.view(np.uint16).tolist() == want[:n].view(np.uint16).tolist()
    wrong = np.zeros(4, "<f2"), np.zeros(x.size, np.float32), np.zeros((x.size, 2), "<f2")[:, 0]
    for bad in wrong:
        with pytest.raises(ValueError):
            ln.to_halves(x, out=bad)
    if not ln._HALVES_IN_C:
        pytest.skip("no F16C on this CPU")
    c = lanes._bulk
    with pytest.raises(ValueError):  # lengths differ
        c.to_halves(np.zeros(4, np.float32), np.zeros(3, np.uint16))
    with pytest.raises(ValueError):  # not whole float32s
        c.to_halves(bytes(6), np.zeros(3, np.uint16))
    with pytest.raises(BufferError):
        c.to_halves(np.zeros(2, np.float32), bytes(4))
    assert ln.to_halves(np.zeros(0, np.float32)).size == 0
    wide = np.arange(12, dtype=np.float64).reshape(3, 4)  # other dtypes: numpy's cast
    assert ln.to_halves(wide).tolist() == wide.astype("<f2").tolist()


@pytest.mark.parametrize("n", [0, 1, 3, 4, 5, 8, 11, 1001])
def test_pack_u10_is_the_numpy_packing(n: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """THC8's sums packed as 10-bit lanes in C are numpy's bytes, for sums that
    fit and (bits ORed over the next lane, as numpy's) ones that do not; a
    destination of the wrong length is refused."""
    if not _native():
        pytest.skip("dlcp.wire._bulk is not built (DLCP_ALLOW_NO_NATIVE=1)")
    rng = np.random.default_rng(n)
    for top in (1 << 10, 1 << 16):
        v = rng.integers(0, top, n).astype(np.uint16)
        got = lanes.narrow_bytes(Codec.THC8_SUM10, v)
        with monkeypatch.context() as m:
            m.setattr(lanes, "_bulk", None)
            want = lanes.narrow_bytes(Codec.THC8_SUM10, v)
        assert got.tobytes() == want.tobytes()
    c = lanes._bulk
    with pytest.raises(ValueError):
        c.pack_u10(np.zeros(n, np.uint16), np.zeros((n * 10 + 7) // 8 + 1, np.uint8))
    with pytest.raises(ValueError):  # not whole uint16s
        c.pack_u10(bytes(3), np.zeros(2, np.uint8))
