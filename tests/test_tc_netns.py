"""The tc applier against a real kernel, in private network namespaces (root only).

Two namespaces joined by a veth pair: the layout goes on `va` (in `a`), and
UDP datagrams with different DSCP marks are sent from `a` to `b` so the
per-class counters can be checked. Namespaces are deleted even on failure.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from dlcp.errors import LocalError
from dlcp.tc import (
    DEFAULT_DSCP,
    ClassStats,
    TcConfig,
    apply_plan,
    build_plan,
    clear,
    is_applied,
    parse_rate,
    read_stats,
    root_qdisc,
)
from dlcp.tc.apply import NEEDS_ROOT

pytestmark = pytest.mark.netns

REPO = Path(__file__).resolve().parents[1]
_counter = itertools.count()
DST = ("10.77.0.2", 9)  # discard port in `b`; nobody listens, which is fine
PAYLOAD = 100
SO_SNDBUFFORCE = getattr(socket, "SO_SNDBUFFORCE", 32)
WIRE_BYTES = 14 + 20 + 8 + PAYLOAD  # what HTB counts per datagram on a veth


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


def tc(*args: str) -> None:
    subprocess.run(["tc", *args], check=True, capture_output=True)


@dataclass
class Pair:
    a: str  # namespace holding `va` (where tc goes)
    b: str  # namespace holding `vb` (the receiver)
    dev: str = "va"


@pytest.fixture
def pair() -> Iterator[Pair]:
    base = f"dlcpt-{os.getpid()}-{next(_counter)}"
    p = Pair(f"{base}-a", f"{base}-b")
    made: list[str] = []
    try:
        for ns in (p.a, p.b):
            ip("netns", "add", ns)
            made.append(ns)
        ip("-n", p.a, "link", "add", "name", "va", "type", "veth", "peer", "name", "vb",
           "netns", p.b)  # fmt: skip
        ip("-n", p.a, "addr", "add", "10.77.0.1/24", "dev", "va")
        ip("-n", p.b, "addr", "add", "10.77.0.2/24", "dev", "vb")
        for ns, dev in ((p.a, "va"), (p.b, "vb"), (p.a, "lo"), (p.b, "lo")):
            ip("-n", ns, "link", "set", dev, "up")
        yield p
    finally:
        for ns in made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def send(ns: str, dscp: int, count: int, payload: int = PAYLOAD) -> None:
    """Send `count` UDP datagrams from namespace `ns` with DSCP `dscp`."""
    from pyroute2 import netns as pr_netns

    sock = pr_netns.create_socket(ns, socket.AF_INET, socket.SOCK_DGRAM, flags=0)
    try:
        sock.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, dscp << 2)
        # room for a whole burst, so sendto never waits for a slow queue to drain
        sock.setsockopt(socket.SOL_SOCKET, SO_SNDBUFFORCE, 16 << 20)
        for _ in range(count):
            sock.sendto(b"\0" * payload, DST)
    finally:
        sock.close()


def wait_for(
    pair: Pair, done: Callable[[dict[int, ClassStats]], bool], limit_s: float = 20.0
) -> dict[int, ClassStats]:
    """Poll read_stats until `done` holds (the limit only stops a hang)."""
    deadline = time.monotonic() + limit_s
    while True:
        stats = {s.cls: s for s in read_stats(pair.dev, netns=pair.a)}
        if done(stats) or time.monotonic() > deadline:
            return stats
        time.sleep(0.05)


def test_apply_reads_back(pair: Pair) -> None:
    plan = build_plan(TcConfig(pair.dev, parse_rate("1gbit")))
    assert root_qdisc(pair.dev, netns=pair.a) == ("noqueue", "0:")
    assert not is_applied(plan, netns=pair.a)
    apply_plan(plan, netns=pair.a)
    assert root_qdisc(pair.dev, netns=pair.a) == ("htb", "1:")
    assert is_applied(plan, netns=pair.a)

    from pyroute2 import IPRoute

    with IPRoute(netns=pair.a, flags=0) as ipr:
        index = ipr.link_lookup(ifname=pair.dev)[0]
        classes = ipr.get_classes(index)
        qdiscs = ipr.get_qdiscs(index)
        # u32 also dumps one hash-table entry per prio, which has no classid
        targets = [
            opts.get_attr("TCA_U32_CLASSID")
            for f in ipr.get_filters(index=index, parent=0x10000)
            if (opts := f.get_attr("TCA_OPTIONS")) is not None
            and opts.get_attr("TCA_U32_CLASSID") is not None
        ]
    assert len(classes) == 9  # 1:1 and 1:10..1:17
    assert sorted(q.get_attr("TCA_KIND") for q in qdiscs) == ["htb"] + ["pfifo"] * 8
    assert sorted(targets) == [0x10010 + i for i in range(8)]

    stats = read_stats(pair.dev, netns=pair.a)
    assert [s.cls for s in stats] == list(range(8))
    assert [s.classid for s in stats] == [f"1:1{i}" for i in range(8)]
    assert tuple(s.dscp for s in stats) == DEFAULT_DSCP
    assert [s.queue_limit for s in stats] == [1000] * 7 + [16]

    out = subprocess.run(["tc", "-n", pair.a, "filter", "show", "dev", pair.dev],
                         check=True, capture_output=True, text=True).stdout  # fmt: skip
    assert "match c0000000/fc000000 at 1" in out  # CS6 -> TOS 0xc0


def test_apply_is_idempotent_and_keeps_counters(pair: Pair) -> None:
    plan = build_plan(TcConfig(pair.dev, parse_rate("1gbit")))
    apply_plan(plan, netns=pair.a)
    send(pair.a, DEFAULT_DSCP[1], 5)
    before = wait_for(pair, lambda s: s[1].packets >= 5)
    assert before[1].packets == 5
    apply_plan(plan, netns=pair.a)  # same plan: nothing is touched
    assert is_applied(plan, netns=pair.a)
    after = {s.cls: s for s in read_stats(pair.dev, netns=pair.a)}
    assert after[1].packets == 5  # the classes were not rebuilt

    # a different plan over ours is applied without force
    other = build_plan(TcConfig(pair.dev, parse_rate("200mbit"), dscp=(46, 40, 34, 26, 18, 10,
                                                                       0, 8)))  # fmt: skip
    apply_plan(other, netns=pair.a)
    assert is_applied(other, netns=pair.a) and not is_applied(plan, netns=pair.a)
    assert read_stats(pair.dev, netns=pair.a)[0].dscp == 46


def test_foreign_root_needs_force(pair: Pair) -> None:
    tc("-n", pair.a, "qdisc", "add", "dev", pair.dev, "root", "handle", "5:", "tbf",
       "rate", "1mbit", "burst", "32kbit", "latency", "400ms")  # fmt: skip
    plan = build_plan(TcConfig(pair.dev, parse_rate("1gbit")))
    with pytest.raises(LocalError, match=r"tbf 5:.*force"):
        apply_plan(plan, netns=pair.a)
    assert root_qdisc(pair.dev, netns=pair.a) == ("tbf", "5:")  # untouched
    apply_plan(plan, netns=pair.a, force=True)
    assert is_applied(plan, netns=pair.a)

    # an HTB at 1: with classes that are not ours is foreign too
    clear(pair.dev, netns=pair.a)
    tc("-n", pair.a, "qdisc", "add", "dev", pair.dev, "root", "handle", "1:", "htb")
    tc("-n", pair.a, "class", "add", "dev", pair.dev, "parent", "1:", "classid", "1:99",
       "htb", "rate", "1mbit")  # fmt: skip
    with pytest.raises(LocalError, match="did not make"):
        apply_plan(plan, netns=pair.a)
    apply_plan(plan, netns=pair.a, force=True)
    assert is_applied(plan, netns=pair.a)


def test_clear(pair: Pair) -> None:
    clear(pair.dev, netns=pair.a)  # nothing there: no error
    apply_plan(build_plan(TcConfig(pair.dev, parse_rate("1gbit"))), netns=pair.a)
    clear(pair.dev, netns=pair.a)
    assert root_qdisc(pair.dev, netns=pair.a) == ("noqueue", "0:")
    assert read_stats(pair.dev, netns=pair.a) == []
    clear(pair.dev, netns=pair.a)


def test_missing_device_and_namespace(pair: Pair) -> None:
    plan = build_plan(TcConfig("nosuchdev0", parse_rate("1gbit")))
    with pytest.raises(LocalError, match="no such device: nosuchdev0"):
        apply_plan(plan, netns=pair.a)
    with pytest.raises(LocalError, match="no such device: nosuchdev0"):
        read_stats("nosuchdev0", netns=pair.a)
    missing = f"{pair.a}-missing"
    with pytest.raises(LocalError, match="no such network namespace"):
        clear("va", netns=missing)
    assert not os.path.exists(f"/run/netns/{missing}")  # pyroute2 would have created it


def test_traffic_lands_in_its_class(pair: Pair) -> None:
    apply_plan(build_plan(TcConfig(pair.dev, parse_rate("1gbit"))), netns=pair.a)
    counts = {cls: 3 + cls for cls in range(8)}
    for cls, n in counts.items():
        send(pair.a, DEFAULT_DSCP[cls], n)
    send(pair.a, 46, 4)  # EF is not in the table: goes to the default class 6
    expected = {**counts, 6: counts[6] + 4}
    stats = wait_for(pair, lambda s: all(s[c].packets >= n for c, n in expected.items()))
    for cls, n in expected.items():
        if cls == 6:  # also takes ARP and IPv6 neighbour discovery, which is unmarked
            assert stats[cls].packets >= n
        else:
            assert stats[cls].packets == n, cls
            assert stats[cls].bytes == n * WIRE_BYTES, cls
        assert stats[cls].drops == 0


def test_droppable_class_drops_first(pair: Pair) -> None:
    # a slow link so queues build: class 7 (short queue) overflows, class 1 does not
    apply_plan(build_plan(TcConfig(pair.dev, parse_rate("1mbit"))), netns=pair.a)
    send(pair.a, DEFAULT_DSCP[1], 40, payload=1000)
    send(pair.a, DEFAULT_DSCP[7], 200, payload=1000)
    stats = wait_for(pair, lambda s: s[7].packets + s[7].drops >= 200 and s[1].packets >= 40)
    assert stats[7].drops > 0
    assert stats[7].packets + stats[7].drops == 200
    assert stats[1].drops == 0 and stats[1].packets == 40


def test_strict_priority_overtakes_backlog(pair: Pair) -> None:
    # 400 packets of class 5 need over 3 s at 1 Mbit/s; 5 packets of class 0
    # sent after them leave first, while class 5 still has a backlog.
    apply_plan(build_plan(TcConfig(pair.dev, parse_rate("1mbit"))), netns=pair.a)
    send(pair.a, DEFAULT_DSCP[5], 400, payload=1000)
    send(pair.a, DEFAULT_DSCP[0], 5, payload=1000)
    stats = wait_for(pair, lambda s: s[0].packets >= 5)
    assert stats[0].packets == 5
    assert stats[5].backlog_packets > 0
    assert stats[5].drops == 0


def run_cli(*args: str, caps_drop: bool = False) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "dlcp", "tc", *args]
    if caps_drop:
        cmd = ["setpriv", "--bounding-set", "-net_admin", "--inh-caps", "-net_admin", *cmd]
    path = [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=120)


def test_cli_end_to_end(pair: Pair) -> None:
    r = run_cli("apply", "--dev", pair.dev, "--rate", "100mbit", "--netns", pair.a)
    assert r.returncode == 0, r.stderr
    r = run_cli("apply", "--dev", pair.dev, "--rate", "100mbit", "--netns", pair.a)
    assert r.returncode == 0, r.stderr
    assert "already applied" in r.stdout
    assert is_applied(build_plan(TcConfig(pair.dev, 100_000_000)), netns=pair.a)

    send(pair.a, DEFAULT_DSCP[2], 7)
    wait_for(pair, lambda s: s[2].packets >= 7)
    r = run_cli("show", "--dev", pair.dev, "--netns", pair.a, "--json")
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    assert [row["cls"] for row in rows] == list(range(8))
    assert rows[2]["packets"] == 7 and rows[2]["dscp"] == DEFAULT_DSCP[2]
    r = run_cli("show", "--dev", pair.dev, "--netns", pair.a)
    assert r.returncode == 0 and "dropped" in r.stdout.splitlines()[0]

    r = run_cli("clear", "--dev", pair.dev, "--netns", pair.a)
    assert r.returncode == 0, r.stderr
    assert root_qdisc(pair.dev, netns=pair.a) == ("noqueue", "0:")
    r = run_cli("show", "--dev", pair.dev, "--netns", pair.a)
    assert r.returncode == 0 and "no dlcp classes" in r.stdout

    r = run_cli("apply", "--dev", "nosuchdev0", "--rate", "1gbit", "--netns", pair.a)
    assert r.returncode == 1
    assert r.stderr.strip() == f"dlcp: error: no such device: nosuchdev0 in netns {pair.a}"
    r = run_cli("apply", "--dev", pair.dev, "--rate", "fast", "--netns", pair.a)
    assert r.returncode == 1 and r.stderr.startswith("dlcp: error: bad rate 'fast'")
    r = run_cli("apply", "--dev", pair.dev, "--rate", "1gbit", "--dscp", "1,2,3", "--netns", pair.a)
    assert r.returncode == 1 and "8 values" in r.stderr


@pytest.mark.skipif(shutil.which("setpriv") is None, reason="setpriv (util-linux) missing")
def test_cli_without_cap_net_admin(pair: Pair) -> None:
    r = run_cli("apply", "--dev", pair.dev, "--rate", "1gbit", "--netns", pair.a, caps_drop=True)
    assert r.returncode == 1
    assert r.stderr.strip() == f"dlcp: error: {NEEDS_ROOT}"
    assert root_qdisc(pair.dev, netns=pair.a) == ("noqueue", "0:")


def test_cli_leaves_a_foreign_root_qdisc_without_force(pair: Pair) -> None:
    tc("-n", pair.a, "qdisc", "add", "dev", pair.dev, "root", "handle", "5:", "tbf",
       "rate", "1mbit", "burst", "32kbit", "latency", "400ms")  # fmt: skip
    for action in (["apply", "--rate", "1gbit"], ["clear"]):
        r = run_cli(*action, "--dev", pair.dev, "--netns", pair.a)
        assert r.returncode == 1, r
        assert r.stderr.startswith(f"dlcp: error: {pair.dev} ") and r.stderr.count("\n") == 1
        assert "tbf 5:" in r.stderr and "did not make" in r.stderr and "--force" in r.stderr
        assert root_qdisc(pair.dev, netns=pair.a) == ("tbf", "5:")  # untouched
    r = run_cli("apply", "--rate", "1gbit", "--force", "--dev", pair.dev, "--netns", pair.a)
    assert r.returncode == 0, r.stderr
    assert is_applied(build_plan(TcConfig(pair.dev, parse_rate("1gbit"))), netns=pair.a)
    r = run_cli("clear", "--dev", pair.dev, "--netns", pair.a)  # dlcp's own: no --force needed
    assert r.returncode == 0, r.stderr
    assert root_qdisc(pair.dev, netns=pair.a) == ("noqueue", "0:")
    tc("-n", pair.a, "qdisc", "add", "dev", pair.dev, "root", "handle", "5:", "tbf",
       "rate", "1mbit", "burst", "32kbit", "latency", "400ms")  # fmt: skip
    r = run_cli("clear", "--force", "--dev", pair.dev, "--netns", pair.a)
    assert r.returncode == 0, r.stderr
    assert root_qdisc(pair.dev, netns=pair.a) == ("noqueue", "0:")


@pytest.mark.parametrize("action", ["apply", "show", "clear"])
def test_cli_missing_device_or_namespace(pair: Pair, action: str) -> None:
    extra = ["--rate", "1gbit"] if action == "apply" else []
    r = run_cli(action, "--dev", "nosuchdev0", *extra, "--netns", pair.a)
    assert r.returncode == 1
    assert r.stderr == f"dlcp: error: no such device: nosuchdev0 in netns {pair.a}\n"
    missing = f"{pair.a}-missing"
    r = run_cli(action, "--dev", pair.dev, *extra, "--netns", missing)
    assert r.returncode == 1
    assert r.stderr == f"dlcp: error: no such network namespace: {missing}\n"
    assert not os.path.exists(f"/run/netns/{missing}")


@pytest.mark.skipif(shutil.which("setpriv") is None, reason="setpriv (util-linux) missing")
def test_cli_clear_without_cap_net_admin_keeps_the_layout(pair: Pair) -> None:
    plan = build_plan(TcConfig(pair.dev, parse_rate("1gbit")))
    apply_plan(plan, netns=pair.a)
    r = run_cli("clear", "--dev", pair.dev, "--netns", pair.a, caps_drop=True)
    assert r.returncode == 1
    assert r.stderr == f"dlcp: error: {NEEDS_ROOT}\n"
    assert is_applied(plan, netns=pair.a)
