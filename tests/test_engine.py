"""The aggregation core end to end in memory: several engines, one network."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from dlcp.core.engine import Engine, JobSpec, RoundComplete, RoundFailed, Send
from dlcp.core.layout import Layout
from dlcp.core.timing import NackClock, Timing, done_wait
from dlcp.errors import LocalError, Reason
from dlcp.wire import Codec, Flags, PacketType, decode
from tests.netsim import Network

KEY = b"k" * 32
JOB = 7


def cluster(hosts: int, *, timing: Timing | None = None, payload: int = 1408) -> dict[int, Engine]:
    engines = {}
    for me in range(hosts):
        e = Engine(timing=timing)
        e.add_job(JobSpec.transpose(JOB, KEY, me, hosts, payload=payload))
        engines[me] = e
    return engines


def smallest_norm_droppable(x: np.ndarray, lay: Layout, bound: float) -> np.ndarray:
    """Mark the smallest-norm packets droppable while their lane share stays <= bound."""
    counts = lay.packet_counts()
    norms = np.array(
        [np.linalg.norm(x[o : o + c]) for o, c in map(lay.packet_range, range(lay.packets))]
    )
    order = np.argsort(norms / np.sqrt(counts))
    share = np.cumsum(counts[order]) / lay.total
    drop = np.zeros(lay.packets, dtype=bool)
    drop[order[share <= bound]] = True
    return drop


def submit_all(
    net: Network, xs: list[np.ndarray], *, bound: float = 0.0, round: int = 0, payload: int = 1408
) -> Layout:
    """Every engine submits its `xs` row (`payload`: the jobs' payload budget)."""
    lay = Layout(total=xs[0].size, codec=Codec.FP32, shards=len(xs), payload=payload)
    for me, x in enumerate(xs):
        drop = smallest_norm_droppable(x, lay, bound) if bound else None
        net.engines[me].submit(
            job=JOB,
            round=round,
            bucket=0,
            codec=Codec.FP32,
            total=x.size,
            lanes=x.astype("<f4").tobytes(),
            droppable=drop,
            bound=bound,
            now=net.now,
        )
    return lay


def completions(net: Network) -> dict[int, RoundComplete]:
    out = {}
    for n, evs in net.events.items():
        for ev in evs:
            assert not isinstance(ev, RoundFailed), ev
            out[n] = ev
    return out


def test_lossless_fp32_equals_numpy_sum_exactly() -> None:
    rng = np.random.default_rng(1)
    xs = [rng.standard_normal(100_003).astype(np.float32) for _ in range(4)]
    net = Network(cluster(4), seed=1)
    submit_all(net, xs)
    net.run()
    done = completions(net)
    assert sorted(done) == [0, 1, 2, 3]
    expected = np.sum(np.stack(xs), axis=0)
    for ev in done.values():
        np.testing.assert_array_equal(ev.sums, expected)
        assert (ev.contributors == 4).all()
        assert ev.lost_lanes == 0


@pytest.mark.parametrize("hosts", [1, 2, 3, 5])
def test_host_counts(hosts: int) -> None:
    xs = [np.full(5000, h + 1, dtype=np.float32) for h in range(hosts)]
    net = Network(cluster(hosts), seed=hosts)
    submit_all(net, xs)
    net.run()
    done = completions(net)
    assert len(done) == hosts
    for ev in done.values():
        np.testing.assert_array_equal(ev.sums, np.full(5000, hosts * (hosts + 1) / 2, np.float32))


def test_four_hosts_4mb_bucket_with_loss_reordering_duplication() -> None:
    """The foundation's acceptance scenario: 4 hosts, 4 MB, 5 % loss, bound 10 %."""
    rng = np.random.default_rng(2)
    n = 1 << 20  # 4 MB of fp32
    scale = rng.uniform(0.01, 3.0, size=n).astype(np.float32)  # uneven magnitudes
    xs = [(rng.standard_normal(n) * scale).astype(np.float32) for _ in range(4)]
    bound = 0.10
    net = Network(cluster(4), seed=3, loss=0.05, duplicate=0.02)
    lay = submit_all(net, xs, bound=bound)
    droppable = [smallest_norm_droppable(x, lay, bound) for x in xs]
    net.run()
    done = completions(net)
    assert sorted(done) == [0, 1, 2, 3], "every host completes the round"
    first = done[0]
    for ev in done.values():  # replicas hold identical bytes
        assert ev.sums.tobytes() == first.sums.tobytes()
        np.testing.assert_array_equal(ev.contributors, first.contributors)
    # Every non-droppable contribution is in: a packet misses only droppable ones.
    may_miss = np.sum(droppable, axis=0)
    assert (first.contributors >= 4 - may_miss).all()
    # Packets with every contribution equal the exact sum in sender order.
    full = first.contributors == 4
    expected = np.sum(np.stack(xs), axis=0)
    for i in np.flatnonzero(full):
        o, c = lay.packet_range(int(i))
        np.testing.assert_array_equal(first.sums[o : o + c], expected[o : o + c])
    # Lost contributions count as zeros, never as stale memory: every lane is
    # finite (the accumulators start as NaN in tests), and where every droppable
    # contribution of a packet was lost the sum is exactly that of the others.
    assert np.isfinite(first.sums).all()
    checked = 0
    for i in np.flatnonzero(~full).tolist():
        miss = [bool(d[i]) for d in droppable]
        if 4 - int(first.contributors[i]) == sum(miss):
            o, c = lay.packet_range(i)
            rows = [np.where(m, np.float32(0), x[o : o + c]) for x, m in zip(xs, miss, strict=True)]
            np.testing.assert_array_equal(first.sums[o : o + c], np.sum(np.stack(rows), axis=0))
            checked += 1
    assert checked > 0
    # The lost share of droppable lanes stays within the bound.
    assert first.total_lanes == 4 * n
    assert first.lost_lanes / first.total_lanes <= bound
    assert net.lost > 0 and sum(e.stats["data_retransmits"] for e in net.engines.values()) > 0
    assert first.lost_lanes > 0, "with 5 % loss some droppable data should be left out"


def test_droppable_never_lost_when_bound_zero() -> None:
    rng = np.random.default_rng(4)
    xs = [rng.standard_normal(50_000).astype(np.float32) for _ in range(3)]
    net = Network(cluster(3), seed=5, loss=0.2)
    submit_all(net, xs, bound=0.0)
    net.run()
    done = completions(net)
    for ev in done.values():
        assert (ev.contributors == 3).all()
        np.testing.assert_array_equal(ev.sums, np.sum(np.stack(xs), axis=0))


def test_dropping_every_droppable_packet_still_completes_within_bound() -> None:
    """The droppable class is starved entirely (a congested scavenger queue)."""
    rng = np.random.default_rng(6)
    xs = [rng.standard_normal(200_000).astype(np.float32) for _ in range(4)]

    def starve(src: int, s) -> bool:  # type: ignore[no-untyped-def]
        return bool(s.droppable)

    net = Network(cluster(4), seed=6, drop=starve)
    submit_all(net, xs, bound=0.05)
    net.run()
    done = completions(net)
    assert len(done) == 4
    ev = done[0]
    assert 0 < ev.lost_lanes <= 0.05 * ev.total_lanes
    assert ev.contributors.min() < 4
    # every droppable packet sent was lost (a host's own shard is not sent):
    # their lanes sum the others' exactly
    lay = Layout(200_000, Codec.FP32, 4)
    drops = [smallest_norm_droppable(x, lay, 0.05) for x in xs]
    for h, d in enumerate(drops):
        pk = lay.shard_packets(h)  # host h owns shard h
        d[pk.start : pk.stop] = False
    rows = [
        np.where(np.repeat(d, lay.packet_counts()), np.float32(0), x)
        for x, d in zip(xs, drops, strict=True)
    ]
    np.testing.assert_array_equal(ev.sums, np.sum(np.stack(rows), axis=0))


def test_results_survive_heavy_loss_of_result_and_control_packets() -> None:
    xs = [np.arange(30_000, dtype=np.float32) * (h + 1) for h in range(3)]
    net = Network(cluster(3), seed=8, loss=0.3, duplicate=0.1)
    submit_all(net, xs)
    net.run()
    done = completions(net)
    assert len(done) == 3
    for ev in done.values():
        np.testing.assert_array_equal(ev.sums, np.arange(30_000, dtype=np.float32) * 6)


def test_a_shard_whose_results_all_vanish_is_asked_for() -> None:
    """Every first result packet and DONE from owner 1 to node 0 is lost (say,
    node 0's socket buffer overflowed while it was busy): node 0 has heard
    nothing of shard 1 at all, so it must ask for the DONE, not wait for the
    round to time out."""

    result_dones = 0

    def drop(src: int, s: Send) -> bool:
        nonlocal result_dones
        if src != 1 or s.node != 0:
            return False
        h = decode(s.datagram, {JOB: KEY})[0]
        if h.type == PacketType.RESULT:
            return not h.flags & Flags.RETRANSMIT
        if h.type == PacketType.DONE and h.flags & Flags.RESULT_LEG:
            result_dones += 1
            return result_dones <= 2  # the owner's two copies; an answer to a NACK passes
        return False

    xs = [np.arange(30_000, dtype=np.float32) * (h + 1) for h in range(3)]
    net = Network(cluster(3, timing=Timing(timeout=5.0, grace=0.05)), seed=3, drop=drop)
    submit_all(net, xs)
    net.run(until=10.0)
    done = completions(net)
    assert len(done) == 3
    assert net.engines[0].stats["result_nacks_sent"] > 0
    for ev in done.values():
        np.testing.assert_array_equal(ev.sums, np.arange(30_000, dtype=np.float32) * 6)


@pytest.mark.parametrize("leg", ["data", "result"])
def test_a_lost_done_pair_costs_answer_times_not_a_grace(leg: str) -> None:
    """Both copies of node 1's DONE to node 0 are lost in round 1, on the data leg
    (node 0 owns shard 0) or the result leg (node 1 owns shard 1), with one
    packet before them (a burst): node 0 cannot tell what is missing. Once
    its NACK clock for node 1 has been timed (round 0: node 1's first data
    or result packets to node 0 lost and re-sent), node 0 asks for the DONE
    after that answer time, a few milliseconds here, not after the 50 ms
    grace (which it still waits for a peer it has never timed). Virtual
    time: the round ends well within a grace of its start."""
    timing = Timing(timeout=5.0, grace=0.05)
    want = PacketType.DATA if leg == "data" else PacketType.RESULT
    dones = 0

    def drop(src: int, s: Send) -> bool:
        nonlocal dones
        if src != 1 or s.node != 0:
            return False
        h = decode(s.datagram, {JOB: KEY})[0]
        if h.round == 0:  # train the clock: lose node 1's first packets once
            return h.type == want and not h.flags & Flags.RETRANSMIT and h.offset % (7 * 352) == 0
        if h.type == PacketType.DONE and bool(h.flags & Flags.RESULT_LEG) == (leg == "result"):
            dones += 1
            return dones <= 2  # both copies; the answer to node 0's question passes
        # and one packet before them: without the DONE node 0 cannot tell what is
        # missing (on the result leg the shard's last, which no later one tells
        # lost: `dlcp.core.stream`)
        start, count = lay.shard_range(h.shard)
        one = start + 2 * 352 if leg == "data" else start + count - 352
        return h.type == want and not h.flags & Flags.RETRANSMIT and h.offset == one

    xs = [np.arange(30_000, dtype=np.float32) * (h + 1) for h in range(3)]
    net = Network(cluster(3, timing=timing), seed=5, drop=drop, delay=(0.0002, 0.0006))
    lay = submit_all(net, xs, round=0)
    net.run(until=10.0)
    assert len(completions(net)) == 3
    assert net.engines[0].stats[f"{leg}_nacks_sent"] > 0
    for events in net.events.values():
        events.clear()
    start = net.now
    submit_all(net, xs, round=1)
    net.run(until=start + 10.0, done=lambda: len(completions(net)) == 3)
    took = net.now - start  # when the last node completed
    done = completions(net)
    assert sorted(done) == [0, 1, 2] and dones > 2  # the DONE was asked for and came
    for ev in done.values():
        np.testing.assert_array_equal(ev.sums, np.arange(30_000, dtype=np.float32) * 6)
    assert took < timing.grace / 2, took


@pytest.mark.parametrize("trickle", [True, False])
def test_an_owner_still_sending_its_data_is_not_asked_for_its_results(trickle: bool) -> None:
    """Node 1 owns shard 1 and gets node 0's data only at 0.2 s (four graces),
    so it aggregates shard 1 then. Meanwhile its own datagrams for node
    0 come one every 4 ms until about 0.18 s (`trickle`), or all within 4 ms.
    Hearing node 1's data, node 0 knows it is still busy with the round and does
    not ask it for shard 1's results (node 1 would ignore the question: before,
    node 0 asked every grace from the round's start). Once node 1 has been
    quiet for a grace (not `trickle`) it is asked, as when all its results
    were lost. Either way the round completes with exact sums."""
    release = 0.2
    held: list[tuple[int, int, bytes]] = []  # (src, dst, datagram) before `release`

    def drop(src: int, s: Send) -> bool:
        dg = s.datagram if isinstance(s.datagram, bytes) else bytes(s.datagram)
        if net.now >= release or dg[3] == PacketType.NACK:  # node 0's questions go at once
            return False
        held.append((src, s.node, dg))
        return True

    xs = [np.arange(30_000, dtype=np.float32) * (h + 1) for h in range(2)]
    net = Network(cluster(2, timing=Timing(timeout=5.0, grace=0.05)), seed=6, drop=drop)
    submit_all(net, xs)
    net.flush_all()
    to_node0 = [dg for src, _dst, dg in held if src == 1]  # its data, then its manifest
    assert len(to_node0) > 40
    step = 0.004 if trickle else 0.004 / len(to_node0)
    for i, dg in enumerate(to_node0):
        net.deliver_at(0.001 + step * i, 1, 0, dg)
    for src, dst, dg in held:
        if src == 0:
            net.deliver_at(release, src, dst, dg)
    net.run(until=10.0)
    done = completions(net)
    assert sorted(done) == [0, 1]
    for ev in done.values():
        np.testing.assert_array_equal(ev.sums, np.arange(30_000, dtype=np.float32) * 3)
    asked = net.engines[0].stats["result_nacks_sent"]
    ignored = net.engines[1].stats["nacks_ignored"]
    if trickle:
        assert (asked, ignored) == (0, 0)
    else:
        assert asked > 0 and ignored > 0


def test_results_are_kept_for_a_receiver_cut_off_longer_than_retain() -> None:
    """Node 0 loses the first results of shard 1 and cannot reach node 1 for
    longer than `retain`: its NACKs get through only after that, and node 1 must
    still hold the results (until node 0 ACKs or its round times out)."""

    def drop(src: int, s: Send) -> bool:
        if src == 1 and s.node == 0:
            h = decode(s.datagram, {JOB: KEY})[0]
            return h.type == PacketType.RESULT and not h.flags & Flags.RETRANSMIT
        return src == 0 and s.node == 1 and net.now < 1.0  # cut off for 1 s > retain

    xs = [np.arange(30_000, dtype=np.float32) * (h + 1) for h in range(3)]
    timing = Timing(timeout=5.0, grace=0.05, retain=0.2)
    net = Network(cluster(3, timing=timing), seed=4)
    net.drop = drop
    submit_all(net, xs)
    net.run(until=10.0)
    done = completions(net)
    assert len(done) == 3
    for ev in done.values():
        np.testing.assert_array_equal(ev.sums, np.arange(30_000, dtype=np.float32) * 6)


def test_peer_that_never_submits_fails_with_reason() -> None:
    timing = Timing(timeout=0.5, grace=0.05)
    net = Network(cluster(3, timing=timing), seed=9)
    x = np.ones(10_000, np.float32)
    for me in (0, 1):  # host 2 is gone
        net.engines[me].submit(
            job=JOB, round=0, bucket=0, codec=Codec.FP32, total=x.size, lanes=x.tobytes(), now=0.0
        )
    net.run(until=5.0, done=lambda: bool(net.events[0] and net.events[1]))
    for me in (0, 1):
        (ev,) = net.events[me]
        assert isinstance(ev, RoundFailed)
        assert "2" in ev.reason
    assert net.now < 2.0, "failure is reported within the timeout, no hang"


def test_thc_lanes_sum_exactly_and_wide_result_lanes_split() -> None:
    hosts = 4
    lay = Layout(total=8192, codec=Codec.THC8, shards=hosts)
    assert lay.result_split == 2
    rng = np.random.default_rng(10)
    qs = [rng.integers(0, 256, size=lay.total, dtype=np.uint8) for _ in range(hosts)]
    net = Network(cluster(hosts), seed=10, loss=0.05)
    for me, q in enumerate(qs):
        net.engines[me].submit(
            job=JOB,
            round=0,
            bucket=0,
            codec=Codec.THC8,
            total=lay.total,
            lanes=q.tobytes(),
            scale=1.5,
            now=0.0,
        )
    net.run()
    done = completions(net)
    expected = np.sum(np.stack(qs).astype(np.uint16), axis=0)
    for ev in done.values():
        np.testing.assert_array_equal(ev.sums, expected)


def test_thc4_and_summed_local_contributions() -> None:
    lay = Layout(total=4096 * 2, codec=Codec.THC4, shards=2)
    q0 = np.full(lay.total, 15, np.uint8)
    from dlcp.codecs import lanes

    packed = lanes.pack(Codec.THC4, q0, summed=False)
    local_sum = np.full(lay.total, 30, np.uint16)  # two local ranks already summed
    net = Network(cluster(2), seed=11)
    net.engines[0].submit(
        job=JOB, round=0, bucket=0, codec=Codec.THC4, total=lay.total, lanes=packed, now=0.0
    )
    net.engines[1].submit(
        job=JOB,
        round=0,
        bucket=0,
        codec=Codec.THC4,
        total=lay.total,
        lanes=local_sum.astype("<u2").tobytes(),
        summed=True,
        weight=2,
        now=0.0,
    )
    net.run()
    for ev in completions(net).values():
        assert (ev.sums == 45).all()
        assert (ev.contributors == 3).all()


def test_scale_mismatch_between_senders_is_rejected() -> None:
    net = Network(cluster(2), seed=12)
    q = np.zeros(2048, np.uint8)
    for me, scale in ((0, 1.0), (1, 2.0)):
        net.engines[me].submit(
            job=JOB,
            round=0,
            bucket=0,
            codec=Codec.THC8,
            total=q.size,
            lanes=q.tobytes(),
            scale=scale,
            now=0.0,
        )
    net.run(until=1.0)
    rejected = sum(e.rejects[Reason.MISMATCH] for e in net.engines.values())
    assert rejected > 0


def test_many_rounds_and_buckets_interleaved_with_late_duplicates() -> None:
    net = Network(cluster(3), seed=13, loss=0.05, duplicate=0.2, delay=(0.0001, 0.01))
    rng = np.random.default_rng(13)
    expected = {}
    for rnd in range(5):
        for bucket in range(3):
            xs = [rng.standard_normal(3000).astype(np.float32) for _ in range(3)]
            expected[(rnd, bucket)] = np.sum(np.stack(xs), axis=0)
            for me, x in enumerate(xs):
                net.engines[me].submit(
                    job=JOB,
                    round=rnd,
                    bucket=bucket,
                    codec=Codec.FP32,
                    total=x.size,
                    lanes=x.tobytes(),
                    now=net.now,
                )
        net.run(until=net.now + 0.001)
    net.run()
    for evs in net.events.values():
        got = {(e.round, e.bucket): e for e in evs}
        assert len(got) == 15
        for k, ev in got.items():
            assert isinstance(ev, RoundComplete)
            np.testing.assert_array_equal(ev.sums, expected[k])
    assert sum(e.stats["late_packets"] + e.stats["duplicate_packets"] for e in net.engines.values())


def test_spoofed_sender_and_wrong_key_are_rejected_and_change_nothing() -> None:
    engines = cluster(2)
    intruder = Engine()
    intruder.add_job(JobSpec.transpose(JOB, b"x" * 32, 1, 2))
    x = np.ones(1000, np.float32)
    intruder.submit(
        job=JOB,
        round=0,
        bucket=0,
        codec=Codec.FP32,
        total=x.size,
        lanes=(x * 99).tobytes(),
        now=0.0,
    )
    for s in intruder.datagrams_to_send():
        engines[0].receive(s.datagram, 0.0, src=1)
    assert engines[0].rejects[Reason.BAD_MAC] > 0
    # A real member's packet arriving from another member's address.
    engines[1].submit(
        job=JOB, round=0, bucket=0, codec=Codec.FP32, total=x.size, lanes=x.tobytes(), now=0.0
    )
    sends = engines[1].datagrams_to_send()
    engines[0].receive(sends[0].datagram, 0.0, src=5)
    assert engines[0].rejects[Reason.BAD_SENDER] == 1
    for s in sends:
        engines[0].receive(s.datagram, 0.0, src=1)
    engines[0].submit(
        job=JOB, round=0, bucket=0, codec=Codec.FP32, total=x.size, lanes=x.tobytes(), now=0.0
    )
    net = Network(engines)
    net.run()
    for ev in completions(net).values():
        np.testing.assert_array_equal(ev.sums, x * 2)


def test_stale_rounds_rejected() -> None:
    engines = cluster(2)
    e0, e1 = engines[0], engines[1]
    x = np.ones(100, np.float32)
    e1.submit(job=JOB, round=0, bucket=0, codec=Codec.FP32, total=100, lanes=x.tobytes(), now=0.0)
    old = [s.datagram for s in e1.datagrams_to_send()]
    e1.submit(
        job=JOB, round=1000, bucket=0, codec=Codec.FP32, total=100, lanes=x.tobytes(), now=0.0
    )
    for s in e1.datagrams_to_send():
        e0.receive(s.datagram, 0.0)
    for dg in old:
        e0.receive(dg, 0.0)
    assert e0.rejects[Reason.STALE_ROUND] == len(old)


def test_submit_validation() -> None:
    e = cluster(2)[0]
    x = np.ones(100, np.float32).tobytes()
    with pytest.raises(LocalError, match="unknown job"):
        e.submit(job=1, round=0, bucket=0, codec=Codec.FP32, total=100, lanes=x, now=0.0)
    with pytest.raises(LocalError, match="bytes of lanes"):
        e.submit(job=JOB, round=0, bucket=0, codec=Codec.FP32, total=101, lanes=x, now=0.0)
    with pytest.raises(LocalError, match="loss bound"):
        e.submit(
            job=JOB, round=0, bucket=0, codec=Codec.FP32, total=100, lanes=x, bound=0.9, now=0.0
        )
    e.submit(job=JOB, round=0, bucket=0, codec=Codec.FP32, total=100, lanes=x, now=0.0)
    with pytest.raises(LocalError, match="already submitted"):
        e.submit(job=JOB, round=0, bucket=0, codec=Codec.FP32, total=100, lanes=x, now=0.0)


def test_droppable_and_last_flags_on_the_wire() -> None:
    e = cluster(2)[0]
    x = np.arange(10_000, dtype=np.float32)
    lay = Layout(total=x.size, codec=Codec.FP32, shards=2)
    drop = np.zeros(lay.packets, bool)
    drop[lay.shard_packets(1).start] = True
    e.submit(
        job=JOB,
        round=0,
        bucket=0,
        codec=Codec.FP32,
        total=x.size,
        lanes=x.tobytes(),
        droppable=drop,
        bound=0.1,
        now=0.0,
    )
    heads = [decode(s.datagram, {JOB: KEY})[0] for s in e.datagrams_to_send()]
    data = [h for h in heads if h.type == 1]
    assert data[0].flags & Flags.DROPPABLE
    assert data[-1].flags & Flags.LAST
    assert sum(bool(h.flags & Flags.DROPPABLE) for h in data) == 1


def _owner_shard(out: np.ndarray | None, held: bool) -> tuple[np.ndarray, np.ndarray, object]:
    """Shard 0 of a 2-host fp32 bucket summed by its owner (node 0): node 0's
    lanes local (held by reference when `held`, else sent like a peer's), node
    1's as data packets. Returns (sums, expected, the completed aggregator)."""
    from dlcp.core.aggregate import ShardAggregator

    lay = Layout(total=5000, codec=Codec.FP32, shards=2, payload=1408)
    off, n = lay.shard_range(0)
    pk = lay.shard_packets(0)
    rng = np.random.default_rng(12)
    xs = [rng.standard_normal(n).astype("<f4") for _ in range(2)]
    agg = ShardAggregator(layout=lay, shard=0, senders=[0, 1], now=0.0, timing=Timing())
    if out is not None:
        agg.sum_into(out)
    nothing = np.zeros(len(pk), dtype=bool)
    starts = np.array([lay.packet_range(i)[0] for i in pk], dtype=np.int64)
    counts = np.array([lay.packet_range(i)[1] for i in pk], dtype=np.int64)
    for node, x in enumerate(xs):
        if node == 0 and held:
            agg.on_local(sender=0, lanes=x.tobytes(), summed=False, weight=1, droppable=nothing,
                         scale=0.0, block_max=np.zeros(len(pk), np.float32), now=0.0)  # fmt: skip
            continue
        payloads = [x[a - off : a - off + c].tobytes() for a, c in zip(starts, counts, strict=True)]
        agg.on_data_many(sender=node, offsets=starts, counts=counts, payloads=payloads,
                         summed=False, weight=1, droppable=nothing, scale=0.0,
                         block_max=np.zeros(len(pk), np.float32), now=0.0)  # fmt: skip
    for node in range(2):
        agg.on_manifest(sender=node, droppable=nothing, bound=0.0, now=0.0)
    _, finished = agg.poll(1.0)
    assert finished and agg.result is not None
    return agg.result.sums, xs[0] + xs[1], agg


@pytest.mark.parametrize("held", [True, False])
def test_owner_sums_a_shard_into_the_collector_without_a_copy(held: bool) -> None:
    from dlcp.core.collector import ResultCollector

    lay = Layout(total=5000, codec=Codec.FP32, shards=2, payload=1408)
    alone, want, _ = _owner_shard(None, held)
    col = ResultCollector(layout=lay, owners=[0, 1], me=0, senders=2, now=0.0, timing=Timing())
    target = col.shard_sums(0)
    sums, _, agg = _owner_shard(target, held)
    assert sums is target and np.shares_memory(sums, col.sums)
    assert sums.tobytes() == alone.tobytes() == want.tobytes()  # same sums, same order
    col.on_local(agg.result)  # type: ignore[attr-defined]
    off, n = lay.shard_range(0)
    assert col.sums[off : off + n].tobytes() == want.tobytes()
    # a result summed elsewhere is copied in
    other = ResultCollector(layout=lay, owners=[0, 1], me=0, senders=2, now=0.0, timing=Timing())
    _, _, separate = _owner_shard(None, held)
    other.on_local(separate.result)  # type: ignore[attr-defined]
    assert other.sums[off : off + n].tobytes() == want.tobytes()


def test_results_land_in_the_callers_out_and_retransmissions_survive_its_reuse() -> None:
    """With `out` (the rank's mapped result lanes in dlcpd) results are stored
    there and RoundComplete.sums is `out`, the owner's own shard included. Once
    the round completes the caller reuses `out` (here: NaN over it), and a peer
    that lost result packets of that shard must still get the true sums: the
    owner resends them from the datagrams it sent, not from `out`."""
    rng = np.random.default_rng(21)
    xs = [rng.standard_normal(40_000).astype(np.float32) for _ in range(2)]
    lost = {"n": 0}

    def drop(src: int, s: Send) -> bool:  # node 0's first copies of 5 result packets
        dg = s.datagram
        if src == 0 and dg[3] == 2 and not dg[4] & Flags.RETRANSMIT and lost["n"] < 5:
            lost["n"] += 1
            return True
        return False

    net = Network(cluster(2), seed=21, drop=drop)
    outs = [np.full(x.size, np.nan, np.float32) for x in xs]
    seen: dict[int, bytes] = {}

    def reuse_out() -> bool:  # the moment node 0 completes, its caller takes `out` back
        for ev in net.events[0]:
            if isinstance(ev, RoundComplete) and 0 not in seen:
                assert ev.sums is outs[0]
                seen[0] = ev.sums.tobytes()
                outs[0][:] = np.nan
        return False

    for me, x in enumerate(xs):
        net.engines[me].submit(job=JOB, round=0, bucket=0, codec=Codec.FP32, total=x.size,
                               lanes=x.tobytes(), now=0.0, out=outs[me])  # fmt: skip
    net.run(done=reuse_out)
    reuse_out()
    done = completions(net)
    want = (xs[0] + xs[1]).tobytes()
    assert lost["n"] == 5 and net.engines[1].stats["result_nacks_sent"] > 0
    assert seen[0] == want
    assert done[1].sums is outs[1] and done[1].sums.tobytes() == want
    with pytest.raises(LocalError, match="lanes"):  # not the bucket's lanes of its sum dtype
        net.engines[0].submit(job=JOB, round=1, bucket=0, codec=Codec.FP32, total=xs[0].size,
                              lanes=xs[0].tobytes(), now=net.now,
                              out=np.zeros(xs[0].size, np.float64))  # fmt: skip


def test_an_owner_encodes_its_results_once_for_every_receiver() -> None:
    """Result datagrams name no receiver, so an owner sends one set of them to
    each of its receivers (the same objects, not a re-encoding each); a
    retransmission is a new datagram with the RETRANSMIT flag and the same lanes."""
    rng = np.random.default_rng(5)
    xs = [rng.standard_normal(30_000).astype(np.float32) for _ in range(3)]
    to: dict[int, list[bytes]] = {1: [], 2: []}
    lost: list[bytes] = []

    def watch(src: int, s: Send) -> bool:
        dg = s.datagram
        if src == 0 and dg[3] == 2 and dg[20:22] == b"\0\0":  # RESULT packets of shard 0
            if dg[4] & Flags.RETRANSMIT:
                assert s.node == 2 and any(dg[64:] == d[64:] for d in lost)
                return False
            to[s.node].append(dg)
            if s.node == 2 and len(lost) < 3:  # node 2 loses three: it NACKs them
                lost.append(dg)
                return True
        return False

    net = Network(cluster(3), seed=5, drop=watch)
    submit_all(net, xs)
    net.run()
    done = completions(net)
    want = (xs[0] + xs[1] + xs[2]).tobytes()
    assert sorted(done) == [0, 1, 2] and all(ev.sums.tobytes() == want for ev in done.values())
    assert to[1] and len(to[1]) == len(to[2])
    assert all(a is b for a, b in zip(to[1], to[2], strict=True))
    assert net.engines[0].stats["result_retransmits"] == 3


def test_sum_into_refuses_a_wrong_target() -> None:
    from dlcp.core.aggregate import ShardAggregator

    lay = Layout(total=5000, codec=Codec.FP32, shards=2, payload=1408)
    agg = ShardAggregator(layout=lay, shard=0, senders=[0, 1], now=0.0, timing=Timing())
    n = lay.shard_range(0)[1]
    with pytest.raises(LocalError, match="lanes"):
        agg.sum_into(np.zeros(n + 1, np.float32))
    with pytest.raises(LocalError, match="lanes"):
        agg.sum_into(np.zeros(n, np.float64))
    _, _, done = _owner_shard(np.zeros(n, np.float32), True)
    with pytest.raises(LocalError, match="completed"):
        done.sum_into(np.zeros(n, np.float32))  # type: ignore[attr-defined]


def test_rounds_reuse_large_buffers_and_sum_exactly(monkeypatch: pytest.MonkeyPatch) -> None:
    """Buckets over a MiB take their accumulators from reused buffers once the
    previous round's are free; each round's sums are still exact (the buffers
    start poisoned in tests, so a lane left from the last round would show)."""
    from dlcp.core import accumulator
    from dlcp.core.buffers import SpareBuffers

    monkeypatch.setattr(accumulator, "_SPARE", SpareBuffers())  # none held by other tests
    rng = np.random.default_rng(13)
    net = Network(cluster(2), seed=13, loss=0.02)
    before = accumulator._SPARE.reused
    for rnd in range(3):
        xs = [rng.standard_normal(600_000).astype(np.float32) for _ in range(2)]
        submit_all(net, xs, round=rnd)
        net.run()
        done = completions(net)
        assert sorted(done) == [0, 1]
        for ev in done.values():
            assert ev.sums.tobytes() == (xs[0] + xs[1]).tobytes()
        del done
    assert accumulator._SPARE.reused > before


@pytest.mark.parametrize("one_by_one", [False, True])
def test_owner_sums_a_peers_packets_as_they_arrive(one_by_one: bool) -> None:
    """With its own lanes held and `out` set, a 2-sender fp32 shard's owner adds
    the peer's packets to its lanes as they arrive (no copy into `slots`, no
    second pass); packets that never came (droppable, within the bound) leave
    the owner's lanes there. Sums, contributor counts and lost lanes are those
    of the aggregator that stores first and sums at the end; a peer whose
    packets all came before the owner's own lanes is stored and summed as
    before, and one whose first packets came before them has those summed
    when the next arrives and the rest as they arrive."""
    from dlcp.core.aggregate import ShardAggregator

    lay = Layout(total=9000, codec=Codec.FP32, shards=2, payload=1408)
    off, n = lay.shard_range(1)
    pk = lay.shard_packets(1)
    rng = np.random.default_rng(31)
    mine, theirs = (rng.standard_normal(n).astype("<f4") for _ in range(2))
    starts = np.array([lay.packet_range(i)[0] for i in pk], dtype=np.int64)
    counts = np.array([lay.packet_range(i)[1] for i in pk], dtype=np.int64)
    droppable = np.zeros(len(pk), dtype=bool)
    droppable[[1, 2, 4]] = True
    arrive = [k for k in range(len(pk)) if k not in (1, 2)]  # two droppable ones lost

    def run(out: np.ndarray | None, before: int) -> ShardAggregator:
        """`before`: the peer's parts that arrive before the owner's own lanes."""
        agg = ShardAggregator(layout=lay, shard=1, senders=[0, 1], now=0.0, timing=Timing())
        if out is not None:
            agg.sum_into(out)

        def local() -> None:
            agg.on_local(sender=1, lanes=mine.tobytes(), summed=False, weight=1,
                         droppable=np.zeros(len(pk), bool), scale=0.0,
                         block_max=np.zeros(len(pk), np.float32), now=0.0)  # fmt: skip

        parts = [[k] for k in arrive] if one_by_one else [arrive[:3], arrive[3:]]
        for i, part in enumerate(parts):
            if i == before:
                local()
            p = [theirs[starts[k] - off : starts[k] - off + counts[k]].tobytes() for k in part]
            agg.on_data_many(sender=0, offsets=starts[part], counts=counts[part], payloads=p,
                             summed=False, weight=1, droppable=droppable[part], scale=0.0,
                             block_max=np.zeros(len(part), np.float32), now=0.0)  # fmt: skip
        if before >= len(parts):
            local()
        agg.on_manifest(sender=0, droppable=droppable, bound=0.1, now=0.0)
        agg.on_manifest(sender=1, droppable=np.zeros(len(pk), bool), bound=0.1, now=0.0)
        agg.poll(0.0)
        _, finished = agg.poll(1.0)
        assert finished and agg.result is not None
        return agg

    want = mine + theirs
    for k in (1, 2):  # what never came counts as zero
        a = starts[k] - off
        want[a : a + counts[k]] = mine[a : a + counts[k]]
    stored = run(None, 0)
    assert stored.acc.summed_row is None
    out = np.full(n, np.nan, np.float32)  # every lane must be written
    summed = run(out, 0)
    assert summed.acc.summed_row == (0 if lanes_native() else None)
    late = run(np.full(n, np.nan, np.float32), 99)  # the peer before the owner's own lanes
    assert late.acc.summed_row is None
    halfway = run(np.full(n, np.nan, np.float32), 1)  # its first part before them
    assert halfway.acc.summed_row == (0 if lanes_native() else None)
    for agg in (stored, summed, late, halfway):
        r = agg.result
        assert r is not None
        assert r.sums.tobytes() == want.tobytes()
        assert r.contributors.tolist() == [1 if k in (1, 2) else 2 for k in range(len(pk))]
        assert r.lost_lanes == int(counts[[1, 2]].sum())
    assert summed.result is not None and summed.result.sums is out


def lanes_native() -> bool:
    from dlcp.codecs import lanes

    return lanes._bulk is not None


# -- gathered sends (Engine(gather=True)): payloads read in place ------------


def _gathered_supported() -> bool:
    from dlcp.wire import mac

    return mac._ghash is not None


gathered = pytest.mark.skipif(
    not _gathered_supported(), reason="dlcp.wire._ghash (the C MAC) is not built"
)


def gather_cluster(hosts: int, timing: Timing | None = None) -> dict[int, Engine]:
    engines = {}
    for me in range(hosts):
        e = Engine(timing=timing, gather=True)
        e.add_job(JobSpec.transpose(JOB, KEY, me, hosts, mac="ghash-aes"))
        engines[me] = e
    return engines


def _submit_out(net: Network, xs: list[np.ndarray], outs: list[np.ndarray], **kw: object) -> None:
    for me, x in enumerate(xs):
        net.engines[me].submit(job=JOB, round=0, bucket=0, codec=Codec.FP32, total=x.size,
                               lanes=x, now=net.now, out=outs[me], **kw)  # type: ignore[arg-type]  # fmt: skip


@gathered
def test_gathered_datagrams_are_the_same_bytes_and_rounds_the_same_sums() -> None:
    """Data and result datagrams read their payloads in place (a Gathered is
    the header bytes and a view), byte for byte what the copying encoder
    makes; four hosts with loss, reordering and duplication sum exactly."""
    from dlcp.wire import _ghash  # type: ignore[attr-defined]

    rng = np.random.default_rng(31)
    xs = [rng.standard_normal(70_001).astype(np.float32) for _ in range(4)]
    kinds: set[str] = set()
    both = {"copied": Engine(), "gathered": Engine(gather=True)}
    for e in both.values():
        e.add_job(JobSpec.transpose(JOB, KEY, 0, 2, mac="ghash-aes"))
        e.submit(job=JOB, round=0, bucket=0, codec=Codec.FP32, total=xs[0].size,
                 lanes=xs[0], now=0.0)  # fmt: skip
    a, b = (e.datagrams_to_send() for e in both.values())
    assert [s.datagram for s in a] == [bytes(s.datagram) for s in b]
    assert any(isinstance(s.datagram, _ghash.Gathered) for s in b)

    def watch(src: int, s: Send) -> bool:
        if isinstance(s.datagram, _ghash.Gathered):
            kinds.add(s.kind)
        return False

    net = Network(gather_cluster(4), seed=31, loss=0.03, duplicate=0.02, drop=watch)
    submit_all(net, xs)
    net.run()
    done = completions(net)
    want = (xs[0] + xs[1] + xs[2] + xs[3]).tobytes()
    assert sorted(done) == [0, 1, 2, 3] and all(ev.sums.tobytes() == want for ev in done.values())
    assert kinds == {"data", "result"}


@gathered
def test_a_completion_waits_for_the_acks_of_results_sent_from_out() -> None:
    """An owner's result datagrams read its caller's `out` in place, and the
    caller may reuse `out` once its round completes. The receivers' ACKs
    usually come a moment later, so the completion waits for them (up to
    `ack_wait`) instead of copying the shard's results aside."""
    rng = np.random.default_rng(32)
    xs = [rng.standard_normal(50_000).astype(np.float32) for _ in range(2)]
    outs = [np.zeros(x.size, np.float32) for x in xs]
    net = Network(gather_cluster(2), seed=32)
    _submit_out(net, xs, outs)
    net.run()
    done = completions(net)
    want = (xs[0] + xs[1]).tobytes()
    assert sorted(done) == [0, 1] and all(o.tobytes() == want for o in outs)
    stats = [e.stats for e in net.engines.values()]
    assert sum(s["completions_held"] for s in stats) >= 1
    assert all(s["gathered_bytes_copied"] == 0 for s in stats)
    assert all(e.pending_rounds() == 0 for e in net.engines.values())


@gathered
@pytest.mark.parametrize("ack_wait", [0.0, 0.01])
def test_results_sent_from_out_are_copied_before_out_is_handed_back(ack_wait: float) -> None:
    """No ACK comes for node 0's result shard (node 1's are all lost) and node
    1 lost some of its result packets: node 0 completes after `ack_wait` (at
    once with 0), its datagrams having copied their payloads first. Its caller
    then overwrites `out` with NaN; the retransmissions node 1 asks for still
    carry the true sums."""
    rng = np.random.default_rng(33)
    xs = [rng.standard_normal(40_000).astype(np.float32) for _ in range(2)]
    outs = [np.zeros(x.size, np.float32) for x in xs]
    lost = {"results": 0}

    def drop(src: int, s: Send) -> bool:
        dg = s.datagram
        if src == 1 and dg[3] == 5:  # every ACK from node 1
            return True
        if src == 0 and dg[3] == 2 and not dg[4] & Flags.RETRANSMIT and lost["results"] < 4:
            lost["results"] += 1
            return True
        return False

    net = Network(gather_cluster(2, Timing(ack_wait=ack_wait)), seed=33, drop=drop)
    _submit_out(net, xs, outs)

    def reuse_out() -> bool:
        if any(isinstance(ev, RoundComplete) for ev in net.events[0]) and not np.isnan(outs[0][0]):
            outs[0][:] = np.nan  # the caller's next use of the buffer
        return False

    net.run(done=reuse_out)
    done = completions(net)
    want = (xs[0] + xs[1]).tobytes()
    e0 = net.engines[0]
    assert lost["results"] == 4 and net.engines[1].stats["result_nacks_sent"] > 0
    assert sorted(done) == [0, 1] and np.isnan(outs[0]).all()
    assert outs[1].tobytes() == want
    shard0 = Layout(total=xs[0].size, codec=Codec.FP32, shards=2).shard_range(0)[1]
    assert e0.stats["gathered_bytes_copied"] == 4 * shard0
    assert e0.stats["completions_held"] == (1 if ack_wait else 0)


@gathered
def test_a_settled_rounds_datagrams_are_freed_by_drop_settled() -> None:
    """A round's end hands the caller its buffers back at once but leaves
    freeing its datagrams to `drop_settled` (the daemon calls it once its
    ranks are told): each round's list keeps its datagrams until then, and
    no more than the last _SETTLED_MAX rounds' wait."""
    from dlcp.core import rounds as rounds_mod
    from dlcp.wire import _ghash  # type: ignore[attr-defined]

    rng = np.random.default_rng(35)
    rounds = rounds_mod._SETTLED_MAX + 2
    firsts: dict[int, bytes] = {}  # round -> node 0's first data datagram of it

    def watch(src: int, s: Send) -> bool:
        dg = s.datagram
        if src == 0 and s.kind == "data" and isinstance(dg, _ghash.Gathered):
            firsts.setdefault(int.from_bytes(bytes(dg)[12:16], "big"), dg)
        return False

    net = Network(gather_cluster(2), seed=35, drop=watch)
    for r in range(rounds):
        xs = [rng.standard_normal(20_000).astype(np.float32) for _ in range(2)]
        submit_all(net, xs, round=r)
        net.run()
        assert sorted(completions(net)) == [0, 1]
    assert sorted(firsts) == list(range(rounds))
    before = {r: sys.getrefcount(dg) for r, dg in firsts.items()}
    net.engines[0].drop_settled()
    after = {r: sys.getrefcount(dg) for r, dg in firsts.items()}
    # the oldest rounds' lists went when later rounds settled; each of the
    # last _SETTLED_MAX held its datagrams until now
    freed_early = rounds - rounds_mod._SETTLED_MAX
    assert [before[r] - after[r] for r in range(rounds)] == [0] * freed_early + [1] * (
        rounds - freed_early
    )
    net.engines[0].drop_settled()  # nothing left: a second call changes nothing
    assert {r: sys.getrefcount(dg) for r, dg in firsts.items()} == after


@gathered
def test_queued_data_datagrams_copy_their_lanes_when_the_round_ends() -> None:
    """Droppable data packets still queued (here: held by the test) when the
    round completes without them copy their payloads then, so the caller can
    reuse its lanes; those no longer held anywhere are left alone."""
    from dlcp.wire import _ghash  # type: ignore[attr-defined]

    rng = np.random.default_rng(34)
    xs = [rng.standard_normal(60_000).astype(np.float32) for _ in range(2)]
    queued: list[tuple[Send, bytes]] = []

    def drop(src: int, s: Send) -> bool:
        if src == 0 and s.droppable and isinstance(s.datagram, _ghash.Gathered):
            queued.append((s, bytes(s.datagram)))  # a queue that never drains
            return True
        return False

    net = Network(gather_cluster(2), seed=34, drop=drop)
    lay = Layout(total=xs[0].size, codec=Codec.FP32, shards=2)
    for me, x in enumerate(xs):  # the arrays themselves: node 0's lanes are read in place
        net.engines[me].submit(job=JOB, round=0, bucket=0, codec=Codec.FP32, total=x.size,
                               lanes=x, droppable=smallest_norm_droppable(x, lay, 0.1),
                               bound=0.1, now=0.0)  # fmt: skip
    net.run()
    done = completions(net)
    assert sorted(done) == [0, 1] and queued
    copied = net.engines[0].stats["gathered_bytes_copied"]
    assert copied == sum(len(dg) - 64 for _s, dg in queued)
    xs[0][:] = np.nan  # the caller reuses its lanes
    assert all(bytes(s.datagram) == dg for s, dg in queued)


def test_a_nack_for_more_packets_than_one_datagram_holds_goes_in_parts() -> None:
    """Every first copy of node 1's result leg is lost: node 0's NACK names
    more packets than one datagram of the job's payload budget holds. It goes
    as several NACKs, each within the budget (one IP packet), that together
    name every lost packet; the round completes with exact sums. (A NACK was
    one datagram: over about 16,000 lost packets it could not be encoded,
    and the error stopped the engine's timers.)"""
    payload = 64  # 16 lanes a packet; 16 packet indices a NACK
    rng = np.random.default_rng(5)
    xs = [rng.standard_normal(3_000).astype(np.float32) for _ in range(2)]
    lost: list[int] = []
    nacks: list[tuple[int, int, np.ndarray]] = []

    def drop(src: int, s: Send) -> bool:
        dg = s.datagram if isinstance(s.datagram, bytes) else bytes(s.datagram)
        if dg[3] == 3:  # a NACK: what it asks for
            h, body = decode(dg, {JOB: net.engines[src].keys[JOB]})
            nacks.append((src, h.offset, np.frombuffer(body, ">u4")))
            assert len(body) <= payload and h.count == len(body) // 4
        if src == 1 and dg[3] == 2 and not dg[4] & Flags.RETRANSMIT:
            lost.append(1)
            return True
        return False

    net = Network(cluster(2, payload=payload), seed=3, drop=drop)
    submit_all(net, xs)
    net.run()
    done = completions(net)
    want = xs[0] + xs[1]
    assert sorted(done) == [0, 1]
    for ev in done.values():
        np.testing.assert_array_equal(ev.sums, want)
    mine = [(off, idx) for src, off, idx in nacks if src == 0]
    named = np.concatenate([idx for _, idx in mine]).tolist()
    # node 1's whole result leg was lost (local indices 0..n-1), and asked for
    # in parts of at most 16 packets, each part a packet of its own (offsets)
    assert len(lost) > 16 and len(mine) >= -(-len(lost) // 16)
    assert set(named) == set(range(len(lost)))
    assert len({off for off, _ in mine}) > 1
    assert net.engines[0].stats["result_nacks_sent"] == len(mine)


def test_an_error_in_one_rounds_timer_fails_that_round_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A bug met while a timer handles one round (here: its NACK cannot be
    sent) fails that round with the error as its reason; it does not escape
    `handle_timer`, and the other rounds go on to complete."""
    rng = np.random.default_rng(8)
    xs = [rng.standard_normal(2_000).astype(np.float32) for _ in range(2)]

    def drop(src: int, s: Send) -> bool:  # node 1's first result copies, both buckets
        dg = s.datagram if isinstance(s.datagram, bytes) else bytes(s.datagram)
        return src == 1 and dg[3] == 2 and not dg[4] & Flags.RETRANSMIT

    net = Network(cluster(2), seed=4, drop=drop)
    e0 = net.engines[0]
    send_nack = e0.emitter.nack

    def broken(spec: JobSpec, op: tuple[int, int, int], *a: object, **kw: object) -> None:
        if op[2] == 0:
            raise ValueError("cannot encode")
        send_nack(spec, op, *a, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(e0.emitter, "nack", broken)
    for bucket in (0, 1):
        for me, x in enumerate(xs):
            net.engines[me].submit(job=JOB, round=0, bucket=bucket, codec=Codec.FP32,
                                   total=x.size, lanes=x.tobytes(), now=0.0)  # fmt: skip
    net.run()
    failed = [ev for ev in net.events[0] if isinstance(ev, RoundFailed)]
    assert [(ev.bucket, ev.reason) for ev in failed] == [(0, "internal error: cannot encode")]
    assert e0.stats["internal_errors"] == 1 and e0.last_error == "cannot encode"
    done = {(n, ev.bucket): ev for n, evs in net.events.items() for ev in evs
            if isinstance(ev, RoundComplete)}  # fmt: skip
    assert sorted(done) == [(0, 1), (1, 0), (1, 1)]
    for ev in done.values():
        np.testing.assert_array_equal(ev.sums, xs[0] + xs[1])


def _next_timer_reference(agg) -> float | None:  # type: ignore[no-untyped-def]
    """`ShardAggregator.next_timer` as it was first written: the whole
    required-missing mask and every row's checks on each call (since then:
    packets found lost by later arrivals are asked for `reorder` after, and
    a row's missing packets are asked for again each after its own ask)."""
    if agg.result is not None:
        return None
    times = [agg.created + agg.timing.timeout]
    if agg.done_at is not None:
        return min(times[0], agg.done_at + agg.timing.linger)
    required = ~agg.received & ~agg.droppable
    short = agg.manifest.all() and not required.any()
    quiet = agg.last_arrival + agg.timing.nack_delay
    for row in range(len(agg.senders)):
        stream = agg.clock.streams[row]
        if stream.pending:
            times.append(stream.pending[0][0] + agg.timing.reorder)
        wait = agg.clock.repeat_after(row)
        again = agg.last_nack[row] + wait
        if agg.manifest[row]:
            if required[row].any():
                first = float(stream.asked[required[row]].min()) + wait
                times.append(max(first, quiet))
            elif short and not agg.received[row].all():
                times.append(max(again, quiet))
        else:  # changed: a timed sender whose packets came is asked after its answer time
            wait = done_wait(agg.clocks.get(agg.senders[row]), agg.timing)
            if wait < agg.timing.grace and agg.received[row].any():
                times.append(max(again, agg.last_arrival + wait))
            else:
                times.append(
                    max(again, agg.created + agg.timing.grace, agg.last_arrival + agg.timing.grace)
                )
    return min(times)


@pytest.mark.parametrize("seed", range(40))
def test_a_shards_next_timer_is_the_whole_masks_answer(seed: int) -> None:
    """`next_timer`, which looks at a sender's row only where its answer can
    arm a time, gives the time the whole required-missing mask gives, through
    rounds of arrivals, manifests (some packets droppable, a bound) and polls."""
    from dlcp.core.aggregate import ShardAggregator

    rng = np.random.default_rng(seed)
    lay = Layout(total=3000, codec=Codec.FP32, shards=2, payload=128)
    pk = lay.shard_packets(0)
    n = len(pk)
    starts = np.array([lay.packet_range(i)[0] for i in pk], dtype=np.int64)
    counts = np.array([lay.packet_range(i)[1] for i in pk], dtype=np.int64)
    clocks = {}
    if seed % 2:  # senders whose answers to NACKs have been timed: shorter repeats
        clocks = {node: NackClock() for node in (1, 2)}
        clocks[1].sample(0.001)
        clocks[2].sample(0.05)
    agg = ShardAggregator(
        layout=lay, shard=0, senders=[0, 1, 2], now=0.0, timing=Timing(), clocks=clocks
    )
    droppable = rng.random((3, n)) < rng.choice([0.0, 0.3, 1.0])
    arrived = np.zeros((3, n), dtype=bool)
    now = 0.0
    seen = set()
    for _step in range(30):
        now += float(rng.choice([0.001, 0.02, 0.2]))
        node = int(rng.integers(3))
        action = rng.random()
        if action < 0.6:  # some of its packets, in order
            pick = np.flatnonzero(rng.random(n) < rng.choice([0.1, 0.5, 1.0]))
            arrived[node, pick] = True
            agg.on_data_many(sender=node, offsets=starts[pick], counts=counts[pick],
                             payloads=[bytes(4 * int(c)) for c in counts[pick]], summed=False,
                             weight=1, droppable=droppable[node, pick], scale=0.0,
                             block_max=np.zeros(pick.size, np.float32), now=now)  # fmt: skip
        elif action < 0.8:
            agg.on_manifest(sender=node, droppable=droppable[node],
                            bound=float(rng.choice([0.0, 0.5])), now=now)  # fmt: skip
        else:
            agg.poll(now)
        if agg.result is not None:
            break
        got, want = agg.next_timer(), _next_timer_reference(agg)
        assert got == want, (seed, _step)
        seen.add((bool(agg.manifest.all()), bool(arrived.all()), agg.done_at is not None))
    assert seen


def test_an_owner_whose_own_contribution_is_late_asks_only_the_others() -> None:
    """Host 1 owns shard 1; hosts 0 and 2 submit and their data reaches it long
    before host 1's own rank submits. Its shard's clock NACKs the senders
    whose DONE is missing, and this node is one of them until its local part
    comes (`on_local`), never from the network: the NACK to itself went out
    (a batch for node 1 from node 1, which the simulator's pump and
    tests/switchsim.py looked up among the peers and failed on)."""
    engines = cluster(3)
    rng = np.random.default_rng(3)
    xs = [rng.standard_normal(30_000).astype(np.float32) for _ in range(3)]
    now = 0.0
    for me in (0, 2):
        engines[me].submit(
            job=JOB, round=0, bucket=0, codec=Codec.FP32, total=xs[me].size,
            lanes=xs[me].tobytes(), now=now,
        )  # fmt: skip
    to_owner = [s.datagram for me in (0, 2) for s in engines[me].datagrams_to_send() if s.node == 1]
    assert to_owner
    owner = engines[1]
    for dg in to_owner:
        assert owner.receive(dg, now, src=None) is not None
    asked: list[int] = []
    for _ in range(400):  # 4 s of the owner's timers, its rank still away
        now += 0.01
        t = owner.get_timer()
        if t is not None and t <= now:
            owner.handle_timer(now)
        asked += [s.node for s in owner.datagrams_to_send()]
    assert 1 not in asked
