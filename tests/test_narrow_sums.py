"""THC's sums in the bits they need (`lanes.narrow_sums`, codecs THC8_SUM10 and
THC4_SUM8): result packets of a shard whose sums fit carry them narrow; the
collector stores them into its uint16 sums exactly as the wide ones."""

from __future__ import annotations

import numpy as np
import pytest

from dlcp.codecs import lanes
from dlcp.core.engine import Engine, JobSpec, RoundComplete, Send
from dlcp.core.layout import Layout
from dlcp.core.timing import Timing
from dlcp.errors import LocalError, Reason
from dlcp.wire import Codec, Flags, PacketType
from dlcp.wire.header import Header, encode, header_of_valid, lane_bytes
from dlcp.wire.mac import mac_state
from tests.netsim import Network
from tests.test_engine import completions

KEY = b"n" * 32
JOB = 5


@pytest.mark.parametrize(("codec", "top"), [(Codec.THC8_SUM10, 1023), (Codec.THC4_SUM8, 255)])
@pytest.mark.parametrize("n", [1, 3, 4, 5, 512, 683, 1027])
def test_pack_and_unpack_are_inverse(codec: Codec, top: int, n: int) -> None:
    v = np.random.default_rng(n).integers(0, top + 1, n).astype(np.uint16)
    v[0] = top
    raw = lanes.pack(codec, v, True)
    assert len(raw) == lane_bytes(codec, n, True)
    np.testing.assert_array_equal(lanes.unpack(codec, raw, n, True), v)
    with pytest.raises(ValueError):
        lanes.pack(codec, np.array([top + 1], np.uint16), True)


def test_a_run_of_narrow_packets_is_stored_at_once_and_one_by_one_alike() -> None:
    v = np.random.default_rng(1).integers(0, 1024, 4096).astype(np.uint16)
    starts, counts = np.arange(0, 4096, 512), np.full(8, 512)
    raw = [lanes.pack(Codec.THC8_SUM10, v[s : s + 512], True) for s in starts]
    run, single = np.zeros(4096, np.uint16), np.zeros(4096, np.uint16)
    lanes.store_runs(run, Codec.THC8_SUM10, True, starts, counts, raw)
    lanes.store_many(single, Codec.THC8_SUM10, True, zip(starts, counts, raw, strict=True))
    np.testing.assert_array_equal(run, v)
    np.testing.assert_array_equal(single, v)
    with pytest.raises(Exception, match="bytes"):  # a short packet: BAD_LENGTH
        lanes.store_runs(run, Codec.THC8_SUM10, True, starts, counts, [*raw[:-1], raw[-1][:-1]])


def test_narrow_only_where_every_sum_fits_and_packets_hold_whole_bytes() -> None:
    offs, counts = np.arange(0, 2048, 512), np.full(4, 512)
    fits = np.full(2048, 1020, np.uint16)
    got = lanes.narrow_sums(Codec.THC8, fits, offs, counts)
    assert got is not None and got[0] == Codec.THC8_SUM10 and got[1].size == 2048 * 10 // 8
    over = fits.copy()
    over[7] = 1024  # five hosts' 8-bit values can sum past 10 bits: the wide lanes go
    assert lanes.narrow_sums(Codec.THC8, over, offs, counts) is None
    odd = np.array([0, 511, 1024]), np.array([511, 513, 1024])  # 511 lanes: not whole bytes
    assert lanes.narrow_sums(Codec.THC8, fits, *odd) is None
    assert lanes.narrow_sums(Codec.FP32, fits.astype(np.float32), offs, counts) is None
    assert lanes.narrow_sums(Codec.THC4, np.full(2048, 255, np.uint16), offs, counts)


def _round(hosts: int, xs: list[bytes]) -> tuple[list[Engine], list[set[int]]]:
    """A transpose round of thc8 `xs` among `hosts` engines; the codecs of the
    result packets each engine received."""
    engines = []
    for me in range(hosts):
        e = Engine()
        e.add_job(JobSpec.transpose(JOB, KEY, me, hosts))
        e.submit(job=JOB, round=0, bucket=0, codec=Codec.THC8, total=8192, lanes=xs[me], now=0.0)
        engines.append(e)
    seen: list[set[int]] = [set() for _ in range(hosts)]
    for _ in range(50):
        out = [(me, s) for me, e in enumerate(engines) for s in e.datagrams_to_send()]
        if not out:
            break
        for src, s in out:
            h = header_of_valid(s.datagram)
            if h.type == PacketType.RESULT:
                seen[s.node].add(int(h.codec))
            engines[s.node].receive(s.datagram, 0.0, src=src)
    return engines, seen


@pytest.mark.parametrize(("hosts", "narrow"), [(3, True), (4, True), (5, False)])
def test_results_go_narrow_while_the_sums_fit_and_sum_exactly(hosts: int, narrow: bool) -> None:
    rng = np.random.default_rng(hosts)
    values = [np.full(8192, 255, np.uint8) for _ in range(hosts)]  # the largest sums
    values[0][:100] = rng.integers(0, 256, 100)
    engines, seen = _round(hosts, [v.tobytes() for v in values])
    want = np.sum([v.astype(np.uint16) for v in values], axis=0)
    for me, e in enumerate(engines):
        ev = e.next_event()
        assert isinstance(ev, RoundComplete), ev
        np.testing.assert_array_equal(ev.sums, want)
        assert seen[me] == {Codec.THC8_SUM10 if narrow else Codec.THC8}


def test_a_data_packet_with_a_narrow_codec_is_refused() -> None:
    e = Engine()
    e.add_job(JobSpec.transpose(JOB, KEY, 0, 2))
    h = Header(
        type=PacketType.DATA,
        job=JOB,
        round=0,
        bucket=0,
        flags=Flags.NONE,
        codec=Codec.THC8_SUM10,
        shard=0,
        sender=1,
        contributors=1,
        offset=0,
        count=1024,
        total=2048,
    )
    dg = encode(h, bytes(1024), mac_state(KEY, "blake2b"))
    assert e.receive(dg, 0.0, src=1) is None
    assert e.rejects[Reason.BAD_CODEC] == 1


def test_narrow_runs_check_each_payloads_length_not_just_their_total() -> None:
    """A run whose payloads' lengths add up but are not each a packet's (1 byte
    for 0 lanes, 4 for 4 ten-bit lanes that take 5) is BAD_LENGTH, as the C
    store says; the one-pass unpack once checked only the total (found by the
    bulk_store_lanes fuzz target)."""
    from dlcp.errors import RemoteError

    for native in (False, True):
        dest = np.zeros(16, np.uint16)
        starts, counts = np.array([0, 0], np.int64), np.array([0, 4], np.int64)
        with pytest.raises(RemoteError, match="bad_length"):
            payloads = [b"\x01", b"\x02" * 4]
            lanes.store_runs(dest, Codec.THC8_SUM10, True, starts, counts, payloads, native=native)


def test_a_narrow_layout_cuts_one_result_packet_a_data_packet() -> None:
    wide = Layout(total=8192, codec=Codec.THC8, shards=2)
    narrow = Layout(total=8192, codec=Codec.THC8, shards=2, narrow=True)
    assert (wide.result_split, narrow.result_split) == (2, 1)  # 1024 10-bit lanes: 1280 bytes
    thc4 = [Layout(total=8192, codec=Codec.THC4, shards=2, narrow=n) for n in (False, True)]
    assert [lay.result_split for lay in thc4] == [3, 2]  # 2048 lanes: 4096 and 2048 bytes
    with pytest.raises(LocalError, match="no narrow sums"):
        Layout(total=8192, codec=Codec.FP32, shards=2, narrow=True)
    spec = JobSpec.transpose(JOB, KEY, 0, 3, ranks=4)
    assert spec.layout(8192, Codec.THC8).narrow and not spec.layout(8192, Codec.FP16).narrow
    assert not JobSpec.transpose(JOB, KEY, 0, 3, ranks=5).layout(8192, Codec.THC8).narrow
    assert not JobSpec.transpose(JOB, KEY, 0, 3).layout(8192, Codec.THC8).narrow  # not known
    with pytest.raises(LocalError, match="2 ranks for 3 contributors"):
        JobSpec.transpose(JOB, KEY, 0, 3, ranks=2)


def _lossy_round(
    ranks: int, values: list[np.ndarray], weights: list[int] | None = None
) -> tuple[list[RoundComplete], list[tuple[int, int]]]:
    """A transpose thc8 round among len(values) engines of a job of `ranks`
    ranks, 5 % loss; the (codec, count) of every result packet sent."""
    hosts = len(values)
    engines = {}
    for me in range(hosts):
        e = Engine(timing=Timing(), early_results=4)
        e.add_job(JobSpec.transpose(JOB, KEY, me, hosts, ranks=ranks))
        engines[me] = e
    results: list[tuple[int, int]] = []

    def note(src: int, s: Send) -> bool:
        h = header_of_valid(s.datagram)
        if h.type == PacketType.RESULT:
            results.append((int(h.codec), h.count))
        return False

    net = Network(engines, seed=3, loss=0.05, drop=note)
    for me, v in enumerate(values):
        w = 1 if weights is None else weights[me]
        lanes_ = v.astype("<u2").tobytes() if w > 1 else v.astype(np.uint8).tobytes()
        engines[me].submit(
            job=JOB, round=0, bucket=0, codec=Codec.THC8, total=v.size, lanes=lanes_,
            summed=w > 1, weight=w, scale=1.0, now=0.0,
        )  # fmt: skip
    net.run(until=30.0)
    done = completions(net)
    return [done[n] for n in range(hosts)], results


@pytest.mark.parametrize("hosts", [2, 3, 4])
def test_a_job_whose_ranks_fit_the_narrow_sums_sends_half_the_result_packets(hosts: int) -> None:
    rng = np.random.default_rng(hosts)
    values = [rng.integers(0, 256, 64 * 1024).astype(np.uint16) for _ in range(hosts)]
    values[0][:3000] = 255
    for v in values[1:]:
        v[:3000] = 255  # the largest sums there are
    want = np.sum(values, axis=0)
    wide, wide_sent = _lossy_round(0, values)
    narrow, narrow_sent = _lossy_round(hosts, values)
    for a, b in zip(wide, narrow, strict=True):
        np.testing.assert_array_equal(a.sums, want)
        np.testing.assert_array_equal(b.sums, want)
    assert {c for c, _ in narrow_sent} == {Codec.THC8_SUM10}
    assert {n for _, n in narrow_sent} == {1024}  # a whole data packet's lanes
    assert {n for _, n in wide_sent} == {512}
    assert len(narrow_sent) < 0.6 * len(wide_sent)


def test_sums_past_a_narrow_layout_s_lanes_are_cut_to_their_top() -> None:
    # a sender claims 4 contributions in a job of 2 ranks: its own lanes sum
    # past what the job's ranks can make, and the narrow result packets have
    # no room for them; the round still completes, those lanes at 1023 on
    # every host, the shard's owner too (its own copy is cut as it is sent)
    a = np.full(4096, 255, np.uint16)
    b = np.full(4096, 1000, np.uint16)
    b[:100] = 3
    done, sent = _lossy_round(2, [a, b], weights=[1, 4])
    want = np.minimum(a + b, 1023)
    for ev in done:
        np.testing.assert_array_equal(ev.sums, want)
    assert {c for c, _ in sent} == {Codec.THC8_SUM10}
