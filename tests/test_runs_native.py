"""The C pass over a run's header records (`ShardAggregator.on_data_run`,
`ResultCollector.on_result_run` with `dlcp.wire._bulk`) against the numpy
forms it stands in for (`on_data_many`, `on_results_many`), state for state.

Runs are drawn around one shard: packets of the shard and of its neighbours,
offsets off the packet grid, wrong counts, packets already stored, repeats in
and out of order, every flag, class, layer and block max, and a scale that
differs; twin aggregators take them one way each and must agree on every
outcome and every array after every run.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from dlcp.core import aggregate as aggregate_mod
from dlcp.core.aggregate import RunRejected, ShardAggregator
from dlcp.core.collector import ResultCollector
from dlcp.core.layout import Layout
from dlcp.core.timing import Timing
from dlcp.errors import Reason, RemoteError
from dlcp.wire import Codec, Flags
from dlcp.wire.batch import HEADER_DTYPE

SCALE = 0.5


def _native() -> None:
    if aggregate_mod._bulk is None:
        assert os.environ.get("DLCP_ALLOW_NO_NATIVE") == "1", "dlcp.wire._bulk was not built"
        pytest.skip("dlcp.wire._bulk is not built (DLCP_ALLOW_NO_NATIVE=1)")


def _heads(offsets: list[int], counts: list[int], rng: np.random.Generator) -> np.ndarray:
    n = len(offsets)
    h = np.zeros(n, dtype=HEADER_DTYPE)
    h["offset"] = offsets
    h["count"] = counts
    h["flags"] = rng.choice([0, int(Flags.DROPPABLE), int(Flags.DROPPABLE | Flags.LAST)], n)
    h["priority"] = rng.integers(0, 8, n)
    h["layer"] = rng.integers(0, 65536, n)
    h["aux"] = rng.standard_normal(n).astype("<f4").view("<u4")  # the block max's bits
    h["param"] = rng.standard_normal(n)  # results: the block max
    h["contributors"] = rng.integers(1, 5, n)
    return h


def _data_run(
    lay: Layout, shard: int, rng: np.random.Generator, n: int
) -> tuple[np.ndarray, list[bytes]]:
    """A run of data packets around `shard`: mostly its own packets (in order,
    shuffled or repeated), some of its neighbours', some off the grid."""
    pk = lay.shard_packets(shard)
    lo, hi = max(pk.start - 2, 0), min(pk.stop + 2, lay.packets)
    picks = np.arange(pk.start, pk.stop)
    if rng.random() < 0.5:
        picks = rng.permutation(picks)
    picks = np.concatenate([picks, rng.integers(lo, hi, n)])[: n + int(rng.integers(0, 5))]
    if rng.random() < 0.5:
        picks = np.sort(picks)  # in order, repeats side by side
    offsets, counts = [], []
    for i in picks.tolist():
        off, count = lay.packet_range(i)
        r = rng.random()
        if r < 0.04:
            off += int(rng.integers(1, lay.per_packet))  # off the grid
        elif r < 0.08:
            count += int(rng.choice([-1, 1]))  # a count the layout does not have
        elif r < 0.10:
            off = lay.total  # past the end
        offsets.append(off)
        counts.append(max(count, 0))
    heads = _heads(offsets, counts, rng)
    payloads = [rng.standard_normal(c).astype("<f4").tobytes() for c in counts]
    return heads, payloads


def _same_state(a: ShardAggregator, b: ShardAggregator) -> None:
    for name in ("received", "droppable", "classes", "layers", "weight", "manifest"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)
    assert a.block_max.tobytes() == b.block_max.tobytes()
    assert (a.duplicates, a.n_received, a.scale) == (b.duplicates, b.n_received, b.scale)
    assert (a.acc.summed_row, a.last_arrival) == (b.acc.summed_row, b.last_arrival)
    off = a.offset
    for row in range(len(a.senders)):  # the lanes of every stored packet
        for local in np.flatnonzero(a.received[row]).tolist():
            start, count = a.layout.packet_range(a.first_packet + local)
            lanes = slice(start - off, start - off + count)
            if a.acc.summed_row == row:
                assert a.out is not None and b.out is not None
                assert a.out[lanes].tobytes() == b.out[lanes].tobytes()
            elif row in a.acc.held:  # on_local's lanes, held by reference (not in slots)
                assert a.acc.held[row][lanes].tobytes() == b.acc.held[row][lanes].tobytes()
            else:
                assert a.slots[row, lanes].tobytes() == b.slots[row, lanes].tobytes()


@pytest.mark.parametrize("summing", [False, True])
@pytest.mark.parametrize("seed", range(6))
def test_data_runs_in_c_are_on_data_many(seed: int, summing: bool) -> None:
    _native()
    rng = np.random.default_rng(seed)
    lay = Layout(total=352 * 20 + 100, codec=Codec.FP32, shards=2, payload=1408)
    shard = 1
    senders = [0, 1] if summing else [0, 1, 2]
    twins = []
    for _ in range(2):
        agg = ShardAggregator(layout=lay, shard=shard, senders=senders, now=0.0, timing=Timing())
        if summing:  # node 1's lanes held, node 0's packets summed into out as they come
            _, count = lay.shard_range(shard)
            agg.sum_into(np.full(count, np.nan, np.float32))
            n_pk = agg.n_packets
            own = np.random.default_rng(99).standard_normal(count).astype("<f4")
            agg.on_local(sender=1, lanes=own.tobytes(), summed=False, weight=1,
                         droppable=np.zeros(n_pk, bool), scale=SCALE,
                         block_max=np.zeros(n_pk, np.float32), now=0.0)  # fmt: skip
        twins.append(agg)
    ref, fast = twins
    seen = {"bad": 0, "dup": 0, "stored": 0}
    for step in range(12):
        sender = 0 if summing else int(rng.choice([0, 2]))
        if step == 6 and not summing:  # a sender's manifest: its droppable flags are final
            for agg in twins:
                agg.on_manifest(sender=2, droppable=np.ones(agg.n_packets, bool), bound=0.1,
                                now=1.0)  # fmt: skip
        heads, payloads = _data_run(lay, shard, rng, int(rng.integers(1, 30)))
        scale = SCALE if rng.random() < 0.9 else SCALE * 3
        now = float(step)
        kw = dict(sender=sender, payloads=payloads, summed=False, weight=2, scale=scale, now=now)
        try:
            fresh, bad = ref.on_data_many(
                offsets=heads["offset"].astype(np.int64),
                counts=heads["count"].astype(np.int64),
                droppable=(heads["flags"] & int(Flags.DROPPABLE)) != 0,
                block_max=heads["aux"].astype("<u4").view(np.float32),
                priority=heads["priority"],
                layer=heads["layer"],
                **kw,  # type: ignore[arg-type]
            )
        except RunRejected as exc:
            with pytest.raises(RunRejected) as got:
                fast.on_data_run(heads=heads, **kw)  # type: ignore[arg-type]
            assert got.value.reason == exc.reason == Reason.MISMATCH
            np.testing.assert_array_equal(got.value.bad, exc.bad)
        else:
            stored, bad_fast = fast.on_data_run(heads=heads, **kw)  # type: ignore[arg-type]
            assert stored == int(fresh.sum())
            np.testing.assert_array_equal(bad, np.zeros_like(bad) if bad_fast is None else bad_fast)
            assert (bad_fast is None) == (not bad.any())
            seen["bad"] += int(bad.sum())
            seen["stored"] += stored
            seen["dup"] += len(payloads) - int(bad.sum()) - stored
        _same_state(ref, fast)
    assert min(seen.values()) > 0, seen
    assert fast.acc.summed_row == (0 if summing else None)  # summing: the lanes added into out
    with pytest.raises(RemoteError) as unknown:
        fast.on_data_run(sender=7, heads=heads, payloads=payloads, summed=False, weight=1,
                         scale=SCALE, now=0.0)  # fmt: skip
    assert unknown.value.reason == Reason.BAD_SENDER


def _result_run(
    lay: Layout, shard: int, rng: np.random.Generator, n: int
) -> tuple[np.ndarray, list[bytes]]:
    """A run of result packets around `shard`, as `_data_run` makes data ones."""
    pk = lay.shard_packets(shard)
    ranges = [r for i in range(max(pk.start - 1, 0), pk.stop) for r in lay.result_ranges(i)]
    own = [r for i in pk for r in lay.result_ranges(i)]
    picks = list(own) if rng.random() < 0.5 else [own[int(k)] for k in rng.permutation(len(own))]
    picks += [ranges[int(k)] for k in rng.integers(0, len(ranges), n)]
    offsets, counts = [], []
    step = -(-lay.per_packet // lay.result_split)
    for off, count in picks[: n + int(rng.integers(0, 5))]:
        r = rng.random()
        if r < 0.04:
            off += int(rng.integers(1, step))  # not the start of a result packet
        elif r < 0.08:
            count += int(rng.choice([-1, 1]))
        offsets.append(off)
        counts.append(max(count, 0))
    heads = _heads(offsets, counts, rng)
    width = np.dtype(aggregate_mod.lane_ops.sum_dtype(lay.codec)).itemsize
    payloads = [rng.integers(0, 256, c * width, dtype=np.uint8).tobytes() for c in counts]
    return heads, payloads


@pytest.mark.parametrize(("codec", "total"), [(Codec.FP32, 352 * 20 + 100), (Codec.THC8, 20_480)])
@pytest.mark.parametrize("seed", range(4))
def test_result_runs_in_c_are_on_results_many(seed: int, codec: Codec, total: int) -> None:
    _native()
    rng = np.random.default_rng(seed)
    lay = Layout(total=total, codec=codec, shards=3, payload=1408)
    assert (lay.result_split > 1) == (codec == Codec.THC8)
    owners = [0, 1, 2]
    ref, fast = (
        ResultCollector(layout=lay, owners=owners, me=0, senders=3, now=0.0, timing=Timing())
        for _ in range(2)
    )
    seen = {"bad": 0, "dup": 0, "stored": 0}
    for step in range(10):
        shard = int(rng.choice([1, 2]))
        heads, payloads = _result_run(lay, shard, rng, int(rng.integers(1, 20)))
        kw = dict(shard=shard, sender=shard, payloads=payloads, now=float(step))
        fresh, bad = ref.on_results_many(
            offsets=heads["offset"].astype(np.int64),
            counts=heads["count"].astype(np.int64),
            contributors=heads["contributors"].astype(np.int64),
            block_max=heads["param"].astype(np.float32),
            **kw,  # type: ignore[arg-type]
        )
        stored, bad_fast = fast.on_result_run(heads=heads, **kw)  # type: ignore[arg-type]
        assert stored == int(fresh.sum())
        np.testing.assert_array_equal(bad, np.zeros_like(bad) if bad_fast is None else bad_fast)
        seen["bad"] += int(bad.sum())
        seen["stored"] += stored
        seen["dup"] += len(payloads) - int(bad.sum()) - stored
        np.testing.assert_array_equal(ref.contributors, fast.contributors)
        assert ref.block_max.tobytes() == fast.block_max.tobytes()
        assert ref.duplicates == fast.duplicates
        assert sorted(ref.waiting) == sorted(fast.waiting)
        for s, w in ref.waiting.items():
            np.testing.assert_array_equal(w.received, fast.waiting[s].received)
            assert w.last_arrival == fast.waiting[s].last_arrival
        for s in (1, 2):  # the lanes of every stored result packet
            w = ref.waiting.get(s)
            got = (np.ones(lay.shard_result_count(s), bool) if w is None else w.received).tolist()
            res = [r for i in lay.shard_packets(s) for r in lay.result_ranges(i)]
            for (off, count), stored_here in zip(res, got, strict=True):
                if stored_here:
                    a, b = ref.sums[off : off + count], fast.sums[off : off + count]
                    assert a.tobytes() == b.tobytes()
    assert min(seen.values()) > 0, seen
    fresh_col = ResultCollector(
        layout=lay, owners=owners, me=0, senders=3, now=0.0, timing=Timing()
    )
    with pytest.raises(RemoteError) as other:
        fresh_col.on_result_run(shard=2, sender=1, heads=heads[:1], payloads=payloads[:1], now=0.0)
    assert other.value.reason == Reason.BAD_SENDER


def test_mark_functions_check_their_arguments() -> None:
    _native()
    c = aggregate_mod._bulk
    heads = np.zeros(2, dtype=HEADER_DTYPE)
    received = np.zeros(4, bool)
    with pytest.raises(ValueError, match="received flags"):
        c.run_index(heads, 352, 1, 1000, 0, 3, 0, received)
    with pytest.raises(ValueError, match="positive"):
        c.run_index(heads, 0, 1, 1000, 0, 4, 0, received)
    take, local = np.array([0, 1]), np.array([0, 4])
    bm, cl, ly = np.zeros(4, np.float32), np.zeros(4, np.uint8), np.zeros(4, np.uint16)
    with pytest.raises(IndexError, match="slot 4"):
        c.mark_data(heads, take, local, received, bm, None, cl, ly, 1)
    with pytest.raises(IndexError, match="record 2"):
        c.mark_data(heads, np.array([2]), np.array([0]), received, bm, None, cl, ly, 1)
    with pytest.raises(ValueError, match="one item a slot"):
        c.mark_data(heads, take[:1], local[:1], received, bm[:3], None, cl, ly, 1)
    with pytest.raises(TypeError, match="int64"):
        c.mark_data(heads, take.astype(np.int32), local, received, bm, None, cl, ly, 1)
    assert not received.any() and not bm.any()  # nothing written by a call refused
    contributors = np.zeros(2, np.int64)
    heads["offset"] = [0, 352 * 2]  # packet 0, then packet 2 of a 2-packet collector
    heads["contributors"] = 3
    with pytest.raises(IndexError, match="packet 2 of 2"):
        c.mark_results(heads, np.array([0, 1]), np.array([0, 1]), received, contributors,
                       np.zeros(2, np.float32), 352)  # fmt: skip
    assert not received.any() and not contributors.any()  # not even record 0's
