"""Results sent before their shard completes (`dlcp.core.early`): the sums
they carry are the shard's own to the bit, a lost one is found by the
pointers of those queued after it in its class and answered before the
shard completes, and the rest of the shard goes without them."""

from __future__ import annotations

import numpy as np
import pytest

from dlcp.core.accumulator import ShardAccumulator
from dlcp.core.early import EarlyResults
from dlcp.core.engine import Engine, JobSpec
from dlcp.core.stream import pointers
from dlcp.core.timing import Timing
from dlcp.daemon.config import parse
from dlcp.errors import LocalError
from dlcp.wire import Codec, Flags, PacketType
from tests.netsim import Network
from tests.test_engine import completions
from tests.test_found_lost import HOLD, JOB, KEY, _Log, _submit

DELAY = 0.0005


def _engines(hosts: int, early: int) -> dict[int, Engine]:
    engines = {}
    for me in range(hosts):
        e = Engine(timing=Timing(), early_results=early)
        e.add_job(JobSpec.transpose(JOB, KEY, me, hosts))
        engines[me] = e
    return engines


def _run(
    hosts: int, early: int, lose: set[tuple[int, int, int, int]], seed: int = 0
) -> tuple[Network, _Log, list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    n = 30 * hosts  # packets
    xs = [rng.standard_normal(n * 352).astype(np.float32) * 10.0**h for h in range(hosts)]
    classes = [rng.integers(1, 6, n).astype(np.uint8) for _ in range(hosts)]
    ref: list[Network] = []
    log = _Log(ref, lose)
    net = Network(_engines(hosts, early), seed=1, drop=log, delay=(DELAY, DELAY))
    ref.append(net)
    _submit(net, xs, classes, None)
    net.run(until=10.0)
    return net, log, xs


@pytest.mark.parametrize("hosts", [2, 3, 4])
def test_early_results_are_the_sums_the_whole_shard_gives(hosts: int) -> None:
    # the last data packet of each shard from its next host is lost, and found
    # lost only by that host's DONE, HOLD late: every other packet is in long
    # before the shards complete, so nearly all results go early
    lose = {((s + 1) % hosts, s, PacketType.DATA, (30 * s + 29) * 352) for s in range(hosts)}
    base, _, _ = _run(hosts, 0, set(lose))
    net, log, _ = _run(hosts, 4, set(lose))
    early = sum(e.stats["early_results"] for e in net.engines.values())
    assert early > 0.9 * sum(e.stats["result_packets_sent"] for e in net.engines.values())
    assert sum(e.stats["early_results"] for e in base.engines.values()) == 0
    want, got = completions(base), completions(net)
    assert sorted(got) == list(range(hosts))
    for n in range(hosts):  # bit for bit: the same additions in the same order
        assert got[n].sums.tobytes() == want[n].sums.tobytes()
        assert got[n].sums.tobytes() == got[0].sums.tobytes()
    # they went before the owners' shards completed: before the data DONEs came
    first_early = min(t for t, _, _, ty, fl, _ in log.sent if ty == PacketType.RESULT)
    assert first_early < min(t for t, _, _, ty, _, _ in log.sent if ty == PacketType.DONE) + HOLD
    assert any(fl & Flags.EARLY for _, _, _, ty, fl, _ in log.sent if ty == PacketType.RESULT)
    # nothing is sent twice: no result packet goes early and again at the end
    sent = [(a, b, off) for _, a, b, ty, fl, off in log.sent if ty == PacketType.RESULT]
    assert len(sent) == len(set(sent))


def test_a_lost_early_result_is_asked_for_and_resent_before_its_shard_completes() -> None:
    # node 1 owns shard 1 (packets 30..59), which completes late: node 0's
    # packet 59 to it is lost, found lost by node 0's DONE, HOLD late. Node 1's
    # early result packet 40 to node 0 is lost too. The next one queued in its
    # class points at it: node 0 asks for it before the owner's shard
    # completes, and the owner answers from the datagram it sent early (with
    # no pointers only the owner's DONE said the packet was lost; a NACK
    # before it met no finished shard and was ignored)
    lose = {(1, 0, PacketType.RESULT, 40 * 352), (0, 1, PacketType.DATA, 59 * 352)}
    net, log, xs = _run(2, 4, lose)
    done = completions(net)
    assert done[0].sums.tobytes() == done[1].sums.tobytes()
    np.testing.assert_array_equal(done[0].sums, xs[0] + xs[1])
    data_done = log.first(0, 1, PacketType.DONE, result_leg=False) + HOLD
    nack = log.first(0, 1, PacketType.NACK, result_leg=True)
    assert nack < data_done < log.first(1, 0, PacketType.DONE, result_leg=True)
    resent = [
        t
        for t, a, b, ty, fl, off in log.sent
        if (a, b, ty, off) == (1, 0, PacketType.RESULT, 40 * 352) and fl & Flags.RETRANSMIT
    ]
    assert len(resent) == 1 and resent[0] < data_done


def test_the_pointers_name_the_two_queued_before_in_the_same_class() -> None:
    e = EarlyResults.__new__(EarlyResults)
    e._last = np.full((8, 2), -1, dtype=np.int64)
    a = e.chain(np.array([3, 5, 7, 8]), np.array([1, 2, 1, 1]), 100)
    assert pointers(a).tolist() == [[-1, -1], [-1, -1], [3, -1], [7, 3]]
    a = e.chain(np.array([9, 10]), np.array([1, 2]), 100)  # a later batch: chained on
    assert pointers(a).tolist() == [[8, 7], [5, -1]]
    assert not e.chain(np.array([70_000]), np.array([1]), 70_001).any()  # do not fit 16 bits


@pytest.mark.parametrize("senders", [1, 2, 3, 5, 9, 17])
def test_sums_of_some_packets_are_the_bits_the_whole_shard_gets(senders: int) -> None:
    rng = np.random.default_rng(senders)
    counts = rng.integers(1, 50, 40)
    lanes = int(counts.sum())
    received = np.ones((senders, 40), dtype=bool)
    rows = rng.standard_normal((senders, lanes)).astype(np.float32) * rng.uniform(
        1, 1e4, (senders, 1)
    ).astype(np.float32)

    def acc() -> tuple[ShardAccumulator, np.ndarray]:
        a = ShardAccumulator(
            shard=0, codec=Codec.FP32, lanes=lanes, received=received, counts=counts
        )
        a.slots[:] = rows
        out = np.full(lanes, np.nan, dtype=np.float32)
        a.sum_into(out)
        return a, out

    whole, out = acc()
    whole.finish()
    part, early = acc()
    for mask in (rng.random(40) < 0.3, rng.random(40) < 0.5):
        part.sum_packets(mask)
        starts = np.concatenate(([0], np.cumsum(counts)))
        for p in np.flatnonzero(mask):
            a, b = starts[p], starts[p + 1]
            assert early[a:b].tobytes() == out[a:b].tobytes()
    part.finish()
    assert early.tobytes() == out.tobytes()


def test_packets_not_all_in_are_not_summed_early() -> None:
    received = np.ones((2, 4), dtype=bool)
    received[1, 2] = False
    a = ShardAccumulator(
        shard=0, codec=Codec.FP32, lanes=8, received=received, counts=np.full(4, 2)
    )
    a.sum_into(np.zeros(8, dtype=np.float32))
    with pytest.raises(Exception, match="before every copy came"):
        a.sum_packets(np.array([False, False, True, False]))


@pytest.mark.parametrize("bad", [-1, True, 1.5, "32"])
def test_a_bad_early_results_setting_is_refused(bad: object) -> None:
    with pytest.raises(LocalError, match=r"network\.early_results"):
        parse({"network": {"early_results": bad}})
