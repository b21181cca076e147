"""A shard's DONE manifest in parts, each within the job's payload budget.

Sans-IO: engines on the simulated network (tests/netsim.py) with a small
payload budget (64 bytes: 16 fp32 lanes a packet, 512 packets a DONE part),
so that small buckets have shards of several parts.
"""

from __future__ import annotations

import numpy as np
import pytest

from dlcp.core.engine import Engine, JobSpec, Send, manifest_capacity
from dlcp.errors import Reason
from dlcp.wire import Codec, PacketType, decode
from dlcp.wire.header import HEADER_SIZE, Header, encode
from tests.netsim import Network
from tests.test_engine import JOB, KEY, completions, smallest_norm_droppable, submit_all
from tests.test_engine import cluster as engines

PAYLOAD = 64
PER = manifest_capacity(PAYLOAD)  # 512 packets a part


def header(s: Send) -> Header:
    return decode(bytes(s.datagram), {JOB: KEY})[0]


def test_each_done_part_fits_the_payload_budget_and_they_cover_the_shard() -> None:
    xs = [np.ones(40_000, np.float32) for _ in range(2)]  # 2,500 packets, 1,250 a shard
    net = Network(engines(2, payload=PAYLOAD))
    lay = submit_all(net, xs, payload=PAYLOAD)
    dones = [
        (header(s), len(s.datagram))
        for s in net.engines[0].datagrams_to_send()
        if s.datagram[3] == PacketType.DONE
    ]
    n = len(lay.shard_packets(1))
    assert n == 1_250
    heads = [h for h, _ in dones]
    # sent twice (insurance), each time in parts of PER packets
    assert [(h.offset, h.count) for h in heads] == 2 * [
        (0, PER),
        (PER, PER),
        (2 * PER, n - 2 * PER),
    ]
    assert all(size <= HEADER_SIZE + PAYLOAD for _, size in dones)


@pytest.mark.parametrize("bound", [0.0, 0.05])
def test_sums_are_exact_with_parts_under_loss(bound: float) -> None:
    """Loss of 20 % (DONE parts too): every round completes; with a bound,
    starving the droppable packets leaves exactly them out, which needs
    each part's droppable bits at their place."""
    rng = np.random.default_rng(8)
    xs = [rng.standard_normal(60_000).astype(np.float32) for _ in range(3)]

    def starve(src: int, s: Send) -> bool:
        return bound > 0 and bool(s.droppable)

    net = Network(engines(3, payload=PAYLOAD), seed=9, loss=0.0 if bound else 0.2, drop=starve)
    lay = submit_all(net, xs, bound=bound, payload=PAYLOAD)
    assert len(lay.shard_packets(0)) > 2 * PER  # three parts a shard
    net.run()
    done = completions(net)
    assert len(done) == 3
    if not bound:
        for ev in done.values():
            np.testing.assert_array_equal(ev.sums, np.sum(np.stack(xs), axis=0))
        return
    drops = [smallest_norm_droppable(x, lay, bound) for x in xs]
    for h, d in enumerate(drops):
        pk = lay.shard_packets(h)  # host h owns shard h: its own are not sent
        d[pk.start : pk.stop] = False
    rows = [
        np.where(np.repeat(d, lay.packet_counts()), np.float32(0), x)
        for x, d in zip(xs, drops, strict=True)
    ]
    assert 0 < done[0].lost_lanes <= bound * done[0].total_lanes
    np.testing.assert_array_equal(done[0].sums, np.sum(np.stack(rows), axis=0))


def test_a_lost_part_is_asked_for_and_the_round_completes() -> None:
    """The droppable packets are all lost, and both copies of one sender's
    middle DONE part: its manifest stays incomplete, so the owner cannot
    tell lost droppable packets from lost required ones and asks for the
    manifest (NEED_MANIFEST); the sender sends all its parts again, the
    repeats change nothing, and the round completes within the bound with
    exactly the droppable packets left out."""
    rng = np.random.default_rng(10)
    xs = [rng.standard_normal(40_000).astype(np.float32) for _ in range(2)]
    lost = []

    def droppable_and_middle_part(src: int, s: Send) -> bool:
        if s.droppable:
            return True
        done = src == 1 and s.datagram[3] == PacketType.DONE
        if done and len(lost) < 2 and header(s).offset == PER:
            lost.append(s)
            return True
        return False

    net = Network(engines(2, payload=PAYLOAD), drop=droppable_and_middle_part)
    lay = submit_all(net, xs, bound=0.05, payload=PAYLOAD)
    net.run()
    assert len(lost) == 2
    done = completions(net)
    assert len(done) == 2
    assert net.engines[0].stats["data_nacks_sent"] >= 1  # the manifest asked for
    d = smallest_norm_droppable(xs[1], lay, 0.05)
    own = lay.shard_packets(1)
    d[own.start : own.stop] = False  # host 1's own shard is not sent
    row1 = np.where(np.repeat(d, lay.packet_counts()), np.float32(0), xs[1])
    o, c = lay.shard_range(0)
    np.testing.assert_array_equal(done[0].sums[o : o + c], (xs[0] + row1)[o : o + c])


@pytest.mark.parametrize(
    ("offset", "count", "why"),
    [(1, PER, "not on a part's boundary"), (0, PER - 1, "short"), (2 * PER, PER, "past the end")],
)
def test_a_part_off_the_partition_is_rejected(offset: int, count: int, why: str) -> None:
    """Parts must be those the senders make (so that they cannot overlap):
    another is a BAD_RANGE reject and changes nothing."""
    owner = engines(2, payload=PAYLOAD)[0]
    xs = np.ones(40_000, np.float32)  # shard 0: packets 0..1249 in 3 parts
    owner.submit(job=JOB, round=0, bucket=0, codec=Codec.FP32, total=xs.size,
                 lanes=xs.tobytes(), now=0.0)  # fmt: skip
    h = Header(
        type=PacketType.DONE,
        job=JOB,
        round=0,
        bucket=0,
        shard=0,
        sender=1,
        contributors=1,
        offset=offset,
        count=count,
        total=xs.size,
    )
    before = owner.rejects[Reason.BAD_RANGE]
    assert owner.receive(encode(h, bytes((count + 7) // 8), KEY), 0.0, 1) is None, why
    assert owner.rejects[Reason.BAD_RANGE] == before + 1


def test_a_shard_past_the_old_single_done_limit_is_sent() -> None:
    """One DONE for a whole shard could not be encoded past 523,544 packets
    (its bitmap over a datagram), and such buckets were refused; in parts
    the shard's size has no limit of its own: the submit goes through and
    its DONE parts, each within the payload budget, cover the shard."""
    payload = 8  # 2 fp32 lanes a packet, 64 packets a DONE part
    e = Engine()
    e.add_job(JobSpec.transpose(JOB, KEY, 0, 2, payload=payload))
    lanes = np.ones(2 * 2 * 523_545, np.float32)  # two shards of 523,545 packets
    e.submit(job=JOB, round=0, bucket=0, codec=Codec.FP32, total=lanes.size,
             lanes=lanes.tobytes(), now=0.0)  # fmt: skip
    parts = [
        header(s) for s in e.datagrams_to_send() if s.datagram[3] == PacketType.DONE
    ]  # both copies
    assert len(parts) == 2 * -(-523_545 // manifest_capacity(payload))
    assert sum(h.count for h in parts) == 2 * 523_545
    assert max(h.count for h in parts) == manifest_capacity(payload) == 64
