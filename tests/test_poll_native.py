"""A poll's drain in one C call (`_udp.recv_drain`, dlcp.daemon.poll) against
the per-buffer receive (`NetworkIn._receive` with DLCP_NATIVE_POLL=0) and the
per-datagram reference (tests/receive_reference.py), on the same buffers:
GRO buffers and single datagrams of several jobs (unknown ones too) and
sources (one outside every job), truncated headers and payloads, segments
shorter than a header, mixed-job buffers, interleaved senders, NACKs,
credits, results, ACKs and DONEs. The engine, the outbox, the rates and the
credits must be given the same things in the same order, and the counters,
rejects and peers' received bytes must be equal. Then the C drain of a real
socket is held to `_udp.drain_buffers` of what was sent, and its budgets to
`NetworkIn._splits`'.
"""

from __future__ import annotations

import socket
from collections import Counter
from typing import Any

import numpy as np
import pytest

from dlcp.core.engine import Engine, JobSpec
from dlcp.daemon import netin, poll, server, transport
from dlcp.daemon.netin import NetworkIn
from dlcp.wire import Codec
from dlcp.wire.probe import probe_payload
from tests import receive_reference
from tests.receive_reference import reference_receive
from tests.test_receive_fast import JOB_A, _buffers, _daemon, _Path, _traffic

pytestmark = pytest.mark.skipif(
    not poll.NATIVE_POLL, reason="dlcp.daemon._udp or dlcp.wire._bulk not built, or turned off"
)


def _receive(d: Any, part: list[tuple[bytes, int, str]], on: bool) -> bool:
    d.native_poll = on
    return NetworkIn._receive(d, _Path(part, native=True, runs=True, poll=on))


@pytest.mark.parametrize("drain", [40, 1, 64])
@pytest.mark.parametrize("seed", range(8))
def test_the_poll_is_the_per_buffer_receive(
    seed: int, drain: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    for module in (netin, poll, receive_reference):  # credits within this little traffic
        monkeypatch.setattr(module, "CREDIT_STEP", 4096)
    rng = np.random.default_rng(seed)
    buffers = _buffers(rng, 300, float(rng.choice([0.0, 0.5, 0.8])))
    logs: list[list[Any]] = [[], [], []]
    daemons = [_daemon(log) for log in logs]
    for cut in range(0, len(buffers), drain):
        part = buffers[cut : cut + drain]
        reference_receive(daemons[0], _Path(part))
        _receive(daemons[1], part, False)
        _receive(daemons[2], part, True)
    for d, log in zip(daemons[1:], logs[1:], strict=True):
        assert log == logs[0]
        assert d.daemon_rejects == daemons[0].daemon_rejects
        assert d.counters == daemons[0].counters
    rx = [
        {(j, n): p.rx_bytes for j, job in d.jobs.items() for n, p in job.peers.items()}
        for d in daemons
    ]
    assert rx[2] == rx[1] == rx[0] and all(rx[0].values()), rx
    kinds = Counter(entry[0] for entry in logs[0])
    assert kinds["engine"] and kinds["nack"] and kinds["ack"] and kinds["credit"], kinds
    assert daemons[0].daemon_rejects["bad_address"] > 0


def test_a_drain_of_only_foreign_addresses_reaches_no_engine() -> None:
    """Datagrams of job A from an address outside it are the daemon's
    rejects, and still count as received."""
    dgs = _traffic(JOB_A, "ghash-aes", 0)[:5]
    d = _daemon([])
    _receive(d, [(dg, 0, "10.9.9.9") for dg in dgs], True)
    assert d.engine.log == []
    assert d.daemon_rejects == {"bad_address": 5}
    assert d.counters == {"rx_packets": 5, "rx_bytes": sum(map(len, dgs))}


def test_the_poll_takes_the_budgets_of_the_per_buffer_drain() -> None:
    """Idle: _RX_BUDGET buffers, and more may wait; with datagrams to send,
    _RX_SENDING at a time until _RX_SENDING_BYTES (as `NetworkIn._splits`)."""
    rng = np.random.default_rng(0)
    for on in (False, True):
        d = _daemon([])
        d.native_poll = on
        path = _Path(_buffers(rng, 300), native=True, runs=True, poll=on)
        assert NetworkIn._receive(d, path)
        assert len(path.buffers) == 300 - server._RX_BUDGET
        d.outbox.backlog.add(object())
        path = _Path([(b"x" * 1500, 0, "10.0.0.2")] * 1000, native=True, runs=True, poll=on)
        assert NetworkIn._receive(d, path)
        taken = 1000 - len(path.buffers)
        assert taken % server._RX_SENDING == 0
        assert (taken - server._RX_SENDING) * 1500 < server._RX_SENDING_BYTES <= taken * 1500
        path = _Path([(b"x" * 1500, 0, "10.0.0.2")] * 10, native=True, runs=True, poll=on)
        assert not NetworkIn._receive(d, path)
        assert path.buffers == []


def _drain_lists(drain: Any) -> tuple[Any, ...]:
    nb, size, dgs, srcs, src, job, kind, length, more, pair, pairs = drain
    return (
        nb,
        size,
        [bytes(x) for x in dgs],
        srcs,
        np.frombuffer(src, np.int32).tolist(),
        np.frombuffer(job, np.int64).tolist(),
        kind,
        np.frombuffer(length, np.int64).tolist(),
        more,
        np.frombuffer(pair, np.int32).tolist(),
        np.frombuffer(pairs, np.int64).reshape(-1, 5).tolist(),
    )


def _same(drain: tuple[Any, ...], sent: list[tuple[bytes, int, str]]) -> bool:
    """Whether a drain is `drain_buffers`' (and `py_drain`'s) of `sent`, but its `more`."""
    want = _drain_lists(transport._udp.drain_buffers(sent))
    assert want == _drain_lists(poll.py_drain(sent))
    return drain[:8] == want[:8] and drain[9:] == want[9:]


def test_drain_buffers_is_the_split_of_each_buffer() -> None:
    """Each datagram of `_udp.drain_buffers` is `split_gro`'s, with its
    source's first-seen index, its job (-1: no whole header), type byte (0:
    none) and length."""
    rng = np.random.default_rng(7)
    bufs = _buffers(rng, 200, 0.5)
    got = _drain_lists(transport._udp.drain_buffers(bufs))
    assert got == _drain_lists(poll.py_drain(bufs))
    assert got[0] == len(bufs) and got[1] == sum(len(b[0]) for b in bufs)
    dgs = [bytes(d) for data, seg, _ in bufs for d in transport.split_gro(data, seg)[0]]
    assert got[2] == dgs
    assert -1 in got[5] and 0 in got[6] and len(got[3]) == 4
    pairs = got[10]  # (source, job) of each datagram's pair, numbered as they first appear
    assert [tuple(pairs[p][:2]) for p in got[9]] == list(zip(got[4], got[5], strict=True))
    assert [p[2] for p in pairs] == sorted(got[9].index(i) for i in range(len(pairs)))
    assert [p[3] for p in pairs] == [got[9].count(i) for i in range(len(pairs))]
    assert sum(p[4] for p in pairs) == got[1] and len(pairs) > 4
    empty = _drain_lists(transport._udp.drain_buffers([]))
    assert empty == (0, 0, [], [], [], [], b"", [], 0, [], [])
    with pytest.raises(ValueError, match="IPv4"):
        transport._udp.drain_buffers([(b"x", 0, "not an address")])


def test_a_drain_of_many_jobs_and_sources_is_numbered_as_in_python() -> None:
    """Forged traffic of a job and a source a datagram (the C numbers pairs
    and sources through hash tables): the same drain as `py_drain`."""
    rng = np.random.default_rng(9)
    bufs = []
    for i in range(3000):
        head = bytearray(rng.integers(0, 256, 64 + int(rng.integers(0, 40)), dtype=np.uint8))
        head[8:12] = int(rng.integers(0, 1 << 32) if i % 3 else i % 7).to_bytes(4, "big")
        src = f"10.{i % 5}.{int(rng.integers(0, 40))}.{int(rng.integers(1, 255))}"
        bufs.append((bytes(head) * int(rng.integers(1, 4)), len(head), src))
    got = _drain_lists(transport._udp.drain_buffers(bufs))
    assert got == _drain_lists(poll.py_drain(bufs))
    assert len(got[10]) > 2000 and len(got[3]) > 1000


def test_recv_drain_of_a_socket_is_drain_buffers_of_what_came() -> None:
    """Datagrams of three source addresses through loopback: recv_drain gives
    drain_buffers' drain of them, and stops where its budgets say."""
    rx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    rx.bind(("127.0.0.1", 0))
    rx.setblocking(False)
    rx.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 22)
    txs = []
    try:
        for host in ("127.0.0.1", "127.0.0.2", "127.0.0.3"):
            t = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            txs.append(t)
            t.bind((host, 0))
        rng = np.random.default_rng(1)
        sent = []
        for i, (data, _, _) in enumerate(_buffers(rng, 60)):
            t = txs[int(rng.integers(0, 3))] if i % 7 else txs[0]
            t.sendto(data, rx.getsockname())
            sent.append((data, 0, t.getsockname()[0]))
        fd = rx.fileno()
        first = _drain_lists(transport._udp.recv_drain(fd, 16, 0))  # one full chunk
        assert first[0] == 16 and first[8] == 1
        assert _same(first, sent[:16])
        capped = _drain_lists(transport._udp.recv_drain(fd, 8, 1))  # over 1 byte after a chunk
        assert capped[0] == 8 and capped[8] == 1
        assert _same(capped, sent[16:24])
        rest = _drain_lists(transport._udp.recv_drain(fd, 16, 1 << 30))  # to the end
        assert rest[0] == 36 and rest[8] == 0
        assert _same(rest, sent[24:])
        assert _drain_lists(transport._udp.recv_drain(fd, 16, 0))[0] == 0  # nothing left
        with pytest.raises(ValueError, match="chunk"):
            transport._udp.recv_drain(fd, 0, 0)
    finally:
        rx.close()
        for t in txs:
            t.close()


def test_a_real_engine_ends_the_same_either_way(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two rounds of fp16 between three engines, the third's arrivals through
    a daemon's receive with the poll on and off (as single datagrams and GRO
    buffers, the senders interleaved): its aggregators' and collectors'
    arrays, counters and rejects end the same."""
    states = []
    for on in (False, True):
        rng = np.random.default_rng(5)
        engines = []
        for me in range(3):
            e = Engine()
            e.add_job(JobSpec.transpose(11, b"k" * 32, me, 3, payload=1000, mac="ghash-aes"))
            engines.append(e)
        d = _daemon([])
        d.engine = engines[2]
        assert d.jobs[11].node_of == {"10.0.0.1": 0, "10.0.0.2": 1}  # tests.test_receive_fast
        d.native_poll = on
        total = 30_000
        for rnd in range(2):
            for e in engines:
                lanes = rng.standard_normal(total).astype("<f2").tobytes()
                e.submit(job=11, round=rnd, bucket=0, codec=Codec.FP16, total=total,
                         lanes=lanes, now=0.0, scale=0.0)  # fmt: skip
        for _ in range(200):
            out = [(me, s.node, bytes(s.datagram)) for me, e in enumerate(engines)
                   for s in e.datagrams_to_send()]  # fmt: skip
            if not out:
                for e in engines:
                    e.handle_timer(1.0)
                if not any(e.pending_rounds() for e in engines):
                    break
                continue
            bufs = []
            for src, dst, dg in out:
                if dst == 2:
                    bufs.append((dg, 0, f"10.0.0.{src + 1}"))
                else:
                    engines[dst].receive_many([dg], 0.0, np.array([src]))
            order = np.argsort(np.arange(len(bufs)) + rng.integers(0, 30, len(bufs)))
            bufs = [bufs[i] for i in order.tolist()]
            for cut in range(0, len(bufs), 50):
                NetworkIn._receive(d, _Path(bufs[cut : cut + 50], True, True, poll=on))
        e = engines[2]
        keys = {"rejects": dict(e.rejects), "stats": dict(e.stats), "counters": dict(d.counters)}
        keys["aggs"] = [
            (op, shard, a.received.tobytes(), a.acc.slots.tobytes(), a.n_received)
            for op, shard, a in e.rounds.aggregators()
        ]
        events = []
        while (ev := e.next_event()) is not None:
            events.append(repr(ev)[:40])
        keys["events"] = events
        states.append(keys)
    assert states[0] == states[1]
    assert states[0]["stats"].get("data_packets_received", 0) > 0


def test_credits_and_probes_reach_the_outbox_and_prober_as_per_buffer() -> None:
    """CONTROL packets (credits, probes, echoes) of a real engine's job from
    both peers' addresses, one from outside the job and a forged one, with
    GRO buffers of them: the outbox and prober hear the same, in order."""
    engines = []
    for me in (0, 1, 2, 2):  # node 2 twice: a receiver for either side
        e = Engine()
        e.add_job(JobSpec.transpose(JOB_A, b"k" * 32, me, 3, payload=1000, mac="ghash-aes"))
        engines.append(e)
    rng = np.random.default_rng(4)
    bufs: list[tuple[bytes, int, str]] = []
    for i in range(120):
        me = int(rng.integers(0, 2))  # node 0 or 1 to node 2
        e = engines[me]
        r = rng.random()
        if r < 0.4:
            dg = e.credit_datagram(JOB_A, i % 3, 1000 * i, bool(i % 2), 64_000)
        else:
            dg = e.control_datagram(JOB_A, probe_payload(i % 2, i, echo=r < 0.7))
        assert dg is not None
        if rng.random() < 0.05:
            dg = dg[:-1] + bytes([dg[-1] ^ 1])  # its MAC fails
        src = "10.9.9.9" if rng.random() < 0.05 else f"10.0.0.{me + 1}"
        k = int(rng.integers(1, 4))
        bufs.append((dg * k, len(dg) if k > 1 else 0, src))
    logs: list[list[Any]] = [[], []]
    for on, log, engine in zip((False, True), logs, engines[2:], strict=True):
        d = _daemon(log)
        d.engine = engine
        d.prober = _Prober(log)
        d.outbox.on_credit = lambda peer, *a, log=log, **k: log.append(("credit in", peer.name, a))
        for cut in range(0, len(bufs), 30):
            _receive(d, bufs[cut : cut + 30], on)
    assert logs[1] == logs[0]
    kinds = Counter(entry[0] for entry in logs[0])
    assert kinds["credit in"] > 20 and kinds["probe"] > 20, kinds


class _Prober:
    def __init__(self, log: list[Any]) -> None:
        self.log = log

    def on_probe(self, peer: Any, job: int, probe: Any, now: float) -> None:
        self.log.append(("probe", peer.name, job, probe, now))
