"""dlcp.testbed: the pure plan (no root needed) and the namespace cluster (root).

The namespace tests build real testbeds with unique names under a temporary
state directory; every fixture tears its testbed down and checks that no
namespace with its prefix is left.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from dlcp.cli import build_parser, main
from dlcp.errors import LocalError
from dlcp.testbed import Testbed, TestbedError, TestbedSpec, down, system
from dlcp.testbed import cli as testbed_cli
from dlcp.testbed.config import daemon_config, merge_config, to_toml
from dlcp.testbed.plan import (
    IPERF_MAX_SECONDS,
    background_flows,
    format_rate,
    host_address,
    host_mac,
    host_netns,
    iperf_client_argv,
    iperf_server_argv,
    loss_permille,
    loss_script,
    owned_netns,
    parse_host,
    switch_netns,
    switch_port,
)
from dlcp.testbed.state import STATE_ENV, state_dir

# ---------------------------------------------------------------------------------
# Pure parts: no root


def test_addresses_and_names() -> None:
    assert host_address(0, 0) == "10.77.0.1"
    assert host_address(2, 1) == "10.77.1.3"
    assert host_netns("dlcp", 0) == "dlcp-h0"
    assert switch_netns("dlcp") == "dlcp-sw"
    assert switch_port(3, 1) == "h3p1"
    assert host_mac(2, 1) == "02:77:01:00:00:02"
    assert len({host_mac(i, p) for i in range(253) for p in range(8)}) == 253 * 8
    with pytest.raises(TestbedError):
        host_address(253, 0)


def test_owned_netns_matches_only_this_testbeds_prefix() -> None:
    existing = ["dlcp-h0", "dlcp-h12", "dlcp-sw", "dlcp-x-h0", "dlcpx", "dlcp-h", "other-h0"]
    assert owned_netns("dlcp", existing) == ["dlcp-h0", "dlcp-h12", "dlcp-sw"]
    assert owned_netns("dlcp-x", existing) == ["dlcp-x-h0"]


@pytest.mark.parametrize(("text", "index"), [("h0", 0), ("h2", 2), ("1", 1), (2, 2), (" h1 ", 1)])
def test_parse_host(text: str | int, index: int) -> None:
    assert parse_host(text, 3) == index


@pytest.mark.parametrize("text", ["h3", "3", "host1", "", "-1", "h"])
def test_parse_host_rejects(text: str) -> None:
    with pytest.raises(TestbedError):
        parse_host(text, 3)


@pytest.mark.parametrize(
    ("pct", "permille"), [(0, 0), (0.5, 5), (1, 10), (20, 200), (2.55, 26), (100, 1000)]
)
def test_loss_permille(pct: float, permille: int) -> None:
    assert loss_permille(pct) == permille


@pytest.mark.parametrize("pct", [-1, 100.5, float("nan")])
def test_loss_permille_rejects(pct: float) -> None:
    with pytest.raises(TestbedError):
        loss_permille(pct)


def test_loss_script() -> None:
    create = loss_script(["h0p0", "h1p0"], {("h0p0", "in"): 200}, create=True)
    assert 'type filter hook ingress device "h0p0"' in create
    assert 'type filter hook egress device "h1p0"' in create
    assert "numgen random mod 1000 < 200 counter drop" in create
    assert create.count("counter drop") == 1
    clear = loss_script(["h0p0"], {("h0p0", "out"): 0}, create=False)
    assert clear == "flush chain netdev dlcp_testbed out_h0p0\n"
    with pytest.raises(TestbedError):
        loss_script(["h0p0"], {("h0p0", "sideways"): 1}, create=False)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (dict(hosts=0), "--hosts"),
        (dict(hosts=254), "--hosts"),
        (dict(hosts=2, paths=0), "--paths"),
        (dict(hosts=2, paths=9), "--paths"),
        (dict(hosts=2, loss_pct=101), "loss"),
        (dict(hosts=2, background="icmp"), "background"),
        (dict(hosts=2, background_pattern="star"), "pattern"),
        (dict(hosts=2, rate_bps=0), "rate"),
        (dict(hosts=2, name="bad name"), "name"),
        (dict(hosts=2, name="x" * 25), "name"),
        (dict(hosts=2, udp_port=0), "udp_port"),
    ],
)
def test_spec_validation(spec: dict[str, Any], message: str) -> None:
    with pytest.raises(TestbedError, match=message):
        TestbedSpec(**spec)


def test_spec_json_roundtrip() -> None:
    spec = TestbedSpec(hosts=3, paths=2, rate_bps=10**9, loss_pct=0.5, name="x", segmentation=True)
    assert TestbedSpec.from_json(json.loads(json.dumps(spec.to_json()))) == spec


def test_background_flows_all_pairs() -> None:
    flows = background_flows(3, [0, 1], "both", link_bps=10**9)
    assert len(flows) == 2 * 2 * 6  # kinds x paths x ordered pairs
    assert {(f.src, f.dst) for f in flows} == {(s, d) for s in range(3) for d in range(3) if s != d}
    udp = [f for f in flows if f.kind == "udp"]
    # 60 % of the link into each port, split over the 2 senders.
    assert {f.rate_bps for f in udp} == {300_000_000}
    assert all(f.rate_bps is None for f in flows if f.kind == "tcp")
    # One server per (destination, source, kind): ports differ by source and kind.
    keys = {(f.dst, f.path, f.port) for f in flows}
    assert len(keys) == len(flows)


def test_background_flows_ring_and_rates() -> None:
    flows = background_flows(4, [0], "udp", link_bps=None, udp_rate_bps=40_000_000, pattern="ring")
    assert [(f.src, f.dst) for f in flows] == [(3, 0), (0, 1), (1, 2), (2, 3)]
    assert {f.rate_bps for f in flows} == {40_000_000}
    assert background_flows(1, [0], "tcp", link_bps=None) == []
    assert background_flows(3, [0], "none", link_bps=None) == []
    unshaped = background_flows(2, [0], "udp", link_bps=None)
    assert unshaped[0].rate_bps == 600_000_000  # 60 % of the 1 Gbit/s reference


def test_iperf_argv() -> None:
    (flow,) = background_flows(2, [1], "udp", link_bps=10**8, pattern="ring")[:1]
    assert (flow.src, flow.dst) == (1, 0)
    # background traffic at the lowest CPU priority (it stands for other hosts)
    nice = ["nice", "-n", "19"]
    assert iperf_server_argv(flow)[:7] == [*nice, "iperf3", "--server", "--bind", "10.77.1.1"]
    client = iperf_client_argv(flow, duration_s=2.5)
    assert client[:8] == [*nice, "iperf3", "--client", "10.77.1.1", "--bind", "10.77.1.2"]
    assert client[client.index("--time") + 1] == "3"
    assert client[-3:] == ["--udp", "--bitrate", str(flow.rate_bps)]
    endless = iperf_client_argv(flow, duration_s=None, parallel=4)
    assert endless[endless.index("--time") + 1] == str(IPERF_MAX_SECONDS)
    assert endless[endless.index("--parallel") + 1] == "4"


def test_daemon_config_has_the_agreed_keys() -> None:
    spec = TestbedSpec(hosts=3, paths=2)
    config = daemon_config(spec, 0, "/run/x/h0/dlcpd.sock")
    parsed = tomllib.loads(to_toml(config))
    assert parsed == {
        "daemon": {"socket": "/run/x/h0/dlcpd.sock", "metrics_port": 9464, "host_index": 0},
        "network": {
            "addresses": ["10.77.0.1", "10.77.1.1"],
            "udp_port": 7400,
            "peers": [
                {"index": 1, "addresses": ["10.77.0.2", "10.77.1.2"]},
                {"index": 2, "addresses": ["10.77.0.3", "10.77.1.3"]},
            ],
        },
    }


def test_daemon_config_merges_extra() -> None:
    spec = TestbedSpec(hosts=2)
    extra = {"daemon": {"log_level": "debug"}, "policies": {"drop": {"loss_bound": 0.01}}}
    parsed = tomllib.loads(to_toml(daemon_config(spec, 1, "/s", extra)))
    assert parsed["daemon"] == {
        "socket": "/s",
        "metrics_port": 9464,
        "host_index": 1,
        "log_level": "debug",
    }
    assert parsed["policies"] == {"drop": {"loss_bound": 0.01}}
    assert parsed["network"]["peers"] == [{"index": 0, "addresses": ["10.77.0.1"]}]
    assert merge_config({"a": {"b": 1, "c": 2}}, {"a": {"c": 3}, "d": 4}) == {
        "a": {"b": 1, "c": 3},
        "d": 4,
    }


def test_to_toml_values() -> None:
    data = {
        "top": 1,
        "t": {
            "s": 'quote " back \\ tab \t nl \n del \x7f é',
            "f": 0.25,
            "inf": float("inf"),
            "b": False,
            "empty": [],
            "odd key": "x",
            "nested": {"deeper": {"x": [1, 2]}},
            "inline": [{"a": 1}, {}],
        },
        "empty_table": {},
    }
    assert tomllib.loads(to_toml(data)) == data
    with pytest.raises(TestbedError):
        to_toml({"x": None})


def test_format_rate() -> None:
    assert format_rate(None) == "unshaped"
    assert format_rate(10**9) == "1 Gbit/s"
    assert format_rate(200 * 10**6) == "200 Mbit/s"
    assert format_rate(500) == "500 bit/s"


def test_state_dir_env_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(STATE_ENV, raising=False)
    assert state_dir("dlcp") == Path("/run/dlcp-testbed/dlcp")
    monkeypatch.setenv(STATE_ENV, "/tmp/elsewhere")
    assert state_dir("x") == Path("/tmp/elsewhere/x")
    assert state_dir("x", "/srv") == Path("/srv/x")


def test_not_root_is_one_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(LocalError, match=r"^testbed needs root \(network namespaces\)$"):
        Testbed.up(TestbedSpec(hosts=2, name="never"))
    assert main(["testbed", "down", "--name", "never"]) == 1


def test_missing_tool_names_the_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shutil, "which", lambda tool: None if tool == "nft" else "/bin/x")
    with pytest.raises(LocalError, match="Debian package nftables"):
        system.require_tools(["ip", "nft"])
    monkeypatch.setattr(shutil, "which", lambda tool: None if tool == "iperf3" else "/bin/x")
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    with pytest.raises(LocalError, match="Debian package iperf3"):
        Testbed.up(TestbedSpec(hosts=2, name="never", background="tcp"))


def _parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["testbed", *argv])


def test_cli_up_arguments() -> None:
    args = _parse(
        "up",
        "--hosts",
        "3",
        "--rate",
        "none",
        "--paths",
        "2",
        "--loss",
        "0.5",
        "--background",
        "both",
        "--background-pattern",
        "ring",
        "--daemons",
        "--name",
        "x",
        "--tso",
        "on",
        "-q",
    )
    spec = testbed_cli.spec_from_args(args)
    assert spec == TestbedSpec(
        hosts=3,
        paths=2,
        rate_bps=None,
        loss_pct=0.5,
        background="both",
        background_pattern="ring",
        daemons=True,
        name="x",
        segmentation=True,
    )
    assert args.quiet
    defaults = testbed_cli.spec_from_args(_parse("up", "--hosts", "2"))
    assert (defaults.name, defaults.paths, defaults.loss_pct, defaults.background) == (
        "dlcp",
        1,
        0.0,
        "none",
    )
    with pytest.raises(SystemExit):
        _parse("up")  # --hosts is required
    with pytest.raises(SystemExit):
        _parse("up", "--hosts", "2", "--background", "icmp")


def test_cli_rates_use_dlcp_tc() -> None:
    pytest.importorskip("dlcp.tc.plan")
    assert testbed_cli.parse_rate_arg("1gbit") == 10**9
    assert testbed_cli.parse_rate_arg("None") is None
    spec = testbed_cli.spec_from_args(_parse("up", "--hosts", "2", "--udp-rate", "200mbit"))
    assert (spec.rate_bps, spec.udp_rate_bps) == (10**9, 200 * 10**6)
    with pytest.raises(LocalError):
        testbed_cli.parse_rate_arg("fast")


def test_cli_exec_arguments() -> None:
    args = _parse("exec", "--name", "x", "h1", "--", "sh", "-c", "exit 3")
    assert (args.name, args.host) == ("x", "h1")
    assert testbed_cli.exec_command(args) == ["sh", "-c", "exit 3"]
    args = _parse("exec", "0", "--", "ip", "-br", "addr", "--json", "--", "x")
    assert testbed_cli.exec_command(args) == ["ip", "-br", "addr", "--json", "--", "x"]
    args = _parse("exec", "h2", "sh", "-c", "true")
    assert (args.host, testbed_cli.exec_command(args)) == ("h2", ["sh", "-c", "true"])


def test_cli_port_arguments() -> None:
    args = _parse("port", "h1", "down", "--path", "1", "--name", "x")
    assert (args.host, args.state, args.path, args.name) == ("h1", "down", 1, "x")
    assert _parse("port", "0", "up").path == 0
    with pytest.raises(SystemExit):
        _parse("port", "h1", "sideways")


def test_cli_exec_needs_a_command(monkeypatch: pytest.MonkeyPatch) -> None:
    assert main(["testbed", "exec", "h0", "--"]) == 1


def test_format_show() -> None:
    info = {
        "name": "x",
        "paths": 1,
        "rate_bps": None,
        "state_dir": "/s",
        "hosts": [
            {
                "name": "h0",
                "netns": "x-h0",
                "addresses": ["10.77.0.1"],
                "daemon_pid": 42,
                "daemon_alive": False,
                "socket": "/s/h0/dlcpd.sock",
            }
        ],
        "switches": [
            {
                "netns": "x-sw",
                "bridges": ["br0"],
                "ports": ["h0p0"],
                "loss_pct": {"h0p0": {"in": 0.5, "out": 0.0}},
            }
        ],
        "background": [{"alive": True}],
    }
    text = testbed_cli.format_show(info)
    assert "unshaped" in text and "42 (dead)" in text and "loss in 0.5 %" in text
    assert "1 iperf3 processes, 1 running" in text


# ---------------------------------------------------------------------------------
# Namespace tests: root


NETTOOL = r'''
"""Tiny network probes run inside host namespaces by the tests."""
import json, os, socket, struct, sys, time

def checksum(data):
    if len(data) % 2:
        data += b"\0"
    total = sum(struct.unpack(f"!{len(data) // 2}H", data))
    total = (total >> 16) + (total & 0xFFFF)
    total += total >> 16
    return ~total & 0xFFFF

def ping(timeout, *dsts):
    """One ICMP echo per destination; prints {dst: replied}."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)
    ident = os.getpid() & 0xFFFF
    out = {}
    for seq, dst in enumerate(dsts):
        body = b"dlcp-testbed" * 4
        head = struct.pack("!BBHHH", 8, 0, 0, ident, seq)
        sock.sendto(struct.pack("!BBHHH", 8, 0, checksum(head + body), ident, seq) + body,
                    (dst, 0))
        out[dst] = False
        deadline = time.monotonic() + float(timeout)
        while not out[dst] and time.monotonic() < deadline:
            sock.settimeout(max(0.001, deadline - time.monotonic()))
            try:
                data, (src, _) = sock.recvfrom(2048)
            except socket.timeout:
                break
            ihl = (data[0] & 15) * 4
            kind, _, _, rid, rseq = struct.unpack("!BBHHH", data[ihl:ihl + 8])
            out[dst] = kind == 0 and rid == ident and rseq == seq and src == dst
    print(json.dumps(out))

def recv(addr, port, idle):
    """Count datagrams until `idle` seconds pass without one."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
    sock.bind((addr, int(port)))
    print("ready", flush=True)
    sock.settimeout(20.0)
    count = 0
    try:
        while True:
            sock.recv(65535)
            count += 1
            sock.settimeout(float(idle))
    except socket.timeout:
        pass
    print(count, flush=True)

def send(dst, port, count, tos, interval):
    """`count` datagrams with TOS byte `tos`, `interval` seconds apart."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, int(tos))
    for _ in range(int(count)):
        sock.sendto(b"g" * 200, (dst, int(port)))
        if float(interval):
            time.sleep(float(interval))

{"ping": ping, "recv": recv, "send": send}[sys.argv[1]](*sys.argv[2:])
'''

STANDIN_DAEMON = r'''
"""Stands in for dlcpd: reads its config, binds its UDP port, creates the socket."""
import signal, socket, sys, time, tomllib
config = tomllib.load(open(sys.argv[1], "rb"))
udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
udp.bind((config["network"]["addresses"][0], config["network"]["udp_port"]))  # our netns only
print("stand-in up", config["daemon"]["host_index"], flush=True)
time.sleep(float(config.get("standin", {}).get("delay", 0)))
unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
unix.bind(config["daemon"]["socket"])
unix.listen()
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
while True:
    time.sleep(1)
'''

_counter = itertools.count()


def _netns_with_prefix(name: str) -> list[str]:
    return owned_netns(name, system.list_netns())


@pytest.fixture(scope="module")
def state_root() -> Iterator[Path]:
    """A short state directory (Unix socket paths must fit in 108 bytes), via the env."""
    root = Path(tempfile.mkdtemp(prefix="dlcptb-"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(STATE_ENV, str(root))
        yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def nettool(state_root: Path) -> Path:
    path = state_root / "nettool.py"
    path.write_text(NETTOOL)
    return path


def _unique_name() -> str:
    return f"t{os.getpid()}x{next(_counter)}"


@pytest.fixture
def make_testbed(state_root: Path) -> Iterator[Callable[..., Testbed]]:
    """Build testbeds with unique names; always removed afterwards, and checked gone."""
    names: list[str] = []

    def make(**spec: Any) -> Testbed:
        spec.setdefault("name", _unique_name())
        names.append(spec["name"])
        return Testbed.up(TestbedSpec(**spec))

    yield make
    for name in names:
        down(name)
        assert _netns_with_prefix(name) == []
        assert not (state_root / name).exists()


@pytest.fixture(scope="module")
def shaped(state_root: Path) -> Iterator[Testbed]:
    """3 hosts, 2 paths, switch ports shaped by dlcp.tc (read-only use by several tests)."""
    pytest.importorskip("dlcp.tc.apply")
    name = _unique_name()
    try:
        with Testbed.up(TestbedSpec(hosts=3, paths=2, rate_bps=10**9, name=name)) as tb:
            yield tb
    finally:
        down(name)
        assert _netns_with_prefix(name) == []


def _ping(tb: Testbed, nettool: Path, src: str, *dsts: str) -> dict[str, bool]:
    done = tb.exec(
        src,
        [sys.executable, str(nettool), "ping", "2", *dsts],
        capture=True,
        check=True,
        timeout=60,
    )
    result: dict[str, bool] = json.loads(done.stdout)
    return result


def _udp_received(
    tb: Testbed,
    nettool: Path,
    src: str,
    dst: str,
    count: int,
    *,
    tos: int = 0,
    interval: float = 0.0005,
    path: int = 0,
    port: int = 9000,
) -> int:
    """Datagrams that arrive at `dst` of `count` sent from `src`."""
    addr = tb.address(dst, path)
    receiver = tb.popen(
        dst,
        [sys.executable, str(nettool), "recv", addr, str(port), "0.5"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert receiver.stdout is not None
        assert receiver.stdout.readline().strip() == "ready"
        tb.exec(
            src,
            [
                sys.executable,
                str(nettool),
                "send",
                addr,
                str(port),
                str(count),
                str(tos),
                str(interval),
            ],
            check=True,
            timeout=60,
        )
        out, _ = receiver.communicate(timeout=30)
    finally:
        if receiver.poll() is None:
            receiver.kill()
            receiver.wait()
    return int(out.strip())


netns = pytest.mark.netns


@netns
def test_hosts_reach_each_other_on_every_path(shaped: Testbed, nettool: Path) -> None:
    for src in shaped.hosts:
        dsts = [addr for h in shaped.hosts if h is not src for addr in h.addresses]
        assert _ping(shaped, nettool, src.name, *dsts) == dict.fromkeys(dsts, True)
    # Paths are separate networks: h0 reaches h1's path-1 address over eth1.
    route = shaped.exec(
        "h0", ["ip", "route", "get", shaped.address("h1", 1)], capture=True, check=True
    )
    assert "dev eth1" in route.stdout
    neigh = shaped.exec("h0", ["ip", "neigh", "show", "dev", "eth1"], capture=True, check=True)
    assert f"{shaped.address('h2', 1)} lladdr {host_mac(2, 1)} PERMANENT" in neigh.stdout


@netns
def test_a_port_set_down_cuts_its_path_alone_until_set_up(shaped: Testbed, nettool: Path) -> None:
    a0, a1 = shaped.address("h1", 0), shaped.address("h1", 1)
    shaped.set_port("h0", 0, False)
    try:
        assert shaped.ports_down() == [shaped.host("h0").switch_ports[0]]
        assert shaped.show()["switches"][0]["ports_down"] == shaped.ports_down()
        # h0 reaches h1 on path 1, not on path 0; h1 and h2 still meet on path 0
        assert _ping(shaped, nettool, "h0", a0, a1) == {a0: False, a1: True}
        assert _ping(shaped, nettool, "h2", a0) == {a0: True}
    finally:
        shaped.set_port("h0", 0, True)
    assert shaped.ports_down() == []
    assert _ping(shaped, nettool, "h0", a0, a1) == {a0: True, a1: True}


def _features(tb: Testbed, netns: str, ifname: str) -> dict[str, str]:
    """`ethtool -k` of `ifname` in `netns`: {feature: "on"/"off"}."""
    out = subprocess.run(
        ["ip", "netns", "exec", netns, "ethtool", "-k", ifname],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    pairs = (line.strip().split(": ", 1) for line in out.splitlines() if ": " in line)
    return {k: v.split()[0] for k, v in pairs if v}


@netns
def test_switch_ports_are_shaped_and_offloads_off(shaped: Testbed) -> None:
    from dlcp.tc.apply import root_qdisc

    for port in shaped.switch_ports:
        assert root_qdisc(port, netns=shaped.switch_netns) == ("htb", "1:")
    host = _features(shaped, shaped.host("h2").netns, "eth1")
    # shaped: MTU packets at the switch, for TCP and UDP alike; GRO as on a NIC
    assert host["tx-udp-segmentation"] == "off"
    assert host["tcp-segmentation-offload"] == "off"
    assert host["generic-receive-offload"] == "on"
    port = _features(shaped, shaped.switch_netns, shaped.host("h2").switch_ports[1])
    assert port["generic-receive-offload"] == "off"  # a switch forwards frames as they come
    assert shaped.show()["senders_decoupled"] is True


@netns
def test_a_sender_faster_than_its_port_loses_at_the_switch(
    make_testbed: Callable[..., Testbed], nettool: Path
) -> None:
    """A switch does not push back on its hosts: a UDP burst far above a 10
    Mbit/s port overflows the port's queue and loses there. Without
    `kernel.decouple_senders` the sending socket stays charged for its frames
    in the switch's queue, blocks, and every datagram arrives."""
    pytest.importorskip("dlcp.tc.apply")
    tb = make_testbed(hosts=2, rate_bps=10_000_000)
    assert tb.show()["senders_decoupled"] is True
    sent = 3000  # ~0.7 MB at once: about 0.6 s at the port's rate, its queue holds 1000
    got = _udp_received(tb, nettool, "h0", "h1", sent, interval=0)
    drops = sum(s.drops for s in tb.tc_stats("h1"))
    assert got < sent and drops == sent - got, (got, drops)


@netns
def test_unshaped_hosts_segment_tcp_and_udp_alike(make_testbed: Callable[..., Testbed]) -> None:
    tb = make_testbed(hosts=2)
    for h in ("h0", "h1"):
        host = _features(tb, tb.host(h).netns, "eth0")
        assert host["tx-udp-segmentation"] == "on"
        assert host["tcp-segmentation-offload"] == "on"
        assert host["generic-receive-offload"] == "on"
    assert tb.show()["segmentation"] is True


@netns
def test_dscp_lands_in_its_class_at_the_switch_port(shaped: Testbed, nettool: Path) -> None:
    from dlcp.tc.plan import TcConfig

    table = TcConfig(dev="x", rate_bps=10**9).dscp

    def packets(host: str, path: int) -> dict[int, int]:
        return {s.cls: s.packets for s in shaped.tc_stats(host, path=path)}

    before, before_h2 = packets("h1", 1), packets("h2", 1)
    sent = {}
    for cls, dscp in enumerate(table):
        sent[cls] = 10 + cls
        got = _udp_received(
            shaped, nettool, "h0", "h1", sent[cls], tos=dscp << 2, interval=0, path=1
        )
        assert got == sent[cls]
    after = packets("h1", 1)
    # Exact: static neighbours and FDB entries mean no ARP and no flooding.
    assert {cls: after[cls] - before[cls] for cls in sent} == sent
    assert packets("h2", 1) == before_h2


@netns
def test_exec_sets_dlcp_socket_and_passes_the_exit_code(
    shaped: Testbed, capfd: pytest.CaptureFixture[str]
) -> None:
    done = shaped.exec("h1", ["sh", "-c", 'echo "$DLCP_SOCKET"; exit 3'], capture=True)
    assert done.returncode == 3
    assert done.stdout.strip() == str(shaped.state_dir / "h1" / "dlcpd.sock")
    name = shaped.name
    assert main(["testbed", "exec", "--name", name, "2", "--", "sh", "-c", "exit 5"]) == 5
    assert (
        main(
            [
                "testbed",
                "exec",
                "--name",
                name,
                "h0",
                "--",
                "sh",
                "-c",
                'test "$DLCP_SOCKET" = "$0"',
                str(shaped.host(0).socket),
            ]
        )
        == 0
    )
    capfd.readouterr()
    assert main(["testbed", "exec", "--name", name, "h7", "--", "true"]) == 1
    assert "no host 'h7'" in capfd.readouterr().err


@netns
def test_show_json_schema(shaped: Testbed, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["testbed", "show", "--name", shaped.name, "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert len(info["hosts"]) == 3
    for i, host in enumerate(info["hosts"]):
        assert {"name", "netns", "addresses", "udp_port", "socket", "metrics_url"} <= set(host)
        assert host["name"] == f"h{i}"
        assert host["netns"] == f"{shaped.name}-h{i}"
        assert host["addresses"] == [f"10.77.0.{i + 1}", f"10.77.1.{i + 1}"]
        assert host["udp_port"] == 7400
        assert host["socket"] == str(shaped.state_dir / f"h{i}" / "dlcpd.sock")
        assert host["metrics_url"] == f"http://10.77.0.{i + 1}:9464/metrics"
    (switch,) = info["switches"]
    assert switch["netns"] == f"{shaped.name}-sw"
    assert sorted(switch["ports"]) == sorted(f"h{i}p{p}" for i in range(3) for p in range(2))
    assert info["rate_bps"] == 10**9 and info["paths"] == 2
    assert main(["testbed", "show", "--name", shaped.name]) == 0
    assert "10.77.0.1, 10.77.1.1" in capsys.readouterr().out


@netns
def test_show_of_a_missing_testbed_is_one_clear_error(
    state_root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["testbed", "show", "--name", "nosuch"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("dlcp: error: no testbed named 'nosuch'") and "\n" not in err


@netns
def test_loss_drops_about_the_expected_fraction(
    make_testbed: Callable[..., Testbed], nettool: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tb = make_testbed(hosts=2, loss_pct=20)
    n = 500
    lost_in = 1 - _udp_received(tb, nettool, "h0", "h1", n) / n
    tb.set_loss("h0", 0)
    lost_none = 1 - _udp_received(tb, nettool, "h0", "h1", n) / n
    tb.set_loss("h1", 20, direction="out")  # toward h1, at its switch port
    lost_out = 1 - _udp_received(tb, nettool, "h0", "h1", n) / n
    tb.set_loss_all(0, direction="out")
    tb.set_loss("h0", 0.5)
    lost_half = 1 - _udp_received(tb, nettool, "h0", "h1", n) / n
    print(
        f"measured loss: 20% in {lost_in:.3f}, 0% {lost_none:.3f}, "
        f"20% out {lost_out:.3f}, 0.5% in {lost_half:.3f}",
        file=sys.stderr,
    )
    assert 0.05 <= lost_in <= 0.40
    assert lost_none == 0
    assert 0.05 <= lost_out <= 0.40
    assert lost_half <= 0.05
    assert tb.loss()["h0p0"] == {"in": 0.5, "out": 0.0}
    # The CLI changes loss from another process and show reports it.
    assert main(["testbed", "loss", "--name", tb.name, "--host", "h1", "3.5"]) == 0
    assert Testbed.attach(tb.name).show()["switches"][0]["loss_pct"]["h1p0"]["in"] == 3.5


@netns
def test_failure_mid_up_removes_everything(
    state_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    name = _unique_name()

    def broken(self: Testbed) -> None:
        assert len(_netns_with_prefix(name)) == 3  # namespaces exist at this point
        raise RuntimeError("injected failure")

    monkeypatch.setattr(Testbed, "_apply_loss", broken)
    with pytest.raises(RuntimeError, match="injected failure"):
        Testbed.up(TestbedSpec(hosts=2, name=name))
    assert _netns_with_prefix(name) == []
    assert not (state_root / name).exists()


@netns
def test_sigterm_during_up_cleans_up(state_root: Path) -> None:
    name = _unique_name()
    script = (
        "import sys, time\n"
        "from dlcp.testbed import Testbed\n"
        "from dlcp.cli import main\n"
        "def slow(self):\n"
        "    print('building', flush=True)\n"
        "    time.sleep(60)\n"
        "Testbed._apply_loss = slow\n"
        f"sys.exit(main(['testbed', 'up', '--hosts', '2', '--rate', 'none', '--name', '{name}']))\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "building"
        assert len(_netns_with_prefix(name)) == 3
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert _netns_with_prefix(name) == []
    assert not (state_root / name).exists()


@netns
def test_up_is_idempotent_and_down_sweeps(make_testbed: Callable[..., Testbed]) -> None:
    first = make_testbed(hosts=2)
    name = first.name
    first.set_loss("h0", 50)
    second = make_testbed(hosts=3, name=name)  # replaces the first one
    assert _netns_with_prefix(name) == sorted(
        [f"{name}-h0", f"{name}-h1", f"{name}-h2", f"{name}-sw"]
    )
    assert second.loss()["h0p0"]["in"] == 0
    assert (
        second.exec(
            "h2", ["ip", "-br", "addr", "show", "eth0"], capture=True, check=True
        ).stdout.split()[2]
        == "10.77.0.3/24"
    )
    # A namespace the state does not know (say, from a crash) is swept too.
    subprocess.run(["ip", "netns", "add", f"{name}-h9"], check=True)
    assert down(name) is True
    assert _netns_with_prefix(name) == []
    assert down(name) is False  # nothing left: still fine


@netns
def test_daemons_start_wait_and_stop(
    make_testbed: Callable[..., Testbed], state_root: Path
) -> None:
    tb = make_testbed(hosts=2, paths=2, rate_bps=None)
    standin = state_root / "standin.py"
    standin.write_text(STANDIN_DAEMON)
    command = [sys.executable, str(standin), "{config}"]
    tb.start_daemons(
        {"daemon": {"log_level": "debug"}},
        host_config={1: {"standin": {"delay": 0.3}}},
        command=command,
    )
    for h in tb.hosts:
        assert h.socket.exists()
        config = tomllib.loads(h.config.read_text())
        assert config["daemon"]["host_index"] == h.index
        assert config["daemon"]["log_level"] == "debug"
        assert config["network"]["addresses"] == list(h.addresses)
        assert "stand-in up" in h.log.read_text()
    hosts = tb.show()["hosts"]
    assert all(h["daemon_alive"] for h in hosts)
    pids = [h["daemon_pid"] for h in hosts]
    tb.stop_daemons()
    assert not any(system.is_alive((pid, None)) for pid in pids)
    assert not any(h.socket.exists() for h in tb.hosts)
    assert tb.processes("daemon") == []

    # A daemon that dies: the error carries the end of its log.
    with pytest.raises(TestbedError, match=r"exited before creating(.|\n)*config is broken"):
        tb.start_daemons(command=["sh", "-c", "echo config is broken; exit 2"])
    # A daemon that never gets ready: timeout, and nothing left running.
    with pytest.raises(TestbedError, match="did not create"):
        tb.start_daemons(command=["sleep", "30"], timeout_s=0.5)
    assert tb.processes("daemon") == []


@netns
def test_background_traffic_congests_the_default_class(
    make_testbed: Callable[..., Testbed],
) -> None:
    pytest.importorskip("dlcp.tc.apply")
    tb = make_testbed(hosts=3, rate_bps=100 * 10**6)
    flows = tb.start_background("both", duration_s=3, pattern="ring", udp_rate_bps=30 * 10**6)
    assert len(flows) == 6
    assert len(tb.processes()) == 12
    time.sleep(1.5)
    stats = {s.cls: s for s in tb.tc_stats("h1")}
    assert stats[6].packets > 1000  # unmarked background is in the default class
    assert sum(s.packets for c, s in stats.items() if c != 6) == 0
    assert all(p["alive"] for p in tb.processes())
    pids = [p["pid"] for p in tb.processes()]
    tb.stop_background()
    assert tb.processes() == []
    assert not any(system.is_alive((pid, None)) for pid in pids)
    assert (tb.state_dir / "background" / "tcp-h0-h1-p0.log").exists()


@netns
def test_cli_up_show_down_across_processes(state_root: Path) -> None:
    name = _unique_name()
    env = {**os.environ, STATE_ENV: str(state_root)}

    def dlcp(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "dlcp", "testbed", *argv],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )

    try:
        up = dlcp(
            "up",
            "--hosts",
            "2",
            "--rate",
            "none",
            "--background",
            "udp",
            "--udp-rate",
            "5mbit",
            "--background-pattern",
            "ring",
            "--name",
            name,
        )
        assert up.returncode == 0, up.stderr
        assert "creating 3 namespaces" in up.stderr  # progress, not with --quiet
        show = dlcp("show", "--json", "--name", name)
        info = json.loads(show.stdout)
        background = info["background"]
        assert len(background) == 4 and all(p["alive"] for p in background)
        assert dlcp("exec", "--name", name, "h1", "--", "sh", "-c", "exit 4").returncode == 4
        gone = dlcp("down", "--name", name, "--quiet")
        assert gone.returncode == 0 and gone.stderr == ""
        assert not any(system.is_alive((p["pid"], p["start"])) for p in background)
        assert _netns_with_prefix(name) == []
    finally:
        down(name)
