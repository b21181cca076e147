"""Flow control: a peer is sent at most its window of bytes it has not credited.

The outbox side is sans-IO here (a path stand-in that takes every datagram,
virtual time); the daemons' side (credits sent as bytes leave the sockets,
taken back by the sender) runs with real daemons on loopback.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Iterator
from contextlib import contextmanager
from itertools import pairwise
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dlcp.core.rate import RateConfig
from dlcp.daemon.flow import CREDIT_STEP, CREDIT_TIMEOUT, WINDOW_MIN
from dlcp.daemon.outbox import Outbox, Peer
from dlcp.policies import from_config
from dlcp.wire import Header, PacketType, encode
from tests.daemons import Daemon, Rank, hosts_of, loopback_daemons, submit

KEY = bytes(range(32))
JOB = 7
PAYLOAD = 8800  # bytes of lanes a datagram (2,200 fp32 lanes)
DATAGRAM = PAYLOAD + 64


class TakeAll:
    """A UdpPath stand-in: takes every datagram, counts the bytes."""

    address = "10.0.0.1"

    def __init__(self) -> None:
        self.bytes = 0

    def send(self, batch: list[bytes], dest: tuple[str, int], tos: int) -> int:
        self.bytes += sum(map(len, batch))
        return len(batch)


def make(window: int) -> tuple[Outbox, Peer, TakeAll]:
    path = TakeAll()
    ob = Outbox(
        [path],  # type: ignore[list-item]
        dscp=(48, 40, 34, 26, 18, 10, 0, 8),
        rate=RateConfig(),
        pacing=False,
        balancer_factory=lambda: from_config("balance", "spray"),
        window_bytes=window,
    )
    return ob, ob.peer(("10.0.0.2",), 7400, 0.0), path


def data(n: int) -> list[bytes]:
    lanes = np.zeros(PAYLOAD // 4, np.float32).tobytes()
    out = []
    for i in range(n):
        h = Header(
            PacketType.DATA,
            JOB,
            1,
            0,
            priority=3,
            shard=0,
            sender=0,
            contributors=1,
            offset=i * 2200,
            count=2200,
            total=1 << 30,
        )
        out.append(encode(h, lanes, KEY))
    return out


@contextmanager
def joined(ds: list[Daemon], tag: str, tmp_path: Path, size: int) -> Iterator[list[Rank]]:
    """A rank at each daemon (a sealed segment of `size` bytes), all in job
    JOB together; closed on the way out, whatever happened."""
    ranks: list[Rank] = []
    try:
        for i, d in enumerate(ds):
            ranks.append(Rank(d, f"dlcp-{tag}{i}-{tmp_path.name[-12:]}", size, sealed=True))
        for i, r in enumerate(ranks):
            r.join(job=JOB, key=KEY, hosts=hosts_of(ds), me=i)
        yield ranks
    finally:
        for r in ranks:
            r.close()


def test_a_peer_gets_no_more_than_its_window_until_it_credits() -> None:
    ob, peer, path = make(WINDOW_MIN)
    n = 3 * WINDOW_MIN // DATAGRAM
    assert ob.push_many(peer, data(n), [3] * n) == n
    ob.flush(0.0)
    first = path.bytes
    assert WINDOW_MIN - DATAGRAM < first <= WINDOW_MIN  # a window, no more
    assert peer.queued and peer.window_stalls == 1
    assert ob.next_wake == pytest.approx(CREDIT_TIMEOUT)  # back when it would give up
    ob.flush(0.01)  # no credit yet: nothing more
    assert path.bytes == first and peer.window_stalls == 1
    ob.on_credit(peer, received=first // 2, epoch=5)  # half of it left the peer's socket
    ob.flush(0.02)
    assert first // 2 - DATAGRAM < path.bytes - first <= first // 2
    assert peer.in_flight <= WINDOW_MIN
    for t in range(3, 20):  # the peer credits all it has: the rest goes
        ob.on_credit(peer, received=path.bytes, epoch=5)
        ob.flush(t / 100)
        assert path.bytes - peer.credited <= WINDOW_MIN
    assert peer.queued == 0 and path.bytes == n * DATAGRAM
    assert peer.window_resets == 0 and ob.credits > 2


def test_no_window_sends_everything_at_once() -> None:
    ob, peer, path = make(0)
    n = 3 * WINDOW_MIN // DATAGRAM
    ob.push_many(peer, data(n), [3] * n)
    ob.flush(0.0)
    assert peer.queued == 0 and path.bytes == n * DATAGRAM and peer.window_stalls == 0


def test_a_full_window_without_credit_sends_a_probe_after_the_timeout() -> None:
    """A lost credit (or bytes the peer's socket dropped, which it never
    counts, or a peer that restarted) cannot stop the sending for good: after
    CREDIT_TIMEOUT a probe of CREDIT_STEP bytes goes, not a whole window (the
    peer may still hold the first), and the next credit sent when the peer's
    sockets were empty, whatever its count, is matched to what was sent by
    then."""
    ob, peer, path = make(WINDOW_MIN)
    n = 3 * WINDOW_MIN // DATAGRAM
    ob.push_many(peer, data(n), [3] * n)
    ob.flush(0.0)
    first = path.bytes
    ob.flush(CREDIT_TIMEOUT / 2)
    assert path.bytes == first
    ob.flush(CREDIT_TIMEOUT)  # none came: a probe goes
    assert peer.window_resets == 1
    assert CREDIT_STEP - DATAGRAM < path.bytes - first <= CREDIT_STEP
    probe = path.bytes
    ob.flush(CREDIT_TIMEOUT * 1.5)  # and nothing more until a credit or the next timeout
    assert path.bytes == probe
    ob.on_credit(peer, received=123, epoch=9, drained=True)  # all sent so far counts
    assert peer.credited == peer.sent_total == probe
    ob.flush(0.1)
    assert WINDOW_MIN - DATAGRAM < path.bytes - probe <= WINDOW_MIN  # a whole window again
    # later counts of that epoch are matched from there
    ob.on_credit(peer, received=123 + 1000, epoch=9)
    assert peer.credited == probe + 1000


def test_after_a_probe_a_peer_still_holding_bytes_is_not_taken_for_empty() -> None:
    """A peer that did not read for CREDIT_TIMEOUT (busy) still holds the
    window in its socket. Its credits while it reads it (not drained) are
    matched as before the probe, so the window opens only as the socket
    empties; only a credit sent with its sockets empty writes off what its
    count lacks (what its socket dropped). Before, the first credit after a
    probe wrote off all that was in flight, the next window went on top of
    what the socket held, and it overflowed."""
    ob, peer, _ = make(WINDOW_MIN)
    n = 4 * WINDOW_MIN // DATAGRAM
    ob.push_many(peer, data(n), [3] * n)
    ob.flush(0.0)
    ob.on_credit(peer, received=0, epoch=3)  # the peer's first count: nothing read yet
    ob.flush(CREDIT_TIMEOUT / 2)
    ob.flush(CREDIT_TIMEOUT)  # it reads nothing for that long: a probe
    assert peer.window_resets == 1 and peer.credit_resync
    ob.on_credit(peer, received=CREDIT_STEP, epoch=3)  # it reads again, not yet empty
    assert peer.credited == CREDIT_STEP  # matched from its first byte, as before the probe
    ob.flush(0.06)
    sent = peer.sent_total
    assert sent - CREDIT_STEP <= WINDOW_MIN  # no new window on top of what it holds
    ob.on_credit(peer, received=sent - DATAGRAM, epoch=3)  # all but one (dropped) read
    assert peer.credit_resync and peer.credited == sent - DATAGRAM  # the offset stays
    ob.on_credit(peer, received=sent - DATAGRAM, epoch=3, drained=True)  # and now empty
    assert not peer.credit_resync and peer.credited == peer.sent_total == sent
    assert peer.credit_offset == DATAGRAM  # the dropped datagram written off


def test_probes_without_a_credit_wait_longer_each_time() -> None:
    """A peer that reads nothing gets a probe after CREDIT_TIMEOUT, the next
    after twice that, then four times, ..., not one every CREDIT_TIMEOUT on
    top of what its socket holds; a credit starts over."""
    ob, peer, _ = make(WINDOW_MIN)
    n = 8 * WINDOW_MIN // DATAGRAM
    ob.push_many(peer, data(n), [3] * n)
    t = 0.0
    ob.flush(t)
    times = []
    while len(times) < 4:
        before = peer.window_resets
        t = ob.next_wake if ob.next_wake is not None else t + 0.001
        ob.flush(t)
        if peer.window_resets > before:
            times.append(t)
        ob.flush(t)  # the probe's bytes fill the window again: stalled anew
    gaps = [b - a for a, b in pairwise(times)]
    assert gaps == pytest.approx([2 * CREDIT_TIMEOUT, 4 * CREDIT_TIMEOUT, 8 * CREDIT_TIMEOUT])
    ob.on_credit(peer, received=0, epoch=1)  # a credit: the next probe waits CREDIT_TIMEOUT
    assert peer.probes == 0
    ob.flush(t + 0.001)
    start = peer.stalled_since
    assert start is not None and ob.next_wake == pytest.approx(start + CREDIT_TIMEOUT)


def test_a_new_epoch_is_a_restarted_peer_and_a_stale_count_is_ignored() -> None:
    ob, peer, path = make(WINDOW_MIN)
    n = 3 * WINDOW_MIN // DATAGRAM
    ob.push_many(peer, data(n), [3] * n)
    ob.flush(0.0)
    ob.on_credit(peer, received=1000, epoch=1)  # the first count: from our first byte
    assert peer.credited == 1000 and peer.credit_offset == 0
    ob.on_credit(peer, received=500, epoch=1)  # older than what we have: no step back
    assert peer.credited == 1000
    ob.on_credit(peer, received=10**12, epoch=1)  # never past what was sent
    assert peer.credited == path.bytes
    ob.flush(0.01)
    sent = path.bytes
    ob.on_credit(peer, received=10, epoch=2)  # the peer restarted: its count begins again
    assert peer.credited == sent and peer.credit_offset == sent - 10
    ob.on_credit(peer, received=10 + DATAGRAM, epoch=2)
    assert peer.credited == min(peer.sent_total, sent + DATAGRAM)


def test_daemons_credit_each_other_and_lose_nothing_past_their_socket_buffers(
    tmp_path: Path,
) -> None:
    """Two daemons whose sockets hold far less than a leg of the bucket (8 MiB
    asked, 16 MiB granted; each leg is 40 MB): with 8 MiB windows nothing is
    dropped by the kernel (no peer reports a loss), the sums are exact, and
    the credits and windows show in `status`."""
    extra = {"network": {"socket_buffer_bytes": 8 << 20, "window_bytes": WINDOW_MIN}}
    with loopback_daemons(tmp_path, 2, extra) as ds, joined(ds, "fc", tmp_path, 200 << 20) as ranks:
        rng = np.random.default_rng(3)
        xs = [rng.standard_normal(20_000_000).astype(np.float32) for _ in ranks]
        for rnd in range(2):
            waits = [submit(r, job=JOB, round=rnd, bucket=0, lanes=x, shards=2)
                     for r, x in zip(ranks, xs, strict=True)]  # fmt: skip
            for w in waits:
                res = w()
                np.testing.assert_array_equal(res.sums, xs[0] + xs[1])
        for r in ranks:
            st = r.client.status()
            (peer,) = st["peers"]
            assert peer["lost_packets"] == 0, st
            assert peer["window_bytes"] == WINDOW_MIN
            assert 0 <= peer["in_flight_bytes"] <= WINDOW_MIN
            assert st["counters"]["credits_sent"] > 0 and st["counters"]["credits_taken"] > 0
            # nothing sent again: no datagram was missing (a NACK that only
            # asks for a result DONE, which can overtake nothing, may come)
            assert st["counters"].get("data_retransmits", 0) == 0, st["counters"]
            assert st["counters"].get("result_retransmits", 0) == 0, st["counters"]


def test_a_credit_is_a_control_packet_its_peer_accepts() -> None:
    """The core makes the credit (sans-IO): a CONTROL packet of the job, MAC'd
    with its key, from this node, whose payload `credit_of` reads back; the
    peer's engine accepts it. Older daemons' shorter credits and a newer
    one's longer credit are read too; other payloads are not credits."""
    from dlcp.core.engine import Engine, JobSpec, credit_of
    from dlcp.wire import decode
    from dlcp.wire.header import HEADER_SIZE

    a, b = Engine(), Engine()
    a.add_job(JobSpec.transpose(JOB, KEY, 0, 2))
    b.add_job(JobSpec.transpose(JOB, KEY, 1, 2))
    assert a.credit_datagram(JOB + 1, 1, 2) is None  # not a job here
    dg = a.credit_datagram(JOB, epoch=2**62 + 5, received=3 << 40)
    assert dg is not None
    h, body = decode(dg, b.keys)
    assert (h.type, h.job, h.sender) == (PacketType.CONTROL, JOB, 0)
    assert credit_of(body) == (2**62 + 5, 3 << 40, False, 0) == credit_of(dg[HEADER_SIZE:])
    drained = a.credit_datagram(JOB, epoch=1, received=2, drained=True, window=3 << 30)
    assert drained is not None
    got = credit_of(decode(drained, b.keys)[1])
    assert got is not None and (got.epoch, got.received, got.drained, got.window) == (
        1,
        2,
        True,
        3 << 30,
    )
    assert b.receive(dg, 0.0, 0) is not None and b.stats["control_packets"] == 1
    # older daemons' credits: without the grant (18 bytes), without the flags too (17)
    assert credit_of(struct.pack("!BQQB", 1, 4, 5, 1)) == (4, 5, True, 0)
    assert credit_of(struct.pack("!BQQ", 1, 4, 5)) == (4, 5, False, 0)
    # a newer daemon's, with a field after the grant: read as far as this one knows
    assert credit_of(struct.pack("!BQQBQI", 1, 4, 5, 1, 6, 7)) == (4, 5, True, 6)
    for other in (b"\x02" + bytes(25), b"\x01" + bytes(15), b"\x01" + bytes(24), b""):
        assert credit_of(other) is None


def test_a_peer_grant_smaller_than_the_window_is_what_goes() -> None:
    """Sans-IO: a peer that grants less than this daemon's window for it (it
    has senders this daemon does not know of) is sent no more than its grant;
    a larger grant does not widen the window, and a grant is never taken
    below WINDOW_MIN."""
    ob, peer, path = make(2 * WINDOW_MIN)
    n = 6 * WINDOW_MIN // DATAGRAM
    ob.push_many(peer, data(n), [3] * n)
    ob.on_credit(peer, received=0, epoch=5, window=WINDOW_MIN + WINDOW_MIN // 2)
    assert peer.limit == WINDOW_MIN + WINDOW_MIN // 2
    ob.flush(0.0)
    first = path.bytes
    assert peer.limit - DATAGRAM < first <= peer.limit  # the grant, not the window
    ob.on_credit(peer, received=first, epoch=5, window=4 * WINDOW_MIN)  # more than ours
    assert peer.limit == 2 * WINDOW_MIN
    ob.flush(0.01)
    assert 2 * WINDOW_MIN - DATAGRAM < path.bytes - first <= 2 * WINDOW_MIN
    ob.on_credit(peer, received=path.bytes, epoch=5, window=1)  # never below WINDOW_MIN
    assert peer.granted == WINDOW_MIN == peer.limit
    sent = path.bytes
    ob.flush(0.02)
    assert WINDOW_MIN - DATAGRAM < path.bytes - sent <= WINDOW_MIN
    ob.on_credit(peer, received=path.bytes, epoch=5)  # no grant (an older daemon): ours
    assert peer.granted == 0 and peer.limit == 2 * WINDOW_MIN


def test_a_new_peer_gets_the_least_window_until_it_says_what_it_grants() -> None:
    """Sans-IO: before its first credit a peer may be sent to by hosts this
    daemon does not know of: it is sent WINDOW_MIN, not this daemon's whole
    window for it, until a credit says what it grants."""
    ob, peer, path = make(3 * WINDOW_MIN)
    n = 6 * WINDOW_MIN // DATAGRAM
    ob.push_many(peer, data(n), [3] * n)
    ob.flush(0.0)
    assert WINDOW_MIN - DATAGRAM < path.bytes <= WINDOW_MIN
    ob.on_credit(peer, received=path.bytes, epoch=1, window=3 * WINDOW_MIN)
    first = path.bytes
    ob.flush(0.01)
    assert 3 * WINDOW_MIN - DATAGRAM < path.bytes - first <= 3 * WINDOW_MIN
    assert make(0)[1].limit == 0  # no flow control: none


def test_the_senders_to_a_node_are_the_other_contributors_or_owners() -> None:
    """Sans-IO: who sends a node a bucket's bytes (what a window is shared by)."""
    from dlcp.core.engine import JobSpec

    t = JobSpec.transpose(JOB, KEY, 0, 4)
    assert [t.senders_to(n) for n in range(4)] == [frozenset({0, 1, 2, 3} - {n}) for n in range(4)]
    ps = JobSpec(job=JOB, key=KEY, me=1, contributors=(1, 2, 3), owners=(0,))
    assert ps.senders_to(0) == {1, 2, 3}  # the aggregator: data from every contributor
    assert ps.senders_to(2) == {0}  # a contributor: results from the aggregator only
    both = JobSpec(job=JOB, key=KEY, me=1, contributors=(0, 1, 2), owners=(0, 3))
    assert both.senders_to(0) == {1, 2, 3}  # owns (data from 1, 2) and contributes (results from 3)


def test_windows_are_shared_among_the_hosts_that_send_to_a_peer(tmp_path: Path) -> None:
    """A peer's socket takes what all its senders have in flight: with a
    4-host job each of the 3 senders to a peer gets a third of
    `window_bytes`; a 2-host job alone gives its peer the whole window; when
    the larger job leaves, its peers' windows grow back. No traffic needed:
    the windows are set when jobs join and leave."""
    window = 3 * WINDOW_MIN
    extra = {"network": {"window_bytes": window}}

    def name(host: dict[str, Any]) -> str:
        return f"{host['addresses'][0]}:{host['udp_port']}"

    def windows_of(client: Any) -> dict[str, int]:
        return {p["peer"]: p["window_bytes"] for p in client.status()["peers"]}

    with loopback_daemons(tmp_path, 1, extra) as (d,):
        hosts = [{"addresses": [f"127.0.0.{i + 1}"], "udp_port": d.port} for i in range(4)]
        with d.client() as pair, d.client() as quad:
            pair.hello()
            quad.hello()
            pair.join(job=1, key=KEY, hosts=hosts[:2], me=0)
            assert windows_of(pair) == {name(hosts[1]): window}
            quad.join(job=2, key=KEY, hosts=hosts, me=0)
            assert windows_of(pair) == {name(h): window // 3 for h in hosts[1:]}
            quad.leave(job=2)
            assert windows_of(pair)[name(hosts[1])] == window  # the 2-host job's peer again


def test_a_daemon_grants_its_senders_a_share_among_all_its_jobs(tmp_path: Path) -> None:
    """Daemons 0 and 1 share a 2-host job; after a round each grants the
    other its whole window. Then daemon 1 joins a 3-host job with two other
    hosts, which daemon 0 does not know of: at once (no traffic needed)
    its credit grants daemon 0 a third of its window (three hosts send to
    it now), and daemon 0 keeps to that while its own share for daemon 1
    stays the whole window. The next round loses nothing and its sums are
    exact."""
    window = 6 * WINDOW_MIN
    extra = {"network": {"window_bytes": window}}

    def peer_of(rank: Rank, address: str) -> dict[str, Any]:
        return next(p for p in rank.client.status()["peers"] if p["peer"].startswith(address))

    with loopback_daemons(tmp_path, 2, extra) as ds, joined(ds, "gr", tmp_path, 64 << 20) as ranks:
        x = np.random.default_rng(5).standard_normal(4_000_000).astype(np.float32)

        def all_reduce(rnd: int) -> None:
            waits = [submit(r, job=JOB, round=rnd, bucket=0, lanes=x, shards=2) for r in ranks]
            for w in waits:
                np.testing.assert_array_equal(w().sums, x + x)

        all_reduce(0)
        to_1 = peer_of(ranks[0], "127.0.0.2:")
        assert to_1["granted_bytes"] == to_1["limit_bytes"] == to_1["window_bytes"] == window
        others = [{"addresses": [f"127.0.0.{i}"], "udp_port": ds[1].port} for i in (3, 4)]
        with ds[1].client() as own:
            own.hello()
            own.join(job=JOB + 1, key=KEY, hosts=hosts_of(ds[1:]) + others, me=0)
            deadline = time.monotonic() + 30  # a wait for the credit, not a speed bound
            while peer_of(ranks[0], "127.0.0.2:")["granted_bytes"] != window // 3:
                assert time.monotonic() < deadline, peer_of(ranks[0], "127.0.0.2:")
                time.sleep(0.02)
            all_reduce(1)
            to_1 = peer_of(ranks[0], "127.0.0.2:")
            assert to_1["lost_packets"] == 0
            assert to_1["window_bytes"] == window  # daemon 0's own share: the whole window
            assert to_1["granted_bytes"] == to_1["limit_bytes"] == window // 3
            assert 0 <= to_1["in_flight_bytes"] <= window // 3
            to_0 = peer_of(ranks[1], "127.0.0.1:")
            assert to_0["granted_bytes"] == to_0["limit_bytes"] == window


def test_credited_bytes_acknowledge_to_the_rate_control_within_a_leg() -> None:
    """A credit's new bytes grow the peer's rate in slow start as the peer's
    results do (what a first round on an unshaped link waited for); a count
    new to the sender (its first, or a restarted peer's) is matched, not
    taken as delivered, and credits without a time leave the rate alone."""
    ob, peer, path = make(WINDOW_MIN)
    n = WINDOW_MIN // DATAGRAM
    ob.push_many(peer, data(n), [3] * n)
    ob.flush(0.0)
    start = peer.rate.rate_bps
    ob.on_credit(peer, received=0, epoch=5, now=0.001)  # its first count
    assert peer.rate.rate_bps == start
    ob.on_credit(peer, received=path.bytes // 2, epoch=5)  # no time given
    assert peer.rate.rate_bps == start
    ob.on_credit(peer, received=path.bytes, epoch=5, now=0.002)
    assert peer.rate.rate_bps > start  # slow start: grew by what was credited
    grown = peer.rate.rate_bps
    ob.on_credit(peer, received=path.bytes, epoch=5, now=0.003)  # nothing new
    assert peer.rate.rate_bps == grown
    ob.on_credit(peer, received=10, epoch=6, now=0.004)  # a restarted peer's count
    assert peer.rate.rate_bps == grown
