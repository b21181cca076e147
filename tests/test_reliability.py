"""Reliability and security of dlcpd: authentication, shim abuse, faults, soak, tenants.

Loopback tests need no root, except those that capture real datagrams on `lo`
(AF_PACKET) to replay them. Namespace tests (`netns` marker) build a testbed
named "rel-*" under a temporary state root and always tear it down. Figures
are printed (pytest -s) and written to $DLCP_RELIABILITY_OUT when it is set;
RELIABILITY.md quotes them.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import random
import shutil
import signal
import socket
import struct
import subprocess
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dlcp import ipc
from dlcp.core.engine import Engine, JobSpec, RoundComplete, Send
from dlcp.core.layout import Layout
from dlcp.core.timing import Timing
from dlcp.shim.client import DaemonClient, DaemonError, Segment
from dlcp.wire.header import (
    HEADER_SIZE,
    MAC_OFFSET,
    MAGIC,
    Codec,
    PacketType,
    compute_mac,
    header_of_valid,
)
from tests.daemons import ROOT, Daemon, Rank, hosts_of, loopback_daemons, submit, wire_key
from tests.netsim import Network

KEY_A = bytes(range(100, 132))
KEY_B = bytes(range(200, 232))
JOB_A = 0xA11CE
JOB_B = 0xB0B
ERROR_CODES = {
    "bad_request",
    "unknown_op",
    "unknown_job",
    "conflict",
    "round_failed",
    "shutting_down",
}
_IS_ROOT = os.geteuid() == 0
needs_root = pytest.mark.skipif(not _IS_ROOT, reason="capturing on lo needs root (AF_PACKET)")


def _report(name: str, figures: dict[str, Any]) -> None:
    print(f"\n{name}: {json.dumps(figures, sort_keys=True, default=str)}")
    out = os.environ.get("DLCP_RELIABILITY_OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / f"{name}.json").write_text(
            json.dumps(figures, indent=2, sort_keys=True, default=str)
        )


def _rejects(d: Daemon) -> Counter[str]:
    with DaemonClient(d.socket) as c:
        return Counter(c.status()["rejects"])


def _counters(d: Daemon) -> Counter[str]:
    with DaemonClient(d.socket) as c:
        return Counter(c.status()["counters"])


def _sum(ds: list[Daemon], f: Callable[[Daemon], Counter[str]]) -> Counter[str]:
    total: Counter[str] = Counter()
    for d in ds:
        total.update(f(d))
    return total


def _grew(after: Counter[str], before: Counter[str]) -> dict[str, int]:
    return {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}


def _wait_for(cond: Callable[[], bool], timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _exact_round(
    ranks: list[Any], job: int, rnd: int, rng: np.random.Generator, lanes: int = 20_000
) -> list[Any]:
    """One fp32 round through every rank; asserts every replica holds the exact sum."""
    xs = [rng.standard_normal(lanes).astype(np.float32) for _ in ranks]
    waits = [
        submit(r, job=job, round=rnd, bucket=0, lanes=x, shards=len(ranks), timeout=60)
        for r, x in zip(ranks, xs, strict=True)
    ]
    results = [w() for w in waits]
    expected = xs[0].copy()
    for x in xs[1:]:
        expected += x
    for res in results:
        np.testing.assert_array_equal(res.sums, expected)
        assert (res.contributors == len(ranks)).all()
        assert res.reply["lost_lanes"] == 0
    return results


# --- capturing real datagrams on lo -----------------------------------------------------


class Capture:
    """dlcp datagrams between loopback daemons, as the kernel delivered them (AF_PACKET)."""

    def __init__(self, port: int, addresses: set[str]) -> None:
        self.port = port
        self.addresses = addresses
        self.packets: list[tuple[str, str, bytes]] = []  # (src, dst, datagram)
        self.drops = 0  # packets the kernel could not queue for us
        self.sock = socket.socket(socket.AF_PACKET, socket.SOCK_DGRAM, socket.htons(0x0003))
        with contextlib.suppress(OSError):
            self.sock.setsockopt(socket.SOL_SOCKET, 33, 64 << 20)  # SO_RCVBUFFORCE
        self.sock.bind(("lo", 0x0003))
        self.sock.settimeout(0.05)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                data, addr = self.sock.recvfrom(70_000)
            except TimeoutError:
                continue
            except OSError:
                return
            if addr[2] == socket.PACKET_OUTGOING or len(data) < 28 or data[9] != 17:
                continue
            ihl = (data[0] & 0x0F) * 4
            src, dst = socket.inet_ntoa(data[12:16]), socket.inet_ntoa(data[16:20])
            _sport, dport, ulen = struct.unpack_from("!HHH", data, ihl)
            if dport != self.port or src not in self.addresses or dst not in self.addresses:
                continue
            dg = data[ihl + 8 : ihl + ulen]
            if len(dg) >= HEADER_SIZE and struct.unpack_from("!H", dg)[0] == MAGIC:
                self.packets.append((src, dst, dg))

    def stop(self) -> list[tuple[str, str, bytes]]:
        self._stop.set()
        self._thread.join(5)
        with contextlib.suppress(OSError):  # PACKET_STATISTICS: tp_packets, tp_drops
            self.drops = struct.unpack("II", self.sock.getsockopt(263, 6, 8))[1]
        self.sock.close()
        return self.packets


def _job_of(dg: bytes) -> int:
    return int(struct.unpack_from("!I", dg, 8)[0])


def _round_of(dg: bytes) -> int:
    return int(struct.unpack_from("!I", dg, 12)[0])


class Sender:
    """UDP sockets bound to given loopback source addresses (any port)."""

    def __init__(self) -> None:
        self.socks: dict[str, socket.socket] = {}
        self.sent = 0

    def send(self, src: str, dst: tuple[str, int], dg: bytes) -> None:
        s = self.socks.get(src)
        if s is None:
            s = self.socks[src] = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            s.bind((src, 0))
        with contextlib.suppress(ConnectionRefusedError, BlockingIOError):
            s.sendto(dg, dst)
            self.sent += 1

    def close(self) -> None:
        for s in self.socks.values():
            s.close()


# --- authentication: MAC, replays, outsiders (loopback) -----------------------------------

# Job A's rounds on the module's daemons only ever go up (a jump moves the
# stale-round window; tests after it must not fall behind it).
_next_a = {"round": 0}


def next_round_a(skip: int = 0) -> int:
    _next_a["round"] += skip
    rnd = _next_a["round"]
    _next_a["round"] += 1
    return rnd


@pytest.fixture(scope="module")
def trio(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Daemon]]:
    tmp = tmp_path_factory.mktemp("rel")
    extra = {"network": {"gso": False}, "timing": {"timeout": 8.0, "retain": 2.0}}
    with loopback_daemons(tmp, 3, extra) as ds:
        yield ds


@pytest.fixture(scope="module")
def ranks_a(trio: list[Daemon]) -> Iterator[list[Rank]]:
    rs = [Rank(d, f"dlcp-rela{os.getpid()}-{i}", 4 << 20) for i, d in enumerate(trio)]
    for i, r in enumerate(rs):
        r.join(JOB_A, KEY_A, hosts_of(trio), i)
    yield rs
    for r in rs:
        r.close()


def test_datagrams_without_the_jobs_mac_are_rejected(
    trio: list[Daemon], ranks_a: list[Rank]
) -> None:
    """Well-formed datagrams of the job from a member's address with no MAC,
    a zero MAC, a guessed key, or the other tenant's key: bad_mac, each one."""
    from dlcp.wire.header import Header, PacketType, encode

    port = trio[0].port
    h = Header(type=PacketType.DATA, job=JOB_A, round=5_000, bucket=0, sender=1, count=4, total=4)
    good = encode(h, bytes(16), wire_key(KEY_A))
    forged = [
        good[:MAC_OFFSET] + bytes(16) + good[HEADER_SIZE:],
        encode(h, bytes(16), wire_key(KEY_B)),
        encode(h, bytes(16), wire_key(os.urandom(32))),
        good[:MAC_OFFSET] + good[MAC_OFFSET:HEADER_SIZE][::-1] + good[HEADER_SIZE:],
        good[:-1] + b"\x01",
    ]
    before = _rejects(trio[0])
    tx = Sender()
    try:
        for _ in range(200):
            for dg in forged:
                tx.send(trio[1].address, (trio[0].address, port), dg)
        # no MAC at all: the header alone is truncated, the payload in its place is bad_length
        tx.send(trio[1].address, (trio[0].address, port), good[:MAC_OFFSET])
    finally:
        tx.close()
    n = 200 * len(forged)
    assert _wait_for(lambda: sum(_grew(_rejects(trio[0]), before).values()) >= n + 1)
    assert _grew(_rejects(trio[0]), before) == {"bad_mac": n, "truncated": 1}
    _exact_round(ranks_a, JOB_A, next_round_a(), np.random.default_rng(33))


@needs_root
def test_replays_behind_the_window_are_stale_and_outsiders_bad_address(
    trio: list[Daemon], ranks_a: list[Rank]
) -> None:
    """A round far ahead (the shim may number rounds freely) moves the window:
    replays of a captured round more than `window` (256) rounds behind are
    counted as stale_round, each exactly once, and change nothing."""
    rng = np.random.default_rng(32)
    port = trio[0].port
    cap = Capture(port, {d.address for d in trio})
    try:
        _exact_round(ranks_a, JOB_A, next_round_a(), rng)
    finally:
        captured = [p for p in cap.stop() if _job_of(p[2]) == JOB_A]
    _exact_round(ranks_a, JOB_A, next_round_a(skip=256), rng)
    before = _sum(trio, _rejects)
    tx = Sender()
    try:
        for src, dst, dg in captured:
            tx.send(src, (dst, port), dg)
        for _src, dst, dg in captured:
            tx.send("127.0.0.9", (dst, port), dg)
    finally:
        tx.close()
    n = len(captured)
    assert _wait_for(lambda: sum(_grew(_sum(trio, _rejects), before).values()) >= 2 * n)
    grew = _grew(_sum(trio, _rejects), before)
    assert grew == {"stale_round": n, "bad_address": n}, grew
    _exact_round(ranks_a, JOB_A, next_round_a(), rng)
    _report("auth_stale_window", {"replayed": n, "rejects": grew})


@needs_root
def test_replayed_and_forged_datagrams_cannot_change_results(
    trio: list[Daemon], ranks_a: list[Rank]
) -> None:
    """Capture a real round r, then while rounds r+1.. run: replay every captured
    datagram from its true source address, the same with the round rewritten to
    the live one, with altered payloads, MAC'd with a guessed key, and from an
    address outside the job; flood forged ones. Every result stays exact."""
    rng = np.random.default_rng(30)
    port = trio[0].port
    addrs = {d.address for d in trio}
    cap = Capture(port, addrs)
    try:
        r0 = next_round_a()
        _exact_round(ranks_a, JOB_A, r0, rng)
    finally:
        job_a = [p for p in cap.stop() if _job_of(p[2]) == JOB_A]
    # a late ACK or DONE of the previous test's last round may be caught too;
    # only round r0's datagrams are replayed (their round is what is checked)
    captured = [p for p in job_a if _round_of(p[2]) == r0]
    assert captured and all(_round_of(dg) < r0 for _, _, dg in job_a if _round_of(dg) != r0)
    kinds = Counter(dg[3] for _, _, dg in captured)
    assert kinds[1] and kinds[2] and kinds[4]  # data, results, DONE manifests captured

    before_rej = _sum(trio, _rejects)
    before_cnt = _sum(trio, _counters)
    # 1. straight after round 0 closed: replays land in the closed-round memory
    tx = Sender()
    for src, dst, dg in captured:
        tx.send(src, (dst, port), dg)
    assert _wait_for(lambda: _sum(trio, _counters)["late_packets"] > before_cnt["late_packets"])

    stop = threading.Event()
    live = {"round": r0 + 1}
    flood: Counter[str] = Counter()

    def hostile() -> None:
        frng = random.Random(31)
        while not stop.is_set():
            src, dst, dg = captured[frng.randrange(len(captured))]
            kind = frng.randrange(6)
            if kind == 0:  # verbatim replay of round 0
                out = dg
            elif kind == 1:  # replay moved into the live round: the MAC no longer fits
                out = dg[:12] + struct.pack("!I", live["round"]) + dg[16:]
            elif kind == 2:  # payload turned into huge values, MAC kept
                out = dg[:HEADER_SIZE] + b"\x7f\x7f\xff\xff" * ((len(dg) - HEADER_SIZE) // 4)
                out += dg[len(out) :]
                if out == dg:
                    continue
            elif kind == 3:  # live round, forged with a guessed key
                head = dg[:12] + struct.pack("!I", live["round"]) + dg[16:MAC_OFFSET]
                body = dg[HEADER_SIZE:]
                out = head + compute_mac(os.urandom(32), head, body) + body
            elif kind == 4:  # a captured datagram from an address outside the job
                tx.send("127.0.0.9", (dst, port), dg)
                flood["outsider"] += 1
                continue
            else:  # another member's datagram sent from the wrong member
                other = next(a for a in sorted(addrs) if a not in (src, dst))
                tx.send(other, (dst, port), dg)
                flood["wrong_member"] += 1
                continue
            tx.send(src, (dst, port), out)
            flood[("replay", "moved", "payload", "guessed_key")[kind]] += 1
            if sum(flood.values()) % 64 == 0:
                time.sleep(0.001)

    t = threading.Thread(target=hostile, daemon=True)
    t.start()
    try:
        live_rounds = 0
        while live_rounds < 20 or sum(flood.values()) < 20_000:
            live["round"] = rnd = next_round_a()
            _exact_round(ranks_a, JOB_A, rnd, rng)
            live_rounds += 1
            assert live_rounds < 2000, flood
    finally:
        stop.set()
        t.join(10)
        tx.close()
    rej = _grew(_sum(trio, _rejects), before_rej)
    cnt = _grew(_sum(trio, _counters), before_cnt)
    assert rej.get("bad_mac", 0) > 0 and rej.get("bad_address", 0) > 0
    assert rej.get("bad_sender", 0) > 0  # a member's datagram from another member
    _report(
        "auth_replay_flood",
        {
            "captured_round0": len(captured),
            "hostile_sent": dict(flood),
            "rejects": rej,
            "counters": {
                k: cnt.get(k, 0)
                for k in ("late_packets", "nacks_ignored", "data_nacks_sent", "rounds_failed")
            },
            "live_rounds_exact": live_rounds,
        },
    )


def test_a_replay_after_the_closed_round_memory_expired_is_not_amplified(tmp_path: Path) -> None:
    from dlcp.wire.header import Header, PacketType, encode

    timeout = 2.0
    with loopback_daemons(tmp_path, 3, {"timing": {"timeout": timeout, "retain": 0.5}}) as ds:
        rs = [Rank(d, f"dlcp-relz{os.getpid()}-{i}", 4 << 20) for i, d in enumerate(ds)]
        try:
            for i, r in enumerate(rs):
                r.join(13, KEY_A, hosts_of(ds), i)
            rng = np.random.default_rng(34)
            for rnd in range(3):
                _exact_round(rs, 13, rnd, rng)
            time.sleep(1.0)  # round 0 has left the closed-round memory
            # what host 1 sent host 0 in round 0 (packet 0 of shard 0), replayed once
            h = Header(
                type=PacketType.DATA, job=13, round=0, bucket=0, sender=1, count=352, total=20_000
            )
            before = _counters(ds[0])
            tx = Sender()
            try:
                replay = encode(h, bytes(1408), wire_key(KEY_A))
                tx.send(ds[1].address, (ds[0].address, ds[0].port), replay)
            finally:
                tx.close()
            time.sleep(timeout + 1.0)
            grew = _grew(_counters(ds[0]), before)
            _exact_round(rs, 13, 3, rng)
        finally:
            for r in rs:
                r.close()
    _report("replay_after_retain", {"replayed": 1, "daemon0_counters": grew})
    assert grew.get("data_nacks_sent", 0) <= 2, grew


def _engine_round(
    net: Network, job: int, rnd: int, bucket: int, contributors: list[int], lanes: int = 5000
) -> np.ndarray:
    xs = {n: np.full(lanes, float(n + rnd + 1), np.float32) for n in contributors}
    for n, x in xs.items():
        net.engines[n].submit(
            job=job,
            round=rnd,
            bucket=bucket,
            codec=Codec.FP32,
            total=lanes,
            lanes=x.tobytes(),
            now=net.now,
        )
    return sum(xs.values())  # type: ignore[return-value]


def _completed(net: Network, rnd: int, bucket: int) -> list[RoundComplete]:
    return [
        ev
        for evs in net.events.values()
        for ev in evs
        if isinstance(ev, RoundComplete) and (ev.round, ev.bucket) == (rnd, bucket)
    ]


def test_the_engine_treats_replays_of_closed_rounds_as_late_for_the_whole_window() -> None:
    """Sans-IO: every datagram of 6 rounds x 2 buckets, replayed verbatim from
    the right member after `retain` expired, is counted late (no aggregator, no
    NACK, no failed round); a round lower than one already closed, never seen
    here, still runs (ps aggregator, rounds out of order); the memory of closed
    rounds is pruned with the stale window."""
    job, key = 77, bytes(range(32))
    timing = Timing(timeout=2.0, retain=0.5)
    engines = {}
    for me in range(3):
        engines[me] = e = Engine(timing=timing)
        e.add_job(JobSpec.transpose(job, key, me, 3, window=16))
    captured: list[tuple[int, Send]] = []

    def record(src: int, s: Send) -> bool:
        captured.append((src, s))
        return False

    net = Network(engines, seed=9, drop=record)
    for rnd in range(6):
        for bucket in range(2):
            want = _engine_round(net, job, rnd, bucket, [0, 1, 2])
            net.run(until=net.now + 1.0)
            got = _completed(net, rnd, bucket)
            assert len(got) == 3
            for ev in got:
                np.testing.assert_array_equal(ev.sums, want)
    net.run(until=net.now + 5.0)  # retain (0.5 s) has long expired
    for e in engines.values():
        e.handle_timer(net.now)
        assert not e.closed.rounds and not e.closed.shards and not e.rounds.table
    before = {n: (e.stats.copy(), e.rejects.copy()) for n, e in engines.items()}
    replayed = acks = 0
    for src, s in captured:
        if s.node == src:
            continue
        engines[s.node].receive(s.datagram, net.now, src=src)
        replayed += 1
        acks += header_of_valid(s.datagram).type == PacketType.ACK
    assert replayed > 100 and acks
    late = 0
    for n, e in engines.items():
        # nothing opened, nothing sent
        assert not list(e.rounds.aggregators()) and not e.datagrams_to_send(), n
        stats, rejects = before[n]
        assert e.rejects == rejects, n
        grew = e.stats - stats
        assert set(grew) <= {"late_packets", "nacks_ignored"}, grew
        late += grew["late_packets"] + grew["nacks_ignored"]
    # every replayed datagram was counted, once, as late or as an ignored NACK
    # (ACKs of results no longer kept are dropped silently, as before)
    assert late == replayed - acks
    want = _engine_round(net, job, 6, 0, [0, 1, 2])
    net.run(until=net.now + 1.0)
    assert all((ev.sums == want).all() for ev in _completed(net, 6, 0))
    assert len(_completed(net, 6, 0)) == 3

    # memory: one entry per (bucket, shard) still inside the window
    for rnd in range(7, 60):
        _engine_round(net, job, rnd, rnd, [0, 1, 2], lanes=500)  # a fresh bucket each round
        net.run(until=net.now + 1.0)
        assert len(_completed(net, rnd, rnd)) == 3
    for e in engines.values():
        assert len(e.closed.bitmaps[job]) <= 16 + 16 // 4 + 2, len(e.closed.bitmaps[job])

    # ps mode: node 0 aggregates only; round 1 closes there before round 0 starts
    ps = {}
    for me in range(3):
        ps[me] = e = Engine(timing=timing)
        e.add_job(JobSpec(job=job, key=key, me=me, contributors=(1, 2), owners=(0,)))
    net = Network(ps, seed=10)
    for rnd in (1, 0, 3, 2):
        want = _engine_round(net, job, rnd, 0, [1, 2])
        net.run(until=net.now + 1.0)
        got = _completed(net, rnd, 0)
        assert len(got) == 2, rnd
        for ev in got:
            np.testing.assert_array_equal(ev.sums, want)
    assert ps[0].stats["rounds_failed"] == 0


# --- two tenants ------------------------------------------------------------------


class _Runner(threading.Thread):
    def __init__(
        self,
        ranks: list[Any],
        job: int,
        rounds: int,
        lanes: int,
        seed: int,
        next_round: Callable[[], int] | None = None,
    ) -> None:
        super().__init__(daemon=True)
        self.ranks, self.job, self.rounds, self.lanes = ranks, job, rounds, lanes
        self.next_round = next_round or iter(range(1 << 30)).__next__
        self.rng = np.random.default_rng(seed)
        self.done = 0
        self.error: BaseException | None = None
        self.seconds = 0.0

    def run(self) -> None:
        t0 = time.monotonic()
        try:
            for _ in range(self.rounds):
                _exact_round(self.ranks, self.job, self.next_round(), self.rng, self.lanes)
                self.done += 1
        except BaseException as exc:  # reported by the test
            self.error = exc
        self.seconds = time.monotonic() - t0


def _wire_bytes_per_round(lanes: int, hosts: int, payload: int) -> int:
    """Bytes a round puts on the wire without loss: data to the shard owners and
    results back, headers included (DONE/ACK control packets left out)."""
    lay = Layout(lanes, Codec.FP32, hosts, payload)
    counts = lay.packet_counts()
    total = 0
    for s in range(hosts):
        pk = lay.shard_packets(s)
        shard_bytes = int(counts[pk.start : pk.stop].sum()) * 4 + HEADER_SIZE * len(pk)
        total += 2 * (hosts - 1) * shard_bytes  # every other host's data in, results out
    return total


def test_two_tenants_share_the_daemons_without_cross_talk(
    trio: list[Daemon], ranks_a: list[Rank]
) -> None:
    """Jobs A and B (different keys, the same three daemons) all-reduce at the
    same time: both exact. B's datagrams relabelled as A are bad_mac. Bytes per
    job are reported (captured on lo when root, else from the layout)."""
    rs_b = [Rank(d, f"dlcp-relb{os.getpid()}-{i}", 4 << 20) for i, d in enumerate(trio)]
    cap = Capture(trio[0].port, {d.address for d in trio}) if _IS_ROOT else None
    try:
        for i, r in enumerate(rs_b):
            r.join(JOB_B, KEY_B, hosts_of(trio), i)
        with pytest.raises(DaemonError) as e:  # the same job id with another key
            rs_b[0].client.join(job=JOB_A, key=KEY_B, hosts=hosts_of(trio), me=0)
        assert e.value.code == "conflict"
        lanes = 60_000
        a = _Runner(ranks_a, JOB_A, 25, lanes, 40, next_round_a)
        b = _Runner(rs_b, JOB_B, 25, lanes, 41)
        a.start()
        b.start()
        a.join(300)
        b.join(300)
        assert a.error is None and b.error is None, (a.error, b.error)
        assert a.done == b.done == 25
    finally:
        captured = cap.stop() if cap is not None else []
        for r in rs_b:
            r.close()
    per_job: Counter[int] = Counter()
    for _src, _dst, dg in captured:
        per_job[_job_of(dg)] += len(dg)
    layout_bytes = _wire_bytes_per_round(lanes, 3, ranks_a[0].info["payload"])
    fig = {
        "rounds_per_job": 25,
        "lanes": lanes,
        "seconds": {"A": round(a.seconds, 2), "B": round(b.seconds, 2)},
        "layout_bytes_per_job": 25 * layout_bytes,
        "captured_bytes": {"A": per_job[JOB_A], "B": per_job[JOB_B]},
        "capture_drops": cap.drops if cap is not None else None,
    }
    if per_job[JOB_A] and per_job[JOB_B]:
        fig["share_A"] = round(per_job[JOB_A] / (per_job[JOB_A] + per_job[JOB_B]), 4)
        # the same work moves the same bytes: neither job is starved or amplified
        assert 0.4 < fig["share_A"] < 0.6
        # B relabelled as A: the MAC is over the job field too
        relabelled = [
            (src, dst, dg[:8] + struct.pack("!I", JOB_A) + dg[12:])
            for src, dst, dg in captured
            if _job_of(dg) == JOB_B
        ][:500]
        before = _sum(trio, _rejects)
        tx = Sender()
        try:
            for src, dst, dg in relabelled:
                tx.send(src, (dst, trio[0].port), dg)
        finally:
            tx.close()
        n = len(relabelled)
        assert _wait_for(lambda: sum(_grew(_sum(trio, _rejects), before).values()) >= n)
        assert _grew(_sum(trio, _rejects), before).get("bad_mac", 0) == n
    _report("multi_tenant_loopback", fig)


# --- shim protocol abuse ------------------------------------------------------------


def _raw(d: Daemon) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(d.socket)
    return s


def _closed(s: socket.socket) -> bool:
    try:
        return s.recv(1) == b""
    except (ConnectionError, TimeoutError):
        return True


def test_framing_abuse_gets_one_error_reply_and_the_daemon_keeps_serving(
    trio: list[Daemon], ranks_a: list[Rank]
) -> None:
    d = trio[0]
    bodies = {
        "huge_prefix": struct.pack("!I", 0xFFFFFFFF),
        "just_over_1mib": struct.pack("!I", ipc.MAX_MESSAGE + 1),
        "1mib_of_garbage": struct.pack("!I", ipc.MAX_MESSAGE) + b"\xff" * ipc.MAX_MESSAGE,
        "not_utf8": struct.pack("!I", 4) + b"\xff\xfe\xfd\xfc",
        "json_list": struct.pack("!I", 2) + b"[]",
        "json_string": struct.pack("!I", 5) + b'"hi!"',
        # valid JSON the parser refuses: a 5000-digit integer, 100k nested lists
        "huge_integer": struct.pack("!I", 5012) + b'{"id":1' + b"0" * 5000 + b',"a":1}',
        "deep_nesting": struct.pack("!I", 200_000) + b"[" * 100_000 + b"]" * 100_000,
    }
    for name, raw in bodies.items():
        s = _raw(d)
        try:
            s.sendall(raw)
            reply = ipc.recv_message(s)
            assert reply["ok"] is False and reply["code"] == "bad_request", (name, reply)
            assert _closed(s), name
        finally:
            s.close()
    # half a message, then gone; and one that never finishes (slowloris) while others work
    s = _raw(d)
    s.sendall(struct.pack("!I", 1000) + b'{"op":')
    s.close()
    idle = _raw(d)
    idle.sendall(struct.pack("!I", ipc.MAX_MESSAGE) + b"{" * 1000)
    try:
        with DaemonClient(d.socket) as c:
            assert c.hello()["udp_port"] == d.port
        _exact_round(ranks_a, JOB_A, next_round_a(), np.random.default_rng(42))
    finally:
        idle.close()


_HOSTILE: list[Any] = [
    None,
    True,
    -1,
    0,
    1,
    7,
    2**31,
    2**32,
    2**63,
    -(2**63),
    10**30,
    -(10**30),
    0.5,
    -0.0,
    1e308,
    float("nan"),
    float("inf"),
    "",
    "x",
    "fp32",
    "dlcp-x",
    "dlcp-../../etc/passwd",
    "a" * 5000,
    [],
    [0],
    [0, 0],
    [-1, 10],
    [10, -1],
    [2**62, 2**62],
    [0, 2**40],
    [1.5, 2],
    ["0", "1"],
    [0, 1, 2],
    {},
    {"addresses": ["127.0.0.1"]},
    [{"addresses": ["127.0.0.1"], "udp_port": 1}],
    [{"addresses": ["999.0.0.1"], "udp_port": 1}],
    [{"addresses": [], "udp_port": 1}],
    [{"addresses": ["127.0.0.1"] * 9, "udp_port": 1}],
    {"addresses": ["127.0.0.1"], "udp_port": 1, "x": 2},
    "transpose",
    "ps",
    [0, 1],
    [5],
]
_FIELDS = {
    "hello": ["version", "pid", "fallbacks"],
    "segment": ["name", "size"],
    "join": [
        "job",
        "key",
        "hosts",
        "me",
        "local_ranks",
        "mode",
        "payload",
        "aggregators",
        "contributors",
    ],
    "submit": [
        "job",
        "round",
        "bucket",
        "codec",
        "total",
        "data",
        "meta",
        "out",
        "bound",
        "scale",
    ],
    "leave": ["job"],
    "status": [],
    "bogus": ["x"],
}


def test_random_requests_get_error_replies_never_internal(trio: list[Daemon]) -> None:
    """Thousands of requests with hostile field values (wrong types, negative,
    huge, overlapping regions, NaN, unknown jobs, codecs and ops) on one
    connection: each gets a reply with a documented code, none `internal`, the
    connection stays open, and a single-host job on it still completes rounds."""
    d = trio[0]
    rng = random.Random(50)
    me = [{"addresses": [d.address], "udp_port": d.port}]
    seg = Segment(f"dlcp-relfz{os.getpid()}", 1 << 16)
    codes: Counter[str] = Counter()
    c = DaemonClient(d.socket)
    try:
        c.hello()
        c.segment(seg)
        c.join(job=77, key=KEY_A, hosts=me, me=0)
        base = {"job": 77, "round": 0, "bucket": 0, "codec": "fp32", "total": 100}
        sent: list[tuple[str, dict[str, Any], Any]] = []
        internal: list[str] = []
        for i in range(3000):
            op = rng.choice(list(_FIELDS))
            fields: dict[str, Any] = {}
            if op == "submit" and rng.random() < 0.5:  # valid but for the hostile fields
                fields.update(base, data=[0, 400], out=[1000, 1000], round=10_000 + i)
            elif op == "join" and rng.random() < 0.5:
                fields.update(job=1000 + i, key=KEY_B.hex(), hosts=me, me=0)
            for name in rng.sample(_FIELDS[op], k=rng.randrange(len(_FIELDS[op]) + 1)):
                fields[name] = rng.choice(_HOSTILE)
            if op == "segment" and fields.get("name") == "dlcp-x":
                continue  # would replace this connection's segment (tested elsewhere)
            # replies to submits come when the round ends (a join with local_ranks > 1
            # makes one wait for the other ranks' timeout): collect them all at the end
            sent.append((op, fields, c.request(op, **fields)))
            assert c.alive
        for op, fields, fut in sent:
            try:
                fut.result(60)
                codes["ok"] += 1
            except DaemonError as exc:
                codes[exc.code] += 1
                if exc.code not in ERROR_CODES:
                    internal.append(f"{op} {fields}: {exc}"[:300])
        assert c.alive
        # the single-host job still works on the same connection
        x = np.arange(100, dtype=np.float32)
        seg.buf[0:400] = x.tobytes()
        lay = Layout(100, Codec.FP32, 1, 1408)
        last = {**base, "round": 99_999, "data": [0, 400], "out": [1000, 400 + 6 * lay.packets]}
        reply = c.call("submit", **last)
        assert reply["ok"] and reply["lost_lanes"] == 0
        np.testing.assert_array_equal(np.frombuffer(bytes(seg.buf[1000:1400]), "<f4"), x)
    finally:
        c.close()
        seg.close()
    assert not internal, internal
    _report("shim_request_fuzz", {"requests": sum(codes.values()), "replies": dict(codes)})


def test_region_and_type_abuse_in_submit(trio: list[Daemon]) -> None:
    d = trio[0]
    me = [{"addresses": [d.address], "udp_port": d.port}]
    r = Rank(d, f"dlcp-relsub{os.getpid()}", 8192)
    try:
        r.join(78, KEY_A, me, 0)
        P = Layout(100, Codec.FP32, 1, 1408).packets
        base = {"job": 78, "round": 1, "bucket": 0, "codec": "fp32", "total": 100}
        ok = {"data": [0, 400], "out": [1000, 400 + 6 * P]}

        def code(**kw: Any) -> str:
            try:
                r.client.call("submit", **{**base, **ok, **kw})
            except DaemonError as exc:
                return exc.code
            return "ok"

        bad = {
            "negative data offset": {"data": [-400, 400]},
            "negative length": {"data": [0, -400]},
            "out past the segment": {"out": [8000, 1000]},
            "out at 2**62": {"out": [2**62, 1000]},
            "length overflowing": {"out": [1000, 2**64]},
            "data overlaps out": {"out": [200, 1000]},
            "meta overlaps out": {"meta": [1100, 6 * P]},
            "meta of the wrong size": {"meta": [500, 7]},
            "data of the wrong size": {"data": [0, 401]},
            "out too small": {"out": [1000, 400]},
            "float offset": {"data": [0.0, 400]},
            "string offset": {"data": ["0", 400]},
            "three-element region": {"data": [0, 400, 1]},
            "bool region": {"data": [True, 400]},
            "unknown codec": {"codec": "int8"},
            "codec as a number": {"codec": 0},
            "float total": {"total": 100.0},
            "huge total": {"total": 2**32},
            "zero total": {"total": 0},
            "negative round": {"round": -1},
            "round as string": {"round": "1"},
            "NaN bound": {"bound": float("nan")},
            "bound above 0.5": {"bound": 0.6},
            "infinite scale": {"scale": float("inf")},
            "unknown job": {"job": 79},
            "job out of range": {"job": 2**32},
        }
        got = {name: code(**kw) for name, kw in bad.items()}
        assert got["unknown job"] == "unknown_job"
        assert all(c == "bad_request" for n, c in got.items() if n != "unknown job"), got
        # NaN or negative norms in the metadata
        meta = np.zeros(P, "<u2").tobytes() + np.full(P, np.nan, "<f4").tobytes()
        r.seg.buf[500 : 500 + len(meta)] = meta
        assert code(meta=[500, len(meta)]) == "bad_request"
        meta = np.zeros(P, "<u2").tobytes() + np.full(P, -1.0, "<f4").tobytes()
        r.seg.buf[500 : 500 + len(meta)] = meta
        assert code(meta=[500, len(meta)]) == "bad_request"
        assert code() == "ok"
        assert code() == "conflict"  # round 1 bucket 0 was already run
        # unknown job for leave, and a job another connection joined
        with pytest.raises(DaemonError) as e:
            r.client.call("leave", job=12345)
        assert e.value.code == "unknown_job"
        other = DaemonClient(d.socket)
        try:
            with pytest.raises(DaemonError) as e:
                other.call("submit", **base, **ok)
            assert e.value.code == "unknown_job"
        finally:
            other.close()
    finally:
        r.close()


def test_a_rank_that_truncates_its_segment_cannot_kill_the_daemon(tmp_path: Path) -> None:
    """A rank shrinks its segment file before submitting, and another after
    submitting (before the result is written). dlcpd never maps the segment
    (preadv/pwritev), so both get `bad_request` naming the shrink, their peer
    gets its exact result, and the daemons keep serving other jobs and ranks."""
    with loopback_daemons(tmp_path, 2) as ds:
        pid = os.getpid()
        rs: list[Rank] = []
        try:
            # 1. truncated before the submit: the daemon cannot read `data`
            r = Rank(ds[0], f"dlcp-reltr{pid}", 1 << 20)
            rs.append(r)
            r.join(5, KEY_A, hosts_of(ds[:1]), 0)
            P = Layout(1000, Codec.FP32, 1, 1408).packets
            r.seg.buf[0:4000] = np.ones(1000, np.float32).tobytes()
            os.truncate(r.seg.path, 0)  # from here on, nobody may touch the mapping
            req = {"job": 5, "round": 0, "bucket": 0, "codec": "fp32", "total": 1000}
            with pytest.raises(DaemonError) as e:
                r.client.call("submit", **req, data=[0, 4000], out=[8192, 4000 + 6 * P])
            assert e.value.code == "bad_request" and "shrank" in str(e.value), e.value
            # the same connection still answers, and so does the daemon
            with pytest.raises(DaemonError) as e:
                r.client.call("submit", **{**req, "round": 1}, data=[0, 4000], out=[8192, 8400])
            assert e.value.code == "bad_request" and "shrank" in str(e.value), e.value
            assert r.client.status()["clients"] >= 1

            # 2. truncated after the submit: the round runs on the daemon's copy of
            # the lanes, the peer gets its exact sum, writing the result is refused
            a = Rank(ds[0], f"dlcp-reltr{pid}-a", 1 << 20)
            b = Rank(ds[1], f"dlcp-reltr{pid}-b", 1 << 20)
            rs += [a, b]
            a.join(6, KEY_B, hosts_of(ds), 0)
            b.join(6, KEY_B, hosts_of(ds), 1)
            xa = np.full(30_000, 1.5, np.float32)
            xb = np.arange(30_000, dtype=np.float32)
            wa = submit(a, job=6, round=0, bucket=0, lanes=xa, shards=2)
            a.client.call("status")  # the submit has been read (requests are in order)
            os.truncate(a.seg.path, 4096)
            wb = submit(b, job=6, round=0, bucket=0, lanes=xb, shards=2)
            np.testing.assert_array_equal(wb().sums, xa + xb)
            with pytest.raises(DaemonError) as e:
                wa()
            assert e.value.code == "bad_request" and "shrank" in str(e.value), e.value

            # 3. both daemons keep serving: fresh ranks run exact rounds
            fresh = [Rank(d, f"dlcp-reltr{pid}-f{i}", 1 << 20) for i, d in enumerate(ds)]
            rs += fresh
            for i, f in enumerate(fresh):
                f.join(7, KEY_A, hosts_of(ds), i)
            rng = np.random.default_rng(5)
            for rnd in range(2):
                _exact_round(fresh, 7, rnd, rng)
        finally:
            for x in rs:
                with contextlib.suppress(Exception):
                    x.client.close()
                with contextlib.suppress(Exception):
                    os.unlink(x.seg.path)
        for d in ds:
            assert d.proc is not None and d.proc.poll() is None, f"dlcpd died: {d.proc.returncode}"


def test_a_rank_that_disconnects_mid_round(tmp_path: Path) -> None:
    """Host 2's only rank submits and disconnects: the others complete or get
    round_failed within the timeout; a new rank on host 2 then runs rounds."""
    timeout = 3.0
    with loopback_daemons(tmp_path, 3, {"timing": {"timeout": timeout}}) as ds:
        rs = [Rank(d, f"dlcp-reldc{os.getpid()}-{i}", 4 << 20) for i, d in enumerate(ds)]
        try:
            for i, r in enumerate(rs):
                r.join(9, KEY_A, hosts_of(ds), i)
            rng = np.random.default_rng(60)
            _exact_round(rs, 9, 0, rng)
            x = np.ones(200_000, np.float32)
            w2 = submit(rs[2], job=9, round=1, bucket=0, lanes=x, shards=3)
            rs[2].close()
            with pytest.raises(ConnectionError):
                w2()
            t = time.monotonic()
            outcomes = []
            for r in rs[:2]:
                w = submit(r, job=9, round=1, bucket=0, lanes=x, shards=3, timeout=timeout + 30)
                try:
                    w()
                    outcomes.append("completed")
                except DaemonError as exc:
                    assert exc.code == "round_failed" and "timed out" in str(exc)
                    outcomes.append("round_failed")
            assert time.monotonic() - t < timeout + 30
            rs[2] = Rank(ds[2], f"dlcp-reldc{os.getpid()}-2b", 4 << 20)
            rs[2].join(9, KEY_A, hosts_of(ds), 2)
            for rnd in (2, 3):
                _exact_round(rs, 9, rnd, rng)
            _report("client_disconnect", {"others": outcomes, "timeout_s": timeout})
        finally:
            for r in rs:
                with contextlib.suppress(Exception):
                    r.close()


def _connectable(path: str) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        try:
            s.connect(path)
        except OSError:
            return False
    return True


def _job_clients(d: Daemon, job: int) -> int:
    with DaemonClient(d.socket) as c:
        return sum(j["clients"] for j in c.status()["jobs"] if j["job"] == job)


@pytest.mark.parametrize("submitted_first", [False, True])
def test_a_local_rank_that_disconnects_fails_the_other_local_rank(
    tmp_path: Path, submitted_first: bool
) -> None:
    """Two ranks on host 0 (local_ranks=2): one dies (before or after
    submitting), then the other submits. It must get round_failed within the
    timeout, not wait forever (regression: dlcpd kept such a local round open
    with no timer); so must host 1. A new second local rank brings the job back."""
    timeout = 2.0
    with loopback_daemons(tmp_path, 2, {"timing": {"timeout": timeout}}) as ds:
        a = Rank(ds[0], f"dlcp-rell{os.getpid()}-a", 1 << 20)
        b = Rank(ds[0], f"dlcp-rell{os.getpid()}-b", 1 << 20)
        c = Rank(ds[1], f"dlcp-rell{os.getpid()}-c", 1 << 20)
        try:
            for r, me in ((a, 0), (b, 0)):
                r.join(6, KEY_A, hosts_of(ds), me, local_ranks=2)
            c.join(6, KEY_A, hosts_of(ds), 1)
            x = np.ones(1000, np.float32)
            if submitted_first:
                submit(a, job=6, round=0, bucket=0, lanes=x, shards=2)
            a.close()
            assert _wait_for(lambda: _job_clients(ds[0], 6) == 1)
            t = time.monotonic()
            wb = submit(b, job=6, round=0, bucket=0, lanes=x, shards=2, timeout=timeout + 30)
            wc = submit(c, job=6, round=0, bucket=0, lanes=x, shards=2, timeout=timeout + 30)
            for w in (wb, wc):
                with pytest.raises(DaemonError) as e:
                    w()
                assert e.value.code == "round_failed"
            assert time.monotonic() - t < timeout + 30
            # a new second local rank: the job runs again
            a = Rank(ds[0], f"dlcp-rell{os.getpid()}-a2", 1 << 20)
            a.join(6, KEY_A, hosts_of(ds), 0, local_ranks=2)
            ws = [submit(r, job=6, round=1, bucket=0, lanes=x, shards=2) for r in (a, b, c)]
            for w in ws:
                np.testing.assert_array_equal(w().sums, np.full(1000, 3.0, np.float32))
        finally:
            for r in (a, b, c):
                with contextlib.suppress(Exception):
                    r.close()


# --- faults: daemon killed and restarted, a peer that disappears (loopback) -----------


def test_daemon_sigkill_mid_round_and_restart_on_the_same_config(tmp_path: Path) -> None:
    timeout = 3.0
    with loopback_daemons(tmp_path, 3, {"timing": {"timeout": timeout}}) as ds:
        rs = [Rank(d, f"dlcp-relk{os.getpid()}-{i}", 4 << 20) for i, d in enumerate(ds)]
        rng = np.random.default_rng(70)
        try:
            for i, r in enumerate(rs):
                r.join(11, KEY_A, hosts_of(ds), i)
            for rnd in range(3):
                _exact_round(rs, 11, rnd, rng)
            x = np.ones(500_000, np.float32)
            waits = [submit(r, job=11, round=3, bucket=0, lanes=x, shards=3) for r in rs]
            ds[1].stop(signal.SIGKILL)
            t = time.monotonic()
            with pytest.raises(ConnectionError):
                waits[1]()
            outcomes = []
            for w in (waits[0], waits[2]):
                try:
                    w()
                    outcomes.append("completed")
                except DaemonError as exc:
                    assert exc.code == "round_failed"
                    outcomes.append("round_failed")
            assert time.monotonic() - t < timeout + 30
            with pytest.raises((ConnectionError, OSError)):
                rs[1].client.hello()
            # the same config again: a new daemon on the same socket (the dead one's
            # file is still there) and UDP port
            assert os.path.exists(ds[1].socket)
            ds[1].start()
            assert _wait_for(lambda: _connectable(ds[1].socket))
            with contextlib.suppress(Exception):
                rs[1].close()
            rs[1] = Rank(ds[1], f"dlcp-relk{os.getpid()}-1b", 4 << 20)
            rs[1].join(11, KEY_A, hosts_of(ds), 1)
            for rnd in range(4, 7):
                _exact_round(rs, 11, rnd, rng)
            _report("daemon_sigkill_restart", {"survivors": outcomes, "rounds_after": 3})
        finally:
            for r in rs:
                with contextlib.suppress(Exception):
                    r.close()


def test_a_peer_that_disappears_mid_run_gives_clear_errors_not_hangs(tmp_path: Path) -> None:
    """Rounds run back to back; host 2's daemon is killed between two of them and
    never returns: the survivors' next rounds fail with a reason naming the
    missing node within the timeout, every time, and their daemons stay up."""
    timeout = 2.0
    with loopback_daemons(tmp_path, 3, {"timing": {"timeout": timeout}}) as ds:
        rs = [Rank(d, f"dlcp-relp{os.getpid()}-{i}", 4 << 20) for i, d in enumerate(ds)]
        rng = np.random.default_rng(80)
        try:
            for i, r in enumerate(rs):
                r.join(12, KEY_A, hosts_of(ds), i)
            for rnd in range(3):
                _exact_round(rs, 12, rnd, rng)
            ds[2].stop(signal.SIGKILL)
            reasons = []
            for rnd in range(3, 6):
                x = np.ones(50_000, np.float32)
                t = time.monotonic()
                waits = [
                    submit(r, job=12, round=rnd, bucket=0, lanes=x, shards=3, timeout=60)
                    for r in rs[:2]
                ]
                for w in waits:
                    with pytest.raises(DaemonError) as e:
                        w()
                    assert e.value.code == "round_failed"
                    assert "2" in str(e.value)  # names the missing node
                    reasons.append(str(e.value))
                assert time.monotonic() - t < timeout + 30
            for d in ds[:2]:
                assert d.proc is not None and d.proc.poll() is None
            _report("peer_disappears_loopback", {"reasons": sorted(set(reasons))})
        finally:
            for r in rs:
                with contextlib.suppress(Exception):
                    r.close()


# --- the emulated cluster: loss bursts, a vanishing host, soak, tenants (netns) --------


def _load_soak() -> Any:
    spec = importlib.util.spec_from_file_location(
        "dlcp_bench_soak", ROOT / "bench" / "diag" / "soak.py"
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class _NsRank:
    def __init__(self, socket_path: str, name: str, size: int) -> None:
        self.client = DaemonClient(socket_path)
        self.info = self.client.hello()
        self.seg = Segment(name, size)
        self.client.segment(self.seg)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.client.close()
        self.seg.close()


NS_TIMEOUT = 10.0


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    from dlcp.testbed import Testbed, TestbedSpec

    root = Path(tempfile.mkdtemp(prefix="dlcp-rel-", dir="/tmp"))
    spec = TestbedSpec(hosts=3, rate_bps=200_000_000, name="rel-net")
    tb = Testbed.up(spec, state_root=root)
    try:
        tb.start_daemons({"timing": {"timeout": NS_TIMEOUT}, "daemon": {"metrics_port": 0}})
        yield tb
    finally:
        tb.down()
        shutil.rmtree(root, ignore_errors=True)
        if os.path.isdir("/run/netns"):
            assert not [n for n in os.listdir("/run/netns") if n.startswith("rel-net")]


def _ns_ranks(tb: Any, job: int, key: bytes, tag: str) -> list[_NsRank]:
    hosts = [{"addresses": [tb.address(i)], "udp_port": tb.spec.udp_port} for i in range(3)]
    rs = []
    for i in range(3):
        r = _NsRank(str(tb.hosts[i].socket), f"dlcp-{tag}{os.getpid()}-{i}", 8 << 20)
        rs.append(r)
        r.client.join(job=job, key=key, hosts=hosts, me=i, local_ranks=1)
    return rs


@pytest.mark.netns
def test_a_30_percent_loss_burst_on_one_link(cluster: Any) -> None:
    """30 % loss both ways on host 1's link for a few seconds while rounds run
    (lossless rounds and 5 %-bound rounds alternating): every round completes,
    replicas agree bit for bit, no non-droppable packet is lost, packets with
    every contribution are exact."""
    soak = _load_soak()
    tb = cluster
    rs = _ns_ranks(tb, 31, os.urandom(32), "relburst")
    rng = np.random.default_rng(90)
    lanes = 1 << 18
    lay = Layout(lanes, Codec.FP32, 3, rs[0].info["payload"])
    norms = rng.permutation(np.linspace(0.01, 10.0, lay.packets)).astype(np.float32)
    fig: Counter[str] = Counter()
    try:
        tb.set_loss(1, 30.0, direction="in")
        tb.set_loss(1, 30.0, direction="out")
        t_end = time.monotonic() + 4.0
        rnd = 0
        while time.monotonic() < t_end or rnd < 4:
            bound = 0.05 if rnd % 2 else 0.0
            drop = soak.droppable_mask(norms.astype(np.float64), lay, bound)
            xs = [rng.standard_normal(lanes).astype(np.float32) for _ in rs]
            waits = [
                submit(
                    r,
                    job=31,
                    round=rnd,
                    bucket=0,
                    lanes=x,
                    shards=3,
                    bound=bound,
                    norms=norms,
                    layers=np.zeros(lay.packets),
                    timeout=120,
                )
                for r, x in zip(rs, xs, strict=True)
            ]
            results = [w() for w in waits]
            first = results[0]
            for res in results[1:]:
                assert res.sums.tobytes() == first.sums.tobytes(), "replicas differ"
                np.testing.assert_array_equal(res.contributors, first.contributors)
            short = first.contributors < 3
            assert not (short & ~drop).any(), "a non-droppable packet was lost"
            full = np.repeat(~short, lay.per_packet)[:lanes]
            np.testing.assert_array_equal(first.sums[full], (xs[0] + xs[1] + xs[2])[full])
            fig["rounds"] += 1
            fig["droppable_lost_packets"] += int(short.sum())
            fig["lost_lanes"] += int(first.reply["lost_lanes"])
            rnd += 1
    finally:
        tb.set_loss(1, 0.0, direction="in")
        tb.set_loss(1, 0.0, direction="out")
        stats = [r.client.status()["counters"] for r in rs]
        for r in rs:
            r.close()
    fig["retransmits"] = sum(
        s.get("data_retransmits", 0) + s.get("result_retransmits", 0) for s in stats
    )
    assert fig["retransmits"] > 0, "30 % loss must have needed NACK recovery"
    _report("loss_burst_30pct", dict(fig))


@pytest.mark.netns
def test_a_host_that_vanishes_from_the_network(cluster: Any) -> None:
    """Host 2's link goes down (its daemon lives on, unreachable): hosts 0 and 1
    get round_failed within the timeout; once the link is back, rounds complete."""
    tb = cluster
    rs = _ns_ranks(tb, 32, os.urandom(32), "relgone")
    rng = np.random.default_rng(91)
    h2 = tb.host(2)
    link = ["ip", "-n", h2.netns, "link", "set", h2.interfaces[0]]
    try:
        _exact_round(rs, 32, 0, rng)
        subprocess.run([*link, "down"], check=True)
        x = np.ones(100_000, np.float32)
        t = time.monotonic()
        waits = [
            submit(r, job=32, round=1, bucket=0, lanes=x, shards=3, timeout=NS_TIMEOUT + 60)
            for r in rs
        ]
        outcomes = []
        for w in waits:
            try:
                w()
                outcomes.append("completed")
            except DaemonError as exc:
                assert exc.code == "round_failed"
                outcomes.append("round_failed")
        assert outcomes[:2] == ["round_failed", "round_failed"]
        elapsed = time.monotonic() - t
        assert elapsed < NS_TIMEOUT + 60
    finally:
        subprocess.run([*link, "up"], check=False)
    try:
        deadline = time.monotonic() + 30
        rnd = 2
        while True:  # the link needs a moment to carry traffic again
            try:
                _exact_round(rs, 32, rnd, rng)
                break
            except DaemonError:
                assert time.monotonic() < deadline
                rnd += 1
        _exact_round(rs, 32, rnd + 1, rng)
        _report("host_vanishes_netns", {"outcomes": outcomes, "elapsed_s": round(elapsed, 1)})
    finally:
        for r in rs:
            r.close()


def _soak_checks(fig: dict[str, Any], rounds: int) -> None:
    assert not fig["failed"], fig["failed"][:5]
    assert fig["completed"] == rounds
    assert fig["replica_mismatches"] == 0
    assert fig["nondroppable_lost_packets"] == 0
    assert fig["inexact_full_packets"] == 0
    for host, r in fig["rss_kib"].items():
        # flat after warm-up: no growth with the rounds run (a leak of even a few
        # bytes per packet would show); the margin covers allocator noise
        assert r["max_after_warmup"] - r["after_warmup"] < 48 * 1024, (host, r)


@pytest.mark.netns
def test_soak_short_loss_and_background(cluster: Any) -> None:
    soak = _load_soak()
    fig = soak.soak(cluster, rounds=100, lanes=1 << 15, bound=0.05, loss_pct=5.0, warmup=20)
    _report("soak_short", fig)
    _soak_checks(fig, 100)


@pytest.mark.netns
@pytest.mark.slow
def test_soak_1000_rounds_loss_and_background(cluster: Any) -> None:
    soak = _load_soak()
    fig = soak.soak(cluster, rounds=1000, lanes=1 << 16, bound=0.05, loss_pct=5.0, warmup=100)
    _report("soak_1000", fig)
    _soak_checks(fig, 1000)


@pytest.mark.netns
def test_two_tenants_share_a_bottleneck(cluster: Any) -> None:
    """Jobs A and B with different keys through the same daemons and 200 Mbit/s
    links at the same time: both exact; the bytes each moved are reported."""
    tb = cluster
    ra = _ns_ranks(tb, 41, os.urandom(32), "relta")
    rb = _ns_ranks(tb, 42, os.urandom(32), "reltb")
    lanes = 1 << 18
    a = _Runner(ra, 41, 12, lanes, 92)
    b = _Runner(rb, 42, 12, lanes, 93)
    try:
        a.start()
        b.start()
        a.join(600)
        b.join(600)
        assert a.error is None and b.error is None, (a.error, b.error)
        assert a.done == b.done == 12
        stats = [r.client.status() for r in ra]
    finally:
        for r in (*ra, *rb):
            r.close()
    per_round = _wire_bytes_per_round(lanes, 3, ra[0].info["payload"])
    rate_a = a.done * per_round / a.seconds
    rate_b = b.done * per_round / b.seconds
    _report(
        "multi_tenant_netns",
        {
            "rounds_per_job": 12,
            "lanes": lanes,
            "seconds": {"A": round(a.seconds, 2), "B": round(b.seconds, 2)},
            "wire_bytes_per_job": 12 * per_round,
            "mbit_s": {"A": round(rate_a * 8e-6, 1), "B": round(rate_b * 8e-6, 1)},
            "share_A": round(rate_a / (rate_a + rate_b), 3),
            "peer_sent_bytes_h0": [p["sent_bytes"] for p in stats[0]["peers"]],
        },
    )
