"""The cached `next_timer` of the aggregation state machines equals a
from-scratch recomputation (the pre-cache formula, kept here verbatim) after
every step of randomized event sequences. `next_timer` is asked after every
step, so a cache that some event fails to invalidate answers stale."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from dlcp.codecs import lanes as lane_ops
from dlcp.core.aggregate import ResultCollector, ShardAggregator, ShardResult, _Tick
from dlcp.core.layout import Layout
from dlcp.core.timing import Timing
from dlcp.errors import RemoteError
from dlcp.wire.header import Codec

TIMING = Timing(nack_delay=0.005, nack_interval=0.03, linger=0.002, grace=0.05, timeout=10.0)
PER = 4  # lanes per packet: payload of 16 bytes of fp32
LAYOUT = Layout(total=7 * PER - 1, codec=Codec.FP32, shards=2, payload=PER * 4)
SENDERS = (0, 1, 2)


def reference_agg_timer(agg: ShardAggregator) -> float | None:
    """ShardAggregator.next_timer as it was before the cache (12b5295)."""
    if agg.result is not None:
        return None
    t = _Tick()
    t.arm(agg.created + agg.timing.timeout)
    if agg.done_at is not None:
        t.arm(agg.done_at + agg.timing.linger)
        return t.at
    required = ~agg.received & ~agg.droppable
    short = agg.manifest.all() and not required.any()
    for row in range(len(agg.senders)):
        again = agg.last_nack[row] + agg.timing.nack_interval
        if agg.manifest[row]:
            if required[row].any() or (short and not agg.received[row].all()):
                t.arm(max(again, agg.last_arrival + agg.timing.nack_delay))
        else:
            t.arm(
                max(
                    again,
                    agg.created + agg.timing.grace,
                    agg.last_arrival + agg.timing.grace,
                )
            )
    return t.at


def reference_collector_timer(col: ResultCollector) -> float | None:
    """ResultCollector.next_timer as it was before the cache (12b5295)."""
    t = _Tick()
    for w in col.waiting.values():
        if w.last_arrival is None and not w.done:
            t.arm(max(col.created, w.last_nack) + col.timing.grace)
            continue
        last = w.last_arrival if w.last_arrival is not None else col.created
        wait = col.timing.nack_delay if w.done else col.timing.grace
        t.arm(max(last + wait, w.last_nack + col.timing.nack_interval))
    if col.waiting:
        t.arm(col.created + col.timing.timeout)
    return t.at


def _packet(i: int) -> tuple[int, int, bytes]:
    off, cnt = LAYOUT.packet_range(i)
    return off, cnt, lane_ops.pack(LAYOUT.codec, np.full(cnt, i, np.float32), False)


_agg_event = st.one_of(
    st.tuples(st.just("data"), st.integers(0, 2), st.integers(0, 6), st.booleans()),
    st.tuples(st.just("many"), st.integers(0, 2), st.lists(st.integers(0, 6), max_size=4)),
    st.tuples(st.just("manifest"), st.integers(0, 2), st.integers(0, 15), st.floats(0, 1)),
    st.tuples(st.just("local"), st.integers(0, 2)),
    st.tuples(st.just("poll")),
)


@settings(max_examples=300, deadline=None)
@given(
    shard=st.integers(0, 1),
    events=st.lists(
        st.tuples(_agg_event, st.floats(0.0, 0.08, allow_nan=False)), min_size=1, max_size=40
    ),
)
def test_aggregator_cached_timer_matches_recomputation(
    shard: int, events: list[tuple[tuple, float]]
) -> None:
    now = 100.0
    agg = ShardAggregator(layout=LAYOUT, shard=shard, senders=SENDERS, now=now, timing=TIMING)
    pk = LAYOUT.shard_packets(shard)
    assert agg.next_timer() == reference_agg_timer(agg)
    for ev, dt in events:
        now += dt
        kind = ev[0]
        try:
            if kind == "data":
                _, sender, k, drop = ev
                off, cnt, payload = _packet(pk.start + k % len(pk))
                agg.on_data(
                    sender=sender, offset=off, count=cnt, payload=payload, summed=False,
                    weight=1, droppable=drop, scale=1.0, block_max=0.0, now=now,
                )  # fmt: skip
            elif kind == "many":
                _, sender, ks = ev
                pkts = [_packet(pk.start + k % len(pk)) for k in ks]
                agg.on_data_many(
                    sender=sender,
                    offsets=np.array([p[0] for p in pkts], np.int64),
                    counts=np.array([p[1] for p in pkts], np.int64),
                    payloads=[p[2] for p in pkts],
                    summed=False,
                    weight=1,
                    droppable=np.array([k % 2 == 0 for k in ks], bool),
                    scale=1.0,
                    block_max=np.zeros(len(ks), np.float32),
                    now=now,
                )
            elif kind == "manifest":
                _, sender, bits, bound = ev
                drop = np.array([(bits >> j) & 1 for j in range(agg.n_packets)], bool)
                agg.on_manifest(sender=sender, droppable=drop, bound=bound, now=now)
            elif kind == "local":
                agg.on_local(
                    sender=ev[1],
                    lanes=np.ones(agg.lanes, np.float32).tobytes(),
                    summed=False,
                    weight=1,
                    droppable=np.zeros(agg.n_packets, bool),
                    scale=1.0,
                    block_max=np.zeros(agg.n_packets, np.float32),
                    now=now,
                )
            else:
                agg.poll(now)
        except RemoteError:
            pass  # a rejected event changes nothing; the check below still holds
        assert agg.next_timer() == reference_agg_timer(agg)
        assert agg._compute_timer() == reference_agg_timer(agg) or agg.result is not None


_col_event = st.one_of(
    st.tuples(st.just("result"), st.integers(0, 1), st.integers(0, 20)),
    st.tuples(st.just("many"), st.integers(0, 1), st.lists(st.integers(0, 20), max_size=4)),
    st.tuples(st.just("done"), st.integers(0, 1)),
    st.tuples(st.just("local"), st.integers(0, 1)),
    st.tuples(st.just("poll")),
)


@settings(max_examples=300, deadline=None)
@given(
    events=st.lists(
        st.tuples(_col_event, st.floats(0.0, 0.08, allow_nan=False)), min_size=1, max_size=40
    )
)
def test_collector_cached_timer_matches_recomputation(events: list[tuple[tuple, float]]) -> None:
    now = 50.0
    owners = (1, 2)
    col = ResultCollector(layout=LAYOUT, owners=owners, me=0, senders=3, now=now, timing=TIMING)
    results = {s: list(LAYOUT.shard_results(s)) for s in range(LAYOUT.shards)}
    assert col.next_timer() == reference_collector_timer(col)
    for ev, dt in events:
        now += dt
        kind = ev[0]
        if kind in ("result", "many"):
            shard = ev[1]
            ks = [ev[2]] if kind == "result" else ev[2]
            ranges = [results[shard][k % len(results[shard])] for k in ks]
            payloads = [
                lane_ops.pack(LAYOUT.codec, np.ones(cnt, np.float32), True) for _, cnt in ranges
            ]
            if kind == "result" and ranges:
                off, cnt = ranges[0]
                col.on_result(
                    shard=shard, sender=owners[shard], offset=off, count=cnt, payload=payloads[0],
                    contributors=3, block_max=0.0, now=now,
                )  # fmt: skip
            else:
                col.on_results_many(
                    shard=shard,
                    sender=owners[shard],
                    offsets=np.array([r[0] for r in ranges], np.int64),
                    counts=np.array([r[1] for r in ranges], np.int64),
                    payloads=payloads,
                    contributors=np.full(len(ranges), 3, np.int64),
                    block_max=np.zeros(len(ranges), np.float32),
                    now=now,
                )
        elif kind == "done":
            col.on_done(shard=ev[1], sender=owners[ev[1]], lost_lanes=0, now=now)
        elif kind == "local":
            shard = ev[1]
            off, cnt = LAYOUT.shard_range(shard)
            n = len(LAYOUT.shard_packets(shard))
            col.on_local(_shard_result(shard, cnt, n))  # this node owns the shard
        else:
            col.poll(now)
        assert col.next_timer() == reference_collector_timer(col)


def _shard_result(shard: int, lanes: int, packets: int) -> ShardResult:
    return ShardResult(
        shard=shard,
        sums=np.ones(lanes, np.float32),
        contributors=np.full(packets, 3, np.int64),
        block_max=np.zeros(packets, np.float32),
        lost_lanes=0,
        total_lanes=lanes * 3,
    )
