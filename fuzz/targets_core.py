"""Fuzz targets of the C passes over a run's header records: a data run's
packets found and noted (`_bulk.run_index`, `_bulk.mark_data`:
`ShardAggregator.on_data_run`) and a result run's (`_bulk.mark_results`:
`ResultCollector.on_result_run`), each against the numpy form it stands in
for (`on_data_many`, `on_results_many`) on twin objects, state for state."""

from __future__ import annotations

import numpy as np

from dlcp.core import aggregate as aggregate_mod
from dlcp.core.aggregate import RunRejected, ShardAggregator
from dlcp.core.collector import ResultCollector
from dlcp.core.layout import Layout
from dlcp.core.timing import Timing
from dlcp.errors import RemoteError
from dlcp.wire import Codec, Flags
from dlcp.wire.batch import HEADER_DTYPE
from fuzz.harness import Input, target

SCALE = 0.5
_FLAGS = (0, int(Flags.DROPPABLE), int(Flags.DROPPABLE | Flags.LAST), int(Flags.LAST))


def _seeds(n: int) -> list[bytes]:
    rng = np.random.default_rng(n)
    return [rng.integers(0, 256, 600, dtype=np.uint8).tobytes() for _ in range(n)]


def _heads(inp: Input, offsets: list[int], counts: list[int]) -> np.ndarray:
    n = len(offsets)
    h = np.zeros(n, dtype=HEADER_DTYPE)
    h["offset"] = offsets
    h["count"] = counts
    h["flags"] = [_FLAGS[inp.uint(1) % 4] for _ in range(n)]
    h["priority"] = [inp.uint(1) % 8 for _ in range(n)]
    h["layer"] = [inp.uint(2) for _ in range(n)]
    h["aux"] = [inp.uint(4) for _ in range(n)]  # the block max's bits (data)
    h["param"] = np.frombuffer(inp.take(4 * n).ljust(4 * n, b"\0"), "<f4")  # results: the block max
    h["contributors"] = [inp.uint(1) % 5 + 1 for _ in range(n)]
    return h


def _lanes(inp: Input, count: int, width: int) -> bytes:
    n = count * width
    if inp.chance(64):  # a payload of the wrong length
        n = max(n + inp.uint(1) % 9 - 4, 0)
    return inp.take(n).ljust(n, b"\x3c")


def _same_state(a: ShardAggregator, b: ShardAggregator) -> None:
    for name in ("received", "droppable", "classes", "layers", "weight", "manifest"):
        assert np.array_equal(getattr(a, name), getattr(b, name)), name
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


def _layout(inp: Input, codec: Codec) -> Layout | None:
    per = 352 if codec == Codec.FP32 else 1024
    total = per * (inp.uint(1) % 24 + 1) + inp.uint(2) % per
    try:
        return Layout(total=total, codec=codec, shards=inp.uint(1) % 3 + 1, payload=1408)
    except ValueError:
        return None


@target(
    "bulk_data_run",
    covers=("_bulk.run_index", "_bulk.mark_data", "_bulk.add_runs", "_bulk.copy_runs"),
    seeds=lambda: _seeds(12),
)
def bulk_data_run(inp: Input) -> None:
    lay = _layout(inp, Codec.FP32)
    if lay is None:
        return
    shard = inp.below(lay.shards)
    summing = inp.chance(2)
    senders = [0, 1] if summing else [0, 1, 2]
    twins = []
    for _ in range(2):
        agg = ShardAggregator(layout=lay, shard=shard, senders=senders, now=0.0, timing=Timing())
        if summing:  # node 1's lanes held, node 0's packets summed into out as they come
            _, count = lay.shard_range(shard)
            agg.sum_into(np.full(count, np.nan, np.float32))
            n_pk = agg.n_packets
            own = np.arange(count, dtype="<f4")
            agg.on_local(sender=1, lanes=own.tobytes(), summed=False, weight=1,
                         droppable=np.zeros(n_pk, bool), scale=SCALE,
                         block_max=np.zeros(n_pk, np.float32), now=0.0)  # fmt: skip
        twins.append(agg)
    ref, fast = twins
    pk = lay.shard_packets(shard)
    lo, hi = max(pk.start - 2, 0), min(pk.stop + 2, lay.packets)
    for step in range(inp.uint(1) % 3 + 1):
        sender = 0 if summing else (0, 2)[inp.uint(1) % 2]
        if not summing and inp.chance(8):  # a manifest: the sender's droppable flags are final
            for agg in twins:
                agg.on_manifest(sender=2, droppable=np.ones(agg.n_packets, bool), bound=0.1,
                                now=1.0)  # fmt: skip
        offsets, counts = [], []
        for _ in range(inp.uint(1) % 24 + 1):
            off, count = lay.packet_range(lo + inp.below(hi - lo))
            r = inp.uint(1)
            if r < 10:
                off += r % lay.per_packet + 1  # off the grid
            elif r < 20:
                count += 1 if r % 2 else -1  # a count the layout does not have
            elif r < 25:
                off = lay.total + r - 20  # past the end
            offsets.append(off)
            counts.append(max(count, 0))
        heads = _heads(inp, offsets, counts)
        payloads = [_lanes(inp, c, 4) for c in counts]
        scale = SCALE * 3 if inp.chance(10) else SCALE
        kw = dict(sender=sender, payloads=payloads, summed=False, weight=2, scale=scale,
                  now=float(step))  # fmt: skip
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
            try:
                fast.on_data_run(heads=heads, **kw)  # type: ignore[arg-type]
            except RunRejected as got:
                assert got.reason == exc.reason and np.array_equal(got.bad, exc.bad)
            else:
                raise AssertionError("on_data_many rejected the run, on_data_run did not")
        except RemoteError as exc:  # a payload of the wrong length: the run refused
            try:
                fast.on_data_run(heads=heads, **kw)  # type: ignore[arg-type]
            except RemoteError as got:
                assert got.reason == exc.reason
            else:
                raise AssertionError(f"on_data_many raised {exc}, on_data_run did not")
            return  # the run stored in part: where each stopped is not defined
        else:
            stored, bad_fast = fast.on_data_run(heads=heads, **kw)  # type: ignore[arg-type]
            assert stored == int(fresh.sum())
            assert (bad_fast is None) == (not bad.any())
            if bad_fast is not None:
                assert np.array_equal(bad, bad_fast)
        _same_state(ref, fast)


@target(
    "bulk_result_run", covers=("_bulk.run_index", "_bulk.mark_results"), seeds=lambda: _seeds(8)
)
def bulk_result_run(inp: Input) -> None:
    codec = (Codec.FP32, Codec.THC8)[inp.uint(1) % 2]
    lay = _layout(inp, codec)
    if lay is None or lay.shards < 2:
        return
    owners = list(range(lay.shards))
    ref, fast = (
        ResultCollector(
            layout=lay, owners=owners, me=0, senders=lay.shards, now=0.0, timing=Timing()
        )
        for _ in range(2)
    )
    width = np.dtype(aggregate_mod.lane_ops.sum_dtype(lay.codec)).itemsize
    step_lanes = -(-lay.per_packet // lay.result_split)
    for step in range(inp.uint(1) % 3 + 1):
        shard = 1 + inp.below(lay.shards - 1)
        pk = lay.shard_packets(shard)
        ranges = [r for i in range(max(pk.start - 1, 0), pk.stop) for r in lay.result_ranges(i)]
        if not ranges:  # a shard without packets (more shards than packets)
            return
        offsets, counts = [], []
        for _ in range(inp.uint(1) % 20 + 1):
            off, count = ranges[inp.below(len(ranges))]
            r = inp.uint(1)
            if r < 10:
                off += r % step_lanes + 1  # not the start of a result packet
            elif r < 20:
                count += 1 if r % 2 else -1
            offsets.append(off)
            counts.append(max(count, 0))
        heads = _heads(inp, offsets, counts)
        payloads = [_lanes(inp, c, width) for c in counts]
        kw = dict(shard=shard, sender=shard, payloads=payloads, now=float(step))
        try:
            fresh, bad = ref.on_results_many(
                offsets=heads["offset"].astype(np.int64),
                counts=heads["count"].astype(np.int64),
                contributors=heads["contributors"].astype(np.int64),
                block_max=heads["param"].astype(np.float32),
                **kw,  # type: ignore[arg-type]
            )
        except RemoteError as exc:
            try:
                fast.on_result_run(heads=heads, **kw)  # type: ignore[arg-type]
            except RemoteError as got:
                assert got.reason == exc.reason
            else:
                raise AssertionError(f"on_results_many raised {exc}, on_result_run did not")
            return
        stored, bad_fast = fast.on_result_run(heads=heads, **kw)  # type: ignore[arg-type]
        assert stored == int(fresh.sum())
        assert (bad_fast is None) == (not bad.any())
        if bad_fast is not None:
            assert np.array_equal(bad, bad_fast)
        assert np.array_equal(ref.contributors, fast.contributors)
        assert ref.block_max.tobytes() == fast.block_max.tobytes()
        assert ref.duplicates == fast.duplicates
        assert sorted(ref.waiting) == sorted(fast.waiting)
        for s, w in ref.waiting.items():
            assert np.array_equal(w.received, fast.waiting[s].received)
            assert w.last_arrival == fast.waiting[s].last_arrival
        res = [r for i in pk for r in lay.result_ranges(i)]
        left = ref.waiting.get(shard)
        stored = (np.ones(len(res), bool) if left is None else left.received).tolist()
        for (off, count), here in zip(res, stored, strict=True):
            if here:
                assert (
                    ref.sums[off : off + count].tobytes() == fast.sums[off : off + count].tobytes()
                )
