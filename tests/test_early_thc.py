"""THC's results sent before their shard completes (`dlcp.core.early`): in
the narrow sums where every sum the shard's contributions can make fits them
(three hosts' thc8 in 10 bits), the same codec for the packets sent early,
those sent when the shard completes and a NACK's answer; none early where a
sum may not fit (five hosts' thc8)."""

from __future__ import annotations

import numpy as np
import pytest

from dlcp.core.early import early_codec
from dlcp.core.engine import Engine, JobSpec, Send
from dlcp.core.layout import Layout
from dlcp.core.timing import Timing
from dlcp.wire import Codec, Flags, PacketType, decode
from tests.netsim import Network
from tests.test_engine import completions
from tests.test_found_lost import HOLD, JOB, KEY

DELAY = 0.0005
PACKETS = 30  # data packets a shard


class _Log:
    """Every datagram sent (time, src, dst, type, flags, offset, codec); the
    first transmission of those in `lose` is lost, and every DONE arrives
    `HOLD` late (the in-memory network has no link rate)."""

    def __init__(self, lose: set[tuple[int, int, int, int]]) -> None:
        self.net: Network | None = None
        self.lose = lose
        self.sent: list[tuple[float, int, int, int, int, int, int]] = []

    def __call__(self, src: int, s: Send) -> bool:
        assert self.net is not None
        dg = bytes(s.datagram)
        h, _ = decode(dg, {JOB: KEY})
        self.sent.append((self.net.now, src, s.node, h.type, h.flags, h.offset, h.codec))
        key = (src, s.node, h.type, h.offset)
        if key in self.lose and not h.flags & Flags.RETRANSMIT:
            self.lose.discard(key)
            return True
        if h.type == PacketType.DONE:
            self.net.deliver_at(self.net.now + HOLD, src, s.node, dg)
            return True
        return False

    def results(self) -> list[tuple[float, int, int, int, int, int, int]]:
        return [e for e in self.sent if e[3] == PacketType.RESULT]


def _run(
    hosts: int, early: int, lose: set[tuple[int, int, int, int]]
) -> tuple[Network, _Log, list[np.ndarray], int]:
    per = Layout(total=1 << 20, codec=Codec.THC8, shards=hosts).per_packet
    rng = np.random.default_rng(hosts)
    xs = [rng.integers(0, 256, PACKETS * hosts * per).astype(np.uint8) for _ in range(hosts)]
    xs[0][: per * 4] = 255  # the largest sums there are
    engines = {}
    for me in range(hosts):
        e = Engine(timing=Timing(), early_results=early)
        e.add_job(JobSpec.transpose(JOB, KEY, me, hosts))
        engines[me] = e
    log = _Log(lose)
    net = Network(engines, seed=1, drop=log, delay=(DELAY, DELAY))
    log.net = net
    for me, x in enumerate(xs):
        net.engines[me].submit(
            job=JOB, round=0, bucket=0, codec=Codec.THC8, total=x.size, lanes=x.tobytes(),
            scale=1.5, now=net.now,
        )  # fmt: skip
    net.run(until=10.0)
    return net, log, xs, per


@pytest.mark.parametrize(("hosts", "goes_early"), [(2, True), (3, True), (4, True), (5, False)])
def test_thc_results_go_early_in_the_narrow_sums_where_every_sum_fits(
    hosts: int, goes_early: bool
) -> None:
    # the last data packet of each shard from its next host is lost, found lost
    # only by that host's DONE, HOLD late: the rest of the shard is whole long
    # before it completes
    per = Layout(total=1 << 20, codec=Codec.THC8, shards=hosts).per_packet
    lose = {
        ((s + 1) % hosts, s, PacketType.DATA, (PACKETS * s + PACKETS - 1) * per)
        for s in range(hosts)
    }
    base, base_log, xs, _ = _run(hosts, 0, set(lose))
    net, log, _, _ = _run(hosts, 4, set(lose))
    want = np.sum([x.astype(np.uint16) for x in xs], axis=0)
    got, ref = completions(net), completions(base)
    assert sorted(got) == list(range(hosts))
    for n in range(hosts):
        np.testing.assert_array_equal(got[n].sums, want)
        assert got[n].sums.tobytes() == ref[n].sums.tobytes()
    early = [e for e in log.results() if e[4] & Flags.EARLY]
    sent = sum(e.stats["result_packets_sent"] for e in net.engines.values())
    assert sum(e.stats["early_results"] for e in net.engines.values()) == len(early)
    # one codec a shard whether its results went early or not, and the same
    # codec as without early results
    assert {e[6] for e in log.results()} == {e[6] for e in base_log.results()}
    if goes_early:
        assert len(early) > 0.9 * sent
        assert {e[6] for e in log.results()} == {Codec.THC8_SUM10}
    else:
        assert not early
        assert {e[6] for e in log.results()} == {Codec.THC8}  # five 255s need 11 bits
    offsets = [(e[1], e[2], e[5]) for e in log.results()]
    assert len(offsets) == len(set(offsets))  # none went early and again at the end


def test_a_lost_narrow_early_result_is_answered_in_its_codec() -> None:
    # node 1's shard completes late (node 0's last packet to it is lost); its
    # early result packet 40 to node 0 is lost too, asked for before the shard
    # completes and answered from the datagram first sent: narrow, as the rest
    per = Layout(total=1 << 20, codec=Codec.THC8, shards=2).per_packet
    lose = {(1, 0, PacketType.RESULT, 40 * per), (0, 1, PacketType.DATA, 59 * per)}
    net, log, xs, _ = _run(2, 4, lose)
    done = completions(net)
    np.testing.assert_array_equal(done[0].sums, xs[0].astype(np.uint16) + xs[1])
    assert done[0].sums.tobytes() == done[1].sums.tobytes()
    again = [e for e in log.results() if e[4] & Flags.RETRANSMIT]
    assert again and all(e[6] == Codec.THC8_SUM10 for e in again)
    assert (1, 0, 40 * per) in {(e[1], e[2], e[5]) for e in again}


def test_the_early_codec_is_the_narrow_one_only_where_every_sum_fits() -> None:
    class _Agg:
        def __init__(self, codec: Codec, weights: list[int]) -> None:
            self.layout = Layout(total=8192, codec=codec, shards=2)
            self.shard = 0
            self.weight = np.array(weights, dtype=np.int64)

    assert early_codec(_Agg(Codec.FP16, [1, 1])) == Codec.FP16  # type: ignore[arg-type]
    assert early_codec(_Agg(Codec.THC8, [1, 3])) == Codec.THC8_SUM10  # type: ignore[arg-type]
    assert early_codec(_Agg(Codec.THC8, [2, 3])) is None  # type: ignore[arg-type]
    assert early_codec(_Agg(Codec.THC4, [9, 8])) == Codec.THC4_SUM8  # type: ignore[arg-type]
    assert early_codec(_Agg(Codec.THC4, [9, 9])) is None  # type: ignore[arg-type]
    assert early_codec(_Agg(Codec.SKETCH, [1, 1])) is None  # type: ignore[arg-type]
