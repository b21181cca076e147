"""Engines ask for a lost packet as soon as what came after it says it is lost
(`dlcp.core.stream`), not at the end of its leg, and never for one merely
reordered within `timing.reorder`."""

from __future__ import annotations

import numpy as np
import pytest

from dlcp.core.engine import Engine, JobSpec, Send
from dlcp.core.layout import Layout
from dlcp.core.timing import Timing
from dlcp.wire import Codec, Flags, PacketType, decode
from tests.netsim import Network
from tests.test_engine import completions

KEY = b"f" * 32
JOB = 5
DELAY = 0.0005  # one way, the same for every datagram: nothing reorders


def _engines(hosts: int) -> dict[int, Engine]:
    engines = {}
    for me in range(hosts):
        e = Engine(timing=Timing())
        e.add_job(JobSpec.transpose(JOB, KEY, me, hosts))
        engines[me] = e
    return engines


def _submit(
    net: Network, xs: list[np.ndarray], classes: list[np.ndarray], drop: list[np.ndarray] | None
) -> Layout:
    lay = Layout(total=xs[0].size, codec=Codec.FP32, shards=len(xs))
    for me, x in enumerate(xs):
        net.engines[me].submit(
            job=JOB, round=0, bucket=0, codec=Codec.FP32, total=x.size,
            lanes=x.astype("<f4").tobytes(), classes=classes[me],
            droppable=None if drop is None else drop[me], bound=0.0 if drop is None else 0.5,
            now=net.now,
        )  # fmt: skip
    return lay


HOLD = 0.02  # how late the DONEs come (a long leg's data still on the wire)


class _Log:
    """Send times of the datagrams that match, and which to lose; every DONE
    arrives `HOLD` late (the in-memory network has no link rate: the leg's
    packets would otherwise all arrive at once, the DONE with them)."""

    def __init__(self, net_ref: list[Network], lose: set[tuple[int, int, int, int]]) -> None:
        self.net_ref = net_ref
        self.lose = lose  # (src, dst, type, offset) of first transmissions to lose once
        self.sent: list[tuple[float, int, int, int, int, int]] = []
        self.hold = True

    def __call__(self, src: int, s: Send) -> bool:
        net = self.net_ref[0]
        dg = bytes(s.datagram)
        h, _ = decode(dg, {JOB: KEY})
        self.sent.append((net.now, src, s.node, h.type, int(h.flags), h.offset))
        key = (src, s.node, h.type, h.offset)
        if key in self.lose and not h.flags & Flags.RETRANSMIT:
            self.lose.discard(key)
            return True
        if self.hold and h.type == PacketType.DONE:
            net.deliver_at(net.now + HOLD, src, s.node, dg)
            return True
        return False

    def first(self, src: int, dst: int, ptype: int, result_leg: bool) -> float:
        return min(
            t
            for t, a, b, ty, fl, _ in self.sent
            if (a, b, ty) == (src, dst, ptype) and bool(fl & Flags.RESULT_LEG) == result_leg
        )

    def resent(self, src: int, dst: int, ptype: int, offset: int) -> int:
        return sum(
            1
            for _, a, b, ty, fl, off in self.sent
            if (a, b, ty, off) == (src, dst, ptype, offset) and fl & Flags.RETRANSMIT
        )


def _run(
    lose: set[tuple[int, int, int, int]],
    classes: int = 5,
    drop: list[np.ndarray] | None = None,
) -> tuple[Network, _Log, list[np.ndarray]]:
    xs = [np.arange(40 * 352, dtype=np.float32) * (h + 1) for h in range(2)]
    ref: list[Network] = []
    log = _Log(ref, lose)
    net = Network(_engines(2), seed=1, drop=log, delay=(DELAY, DELAY))
    ref.append(net)
    _submit(net, xs, [np.full(40, classes, np.uint8)] * 2, drop)
    net.run(until=10.0)
    return net, log, xs


def test_a_data_packet_lost_early_is_asked_for_before_the_senders_done_comes() -> None:
    # node 0 owns shard 0 (packets 0..19): node 1's packet 2 to it is lost
    net, log, xs = _run({(1, 0, PacketType.DATA, 2 * 352)})
    done = completions(net)
    assert sorted(done) == [0, 1]
    np.testing.assert_array_equal(done[0].sums, xs[0] + xs[1])
    nack = log.first(0, 1, PacketType.NACK, result_leg=False)
    done_arrives = log.first(1, 0, PacketType.DONE, result_leg=False) + HOLD
    assert nack < done_arrives  # before: DONE + nack_delay
    assert log.resent(1, 0, PacketType.DATA, 2 * 352) == 1
    # the NACK said node 0 lacks the DONE, which is on its way: not sent again
    dones = [
        t
        for t, a, b, ty, fl, _ in log.sent
        if (a, b, ty) == (1, 0, PacketType.DONE) and not fl & Flags.RESULT_LEG
    ]
    assert len(dones) == 2  # the two copies a DONE always goes in


def test_a_result_packet_lost_early_is_asked_for_before_the_owners_done_comes() -> None:
    # node 1 owns shard 1 (packets 20..39): its result packet 22 to node 0 is lost
    net, log, xs = _run({(1, 0, PacketType.RESULT, 22 * 352)}, classes=1)
    done = completions(net)
    np.testing.assert_array_equal(done[0].sums, xs[0] + xs[1])
    nack = log.first(0, 1, PacketType.NACK, result_leg=True)
    done_arrives = log.first(1, 0, PacketType.DONE, result_leg=True) + HOLD
    assert nack < done_arrives
    assert log.resent(1, 0, PacketType.RESULT, 22 * 352) == 1


def test_a_droppable_packet_found_lost_before_the_done_stays_out() -> None:
    """Asked for before the sender's DONE, the owner cannot tell it was
    droppable; the sender can, and leaves it out (the bound allows it)."""
    drop = [np.zeros(40, dtype=bool) for _ in range(2)]
    drop[1][2] = True  # node 1's packet 2 of shard 0 is droppable
    net, log, xs = _run({(1, 0, PacketType.DATA, 2 * 352)}, drop=drop)
    done = completions(net)
    assert log.resent(1, 0, PacketType.DATA, 2 * 352) == 0
    assert done[0].lost_lanes == 352 and done[1].lost_lanes == 352
    expected = xs[0] + xs[1]
    expected[2 * 352 : 3 * 352] = xs[0][2 * 352 : 3 * 352]
    np.testing.assert_array_equal(done[0].sums, expected)


@pytest.mark.parametrize("seed", range(4))
def test_packets_reordered_within_the_window_are_never_asked_for(seed: int) -> None:
    """Every datagram a random delay of 0.1-1.9 ms (reordered across classes
    and with the DONEs), no loss, `reorder` 2 ms: no NACK names a packet, so
    nothing is sent twice."""
    rng = np.random.default_rng(seed)
    hosts = 3
    xs = [rng.standard_normal(60 * 352).astype(np.float32) for _ in range(hosts)]
    ref: list[Network] = []
    log = _Log(ref, set())
    log.hold = False
    net = Network(_engines(hosts), seed=seed, drop=log, delay=(0.0001, 0.0019))
    ref.append(net)
    classes = [rng.integers(1, 6, 60).astype(np.uint8) for _ in range(hosts)]
    _submit(net, xs, classes, None)
    net.run(until=10.0)
    assert sorted(completions(net)) == list(range(hosts))
    for e in net.engines.values():
        assert e.stats["data_retransmits"] == 0 and e.stats["result_retransmits"] == 0
