"""dlcpd end to end on loopback: real daemons, real UDP sockets, the shim protocol.

No root needed (127.0.0.0/8 is all loopback); the namespace variant with rate
limits and nftables loss is in test_daemon_netns.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from dlcp import ipc
from dlcp.core.timing import Timing
from dlcp.shim.client import DaemonClient, DaemonError, SealedSegment
from dlcp.wire import mac
from dlcp.wire.header import Header, PacketType, encode
from tests.daemons import (
    ROOT,
    Rank,
    free_tcp_port,
    free_udp_port,
    hosts_of,
    loopback_daemons,
    packet_norms,
    submit,
    toml_value,
    wire_key,
    write_config,
)

KEY = bytes(range(32))
JOB = 4242


@pytest.fixture(scope="module")
def trio(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list]:  # type: ignore[type-arg]
    tmp = tmp_path_factory.mktemp("trio")
    with loopback_daemons(tmp, 3, {"timing": {"timeout": 5.0}}) as ds:
        yield ds


@pytest.fixture(scope="module", params=["named", "sealed"])
def ranks(trio: list, request: pytest.FixtureRequest) -> Iterator[list[Rank]]:  # type: ignore[type-arg]
    """Ranks with named /dev/shm segments, or with sealed memfds the daemons map."""
    sealed = request.param == "sealed"
    rs = [Rank(d, f"dlcp-t{os.getpid()}-{i}", 8 << 20, sealed=sealed) for i, d in enumerate(trio)]
    for i, r in enumerate(rs):
        r.join(JOB, KEY, hosts_of(trio), i)
    yield rs
    for r in rs:
        r.close()


_round = iter(range(10_000))


def allreduce(ranks: list[Rank], xs: list[np.ndarray], **kw: object) -> list:  # type: ignore[type-arg]
    rnd = next(_round)
    waits = [
        submit(r, job=JOB, round=rnd, bucket=0, lanes=x, shards=len(ranks), **kw)  # type: ignore[arg-type]
        for r, x in zip(ranks, xs, strict=True)
    ]
    return [w() for w in waits]


def test_fp32_sums_are_exact_over_three_daemons(ranks: list[Rank]) -> None:
    rng = np.random.default_rng(0)
    in_place = [r.client.status()["counters"].get("results_in_place", 0) for r in ranks]
    for n in (1, 351, 352, 100_003):
        xs = [rng.standard_normal(n).astype(np.float32) for _ in ranks]
        expected = xs[0] + xs[1] + xs[2]  # the aggregator sums in sender order
        for res in allreduce(ranks, xs):
            np.testing.assert_array_equal(res.sums, expected)
            assert (res.contributors == 3).all()
            assert res.reply["lost_lanes"] == 0
    # a mapped segment gets its result lanes stored in place, a named one by pwritev
    sealed = isinstance(ranks[0].seg, SealedSegment)
    for r, before in zip(ranks, in_place, strict=True):
        now = r.client.status()["counters"].get("results_in_place", 0)
        assert now - before == (4 if sealed else 0)


def test_two_buckets_in_flight_at_once(ranks: list[Rank]) -> None:
    rng = np.random.default_rng(1)
    a = [rng.standard_normal(50_000).astype(np.float32) for _ in ranks]
    b = [rng.standard_normal(20_000).astype(np.float32) for _ in ranks]
    rnd = next(_round)
    wa = [
        submit(r, job=JOB, round=rnd, bucket=0, lanes=x, shards=3)
        for r, x in zip(ranks, a, strict=True)
    ]
    wb = [
        submit(r, job=JOB, round=rnd, bucket=1, lanes=x, shards=3, base=4 << 20)
        for r, x in zip(ranks, b, strict=True)
    ]
    for w in wa:
        np.testing.assert_array_equal(w().sums, a[0] + a[1] + a[2])
    for w in wb:
        np.testing.assert_array_equal(w().sums, b[0] + b[1] + b[2])


def test_fp16_and_thc_lanes(ranks: list[Rank]) -> None:
    rng = np.random.default_rng(2)
    h = [rng.standard_normal(4096).astype(np.float16) for _ in ranks]
    in_place = [r.client.status()["counters"].get("results_in_place", 0) for r in ranks]
    for res in allreduce(ranks, h, codec="fp16"):
        assert res.sums.dtype == np.float16
        expected = sum(x.astype(np.float32) for x in h).astype(np.float16)  # f32 sums
        np.testing.assert_array_equal(res.sums, expected)
    # a mapped segment gets fp16's halves cast straight into it, a named one by pwritev
    sealed = isinstance(ranks[0].seg, SealedSegment)
    for r, before in zip(ranks, in_place, strict=True):
        now = r.client.status()["counters"].get("results_in_place", 0)
        assert now - before == (1 if sealed else 0)
    q = [rng.integers(0, 256, 8192, dtype=np.uint8) for _ in ranks]
    for res in allreduce(ranks, q, codec="thc8"):
        np.testing.assert_array_equal(res.sums, sum(x.astype(np.uint16) for x in q))


def test_bounded_loss_metadata_is_accepted_and_lossless_without_loss(ranks: list[Rank]) -> None:
    rng = np.random.default_rng(3)
    xs = [rng.standard_normal(60_000).astype(np.float32) for _ in ranks]
    norms = [packet_norms(x, 3) for x in xs]
    layers = np.arange(len(norms[0])) // 10
    waits = []
    rnd = next(_round)
    for r, x, nm in zip(ranks, xs, norms, strict=True):
        waits.append(
            submit(
                r,
                job=JOB,
                round=rnd,
                bucket=0,
                lanes=x,
                shards=3,
                bound=0.1,
                layers=layers,
                norms=nm,
            )
        )
    results = [w() for w in waits]
    for res in results:  # replicas are bitwise identical
        assert res.sums.tobytes() == results[0].sums.tobytes()
        assert res.reply["lost_lanes"] <= 0.1 * res.reply["total_lanes"]


def _datagram(**kw: object) -> Header:
    base = dict(type=PacketType.DATA, job=JOB, round=0, bucket=0, count=1, total=1)
    base.update(kw)
    return Header(**base)  # type: ignore[arg-type]


def test_malformed_and_spoofed_datagrams_are_counted_and_change_nothing(
    trio: list,
    ranks: list[Rank],  # type: ignore[type-arg]
) -> None:
    target = trio[0]
    before = ranks[0].client.status()["rejects"]
    good = encode(_datagram(sender=1, round=10**6), b"\0\0\0\0", wire_key(KEY))
    from_outsider = {
        "truncated": [b"", b"\xd1", good[:63]],
        "bad_magic": [b"\0\0" + good[2:]],
        "unknown_job": [encode(_datagram(job=JOB + 1, sender=1), b"\0" * 4, wire_key(KEY))],
        "bad_address": [good],  # a valid packet from an address outside the job
    }
    from_member = [  # sent from host 2's address
        good[:-1] + bytes([good[-1] ^ 1]),  # bad_mac: corrupted payload
        encode(_datagram(sender=2), b"\0" * 4, wire_key(b"w" * 32)),  # bad_mac: wrong key
        encode(_datagram(sender=1), b"\0" * 4, wire_key(KEY)),  # bad_sender: claims host 1
    ]
    rng = np.random.default_rng(4)
    garbage = [rng.bytes(int(n)) for n in rng.integers(0, 1500, 300)]
    sent = 0
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.9", 0))  # not a member of the job
        for dg in [*(d for v in from_outsider.values() for d in v), *garbage]:
            s.sendto(dg, (target.address, target.port))
            sent += 1
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind((trio[2].address, 0))
        for dg in from_member:
            s.sendto(dg, (target.address, target.port))
            sent += 1
    deadline = time.monotonic() + 10
    while True:
        after = ranks[0].client.status()["rejects"]
        grew = {r: after.get(r, 0) - before.get(r, 0) for r in after}
        if sum(grew.values()) >= sent or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    for reason in ("truncated", "bad_magic", "bad_mac", "unknown_job", "bad_address", "bad_sender"):
        assert grew.get(reason, 0) >= 1, (reason, grew)
    assert sum(grew.values()) == sent, grew  # every datagram is counted under one reason
    # and the job still all-reduces exactly
    xs = [np.full(10_000, i + 1, np.float32) for i in range(3)]
    for res in allreduce(ranks, xs):
        np.testing.assert_array_equal(res.sums, np.full(10_000, 6, np.float32))


def test_bad_requests_get_error_replies_and_the_daemon_keeps_serving(
    trio: list,
    ranks: list[Rank],  # type: ignore[type-arg]
) -> None:
    d = trio[1]
    c = DaemonClient(d.socket)
    try:

        def err(op: str, **kw: object) -> str:
            with pytest.raises(DaemonError) as e:
                c.call(op, **kw)
            return e.value.code

        assert err("bogus") == "unknown_op"
        assert err("hello", version=99) == "bad_request"
        assert err("segment", name="../etc/passwd", size=10) == "bad_request"
        assert err("segment", name="dlcp-does-not-exist", size=10) == "bad_request"
        assert err("join", job=-1, key="00" * 32, hosts=[]) == "bad_request"
        assert err("join", job=1, key="zz", hosts=hosts_of(trio), me=1) == "bad_request"
        assert err("join", job=1, key="00" * 32, hosts=hosts_of(trio), me=0) == "conflict"
        assert err("join", job=1, key="00" * 32, hosts=hosts_of(trio), me=1, ranks=2) == (
            "bad_request"  # fewer ranks than the job's hosts
        )
        assert err("submit", job=JOB) == "unknown_job"
        r = Rank(d, f"dlcp-bad{os.getpid()}", 4096)
        try:
            r.join(JOB + 7, KEY, hosts_of(trio), 1)
            base = dict(job=JOB + 7, round=0, bucket=0, codec="fp32", total=10)

            def rerr(**kw: object) -> str:
                with pytest.raises(DaemonError) as e:
                    r.client.call("submit", **{**base, **kw})
                return e.value.code

            assert rerr(data=[0, 40], out=[4000, 1000]) == "bad_request"  # out past the end
            assert rerr(data=[-4, 40], out=[100, 100]) == "bad_request"
            assert rerr(data=[0, 41], out=[100, 100]) == "bad_request"
            assert rerr(data=[0, 40], out=[20, 100]) == "bad_request"  # overlap
            assert rerr(data=[0, 40], out=[100, 100], codec="int8") == "bad_request"
            assert rerr(data=[0, 40], out=[100, 100], total=0) == "bad_request"
            assert rerr(data=[0, 40], out=[100, 100], bound=0.9) == "bad_request"
            assert rerr(data=[0, 40], out=[100, 100], meta=[200, 3]) == "bad_request"
            assert rerr(data=[0, 40], out=[100, 100], round="x") == "bad_request"
            # the sketch's index union is never droppable (2 bytes: 10 bits)
            assert rerr(data=[0, 2], out=[100, 100], codec="union", bound=0.05) == "bad_request"
        finally:
            r.close()
        # broken framing closes only that connection
        raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        raw.connect(d.socket)
        raw.sendall(struct.pack("!I", 5) + b"nope!")
        reply = ipc.recv_message(raw)
        assert reply["ok"] is False and reply["code"] == "bad_request"
        raw.close()
    finally:
        c.close()
    xs = [np.full(1000, 2.0, np.float32) for _ in range(3)]
    for res in allreduce(ranks, xs):
        np.testing.assert_array_equal(res.sums, np.full(1000, 6.0, np.float32))


def test_metrics_endpoint_and_status_cli(trio: list, ranks: list[Rank]) -> None:  # type: ignore[type-arg]
    allreduce(ranks, [np.ones(5000, np.float32)] * 3)
    d = trio[0]
    text = urllib.request.urlopen(f"http://127.0.0.1:{d.metrics_port}/metrics", timeout=10).read()
    body = text.decode()
    for name in (
        "dlcp_up 1.0",
        'dlcp_rounds_total{outcome="completed"}',
        "dlcp_sent_packets_total{",
        "dlcp_rejected_packets_total{reason=",
        "dlcp_round_duration_seconds_bucket",
        "dlcp_peer_rate_bps{",
        'dlcp_wakeups_total{kind="poll"}',
        'dlcp_wakeups_total{kind="timer"}',
    ):
        assert name in body, name
    # the round's datagrams woke the daemon: at least once for a readable socket
    woke = re.search(r'^dlcp_wakeups_total\{kind="readable"\} (\S+)$', body, re.M)
    assert woke is not None and float(woke.group(1)) >= 1
    out = subprocess.run(
        [sys.executable, "-m", "dlcp", "status", "--socket", d.socket, "--json"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        check=True,
    ).stdout
    st = json.loads(out)
    (job,) = (j for j in st["jobs"] if j["job"] == JOB)
    # each peer's NACK clock: untimed (no NACK answered yet: the fixed wait)
    # or timed (the learnt wait, within the bounds)
    answers = job["nack_answers"]
    assert sorted(a["node"] for a in answers) == sorted(set(range(3)) - {job["me"]})
    timing = Timing()
    for a in answers:
        assert a["peer"]
        if a["answer_s"] is None:
            assert a["answers"] == 0 and a["repeat_after_s"] == timing.nack_interval
        else:
            assert a["answers"] > 0 and a["deviation_s"] >= 0
            assert timing.nack_min <= a["repeat_after_s"] <= timing.nack_interval
    assert st["mac"] == f"ghash-aes ({mac.GhashAesKey(bytes(32)).backend})"
    human = subprocess.run(
        [sys.executable, "-m", "dlcp", "status", "--socket", d.socket],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        check=True,
    ).stdout
    assert str(JOB) in human and "peer" in human and f"MAC {st['mac']}" in human
    assert len(re.findall(r"node \d \(\S+\): .*, repeat after \d+\.\d ms", human)) == 2


def test_status_cli_without_daemon_is_one_clear_error(tmp_path: Path) -> None:
    p = subprocess.run(
        [sys.executable, "-m", "dlcp", "status", "--socket", str(tmp_path / "none.sock")],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert p.returncode == 1
    assert p.stderr.startswith("dlcp: error:") and "none.sock" in p.stderr


def test_peer_that_disappears_fails_rounds_with_a_reason(tmp_path: Path) -> None:
    with loopback_daemons(tmp_path, 2, {"timing": {"timeout": 1.0}}) as ds:
        a = Rank(ds[0], f"dlcp-gone{os.getpid()}", 1 << 20)
        try:
            a.join(9, KEY, hosts_of(ds), 0)
            ds[1].stop(signal.SIGKILL)
            t = time.monotonic()
            wait = submit(a, job=9, round=0, bucket=0, lanes=np.ones(10_000, np.float32), shards=2)
            with pytest.raises(DaemonError) as e:
                wait()
            assert e.value.code == "round_failed"
            assert "timed out" in str(e.value)
            assert time.monotonic() - t < 30
        finally:
            a.close()


def test_sigterm_drains_and_notifies_systemd(tmp_path: Path) -> None:
    notify_path = str(tmp_path / "notify.sock")
    ns = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    ns.bind(notify_path)
    ns.settimeout(20)
    try:
        with loopback_daemons(tmp_path, 1, start=False) as (d,):
            d.env = {"NOTIFY_SOCKET": notify_path, "WATCHDOG_USEC": "200000"}
            d.start()
            msgs: list[str] = []
            while not any("READY=1" in m for m in msgs):
                msgs.append(ns.recv(4096).decode())
            while sum("WATCHDOG=1" in m for m in msgs) < 3:
                msgs.append(ns.recv(4096).decode())
            assert d.stop(signal.SIGTERM) == 0
            ns.settimeout(1)
            try:
                while True:
                    msgs.append(ns.recv(4096).decode())
            except TimeoutError:
                pass
            assert any("STOPPING=1" in m for m in msgs)
            assert not os.path.exists(d.socket)
    finally:
        ns.close()


def test_sighup_reloads_policies(tmp_path: Path) -> None:
    with loopback_daemons(tmp_path, 1) as (d,):
        text = d.config.read_text() + '\n[policies]\npriority = "flow"\n'
        d.config.write_text(text)
        assert d.proc is not None
        d.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 10
        while "reloaded policies" not in d.log.read_text():
            assert time.monotonic() < deadline, d.log.read_text()
            time.sleep(0.05)
        with DaemonClient(d.socket) as c:
            assert c.hello()["udp_port"] == d.port


def test_bad_config_is_one_clear_error(tmp_path: Path) -> None:
    cfg = tmp_path / "bad.toml"
    cfg.write_text("[network]\nudp_port = 70000\n")
    p = subprocess.run(
        [sys.executable, "-m", "dlcp.daemon", "--config", str(cfg)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert p.returncode == 2
    assert "udp_port" in p.stderr and "Traceback" not in p.stderr


@pytest.mark.parametrize("taken", ["udp", "metrics"])
def test_a_port_in_use_is_one_clear_error_and_no_control_socket(tmp_path: Path, taken: str) -> None:
    """A daemon that cannot bind, even where the port's holder allows sharing it,
    exits before its control socket appears: a client (or a test) that sees the
    socket finds a daemon that stays up."""
    kind = socket.SOCK_DGRAM if taken == "udp" else socket.SOCK_STREAM
    with socket.socket(socket.AF_INET, kind) as holder:
        if taken == "udp":  # as another daemon on this address and port would
            holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        holder.bind(("127.0.0.1", free_udp_port() if taken == "udp" else free_tcp_port()))
        if taken == "metrics":
            holder.listen()
        port = holder.getsockname()[1]
        sock = tmp_path / "d.sock"
        cfg = tmp_path / "d.toml"
        write_config(
            cfg,
            {
                "daemon": {
                    "socket": str(sock),
                    "metrics_address": "127.0.0.1",
                    "metrics_port": port if taken == "metrics" else free_tcp_port(),
                },
                "network": {
                    "addresses": ["127.0.0.1"],
                    "udp_port": port if taken == "udp" else free_udp_port(),
                },
            },
        )
        p = subprocess.run(
            [sys.executable, "-m", "dlcp.daemon", "--config", str(cfg)],
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            timeout=60,
        )
    assert p.returncode == 1, p.stderr
    assert "dlcpd: error:" in p.stderr and str(port) in p.stderr, p.stderr
    assert "Traceback" not in p.stderr
    assert not sock.exists()


def test_example_config_is_valid_and_documents_every_key() -> None:
    from dlcp.daemon.config import load

    example = ROOT / "systemd" / "dlcpd.toml"
    cfg = load(example)
    assert cfg.socket == "/run/dlcp/dlcpd.sock"
    text = example.read_text()
    for key in (
        "socket",
        "socket_mode",
        "metrics_port",
        "metrics_address",
        "host_index",
        "drain_timeout_s",
        "log_level",
        "addresses",
        "udp_port",
        "payload",
        "gso",
        "gro",
        "socket_buffer_bytes",
        "peers",
        "priority",
        "drop",
        "balance",
        "dscp",
        "pacing",
        "initial_rate_bps",
        "min_rate_bps",
        "link_rate_bps",
        "utilization",
        "loss_backoff",
        "nack_delay",
        "reorder",
        "timeout",
        "devices",
        "jobs",
    ):
        assert key in text, key


def test_two_local_ranks_are_summed_on_their_host_first(tmp_path: Path) -> None:
    with loopback_daemons(tmp_path, 2) as ds:
        pid = os.getpid()
        ranks = [
            Rank(ds[0], f"dlcp-lr{pid}-0", 1 << 20),
            Rank(ds[0], f"dlcp-lr{pid}-1", 1 << 20),
            Rank(ds[1], f"dlcp-lr{pid}-2", 1 << 20),
        ]
        try:
            for r, me in zip(ranks, (0, 0, 1), strict=True):
                r.join(11, KEY, hosts_of(ds), me, local_ranks=2 if me == 0 else 1)
            xs = [np.full(7000, v, np.float32) for v in (1.0, 2.0, 4.0)]
            waits = [
                submit(r, job=11, round=0, bucket=0, lanes=x, shards=2)
                for r, x in zip(ranks, xs, strict=True)
            ]
            for w in waits:
                res = w()
                np.testing.assert_array_equal(res.sums, np.full(7000, 7.0, np.float32))
                assert (res.contributors == 3).all()  # rank contributions, not hosts
        finally:
            for r in ranks:
                r.close()


def test_ps_mode_with_a_dedicated_aggregator_daemon(tmp_path: Path) -> None:
    """Host 0 runs only an aggregator (job declared in its config); hosts 1, 2 train."""
    port = free_udp_port()
    hosts = [{"addresses": [f"127.0.0.{i + 1}"], "udp_port": port} for i in range(3)]
    job = {
        "job": 21,
        "key": KEY.hex(),
        "hosts": hosts,
        "me": 0,
        "mode": "ps",
        "aggregators": [0],
        "contributors": [1, 2],
    }
    with loopback_daemons(tmp_path, 3, start=False) as ds:
        for d in ds:
            d.port = port
            d.config.write_text(
                re.sub(r"udp_port = \d+", f"udp_port = {port}", d.config.read_text())
            )
        ds[0].config.write_text(
            ds[0].config.read_text()
            + "\n[[jobs]]\n"
            + "\n".join(f"{k} = {toml_value(v)}" for k, v in job.items())
            + "\n"
        )
        for d in ds:
            d.start()
        pid = os.getpid()
        ranks = [Rank(ds[i], f"dlcp-ps{pid}-{i}", 1 << 20) for i in (1, 2)]
        try:
            for r, me in zip(ranks, (1, 2), strict=True):
                r.client.join(
                    job=21,
                    key=KEY,
                    hosts=hosts,
                    me=me,
                    mode="ps",
                    aggregators=[0],
                    contributors=[1, 2],
                )
            rng = np.random.default_rng(5)
            xs = [rng.standard_normal(30_000).astype(np.float32) for _ in ranks]
            waits = [
                submit(r, job=21, round=0, bucket=0, lanes=x, shards=1)
                for r, x in zip(ranks, xs, strict=True)
            ]
            for w in waits:
                np.testing.assert_array_equal(w().sums, xs[0] + xs[1])
            with DaemonClient(ds[0].socket) as c:
                counters = c.status()["counters"]
            assert counters["shards_aggregated"] >= 1  # the aggregator did the summing
            assert counters.get("data_packets_sent", 0) == 0  # and contributed nothing
        finally:
            for r in ranks:
                r.close()


def test_a_rank_gets_an_input_buffer_of_its_own() -> None:
    from dlcp.daemon.server import INPUT_BUFFERS, Client

    a, b = Client(None), Client(None)  # type: ignore[arg-type]
    assert a.inputs is not b.inputs and a.inputs.max_buffers == INPUT_BUFFERS
    first = a.inputs.take(1000)
    addr = first.ctypes.data
    del first
    assert b.inputs.take(1000).ctypes.data != addr  # never another rank's
    assert a.inputs.take(1000).ctypes.data == addr


def _raw_client(path: str) -> socket.socket:
    raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    raw.settimeout(10)
    raw.connect(path)
    return raw


def _memfd(size: int, seals: int) -> int:
    import fcntl

    fd = os.memfd_create("dlcp-test", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


def _hand_over(raw: socket.socket, fd: int | None, size: int, payload: bytes = b"F") -> dict:  # type: ignore[type-arg]
    """A memfd `segment` request by hand; returns the reply to the descriptor."""
    import array

    ipc.send_message(raw, {"op": "segment", "id": 1, "memfd": True, "size": size})
    assert ipc.recv_message(raw) == {"id": 1, "ok": True, "send_fd": True}
    anc = [] if fd is None else [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))]
    raw.sendmsg([payload], anc)
    return ipc.recv_message(raw)


def test_a_memfd_segment_must_be_sealed_and_handed_over_as_announced(
    trio: list,  # type: ignore[type-arg]
) -> None:
    import fcntl

    from dlcp.shim.client import SealedSegment

    d = trio[0]
    # a sealed segment cannot shrink under the daemon's mapping
    seg = SealedSegment(f"dlcp-seal{os.getpid()}", 1 << 16)
    with pytest.raises(PermissionError):
        os.ftruncate(seg.fd, 100)
    seg.close()
    raw = _raw_client(d.socket)
    try:
        fd = _memfd(4096, 0)  # not sealed: it could shrink, so it is not mapped
        reply = _hand_over(raw, fd, 4096)
        assert reply["ok"] is False and "F_SEAL_SHRINK" in reply["error"]
        os.close(fd)
        fd = _memfd(1024, fcntl.F_SEAL_SHRINK)  # sealed, but smaller than announced
        reply = _hand_over(raw, fd, 4096)
        assert reply["ok"] is False and "1024 bytes" in reply["error"]
        os.close(fd)
        fd = _memfd(4096, fcntl.F_SEAL_SHRINK)
        assert _hand_over(raw, fd, 4096) == {"id": 1, "ok": True, "mapped": True}
        os.close(fd)
        ipc.send_message(raw, {"op": "hello", "id": 2})  # the connection is in step
        assert ipc.recv_message(raw)["ok"] is True
    finally:
        raw.close()
    # no descriptor with the byte, or a request in its place: the connection is
    # out of step and closed; the daemon serves everyone else meanwhile
    for payload in (b"F", struct.pack("!I", 2) + b"{}"):
        raw = _raw_client(d.socket)
        try:
            ipc.send_message(raw, {"op": "segment", "id": 1, "memfd": True, "size": 4096})
            assert ipc.recv_message(raw)["send_fd"] is True
            with DaemonClient(d.socket) as other:  # while `raw` keeps its handover pending
                assert other.hello()["id"]
            raw.sendmsg([payload])
            reply = ipc.recv_message(raw)
            assert reply["ok"] is False and "descriptor" in reply["error"]
            # closed (reset when the rest of the frame was left unread)
            with contextlib.suppress(ConnectionResetError):
                assert raw.recv(1) == b""
        finally:
            raw.close()
    with DaemonClient(d.socket) as c:
        assert c.hello()["id"]


def test_a_rank_the_daemon_refuses_leaves_no_segment_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The test helper's own cleanup: a Rank whose segment request fails closes
    its connection and removes its /dev/shm file before the error propagates."""
    from tests.daemons import OPEN_RANKS

    name = f"dlcp-refused{os.getpid()}"
    before = set(OPEN_RANKS)

    def refuse(self: DaemonClient, seg: object) -> None:
        assert os.path.exists(f"/dev/shm/{name}")  # made, then refused
        raise DaemonError("bad_request", "refused by the test")

    with loopback_daemons(tmp_path, 1) as (d,):
        monkeypatch.setattr(DaemonClient, "segment", refuse)
        with pytest.raises(DaemonError, match="refused"):
            Rank(d, name, 1 << 20)
    assert not os.path.exists(f"/dev/shm/{name}")
    assert before == OPEN_RANKS


def test_the_timer_is_armed_again_when_the_engine_fails_in_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An error raised while the engine handles its timers is logged by the
    event loop, and the daemon still pumps and arms its timer again: before,
    the timer stayed disarmed, and a daemon that had no other event coming
    never timed out its round (found with a 400 MB bucket whose NACK could
    not be encoded)."""
    import asyncio

    from dlcp.daemon.config import Config
    from dlcp.daemon.server import Daemon

    d = Daemon(Config())
    loop = asyncio.new_event_loop()  # its clock only: never run
    d._loop = loop
    due = d.now - 1.0

    def fail(now: float) -> None:
        raise ValueError("boom")

    monkeypatch.setattr(d.engine, "get_timer", lambda: due)
    monkeypatch.setattr(d.engine, "handle_timer", fail)
    try:
        with pytest.raises(ValueError, match="boom"):
            d._on_timer()
        assert d._timer is not None and d._timer_at == due
    finally:
        if d._timer is not None:
            d._timer.cancel()
        loop.close()
