"""Repeated NACKs wait for how soon a peer answers (NackClock), not a fixed interval."""

from __future__ import annotations

import math

import numpy as np
import pytest

from dlcp.core.aggregate import ShardAggregator
from dlcp.core.engine import Engine, JobSpec, RoundComplete
from dlcp.core.layout import Layout
from dlcp.core.timing import NackClock, Timing
from dlcp.errors import LocalError
from dlcp.wire import Codec, PacketType
from tests.netsim import Network

KEY = bytes(range(32))
JOB = 11


def test_an_untimed_peer_is_asked_again_after_nack_interval() -> None:
    t = Timing(nack_interval=0.03, nack_min=0.005)
    c = NackClock()
    assert c.repeat_after(t) == 0.03
    assert c.repeat_after(t, 3) == 0.03


def test_the_wait_is_mean_plus_four_deviations_within_the_bounds_and_doubles() -> None:
    t = Timing(nack_interval=0.04, nack_min=0.002)
    c = NackClock()
    c.sample(0.001)  # srtt 1 ms, deviation 0.5 ms: 3 ms
    assert c.srtt == pytest.approx(0.001) and c.rttvar == pytest.approx(0.0005)
    assert c.repeat_after(t) == pytest.approx(0.003)
    assert c.repeat_after(t, 2) == pytest.approx(0.006)  # one NACK before went unanswered
    assert c.repeat_after(t, 3) == pytest.approx(0.012)
    assert c.repeat_after(t, 5) == pytest.approx(0.04)  # never past nack_interval
    c.sample(0.003)  # RFC 6298's smoothing
    assert c.rttvar == pytest.approx(0.75 * 0.0005 + 0.25 * 0.002)
    assert c.srtt == pytest.approx(0.875 * 0.001 + 0.125 * 0.003)
    fast = NackClock()
    fast.sample(0.0)
    assert fast.repeat_after(t) == 0.002  # never below nack_min
    slow = NackClock()
    slow.sample(1.0)
    assert slow.repeat_after(t) == 0.04
    for bad in (-0.001, math.nan):  # not a time: ignored
        fast.sample(bad)
    assert fast.samples == 1


def test_nack_min_may_not_exceed_nack_interval() -> None:
    with pytest.raises(LocalError, match="nack_min"):
        Timing(nack_interval=0.01, nack_min=0.02)
    with pytest.raises(LocalError, match="nack_min"):
        Timing(nack_min=0.0)


def _aggregator(clock: NackClock) -> tuple[ShardAggregator, Layout]:
    lay = Layout(total=4000, codec=Codec.FP32, shards=1, payload=400)
    n = len(lay.shard_packets(0))
    timing = Timing(nack_min=0.002)
    agg = ShardAggregator(
        layout=lay, shard=0, senders=[0, 1], now=0.0, timing=timing, clocks={1: clock}
    )
    pk = lay.shard_packets(0)
    starts = np.array([lay.packet_range(i)[0] for i in pk], dtype=np.int64)
    counts = np.array([lay.packet_range(i)[1] for i in pk], dtype=np.int64)
    # node 0's packets all in, node 1's none: only node 1 is asked
    agg.on_data_many(sender=0, offsets=starts, counts=counts,
                     payloads=[bytes(4 * int(c)) for c in counts], summed=False, weight=1,
                     droppable=np.zeros(n, bool), scale=0.0,
                     block_max=np.zeros(n, np.float32), now=0.0)  # fmt: skip
    agg.on_manifest(sender=0, droppable=np.zeros(n, bool), bound=0.0, now=0.0)
    agg.on_manifest(sender=1, droppable=np.zeros(n, bool), bound=0.0, now=0.0)
    return agg, lay


def test_a_shard_repeats_its_nack_after_the_senders_answer_time() -> None:
    clock = NackClock()
    clock.sample(0.001)  # this sender answers in about a millisecond: 3 ms
    agg, _ = _aggregator(clock)
    nacks, _ = agg.poll(0.01)
    assert [n.node for n in nacks] == [1]
    assert agg.next_timer() == pytest.approx(0.013)
    assert agg.poll(0.012)[0] == []
    nacks, _ = agg.poll(0.0131)
    assert [n.node for n in nacks] == [1]
    # the second went unanswered too: twice the wait
    assert agg.next_timer() == pytest.approx(0.0191)
    # an untimed sender: nack_interval
    agg2, _ = _aggregator(NackClock())
    agg2.poll(0.01)
    assert agg2.next_timer() == pytest.approx(0.04)


def test_only_a_nack_answered_without_a_repeat_is_timed() -> None:
    clock = NackClock()
    agg, _ = _aggregator(clock)
    agg.poll(0.01)
    agg.answered(1, 0.0125)  # the answer to the one NACK: 2.5 ms
    assert clock.samples == 1 and clock.srtt == pytest.approx(0.0025)
    agg.answered(1, 0.02)  # no NACK waits: nothing
    assert clock.samples == 1
    agg.poll(1.0)
    agg.poll(2.0)  # repeated: which one is answered is unknown (Karn)
    agg.answered(1, 2.001)
    assert clock.samples == 1
    assert agg.unanswered[1] == 0  # but the next repeat waits the base time again
    agg.poll(3.0)
    assert agg.next_timer() == pytest.approx(3.0 + clock.repeat_after(agg.timing, 1))


def _pair(timing: Timing) -> dict[int, Engine]:
    engines = {}
    for me in range(2):
        e = Engine(timing=timing)
        e.add_job(JobSpec.transpose(JOB, KEY, me, 2, payload=1408))
        engines[me] = e
    return engines


def _rounds(timing: Timing, rounds: int, seed: int) -> tuple[float, Network]:
    """`rounds` all-reduces of 2 nodes, 25 % of every datagram lost; the
    virtual time they took (no sleeping: the network simulation's clock)."""
    rng = np.random.default_rng(seed)
    net = Network(_pair(timing), seed=seed, loss=0.25, delay=(0.0002, 0.001))
    for r in range(rounds):
        xs = [rng.standard_normal(20000).astype(np.float32) for _ in range(2)]
        for me, x in enumerate(xs):
            net.engines[me].submit(job=JOB, round=r, bucket=0, codec=Codec.FP32, total=x.size,
                                   lanes=x.astype("<f4").tobytes(), now=net.now)  # fmt: skip
        net.run(until=net.now + 30.0, done=lambda r=r: all(
            sum(isinstance(ev, RoundComplete) and ev.round == r for ev in evs) == 1
            for evs in net.events.values()))  # fmt: skip
        for evs in net.events.values():
            ev = next(e for e in evs if isinstance(e, RoundComplete) and e.round == r)
            np.testing.assert_array_equal(np.frombuffer(ev.sums, np.float32), xs[0] + xs[1])
    return net.now, net


@pytest.mark.parametrize("seed", range(3))
def test_under_heavy_loss_rounds_recover_sooner_once_answers_are_timed(seed: int) -> None:
    """The same rounds, the same losses: with a NACK repeated once the peer's
    answer time has passed (here about 1-2 ms of simulated delay) they end in
    less virtual time than when every repeat waits nack_interval (nack_min
    raised to it), and the clocks learnt what the network's delays give."""
    adaptive, net = _rounds(Timing(), 12, seed)
    fixed, _ = _rounds(Timing(nack_min=0.03), 12, seed)
    assert adaptive < fixed
    for me, e in net.engines.items():
        clock = e.nack_clocks(JOB)[1 - me]
        assert clock.samples > 0
        # a NACK and its answer: two one-way delays of 0.2-1 ms
        assert clock.srtt is not None and 0.0004 <= clock.srtt <= 0.002


def test_a_sender_resends_a_repeated_nack_once_its_answer_time_has_passed() -> None:
    """A sender keeps a NACKed packet from being sent again only within half
    the wait after which the NACKing peer repeats (`nack_interval` until it has
    timed that peer): a repeat after 10 ms is answered, where the fixed
    interval (30 ms) would have kept it back."""
    for timed in (False, True):
        engines = _pair(Timing())
        # node 0's data never arrives (its DONE does)
        net = Network(engines, drop=lambda src, s: src == 0 and s.datagram[3] == PacketType.DATA)
        x = np.ones(20000, np.float32)
        for me in range(2):
            engines[me].submit(job=JOB, round=0, bucket=0, codec=Codec.FP32, total=x.size,
                               lanes=x.tobytes(), now=0.0)  # fmt: skip
        net.run(until=0.05)  # node 1 asks; every resend of node 0 is lost
        if timed:
            engines[0].nack_clocks(JOB)[1].sample(0.001)  # node 0 has timed node 1: 2.5 ms
        nack = _nacks(engines[1], net, 0)
        assert nack, "node 1 asks node 0 for its data"
        t = net.now + 1.0  # long after node 0's resends in the run
        for dg in nack:
            engines[0].receive(dg, t, src=1)
        first = engines[0].stats["data_retransmits"]
        suppressed = engines[0].stats["retransmits_suppressed"]
        for dg in nack:  # the same NACK again, 10 ms later
            engines[0].receive(dg, t + 0.01, src=1)
        resent = engines[0].stats["data_retransmits"] - first
        held = engines[0].stats["retransmits_suppressed"] - suppressed
        assert first > 0
        if timed:
            assert resent > 0 and held == 0
        else:
            assert resent == 0 and held > 0


def _nacks(e: Engine, net: Network, to: int) -> list[bytes]:
    """NACK datagrams `e` would send `to` now (its timer fired well past due)."""
    e.handle_timer(net.now + 1.0)
    out = []
    for s in e.datagrams_to_send():
        dg = bytes(s.datagram)
        if s.node == to and dg[3] == PacketType.NACK:
            out.append(dg)
    return out


def test_nack_answers_show_each_peers_clock() -> None:
    """`Engine.nack_answers` (what `dlcp status` and the metrics show): nothing
    timed and the fixed interval before any NACK; after lossy rounds, the
    learnt answer time, its deviation and the repeat wait the clock gives."""
    timing = Timing()
    fresh = _pair(timing)[0].nack_answers(JOB)
    assert fresh == {
        1: {"answer_s": None, "deviation_s": None, "answers": 0, "repeat_after_s": 0.03}
    }
    _, net = _rounds(timing, 4, seed=5)
    for me, e in net.engines.items():
        (node, seen), *others = e.nack_answers(JOB).items()
        clock = e.nack_clocks(JOB)[1 - me]
        assert node == 1 - me and not others
        assert seen["answers"] == clock.samples > 0
        assert seen["answer_s"] == clock.srtt and seen["deviation_s"] == clock.rttvar
        assert seen["repeat_after_s"] == clock.repeat_after(timing)
        assert timing.nack_min <= seen["repeat_after_s"] < timing.nack_interval
    assert e.nack_answers(JOB + 1) == {}
