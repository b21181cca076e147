"""The outbox charges NACKed packets to the paths they were sent on, paces each
path on its own and sends a DONE behind its shard (no sockets)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from dlcp.core.layout import Layout
from dlcp.core.pathhealth import HealthConfig
from dlcp.core.rate import WIRE_OVERHEAD, RateConfig
from dlcp.daemon import pathloss, reroute, sending
from dlcp.daemon import peer as peer_mod
from dlcp.daemon.outbox import Outbox, Peer
from dlcp.policies import from_config
from dlcp.wire import Flags, Header, PacketType, decode, encode
from dlcp.wire.header import Codec

KEY = bytes(range(32))
JOB, ROUND, BUCKET = 7, 3, 1
SHARDS = 2


class FakePath:
    """Stands in for a UdpPath: records what was sent, accepts everything."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.sent: list[bytes] = []

    def send(self, batch: list[bytes], dest: tuple[str, int], tos: int) -> int:
        self.sent.extend(batch)
        return len(batch)


def make(
    n_paths: int,
    balance: str = "spray",
    *,
    rate: RateConfig | None = None,
    health: HealthConfig | None = None,
) -> tuple[Outbox, Peer, list[FakePath]]:
    """An outbox over fake paths; paced when `rate` is given, its paths
    probed (`Peer.health`) when `health` is."""
    paths = [FakePath(f"10.0.{p}.1") for p in range(n_paths)]
    ob = Outbox(
        paths,  # type: ignore[arg-type]
        dscp=(48, 40, 34, 26, 18, 10, 0, 8),
        rate=rate if rate is not None else RateConfig(),
        pacing=rate is not None,
        balancer_factory=lambda: from_config("balance", balance),
        health=health,
    )
    peer = ob.peer(tuple(f"10.0.{p}.2" for p in range(n_paths)), 7400, 0.0)
    return ob, peer, paths


def layout(total: int = 40 * 352) -> Layout:
    return Layout(total, Codec.FP32, SHARDS)


def data_packets(lay: Layout, shard: int) -> list[bytes]:
    out = []
    for i in lay.shard_packets(shard):
        off, count = lay.packet_range(i)
        h = Header(PacketType.DATA, JOB, ROUND, BUCKET, priority=2, shard=shard, sender=0,
                   offset=off, count=count, total=lay.total)  # fmt: skip
        out.append(encode(h, np.zeros(count, np.float32).tobytes(), KEY))
    return out


def result_packets(lay: Layout, shard: int) -> list[bytes]:
    out = []
    for off, count in lay.shard_results(shard):
        h = Header(PacketType.RESULT, JOB, ROUND, BUCKET, priority=2, shard=shard, sender=0,
                   contributors=2, offset=off, count=count, total=lay.total)  # fmt: skip
        out.append(encode(h, np.zeros(count, np.float32).tobytes(), KEY))
    return out


def nack(lay: Layout, shard: int, indices: list[int], *, result: bool = False) -> bytes:
    h = Header(PacketType.NACK, JOB, ROUND, BUCKET,
               flags=Flags.RESULT_LEG if result else Flags.NONE, shard=shard, sender=1,
               count=len(indices), total=lay.total)  # fmt: skip
    return encode(h, np.asarray(indices, ">u4").tobytes(), KEY)


def deliver(ob: Outbox, peer: Peer, dgram: bytes, lay: Layout, now: float = 1.0) -> None:
    h, _ = decode(dgram, {JOB: KEY})
    ob.on_nack(peer, h, memoryview(dgram), shards=SHARDS, payload=lay.payload, now=now)


def path_of(paths: list[FakePath]) -> dict[tuple[Any, ...], int]:
    """(type, shard, offset) -> the path each datagram went on."""
    out = {}
    for p, fp in enumerate(paths):
        for dg in fp.sent:
            h, _ = decode(dg, {JOB: KEY})
            out[(h.type, h.shard, h.offset)] = p
    return out


def test_data_losses_are_charged_to_their_paths() -> None:
    ob, peer, paths = make(2)
    lay = layout()
    for dg in data_packets(lay, 1):
        ob.push(peer, dg, 2)
    ob.flush(0.0)
    where = path_of(paths)
    assert sorted(set(where.values())) == [0, 1]  # sprayed
    missing = [0, 1, 2, 5, 8]
    first = lay.shard_packets(1).start
    want = [0, 0]
    for i in missing:
        want[where[(PacketType.DATA, 1, lay.packet_range(first + i)[0])]] += 1
    deliver(ob, peer, nack(lay, 1, missing), lay)
    assert [ps.lost for ps in peer.paths] == want
    assert peer.paths[0].last_loss == 1.0 or want[0] == 0
    # the same NACK again (the receiver repeats it): nothing is charged twice
    deliver(ob, peer, nack(lay, 1, missing), lay)
    assert [ps.lost for ps in peer.paths] == want


def test_result_losses_and_retransmissions() -> None:
    ob, peer, paths = make(2)
    lay = layout()
    for dg in result_packets(lay, 0):
        ob.push(peer, dg, 2)
    ob.flush(0.0)
    where = path_of(paths)
    deliver(ob, peer, nack(lay, 0, [3], result=True), lay)
    off = lay.shard_results(0)[3][0]
    lost = [ps.lost for ps in peer.paths]
    assert lost[where[(PacketType.RESULT, 0, off)]] == 1 and sum(lost) == 1
    # a data NACK for the same offsets names other packets (never sent): no charge
    deliver(ob, peer, nack(lay, 0, [3]), lay)
    assert [ps.lost for ps in peer.paths] == lost
    # A retransmission is not charged: a repeated NACK may cross it in flight.
    # It went on a path all the same, and counts as sent there.
    for p in paths:
        p.sent.clear()
    sent_before = [ps.sent for ps in peer.paths]
    ob.push(peer, retransmitted(result_packets(lay, 0)[3]), 1)
    ob.flush(0.0)
    again = path_of(paths)[(PacketType.RESULT, 0, off)]
    assert peer.paths[again].sent == sent_before[again] + 1
    deliver(ob, peer, nack(lay, 0, [3], result=True), lay)
    assert [ps.lost for ps in peer.paths] == lost
    # a first transmission sent after it is charged as ever
    ob.push(peer, result_packets(lay, 0)[4], 2)
    ob.flush(0.0)
    fourth = path_of(paths)[(PacketType.RESULT, 0, lay.shard_results(0)[4][0])]
    deliver(ob, peer, nack(lay, 0, [3, 4], result=True), lay)
    assert sum(ps.lost for ps in peer.paths) == 2 and peer.paths[fourth].lost >= 1


def retransmitted(dgram: bytes) -> bytes:
    """`dgram` as the engine resends it: the RETRANSMIT flag set, signed again."""
    h, payload = decode(dgram, {JOB: KEY})
    return encode(replace(h, flags=h.flags | Flags.RETRANSMIT), bytes(payload), KEY)


def test_unsent_packets_and_one_path() -> None:
    ob, peer, _ = make(2)
    lay = layout()
    deliver(ob, peer, nack(lay, 1, [0, 1, 2]), lay)  # nothing was sent
    assert [ps.lost for ps in peer.paths] == [0, 0]
    ob1, peer1, _ = make(1)
    deliver(ob1, peer1, nack(lay, 1, [0, 1, 2]), lay)  # one path: all of it there
    assert peer1.paths[0].lost == 3
    assert not peer1.sent_paths.new  # single-path peers track nothing


def test_adaptive_shifts_away_from_the_lossy_path() -> None:
    ob, peer, paths = make(2, "adaptive")
    lay = layout(400 * 352)
    for dg in data_packets(lay, 1):
        ob.push(peer, dg, 2)
    ob.flush(0.0)
    where = path_of(paths)
    first = lay.shard_packets(1).start
    on_1 = [i for i in range(len(lay.shard_packets(1)))
            if where[(PacketType.DATA, 1, lay.packet_range(first + i)[0])] == 1]  # fmt: skip
    deliver(ob, peer, nack(lay, 1, on_1[::10]), lay)  # 10 % of path 1's packets
    assert peer.paths[1].loss_rate > 0.05 and peer.paths[0].loss_rate == 0.0
    shares = peer.balancer.shares(peer.paths)  # type: ignore[attr-defined]
    assert shares[1] < 0.1 < 0.9 < shares[0]


def test_tracking_is_bounded(monkeypatch: Any) -> None:
    monkeypatch.setattr(pathloss, "TRACKED_PER_GENERATION", 8)
    ob, peer, _ = make(2)
    lay = layout()
    for dg in data_packets(lay, 1):
        ob.push(peer, dg, 2)
        ob.flush(0.0)
    new, old = peer.sent_paths.as_dicts()
    assert len(new) <= 9 and len(old) <= 9 and peer.sent_paths.live == len(new)


def done_packet(lay: Layout, shard: int) -> bytes:
    h = Header(PacketType.DONE, JOB, ROUND, BUCKET, flags=Flags.LAST, priority=0,
               shard=shard, sender=0, total=lay.total)  # fmt: skip
    return encode(h, b"", KEY)


def run_paced(
    ob: Outbox, until: float = 60.0, waits: list[float] | None = None, late: float = 0.0
) -> float:
    """Flush at every wake-up the outbox asks for, `late` seconds after it,
    until its queues are empty (each wait appended to `waits`, if given);
    returns the time of the last."""
    now = 0.0
    ob.flush(now)
    while ob.queued():
        assert ob.next_wake is not None and ob.next_wake > now
        if waits is not None:
            waits.append(ob.next_wake - now)
        now = ob.next_wake + late
        assert now < until
        ob.flush(now)
    return now


def test_each_path_is_paced_and_cut_on_its_own(monkeypatch: Any) -> None:
    monkeypatch.setattr(peer_mod, "BURST_BYTES", 3000)
    cfg = RateConfig(initial_rate_bps=8e6, min_rate_bps=1e6, loss_tolerance=0.15)
    ob, peer, paths = make(2, rate=cfg)
    # 40 % of path 1's recent packets lost: congestion, path 1 alone is cut
    peer.balancer.on_sent(peer.paths[1], 100)
    peer.balancer.on_loss(peer.paths[1], 40, 0.0)
    peer.rate.on_loss(1, 40, 0.0, loss_rate=peer.paths[1].loss_rate)
    assert peer.rate.rates() == [8e6, 4e6]
    lay = layout(2000 * 352)
    for dg in data_packets(lay, 1):
        ob.push(peer, dg, 2)
    end = run_paced(ob)
    sent = [sum(len(d) for d in fp.sent) for fp in paths]
    # spray keeps to the paths with budget: each carries what its rate allows
    assert sent[0] / sent[1] == pytest.approx(2.0, rel=0.05)
    for nbytes, rate in zip(sent, peer.rate.rates(), strict=True):
        # the burst and the last batch (sent into debt) are all it runs ahead
        burst = max(3000, rate * peer_mod.BURST_SECONDS / 8)  # the pacer's burst
        assert rate * end / 8 <= nbytes <= rate * end / 8 + burst + sending.BATCH_BYTES
    # once a path was cut the rates tell the balancer what the paths carry
    assert [ps.rate_bps for ps in peer.paths] == [8e6, 4e6]
    # random loss under the tolerance leaves a path's rate alone
    ps = peer.paths[0]
    deliver(ob, peer, nack(lay, 1, [i for i in range(0, 900, 10)]), lay, now=100.0)
    assert 0 < ps.loss_rate <= 0.15 and peer.rate.rates()[0] == 8e6


def test_a_fast_path_is_woken_once_a_quantum_and_keeps_its_rate() -> None:
    # at 1 Gbit/s a batch is about 0.5 ms of tokens: without the quantum the
    # outbox would ask to be woken for every batch
    ob, peer, paths = make(1, rate=RateConfig(initial_rate_bps=1e9, min_rate_bps=1e6))
    lay = layout(4000 * 352)
    for dg in data_packets(lay, 1):
        ob.push(peer, dg, 2)
    wakes: list[float] = []
    now = run_paced(ob, waits=wakes)
    assert len(wakes) > 5  # the burst did not cover it all: it was paced
    assert min(wakes) >= sending.PACING_QUANTUM
    # what the wire carries (pacers count each datagram's headers too)
    nbytes = sum(len(d) + WIRE_OVERHEAD for d in paths[0].sent)
    burst = max(peer_mod.BURST_BYTES, 1e9 * peer_mod.BURST_SECONDS / 8)
    # the rate still holds both ways: the tokens earned while asleep are spent
    # at the wake-up (the burst holds a quantum's worth), none beyond them; a
    # new path starts with no tokens, and the last wake-up, a quantum after
    # the one before, may find fewer datagrams left than its tokens
    last = 1e9 * sending.PACING_QUANTUM / 8 + len(paths[0].sent[-1]) + WIRE_OVERHEAD
    assert 1e9 * now / 8 - last <= nbytes <= 1e9 * now / 8 + burst + sending.BATCH_BYTES


@pytest.mark.parametrize("late", [0.003, 0.009, 0.05])
def test_a_late_daemon_keeps_its_rate_within_the_catch_up(late: float) -> None:
    # the daemon comes back `late` after each wake-up it asked for (busy, or
    # not scheduled): the tokens earned meanwhile are kept up to CATCH_UP_SECONDS
    # beyond the 4 ms burst, so the rate holds; lateness beyond that is lost
    rate = 1e9
    ob, peer, paths = make(1, rate=RateConfig(initial_rate_bps=rate, min_rate_bps=1e6))
    lay = layout(60000 * 352)  # about 85 MB: many wake-ups
    for dg in data_packets(lay, 1):
        ob.push(peer, dg, 2)
    wakes: list[float] = []
    now = run_paced(ob, waits=wakes, late=late)
    nbytes = sum(len(d) for d in paths[0].sent)
    burst = max(peer_mod.BURST_BYTES, rate * peer_mod.BURST_SECONDS / 8)
    catch_up = rate * sending.CATCH_UP_SECONDS / 8
    kept = min(late, sending.CATCH_UP_SECONDS)  # per wake-up, of the lateness
    # never ahead of the rate by more than the burst, the catch-up and a batch
    assert nbytes <= rate * now / 8 + burst + catch_up + sending.BATCH_BYTES
    # behind it by no more than the lateness beyond the catch-up
    lost = len(wakes) * (late - kept)
    assert nbytes >= rate * (now - lost) / 8 - burst - catch_up
    # and a late pacer left with tokens beyond its burst drops them once idle
    assert peer.pacers is not None and peer.pacers[0].tokens(now) <= burst


def test_flow_waits_for_its_own_path(monkeypatch: Any) -> None:
    monkeypatch.setattr(peer_mod, "BURST_BYTES", 3000)
    ob, peer, paths = make(2, "flow", rate=RateConfig(initial_rate_bps=8e6, min_rate_bps=1e6))
    lay = layout(400 * 352)
    for dg in data_packets(lay, 1):
        ob.push(peer, dg, 2)
    run_paced(ob)
    used = [len(fp.sent) for fp in paths]
    assert sorted(used)[0] == 0  # never the other path, though it had budget
    # no path was ever cut: rates still in slow start say nothing about capacity
    assert all(ps.rate_bps is None for ps in peer.paths)


def test_done_follows_the_path_that_carried_its_shard() -> None:
    for weights, want in (([3, 1], 0), ([1, 3], 1)):
        paths = [FakePath(f"10.0.{p}.1") for p in range(2)]
        ob = Outbox(
            paths,  # type: ignore[arg-type]
            dscp=(48, 40, 34, 26, 18, 10, 0, 8),
            rate=RateConfig(),
            pacing=False,
            balancer_factory=lambda w=weights: from_config(  # type: ignore[misc]
                "balance", {"name": "weighted", "weights": w}
            ),
        )
        peer = ob.peer(("10.0.0.2", "10.0.1.2"), 7400, 0.0)
        lay = layout()
        for dg in data_packets(lay, 1):
            ob.push(peer, dg, 2)
        for _ in range(4):  # a DONE after the bulk of its shard, several times over
            ob.push(peer, done_packet(lay, 1), 0)
            ob.flush(0.0)
        dones = [
            [dg for dg in fp.sent if decode(dg, {JOB: KEY})[0].type == PacketType.DONE]
            for fp in paths
        ]
        assert len(dones[want]) >= 1 and not dones[1 - want], weights


def test_retransmissions_take_the_least_lossy_path() -> None:
    ob, peer, paths = make(2, "spray")
    peer.balancer.on_sent(peer.paths[1], 100)
    peer.balancer.on_loss(peer.paths[1], 10, 0.0)  # path 1 loses 10 %
    lay = layout()
    first = lay.shard_packets(1).start
    for i in range(6):
        off, count = lay.packet_range(first + i)
        h = Header(PacketType.DATA, JOB, ROUND, BUCKET, flags=Flags.RETRANSMIT, priority=1,
                   shard=1, sender=0, offset=off, count=count, total=lay.total)  # fmt: skip
        ob.push(peer, encode(h, np.zeros(count, np.float32).tobytes(), KEY), 1)
    for dg in data_packets(lay, 1)[6:12]:  # first transmissions are sprayed as ever
        ob.push(peer, dg, 2)
    ob.flush(0.0)
    sent = path_of(paths)
    resent = [sent[(PacketType.DATA, 1, lay.packet_range(first + i)[0])] for i in range(6)]
    fresh = [sent[(PacketType.DATA, 1, lay.packet_range(first + i)[0])] for i in range(6, 12)]
    assert resent == [0] * 6 and sorted(set(fresh)) == [0, 1]


@pytest.mark.parametrize("bulk", [False, True])
def test_both_copies_of_a_done_go_out(bulk: bool) -> None:
    """The engine sends every DONE twice, as insurance against losing it: neither
    copy is a repeat, whether the DONE goes at once or waits behind its shard."""
    ob, peer, paths = make(1)
    lay = layout()
    done = done_packet(lay, 1)
    data = data_packets(lay, 1)
    batch = [*data, done, done]
    if bulk:
        assert ob.push_many(peer, batch, [2] * len(batch)) == len(batch)
    else:
        assert all(ob.push(peer, dg, 2) for dg in batch)
    assert ob.repeats == 0 and peer.queued == len(batch)
    # a repeated DATA packet is still one
    assert not ob.push(peer, data[0], 2) and ob.repeats == 1
    ob.flush(0.0)
    sent = paths[0].sent
    assert sent.count(done) == 2 and sent[-2:] == [done, done]  # behind their shard
    assert len(sent) == len(batch) and peer.queued == 0
    # and again when there is nothing left to wait for
    assert ob.push_many(peer, [done, done], [0, 0]) == 2 if bulk else ob.push(peer, done, 0)
    ob.flush(1.0)
    assert sent.count(done) == (4 if bulk else 3)


@pytest.mark.parametrize("balance", ["spray", "weighted", "adaptive", "flow"])
def test_a_path_out_of_use_carries_nothing_whatever_the_balancer(balance: str) -> None:
    """Path health (`Peer.usable`) overrides every balancer: data, DONEs and
    retransmissions all go on the paths in use; back in use, sprayed again."""
    ob, peer, paths = make(2, balance)
    lay = layout()
    peer.usable = [False, True]
    for dg in data_packets(lay, 1):
        ob.push(peer, dg, 2)
    ob.push(peer, done_packet(lay, 1), 0)
    ob.push(peer, retransmitted(data_packets(lay, 0)[2]), 1)
    ob.flush(0.0)
    assert not paths[0].sent
    assert len(paths[1].sent) == len(data_packets(lay, 1)) + 2
    assert peer.paths[0].weight == 0.0
    assert peer.live_path() == 1
    if balance == "spray":
        peer.usable = None
        for dg in data_packets(lay, 0):
            ob.push(peer, dg, 2)
        ob.flush(0.0)
        assert paths[0].sent and peer.live_path() == 0


def test_a_path_found_down_has_its_urgent_datagrams_sent_again_on_the_live_one() -> None:
    ob, peer, paths = make(2, health=HealthConfig())
    assert peer.health is not None and ob.multipath == [peer]
    lay = layout()
    for dg in data_packets(lay, 1):
        ob.push(peer, dg, 2)
    resent = [retransmitted(dg) for dg in data_packets(lay, 0)[:6]]
    for dg in resent:
        ob.push(peer, dg, 1)
    ob.push(peer, nack(lay, 0, [1, 2]), 0)
    ob.flush(0.0)
    on_1 = [dg for dg in paths[1].sent if dg in resent or dg[3] == PacketType.NACK]
    assert on_1  # sprayed: some urgent ones went on path 1
    for p in paths:
        p.sent.clear()
    peer.usable = [True, False]
    # found down within the horizon: they are queued again, and go on path 0
    assert ob.path_down(peer, 1, 0.1) == len(on_1) == ob.resent_on_down
    ob.flush(0.1)
    assert not paths[1].sent and sorted(paths[0].sent) == sorted(on_1)
    # first transmissions of data are not kept (their DONE draws NACKs), and
    # what is past the horizon is not sent again
    ob.push(peer, retransmitted(data_packets(lay, 0)[7]), 1)
    peer.usable = None
    ob.flush(0.2)
    assert ob.path_down(peer, 1, 0.2 + reroute.RESEND_HORIZON + 0.01) == 0


def test_a_paced_path_out_of_use_is_never_ready() -> None:
    rate = RateConfig(initial_rate_bps=1e8, min_rate_bps=1e6)
    ob, peer, paths = make(2, rate=rate)
    lay = layout(400 * 352)
    peer.usable = [True, False]
    for dg in data_packets(lay, 1):
        ob.push(peer, dg, 2)
    last = run_paced(ob)
    assert not paths[1].sent and len(paths[0].sent) == len(data_packets(lay, 1))
    assert last > 0  # paced on path 0 alone
