"""Operations: the systemd unit, sysusers/tmpfiles, Makefile, metrics, alerts and dashboard.

These tests run the real tools: systemd-analyze, systemd-sysusers, systemd-tmpfiles
(Debian package systemd), promtool and prometheus (package prometheus), make and
/bin/kill (procps). CI runs as root and installs them (scripts/test); a missing
tool fails the test as root and skips it otherwise. Every process a test starts
is stopped, and every namespace it makes is deleted, even on failure.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
import tomllib
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from dlcp import ipc
from dlcp.shim.client import DaemonClient
from dlcp.tc.stats import ClassStats, stats_as_samples
from tests.daemons import (
    ROOT,
    Daemon,
    Rank,
    free_tcp_port,
    free_udp_port,
    hosts_of,
    loopback_daemons,
    packet_norms,
    submit,
    write_config,
)

UNIT = ROOT / "systemd" / "dlcpd.service"
SYSUSERS = ROOT / "systemd" / "dlcp.sysusers.conf"
TMPFILES = ROOT / "systemd" / "dlcp.tmpfiles.conf"
EXAMPLE_CONFIG = ROOT / "systemd" / "dlcpd.toml"
DASHBOARD = ROOT / "dashboards" / "dlcp.json"
ALERTS = ROOT / "prometheus" / "dlcp-alerts.yml"
ALERT_TESTS = ROOT / "prometheus" / "dlcp-alerts.test.yml"
METRICS_DOC = ROOT / "docs" / "metrics.md"
KEY = bytes(range(32))
JOB = 515
ROUNDS = 4

# tool -> the Debian package that has it
PACKAGES = {
    "systemd-analyze": "systemd",
    "systemd-sysusers": "systemd",
    "systemd-tmpfiles": "systemd",
    "promtool": "prometheus",
    "prometheus": "prometheus",
    "make": "make",
    "/bin/kill": "procps",
    "ip": "iproute2",
}


def tool(name: str) -> str:
    """The tool's path; as root a missing tool is an error (CI installs it), else a skip."""
    path = shutil.which(name)
    if path is None:
        why = f"{name} is not installed (Debian package {PACKAGES.get(name, name)})"
        if os.geteuid() == 0:
            pytest.fail(f"{why}; scripts/test installs it")
        pytest.skip(why)
    return path


def run(cmd: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, **kw)


def http_get(url: str, timeout: float = 10.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return str(r.read().decode())


def wait_for(what: str, probe: Callable[[], Any], deadline_s: float = 60.0) -> Any:
    """Call probe until it returns something truthy; fail with `what` after the deadline."""
    deadline = time.monotonic() + deadline_s
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = probe()
        except (OSError, ValueError) as exc:
            last = exc
        if last and not isinstance(last, Exception):
            return last
        time.sleep(0.1)
    pytest.fail(f"timed out waiting for {what} (last: {last!r})")


def dlcpd_argv0() -> list[str]:
    """How to start the installed daemon: the `dlcpd` script, else `python -m dlcp.daemon`."""
    path = shutil.which("dlcpd")
    return [path] if path else [sys.executable, "-m", "dlcp.daemon"]


def parse_unit(path: Path) -> dict[str, list[tuple[str, str]]]:
    """A systemd unit as section -> [(key, value)] (keys may repeat)."""
    out: dict[str, list[tuple[str, str]]] = {}
    section = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            out.setdefault(section, [])
            continue
        key, _, value = line.partition("=")
        out[section].append((key.strip(), value.strip()))
    return out


def unit_value(unit: dict[str, list[tuple[str, str]]], section: str, key: str) -> str:
    values = [v for k, v in unit[section] if k == key]
    assert values, f"{key}= is missing from [{section}]"
    return values[-1]


def sample_names(text: str) -> set[str]:
    """Every sample name in a Prometheus text exposition (_total, _bucket, ... included)."""
    return {s.name for fam in text_string_to_metric_families(text) for s in fam.samples}


def documented_name(fam_name: str, fam_type: str) -> str:
    return fam_name + "_total" if fam_type == "counter" else fam_name


def exposed_families(text: str) -> dict[str, str]:
    """Metric name as docs/metrics.md writes it -> type."""
    fams = {f.name: f.type for f in text_string_to_metric_families(text)}
    return {
        documented_name(name, kind): kind
        for name, kind in fams.items()
        if not (name.endswith("_created") and fams.get(name[: -len("_created")]) == "histogram")
    }


def tc_sample_names() -> set[str]:
    stats = [
        ClassStats(
            cls=0,
            classid="1:10",
            bytes=1,
            packets=1,
            drops=0,
            overlimits=0,
            backlog_bytes=0,
            backlog_packets=0,
        )
    ]
    return {s["name"] for s in stats_as_samples(stats, "eth0")}


def dashboard() -> dict[str, Any]:
    data = json.loads(DASHBOARD.read_text())
    assert isinstance(data, dict)
    return data


def dashboard_panels() -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for p in dashboard()["panels"]:
        out.append(p)
        out += p.get("panels", [])  # panels inside collapsed rows
    return out


def dashboard_queries() -> list[str]:
    """Every PromQL string of the dashboard: panel targets and query variables."""
    exprs = [t["expr"] for p in dashboard_panels() for t in p.get("targets", [])]
    for var in dashboard()["templating"]["list"]:
        q = var.get("query")
        if var.get("type") == "query":
            exprs.append(q["query"] if isinstance(q, dict) else str(q))
    return exprs


def metric_names_in(expr: str) -> set[str]:
    return set(re.findall(r"\bdlcp_[A-Za-z0-9_]+\b", expr))


def promql(expr: str) -> str:
    """A dashboard query with Grafana's variables filled in."""
    for var, value in (
        ("$__rate_interval", "1m"),
        ("$__interval", "15s"),
        ("$__range", "5m"),
        ("$job", ".*"),
        ("$instance", ".*"),
    ):
        expr = expr.replace(var, value)
    return expr


def label_values_query(expr: str) -> str:
    """label_values(SELECTOR, label) -> SELECTOR (Grafana's query function)."""
    m = re.fullmatch(r"label_values\((.*),\s*(\w+)\)", expr.strip())
    return m.group(1) if m else expr


# -- a cluster of loopback daemons that has all-reduced some rounds -----------------


@dataclass
class Cluster:
    daemons: list[Daemon]
    ranks: list[Rank]

    def metrics(self, i: int = 0) -> str:
        return http_get(f"http://127.0.0.1:{self.daemons[i].metrics_port}/metrics")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("ops")
    # two paths (127.0.0.x and 127.0.1.x): the path health series exist too
    with loopback_daemons(tmp, 3, {"timing": {"timeout": 10.0}}, paths=2) as ds:
        ranks: list[Rank] = []
        try:
            for i, d in enumerate(ds):
                ranks.append(Rank(d, f"dlcp-ops{os.getpid()}-{i}", 4 << 20))
            for i, r in enumerate(ranks):
                r.join(JOB, KEY, hosts_of(ds), i)
            rng = np.random.default_rng(0)
            for rnd in range(ROUNDS):
                xs = [rng.standard_normal(40_000).astype(np.float32) for _ in ranks]
                norms = [packet_norms(x, len(ranks)) for x in xs]
                layers = np.arange(len(norms[0])) // 8
                waits = [
                    submit(
                        r,
                        job=JOB,
                        round=rnd,
                        bucket=0,
                        lanes=x,
                        shards=len(ranks),
                        bound=0.05,
                        layers=layers,
                        norms=nm,
                    )
                    for r, x, nm in zip(ranks, xs, norms, strict=True)
                ]
                for w in waits:
                    w()
            # one rejected datagram per daemon, so the reject series exist
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.bind(("127.0.0.9", 0))
                for d in ds:
                    s.sendto(b"\xd1", (d.address, d.port))
            c = Cluster(ds, ranks)
            for i in range(len(ds)):
                wait_for(
                    f"a reject counted by daemon {i}",
                    lambda i=i: "dlcp_rejected_packets_total{" in c.metrics(i),
                )
            yield c
        finally:
            for r in ranks:
                r.close()


# -- Prometheus --------------------------------------------------------------------


@dataclass
class Prometheus:
    url: str
    dead_target: str
    log: Path

    def api(self, path: str, **params: str) -> Any:
        q = urllib.parse.urlencode(params)
        body = json.loads(http_get(f"{self.url}/api/v1/{path}" + (f"?{q}" if q else "")))
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        data = self.api("query", query=expr)
        assert data["resultType"] == "vector", data
        result: list[dict[str, Any]] = data["result"]
        return result


@contextlib.contextmanager
def prometheus_server(tmp: Path, targets: list[str]) -> Iterator[Prometheus]:
    binary = tool("prometheus")
    port = free_tcp_port()
    dead = f"127.0.0.1:{free_tcp_port()}"  # nothing listens there: up == 0
    targets_yaml = ", ".join(f'"{t}"' for t in [*targets, dead])
    config = tmp / "prometheus.yml"
    config.write_text(
        "global:\n"
        "  scrape_interval: 1s\n"
        "  scrape_timeout: 1s\n"
        "  evaluation_interval: 1s\n"
        f"rule_files: [{json.dumps(str(ALERTS))}]\n"
        "scrape_configs:\n"
        "  - job_name: dlcp\n"
        f"    static_configs: [{{targets: [{targets_yaml}]}}]\n"
    )
    log = tmp / "prometheus.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [
                binary,
                f"--config.file={config}",
                f"--storage.tsdb.path={tmp / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--log.level=warn",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=tmp,
        )
    try:
        url = f"http://127.0.0.1:{port}"

        def ready() -> bool:
            if proc.poll() is not None:
                pytest.fail(f"prometheus exited {proc.returncode}: {log.read_text()[-3000:]}")
            with urllib.request.urlopen(f"{url}/-/ready", timeout=5) as r:
                return bool(r.status == 200)

        wait_for("prometheus to be ready", ready)
        yield Prometheus(url, dead, log)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def prom(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Prometheus]:
    tmp = tmp_path_factory.mktemp("prometheus")
    with prometheus_server(tmp, [f"127.0.0.1:{d.metrics_port}" for d in cluster.daemons]) as p:
        yield p


# -- 1. the unit, sysusers and tmpfiles ----------------------------------------------


def test_unit_declares_the_service_contract() -> None:
    unit = parse_unit(UNIT)
    svc = dict(unit["Service"])
    assert svc["Type"] == "notify"
    assert svc["Restart"] == "on-failure"
    assert int(svc["WatchdogSec"].removesuffix("s")) > 0
    assert svc["User"] == "dlcp" and svc["Group"] == "dlcp"
    assert svc["CapabilityBoundingSet"] == "CAP_NET_ADMIN"
    assert svc["AmbientCapabilities"] == "CAP_NET_ADMIN"
    assert svc["NoNewPrivileges"] == "yes"
    assert svc["ProtectSystem"] == "strict"
    assert svc["ProtectHome"] == "yes" and svc["PrivateTmp"] == "yes"
    assert svc["ProtectKernelModules"] == "yes"
    assert set(svc["RestrictAddressFamilies"].split()) == {
        "AF_UNIX",
        "AF_INET",
        "AF_INET6",
        "AF_NETLINK",
    }
    # ranks' /dev/shm/dlcp-* segments must stay visible to the daemon
    for hiding in ("PrivateDevices", "PrivateIPC", "RemoveIPC"):
        assert svc.get(hiding, "no") == "no", hiding
    assert svc["ExecReload"] == "/bin/kill -HUP $MAINPID"
    # the socket lives in the RuntimeDirectory, the config in the ConfigurationDirectory
    argv = shlex.split(svc["ExecStart"])
    assert argv == ["/usr/local/bin/dlcpd", "--config", "/etc/dlcp/dlcpd.toml"]
    assert os.path.dirname(argv[2]) == "/etc/" + svc["ConfigurationDirectory"]
    example = tomllib.loads(EXAMPLE_CONFIG.read_text())
    sock = example["daemon"]["socket"]
    assert sock == ipc.DEFAULT_SOCKET
    assert os.path.dirname(sock) == "/run/" + svc["RuntimeDirectory"]
    # SIGTERM drains for up to drain_timeout_s before systemd's stop timeout
    drain = float(example["daemon"]["drain_timeout_s"])
    assert float(svc["TimeoutStopSec"].removesuffix("s")) > drain
    assert svc["RestartPreventExitStatus"] == "2"  # the daemon's exit status for a bad config


def test_make_install_stages_the_files_and_systemd_analyze_accepts_the_unit(
    tmp_path: Path,
) -> None:
    make = tool("make")
    analyze = tool("systemd-analyze")
    tool("/bin/kill")  # ExecReload's /bin/kill; verify checks that it exists
    stage = tmp_path / "stage"
    dlcpd = " ".join(dlcpd_argv0())
    p = run([make, "-C", str(ROOT), "install-systemd", f"DESTDIR={stage}", f"DLCPD={dlcpd}"])
    assert p.returncode == 0, p.stdout + p.stderr
    unit = stage / "usr/local/lib/systemd/system/dlcpd.service"
    conf = stage / "etc/dlcp/dlcpd.toml"
    assert (stage / "usr/local/lib/sysusers.d/dlcp.conf").read_text() == SYSUSERS.read_text()
    assert (stage / "usr/local/lib/tmpfiles.d/dlcp.conf").read_text() == TMPFILES.read_text()
    assert conf.read_text() == EXAMPLE_CONFIG.read_text()
    exec_start = unit_value(parse_unit(unit), "Service", "ExecStart")
    assert exec_start == f"{dlcpd} --config /etc/dlcp/dlcpd.toml"
    assert (unit.stat().st_mode & 0o777) == 0o644

    # the staged unit, with the real dlcpd path, passes systemd-analyze verify
    p = run([analyze, "verify", str(unit)], cwd=tmp_path)
    ours = [line for line in p.stderr.splitlines() if "dlcpd" in line or str(unit) in line]
    assert p.returncode == 0 and not ours, p.stderr
    # a broken unit is caught (the check is not a no-op)
    broken = tmp_path / "broken" / "dlcpd.service"
    broken.parent.mkdir()
    broken.write_text(unit.read_text().replace(dlcpd, "/nonexistent/dlcpd"))
    assert run([analyze, "verify", str(broken)], cwd=tmp_path).returncode != 0
    # its hardening keeps the exposure score at most 3.0 (threshold in tenths; "OK")
    p = run([analyze, "security", "--offline=true", "--threshold=30", str(unit)], cwd=tmp_path)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr

    # an edited config survives a second install; uninstall keeps it
    conf.write_text(conf.read_text() + "\n# local edit\n")
    p = run([make, "-C", str(ROOT), "install-systemd", f"DESTDIR={stage}", f"DLCPD={dlcpd}"])
    assert p.returncode == 0 and "local edit" in conf.read_text(), p.stdout + p.stderr
    p = run([make, "-C", str(ROOT), "uninstall", f"DESTDIR={stage}"])
    assert p.returncode == 0, p.stdout + p.stderr
    assert not unit.exists()
    assert not (stage / "usr/local/lib/sysusers.d/dlcp.conf").exists()
    assert conf.exists()


def test_sysusers_and_tmpfiles_create_the_user_and_runtime_directory(tmp_path: Path) -> None:
    sysusers = tool("systemd-sysusers")
    tmpfiles = tool("systemd-tmpfiles")
    root = tmp_path / "root"
    (root / "etc").mkdir(parents=True)
    p = run([sysusers, f"--root={root}", "-"], input=SYSUSERS.read_text())
    assert p.returncode == 0, p.stderr
    passwd = {
        ln.split(":")[0]: ln.split(":") for ln in (root / "etc/passwd").read_text().splitlines()
    }
    assert "dlcp" in passwd, passwd
    uid, gid, shell = int(passwd["dlcp"][2]), int(passwd["dlcp"][3]), passwd["dlcp"][6]
    assert uid < 1000 and shell.endswith("nologin")  # a system user that cannot log in
    assert "dlcp" in (root / "etc/group").read_text()
    # the tools do reject bad lines (so the checks here mean something)
    assert run([sysusers, f"--root={root}", "-"], input="u dlcp - x / /bin/sh junk\n").returncode

    if os.geteuid() != 0:
        pytest.skip("systemd-tmpfiles chowns /run/dlcp to the dlcp user: needs root")
    p = run([tmpfiles, f"--root={root}", "--create", "-"], input=TMPFILES.read_text())
    assert p.returncode == 0, p.stderr
    st = (root / "run/dlcp").stat()
    assert (st.st_uid, st.st_gid, st.st_mode & 0o777) == (uid, gid, 0o755)
    assert (root / "etc/dlcp").is_dir()

    bad = run([tmpfiles, f"--root={root}", "--create", "-"], input="d /run/x 07555 nobody\n")
    assert bad.returncode != 0


# -- 2. /metrics and a real Prometheus ---------------------------------------------


def test_metrics_pass_promtool_check_metrics(cluster: Cluster) -> None:
    promtool = tool("promtool")
    for i in range(len(cluster.daemons)):
        text = cluster.metrics(i)
        p = run([promtool, "check", "metrics"], input=text)
        assert p.returncode == 0 and not (p.stdout + p.stderr).strip(), p.stdout + p.stderr
    # promtool does flag bad exposition (the check is not a no-op)
    bad = "# TYPE dlcp_bad counter\ndlcp_bad 1\n"
    assert run([promtool, "check", "metrics"], input=bad).returncode != 0


def test_prometheus_scrapes_the_daemons_and_answers_queries(
    cluster: Cluster, prom: Prometheus
) -> None:
    instances = {f"127.0.0.1:{d.metrics_port}" for d in cluster.daemons}

    def completed() -> dict[str, float]:
        res = prom.query('dlcp_rounds_total{job="dlcp", outcome="completed"}')
        return {r["metric"]["instance"]: float(r["value"][1]) for r in res}

    got = wait_for(
        "dlcp_rounds_total of every daemon in Prometheus",
        lambda: (c := completed()) and set(c) == instances and c,
    )
    assert all(v >= ROUNDS for v in got.values()), got

    def up() -> dict[str, str]:
        return {r["metric"]["instance"]: r["value"][1] for r in prom.query('up{job="dlcp"}')}

    # targets are scraped at different offsets within the interval: wait for all four
    up_now = wait_for("up of every target", lambda: (u := up()) and len(u) == 4 and u)
    assert {i: up_now.get(i) for i in instances} == dict.fromkeys(instances, "1")
    assert up_now.get(prom.dead_target) == "0"
    # a histogram query over the scraped data
    q = 'histogram_quantile(0.5, sum by (le) (dlcp_round_duration_seconds_bucket{job="dlcp"}))'
    (res,) = prom.query(q)
    assert 0 < float(res["value"][1]) < 60


def test_alert_rules_load_evaluate_and_fire_in_prometheus(
    cluster: Cluster, prom: Prometheus
) -> None:
    def rules() -> list[dict[str, Any]]:
        return [r for g in prom.api("rules")["groups"] for r in g["rules"]]

    loaded = wait_for(
        "every alert rule to be evaluated",
        lambda: (rs := rules()) and all(r.get("health") != "unknown" for r in rs) and rs,
    )
    assert {r["name"] for r in loaded} >= {
        "DlcpDaemonDown",
        "DlcpMetricsAbsent",
        "DlcpShimFallback",
        "DlcpLanesLostHigh",
        "DlcpRoundsFailing",
    }
    assert all(r["health"] == "ok" for r in loaded), [
        (r["name"], r.get("lastError")) for r in loaded
    ]
    # a fallback reported by a shim, after Prometheus has seen the counter at 0
    d0 = f"127.0.0.1:{cluster.daemons[0].metrics_port}"
    wait_for(
        "dlcp_shim_fallbacks_total in Prometheus",
        lambda: prom.query(f'dlcp_shim_fallbacks_total{{instance="{d0}"}} == 0'),
    )
    with DaemonClient(cluster.daemons[0].socket) as c:
        c.hello(fallbacks=3)

    def alerts() -> dict[tuple[str, str], str]:
        return {
            (a["labels"]["alertname"], a["labels"].get("instance", "")): a["state"]
            for a in prom.api("alerts")["alerts"]
        }

    def fired() -> dict[tuple[str, str], str] | None:
        a = alerts()
        if ("DlcpShimFallback", d0) in a and ("DlcpDaemonDown", prom.dead_target) in a:
            return a
        return None

    a = wait_for("DlcpShimFallback and DlcpDaemonDown alerts", fired)
    assert a[("DlcpShimFallback", d0)] == "firing"  # no `for:` on fallbacks
    assert a[("DlcpDaemonDown", prom.dead_target)] in ("pending", "firing")
    live = {f"127.0.0.1:{d.metrics_port}" for d in cluster.daemons}
    assert not [k for k in a if k[0] == "DlcpDaemonDown" and k[1] in live], a
    assert not [k for k in a if k[0] in ("DlcpRoundsFailing", "DlcpMetricsAbsent")], a


def test_dashboard_queries_are_valid_promql_with_data(cluster: Cluster, prom: Prometheus) -> None:
    # two scrapes of every daemon, so rate() over 1m has data
    wait_for(
        "two scrapes of each daemon",
        lambda: (
            len(prom.query('count_over_time(dlcp_up{job="dlcp"}[1m]) >= 2')) == len(cluster.daemons)
        ),
    )
    tc = tc_sample_names()
    empty = []
    for expr in dashboard_queries():
        q = promql(label_values_query(expr))
        res = prom.query(q)  # raises on a PromQL error
        if not res and not metric_names_in(expr) & tc:
            empty.append(q)
    assert not empty, "dashboard queries without data from running daemons:\n" + "\n".join(empty)


# -- 3. dashboard metric names exist -------------------------------------------------


def test_every_metric_the_dashboard_queries_is_exposed(cluster: Cluster) -> None:
    exposed = set().union(*(sample_names(cluster.metrics(i)) for i in range(3)))
    tc = tc_sample_names()
    wanted = set().union(*(metric_names_in(e) for e in dashboard_queries()))
    assert wanted, "no dlcp_ metric names found in the dashboard"
    # tc class stats appear only with [tc] devices: checked against the exporter's names
    # here and against a daemon reading a real qdisc in test_tc_metrics_of_a_daemon_in_a_netns
    assert sorted(wanted - exposed - tc) == []
    assert sorted(wanted & {n for n in wanted if n.startswith("dlcp_tc_")} - tc) == []
    # the dashboard covers what the brief asks for
    for name in (
        "dlcp_sent_bytes_total",
        "dlcp_received_bytes_total",
        "dlcp_rejected_packets_total",
        "dlcp_round_duration_seconds_bucket",
        "dlcp_loss_bound_rounds_total",
        "dlcp_lanes_lost_total",
        "dlcp_lanes_expected_total",
        "dlcp_shim_fallbacks_total",
        "dlcp_retransmits_total",
        "dlcp_nacks_sent_total",
        "dlcp_peer_rate_bps",
        "dlcp_tc_dropped_packets_total",
    ):
        assert name in wanted, name


NETNS_DEV = "dlcpo0"


@pytest.mark.netns
def test_tc_metrics_of_a_daemon_in_a_netns(tmp_path: Path) -> None:
    """A daemon with [tc] devices on a veth with `dlcp tc apply` exports every dlcp_tc_* name
    the dashboard queries, and its /metrics passes promtool."""
    ip = tool("ip")
    promtool = tool("promtool")
    ns = f"dlcpops-{os.getpid()}"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    made = False
    proc: subprocess.Popen[bytes] | None = None
    log = tmp_path / "dlcpd.log"
    try:
        subprocess.run([ip, "netns", "add", ns], check=True, capture_output=True)
        made = True
        for cmd in (
            ["link", "add", NETNS_DEV, "type", "veth", "peer", "name", "dlcpo1"],
            ["link", "set", NETNS_DEV, "up"],
            ["link", "set", "dlcpo1", "up"],
            ["link", "set", "lo", "up"],
        ):
            subprocess.run([ip, "-n", ns, *cmd], check=True, capture_output=True)
        p = run(
            [
                sys.executable,
                "-m",
                "dlcp",
                "tc",
                "apply",
                "--dev",
                NETNS_DEV,
                "--netns",
                ns,
                "--rate",
                "100mbit",
            ],
            env=env,
        )
        assert p.returncode == 0, p.stderr
        port = free_tcp_port()
        config = tmp_path / "dlcpd.toml"
        write_config(
            config,
            {
                "daemon": {
                    "socket": str(tmp_path / "d.sock"),
                    "metrics_address": "127.0.0.1",
                    "metrics_port": port,
                },
                "network": {"addresses": ["127.0.0.1"], "udp_port": free_udp_port()},
                "tc": {"devices": [NETNS_DEV]},
            },
        )
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                [ip, "netns", "exec", ns, *dlcpd_argv0(), "--config", str(config)],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
            )
        fetch = [
            ip,
            "netns",
            "exec",
            ns,
            sys.executable,
            "-c",
            "import sys, urllib.request; sys.stdout.write(urllib.request.urlopen("
            f"'http://127.0.0.1:{port}/metrics', timeout=5).read().decode())",
        ]

        def tc_metrics() -> str | None:
            assert proc is not None
            if proc.poll() is not None:
                pytest.fail(f"dlcpd exited {proc.returncode}: {log.read_text()[-3000:]}")
            out = run(fetch)
            return out.stdout if "dlcp_tc_dropped_packets_total{" in out.stdout else None

        text = wait_for("tc samples in the daemon's /metrics", tc_metrics)
        names = sample_names(text)
        wanted = set().union(*(metric_names_in(e) for e in dashboard_queries()))
        assert sorted(n for n in wanted if n.startswith("dlcp_tc_") and n not in names) == []
        assert tc_sample_names() <= names
        classes = {
            s.labels["class"]
            for f in text_string_to_metric_families(text)
            for s in f.samples
            if s.name == "dlcp_tc_sent_packets_total" and s.labels.get("dev") == NETNS_DEV
        }
        assert classes == {str(c) for c in range(8)}
        p = run([promtool, "check", "metrics"], input=text)
        assert p.returncode == 0 and not (p.stdout + p.stderr).strip(), p.stdout + p.stderr
    finally:
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if made:
            subprocess.run([ip, "netns", "del", ns], capture_output=True)


# -- 4. the daemon as systemd starts it ------------------------------------------------


def _recv_notify(sock: socket.socket) -> tuple[int, list[str]]:
    """One sd_notify datagram: (sender pid from SCM_CREDENTIALS, its lines)."""
    data, anc, _flags, _addr = sock.recvmsg(4096, socket.CMSG_SPACE(12))
    pid = -1
    for level, kind, payload in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
            pid = struct.unpack("iII", payload[:12])[0]
    return pid, data.decode().split("\n")


def test_service_command_line_notifies_ready_watchdog_and_stopping(tmp_path: Path) -> None:
    tool("/bin/kill")
    unit = parse_unit(UNIT)
    argv = shlex.split(unit_value(unit, "Service", "ExecStart"))
    watchdog_usec = 400_000  # systemd passes WatchdogSec in µs; short here to see pings
    notify_path = str(tmp_path / "notify.sock")
    ns = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    ns.bind(notify_path)
    ns.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
    ns.settimeout(30)
    proc: subprocess.Popen[bytes] | None = None
    with loopback_daemons(tmp_path, 1, start=False) as (d,):
        # ExecStart as written, with the installed dlcpd and this test's config
        assert argv[1:] == ["--config", "/etc/dlcp/dlcpd.toml"]
        cmd = [*dlcpd_argv0(), "--config", str(d.config)]
        env = {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "NOTIFY_SOCKET": notify_path,
            "WATCHDOG_USEC": str(watchdog_usec),
        }
        try:
            with open(d.log, "wb") as log:
                # systemd sets WATCHDOG_PID to the main pid; `exec` keeps the shell's pid
                proc = subprocess.Popen(
                    [
                        "/bin/sh",
                        "-c",
                        'WATCHDOG_PID=$$; export WATCHDOG_PID; exec "$@"',
                        "sh",
                        *cmd,
                    ],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=env,
                )
            msgs: list[str] = []
            senders: set[int] = set()

            def recv() -> None:
                try:
                    pid, lines = _recv_notify(ns)
                except TimeoutError:
                    assert proc is not None
                    pytest.fail(f"no sd_notify message; dlcpd log: {d.log.read_text()[-3000:]}")
                senders.add(pid)
                msgs.extend(lines)

            while "READY=1" not in msgs:
                recv()
            # READY means serving: the socket and the metrics endpoint answer
            assert os.path.exists(d.socket)
            assert "dlcp_up 1.0" in http_get(f"http://127.0.0.1:{d.metrics_port}/metrics")
            with DaemonClient(d.socket) as c:
                assert c.status()["daemon"]["udp_port"] == d.port
            while msgs.count("WATCHDOG=1") < 4:
                recv()
            # NotifyAccess=main: every message comes from the main pid
            assert senders == {proc.pid}, (senders, proc.pid)

            # ExecReload: /bin/kill -HUP $MAINPID reloads and keeps serving
            reload = shlex.split(unit_value(unit, "Service", "ExecReload"))
            reload = [str(proc.pid) if a == "$MAINPID" else a for a in reload]
            subprocess.run(reload, check=True)
            pings = msgs.count("WATCHDOG=1")
            while msgs.count("WATCHDOG=1") < pings + 2:
                recv()
            assert proc.poll() is None

            # SIGTERM (systemctl stop): STOPPING=1, then exit 0 with the socket removed
            proc.send_signal(signal.SIGTERM)
            while "STOPPING=1" not in msgs:
                recv()
            assert proc.wait(60) == 0, d.log.read_text()[-3000:]
            assert not os.path.exists(d.socket)
            assert senders == {proc.pid}
        finally:
            ns.close()
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()


# -- 5. rules and dashboard files ----------------------------------------------------


def test_promtool_accepts_the_alert_rules_and_their_unit_tests() -> None:
    promtool = tool("promtool")
    p = run([promtool, "check", "rules", str(ALERTS)])
    assert p.returncode == 0 and "SUCCESS" in p.stdout, p.stdout + p.stderr
    p = run([promtool, "test", "rules", str(ALERT_TESTS)])
    assert p.returncode == 0, p.stdout + p.stderr


def test_dashboard_json_is_well_formed() -> None:
    dash = dashboard()
    assert dash["uid"] and dash["title"] and dash["schemaVersion"] >= 36
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    panels = dashboard_panels()
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    graphs = [p for p in panels if p["type"] != "row"]
    assert len(graphs) >= 10
    for p in graphs:
        where = f"panel {p['id']} {p.get('title')!r}"
        assert p.get("title"), where
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, where
        assert p.get("targets"), f"{where} has no targets"
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)), where
        for t in p["targets"]:
            assert t.get("datasource") == p["datasource"], where
            assert t.get("expr", "").strip(), where
            assert t["expr"].count("(") == t["expr"].count(")"), where
        g = p["gridPos"]
        assert g["w"] > 0 and g["h"] > 0 and g["x"] + g["w"] <= 24, where
    for v in variables.values():
        if v["type"] == "query":
            assert v["datasource"] == {"type": "prometheus", "uid": "${datasource}"}


def test_every_exposed_metric_is_documented(cluster: Cluster) -> None:
    exposed = exposed_families(cluster.metrics(0))
    stats = [
        ClassStats(
            cls=0,
            classid="1:10",
            bytes=1,
            packets=1,
            drops=0,
            overlimits=0,
            backlog_bytes=0,
            backlog_packets=0,
        )
    ]
    for s in stats_as_samples(stats, "eth0"):
        exposed[s["name"]] = s["type"]
    doc = METRICS_DOC.read_text()
    rows = re.findall(r"^\| `(dlcp_[a-z0-9_]+)` \| (\w+) \|", doc, re.MULTILINE)
    documented = dict(rows)
    assert sorted(set(exposed) - set(documented)) == [], "add them to docs/metrics.md"
    assert sorted(set(documented) - set(exposed)) == [], "docs/metrics.md lists unknown names"
    wrong = {n: (documented[n], k) for n, k in exposed.items() if documented[n] != k}
    assert wrong == {}, "documented type differs from the exposed one"
