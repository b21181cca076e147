"""Property tests of Layout: how a bucket is cut into packets, shards and results."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dlcp.core.layout import DEFAULT_PAYLOAD, Layout, lanes_per_packet
from dlcp.errors import LocalError
from dlcp.wire.header import LANE_BITS, MAX_PAYLOAD, RESULT_ONLY_CODECS, Codec, lane_bytes

SETTINGS = settings(max_examples=200, deadline=None)

BLOCK = (Codec.THC8, Codec.THC4)
CODECS = [c for c in Codec if c not in RESULT_ONLY_CODECS]  # a bucket's codecs
# Keep the number of packets small enough to walk every one of them.
MAX_PACKETS = 300

payloads = st.one_of(
    st.integers(8, 64),
    st.integers(8, MAX_PAYLOAD),
    # odd budgets where rounding of the result split used to overflow the budget
    st.sampled_from([8, 9, 11, 43, 683, DEFAULT_PAYLOAD, 43691, MAX_PAYLOAD - 1, MAX_PAYLOAD]),
)


@st.composite
def layouts(draw: st.DrawFn, codec: Codec | None = None) -> Layout:
    c = draw(st.sampled_from(CODECS)) if codec is None else codec
    payload = draw(payloads)
    per = lanes_per_packet(c, payload)
    if c in BLOCK:
        total = per * draw(st.integers(1, MAX_PACKETS))
    else:
        total = draw(st.integers(1, per * MAX_PACKETS))
    shards = draw(st.one_of(st.integers(1, 8), st.integers(1, 2 * MAX_PACKETS)))
    return Layout(total=total, codec=c, shards=shards, payload=payload)


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@SETTINGS
@given(st.sampled_from(CODECS), payloads)
def test_lanes_per_packet_fills_the_budget(codec: Codec, payload: int) -> None:
    per = lanes_per_packet(codec, payload)
    assert per >= 1
    assert lane_bytes(codec, per, False) <= payload
    if codec in BLOCK:
        assert _is_pow2(per)
        assert lane_bytes(codec, 2 * per, False) > payload  # the largest power of two
    else:
        assert lane_bytes(codec, per + 1, False) > payload  # whole lanes, as many as fit
    assert lanes_per_packet(codec) == lanes_per_packet(codec, DEFAULT_PAYLOAD)


@SETTINGS
@given(layouts())
def test_packets_cover_bucket_exactly_once(lay: Layout) -> None:
    per = lay.per_packet
    assert per == lanes_per_packet(lay.codec, lay.payload)
    assert lay.packets == -(-lay.total // per)
    end = 0
    for i in range(lay.packets):
        off, count = lay.packet_range(i)
        assert off == end  # contiguous, no gap or overlap
        if i < lay.packets - 1:
            assert count == per  # all but the last full
        else:
            assert 1 <= count <= per
        assert lane_bytes(lay.codec, count, False) <= lay.payload
        assert lay.packet_of(off) == i
        assert lay.packet_of(off + count - 1) == i
        end = off + count
    assert end == lay.total
    counts = lay.packet_counts()
    assert counts.dtype == np.int64
    assert counts.sum() == lay.total
    assert counts.tolist() == [lay.packet_range(i)[1] for i in range(lay.packets)]


@SETTINGS
@given(layouts(), st.data())
def test_packet_of_every_lane(lay: Layout, data: st.DataObject) -> None:
    lane = data.draw(st.integers(0, lay.total - 1))
    i = lay.packet_of(lane)
    off, count = lay.packet_range(i)
    assert off <= lane < off + count


@SETTINGS
@given(layouts())
def test_shards_partition_packets_contiguously(lay: Layout) -> None:
    nxt = 0
    lanes = 0
    sizes = []
    for s in range(lay.shards):
        pk = lay.shard_packets(s)
        assert pk.step == 1
        assert pk.start == nxt
        nxt = pk.stop
        sizes.append(len(pk))
        for i in pk:
            assert lay.shard_of_packet(i) == s
        off, count = lay.shard_range(s)
        if pk:
            assert off == lay.packet_range(pk.start)[0]
            last_off, last_count = lay.packet_range(pk.stop - 1)
            assert off + count == last_off + last_count
            assert count == sum(lay.packet_range(i)[1] for i in pk)
            assert lanes == off
        else:
            assert (off, count) == (0, 0)
        lanes += count
    assert nxt == lay.packets
    assert lanes == lay.total
    # balanced: shard sizes differ by at most one packet
    assert max(sizes) - min(sizes) <= 1
    # shard_of_packet is a valid shard for every packet
    for i in range(lay.packets):
        s = lay.shard_of_packet(i)
        assert 0 <= s < lay.shards
        assert i in lay.shard_packets(s)


@SETTINGS
@given(layouts())
def test_result_ranges_and_indices(lay: Layout) -> None:
    split = lay.result_split
    assert split >= 1
    if lay.codec in (Codec.FP32, Codec.FP16):
        assert split == 1  # summed lanes are as wide as data lanes
    seen: set[int] = set()
    prev = -1
    for i in range(lay.packets):
        off, count = lay.packet_range(i)
        ranges = lay.result_ranges(i)
        assert 1 <= len(ranges) <= split
        end = off
        for j, (o, c) in enumerate(ranges):
            assert o == end
            assert c >= 1
            assert lane_bytes(lay.codec, c, True) <= lay.payload  # a result fits a packet
            idx = lay.result_index(o)
            assert idx == i * split + j
            assert idx > prev  # increasing, hence unique
            assert idx not in seen
            seen.add(idx)
            prev = idx
            assert lay.packet_of(o) == i
            end = o + c
        assert end == off + count
    assert prev < lay.packets * split
    for s in range(lay.shards):
        want = [r for i in lay.shard_packets(s) for r in lay.result_ranges(i)]
        assert list(lay.shard_results(s)) == want
        offs, counts = lay.shard_result_arrays(s)
        assert offs.dtype == counts.dtype == np.int64
        assert list(zip(offs.tolist(), counts.tolist(), strict=True)) == want
        assert lay.shard_result_count(s) == len(want)


@pytest.mark.parametrize("codec", BLOCK)
def test_results_fit_every_payload_budget(codec: Codec) -> None:
    # summed THC lanes are wider than data lanes; every budget, exhaustively
    for payload in range(8, MAX_PAYLOAD + 1):
        lay = Layout(total=lanes_per_packet(codec, payload), codec=codec, shards=1, payload=payload)
        ranges = lay.result_ranges(0)
        assert len(ranges) == lay.result_split
        assert all(lane_bytes(codec, c, True) <= payload for _, c in ranges), payload


@SETTINGS
@given(st.sampled_from(BLOCK), payloads, st.integers(1, 10**6))
def test_block_codecs_need_whole_blocks(codec: Codec, payload: int, total: int) -> None:
    per = lanes_per_packet(codec, payload)
    assert _is_pow2(per)
    if total % per:
        with pytest.raises(LocalError):
            Layout(total=total, codec=codec, shards=1, payload=payload)
    else:
        lay = Layout(total=total, codec=codec, shards=1, payload=payload)
        assert (lay.packet_counts() == per).all()


@SETTINGS
@given(st.sampled_from([Codec.FP32, Codec.FP16]), payloads, st.integers(1, 10**6))
def test_fp_codecs_take_any_total(codec: Codec, payload: int, total: int) -> None:
    lay = Layout(total=total, codec=codec, shards=3, payload=payload)
    assert lay.packet_counts().sum() == total


@pytest.mark.parametrize(
    "kwargs",
    [
        {"total": 0},
        {"total": -5},
        {"total": 2**32},
        {"shards": 0},
        {"shards": -1},
        {"shards": 2**16 + 1},
        {"payload": 7},
        {"payload": 0},
        {"payload": -1},
        {"payload": MAX_PAYLOAD + 1},
        {"codec": 9},
        {"codec": Codec.THC8, "total": 1000},
        {"codec": Codec.THC4, "total": 4096 + 1},
    ],
)
def test_bad_inputs_raise_local_error(kwargs: dict[str, object]) -> None:
    args: dict[str, object] = {"total": 4096, "codec": Codec.FP32, "shards": 2, **kwargs}
    with pytest.raises(LocalError):
        Layout(**args)  # type: ignore[arg-type]


@pytest.mark.parametrize("payload", [-1, 0, 7, MAX_PAYLOAD + 1])
def test_lanes_per_packet_bad_payload(payload: int) -> None:
    for codec in Codec:
        with pytest.raises(LocalError):
            lanes_per_packet(codec, payload)
    with pytest.raises(LocalError):
        lanes_per_packet(99)


def test_limits_accepted() -> None:
    lay = Layout(total=2**32 - 1, codec=Codec.FP32, shards=2**16)
    assert lay.packets == -(-(2**32 - 1) // lay.per_packet)
    assert lay.shard_of_packet(lay.packets - 1) == 2**16 - 1
    for codec in CODECS:
        lay = Layout(total=lanes_per_packet(codec, 8), codec=codec, shards=1, payload=8)
        assert lay.packets == 1
        assert lay.per_packet * LANE_BITS[codec][0] <= 64


def test_result_only_codecs_make_no_layout() -> None:
    for codec in RESULT_ONLY_CODECS:
        with pytest.raises(LocalError):
            Layout(total=1024, codec=codec, shards=1)


def test_default_payload_known_values() -> None:
    assert lanes_per_packet(Codec.FP32) == 352
    assert lanes_per_packet(Codec.FP16) == 704
    assert lanes_per_packet(Codec.THC8) == 1024
    assert lanes_per_packet(Codec.THC4) == 2048
    assert Layout(total=2048, codec=Codec.THC4, shards=1).result_split == 3
    assert Layout(total=1024, codec=Codec.THC8, shards=1).result_split == 2
