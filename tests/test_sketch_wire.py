"""The sketch codec on the wire: the index union's 1-bit OR lanes and the
count sketch's fp32 cells through the sans-IO core (lanes, engines, loss)."""

from __future__ import annotations

import numpy as np
import pytest

from dlcp import ipc
from dlcp.codecs import lanes
from dlcp.core.aggregate import ShardAggregator
from dlcp.core.engine import Send
from dlcp.core.layout import Layout
from dlcp.core.timing import Timing
from dlcp.errors import LocalError, Reason, RemoteError, WireError
from dlcp.wire import Codec, Header, PacketType, decode, encode
from dlcp.wire.header import lane_bytes
from tests.netsim import Network
from tests.test_engine import JOB, KEY, cluster, completions


def bits(rng: np.random.Generator, n: int, density: float) -> np.ndarray:
    return (rng.random(n) < density).astype(np.uint8)


def test_union_lanes_are_bits_and_their_sums_an_or() -> None:
    rng = np.random.default_rng(1)
    a, b = bits(rng, 1001, 0.1), bits(rng, 1001, 0.1)
    pa = lanes.pack(Codec.UNION, a, summed=False)
    assert len(pa) == lane_bytes(Codec.UNION, 1001, False) == 126
    np.testing.assert_array_equal(lanes.unpack(Codec.UNION, pa, 1001, False), a)
    acc = lanes.unpack(Codec.UNION, pa, 1001, False).astype(lanes.sum_dtype(Codec.UNION))
    acc = acc + lanes.unpack(Codec.UNION, lanes.pack(Codec.UNION, b, False), 1001, False)
    assert acc.max() == 2  # counts at the aggregator ...
    out = lanes.summed_wire(Codec.UNION, acc)  # ... bits on the wire: the OR
    assert out.dtype == np.uint8 and out.nbytes == lane_bytes(Codec.UNION, 1001, True)
    np.testing.assert_array_equal(lanes.unpack(Codec.UNION, out, 1001, True), a | b)
    with pytest.raises(RemoteError) as err:
        lanes.unpack(Codec.UNION, pa[:-1], 1001, False)
    assert err.value.reason == Reason.BAD_LENGTH


def test_sketch_cells_are_fp32_lanes() -> None:
    x = np.arange(10, dtype=np.float32)
    assert lanes.pack(Codec.SKETCH, x, False) == lanes.pack(Codec.FP32, x, False)
    assert lanes.sum_dtype(Codec.SKETCH) == np.float32
    assert lanes.summed_wire(Codec.SKETCH, x).dtype == np.dtype("<f4")


@pytest.mark.parametrize("codec", [Codec.UNION, Codec.SKETCH])
def test_the_new_codecs_round_trip_in_a_header(codec: Codec) -> None:
    count = 64
    h = Header(PacketType.DATA, job=1, round=2, bucket=3, codec=codec, count=count, total=count)
    payload = bytes(lane_bytes(codec, count, False))
    got, body = decode(encode(h, payload, KEY), {1: KEY})
    assert got.codec == codec and bytes(body) == payload
    assert ipc.CODEC_BY_NAME[codec.name.lower()] == int(codec)


def test_union_packets_start_on_bytes() -> None:
    lay = Layout(total=100_000, codec=Codec.UNION, shards=3)
    assert lay.per_packet == 1408 * 8 and lay.result_split == 1
    assert all(o % 8 == 0 for o, _ in lay.shard_results(1))


def union_round(hosts: int, maps: list[np.ndarray], **net_kw: object) -> dict[int, object]:
    n = maps[0].size
    net = Network(cluster(hosts), seed=5, **net_kw)  # type: ignore[arg-type]
    for me, m in enumerate(maps):
        net.engines[me].submit(
            job=JOB,
            round=0,
            bucket=1,
            codec=Codec.UNION,
            total=n,
            lanes=lanes.pack(Codec.UNION, m, False),
            now=0.0,
        )
    net.run()
    return completions(net)  # type: ignore[return-value]


@pytest.mark.parametrize("loss", [0.0, 0.05])
def test_three_engines_agree_on_the_union_of_their_bitmaps(loss: float) -> None:
    rng = np.random.default_rng(2)
    n = 100_003  # several packets a shard, a short last packet
    maps = [bits(rng, n, 0.02) for _ in range(3)]
    done = union_round(3, maps, loss=loss)
    want = maps[0] | maps[1] | maps[2]
    assert sorted(done) == [0, 1, 2]
    for ev in done.values():
        got = lanes.unpack(Codec.UNION, lanes.summed_wire(Codec.UNION, ev.sums), n, True)
        np.testing.assert_array_equal(got, want)  # every bit, lost packets resent
        assert ev.lost_lanes == 0


def test_the_union_is_never_submitted_droppable() -> None:
    e = cluster(2)[0]
    with pytest.raises(LocalError, match="never droppable"):
        e.submit(
            job=JOB,
            round=0,
            bucket=0,
            codec=Codec.UNION,
            total=64,
            lanes=bytes(8),
            bound=0.01,
            droppable=np.ones(1, bool),
            now=0.0,
        )


def test_a_union_manifest_with_droppable_packets_is_rejected() -> None:
    lay = Layout(total=100_000, codec=Codec.UNION, shards=1)
    agg = ShardAggregator(layout=lay, shard=0, senders=[0, 1], now=0.0, timing=Timing())
    n = agg.n_packets
    with pytest.raises(RemoteError) as err:
        agg.on_manifest(sender=1, droppable=np.ones(n, bool), bound=0.05, now=0.0)
    assert err.value.reason == Reason.BAD_FLAGS
    assert not agg.manifest.any()
    agg.on_manifest(sender=1, droppable=np.zeros(n, bool), bound=0.0, now=0.0)
    assert agg.manifest[1]


def test_sketch_cells_sum_like_fp32_and_their_loss_is_counted() -> None:
    rng = np.random.default_rng(3)
    xs = [rng.standard_normal(20_000).astype(np.float32) for _ in range(3)]
    net = Network(cluster(3), seed=4)
    for me, x in enumerate(xs):
        drop = np.zeros(Layout(x.size, Codec.SKETCH, 3).packets, bool)
        drop[me::7] = True
        net.engines[me].submit(
            job=JOB,
            round=0,
            bucket=0,
            codec=Codec.SKETCH,
            total=x.size,
            lanes=x.tobytes(),
            droppable=drop,
            bound=0.2,
            now=0.0,
        )
    net.drop = lambda src, send: bool(
        (h := _header(send)) is not None and h.type == PacketType.DATA and h.flags & 1
    )
    net.run()
    done = completions(net)
    first = done[0]
    assert (first.contributors < 3).any()  # droppable cells were dropped, and counted
    full = np.repeat(first.contributors == 3, Layout(20_000, Codec.SKETCH, 3).packet_counts())
    np.testing.assert_allclose(first.sums[full], np.sum(xs, axis=0)[full], rtol=1e-5, atol=1e-5)


def _header(send: Send) -> Header | None:
    dg = send.datagram if isinstance(send.datagram, bytes) else bytes(send.datagram)
    try:
        return decode(dg, {JOB: KEY})[0]
    except WireError:
        return None
