"""One benchmark's emulated cluster: the testbed, the scenario's disturbances,
Gloo's DSCP marking and dlcp's daemons per backend. What it runs on is a
`dlcp.bench.setup.Setup` (re-exported here); the disturbances' threads are
`dlcp.bench.disturb`'s.

    with Cluster(Setup(hosts=3, rate_bps=10**9, scenario="loss", loss_pct=5.0)) as c:
        c.start_dlcp("dlcp")
        with c.disturbed():
            ...  # run the backend's workers in c.tb's host namespaces
        c.stop_dlcp()

The testbed gets a unique name ("bench-<pid>" unless given) and a private
state root under /tmp, and is always removed on exit, so benchmarks may run
beside other testbeds on the same machine.
"""

from __future__ import annotations

import contextlib
import dataclasses
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from dlcp.bench.common import BenchError
from dlcp.bench.disturb import Burster, PortCutter
from dlcp.bench.setup import (
    BURST,
    CONGESTION,
    PATH_DOWN,
    Burst,
    Congestion,
    PathDown,
    Setup,
    dlcp_daemon_config,
)
from dlcp.testbed import Host, Testbed, TestbedSpec
from dlcp.testbed.plan import IPERF_BASE_PORT
from dlcp.testbed.switchagg import SWITCH_ROLE
from dlcp.testbed.system import require_root, require_tools

__all__ = [
    "BURST",
    "CONGESTION",
    "GLOO_PRIO_DSCP",
    "PATH_DOWN",
    "Burst",
    "Cluster",
    "Congestion",
    "PathDown",
    "Setup",
    "cut_steps",
    "dlcp_daemon_config",
    "gloo_mark_script",
    "unmark_script",
]

GLOO_PRIO_DSCP = "cs5"  # the top gradient class of the default DSCP table (class 1)
CONTROL_DSCP = "cs6"  # class 0: dlcp's control traffic
MARK_TABLE = "dlcp_bench"

Progress = Callable[[str], None]


def _iperf_ports(hosts: int) -> str:
    return f"{IPERF_BASE_PORT}-{IPERF_BASE_PORT + 2 * hosts + 1}"


def gloo_mark_script(dscp: str, hosts: int) -> str:
    """nftables script for a host namespace: its TCP (but not the background
    iperf3 flows, which are TCP too) leaves with DSCP `dscp`."""
    ports = _iperf_ports(hosts)
    return (
        f"table ip {MARK_TABLE} {{\n"
        "  chain out {\n"
        "    type filter hook output priority 0; policy accept;\n"
        f"    ip protocol tcp tcp sport != {ports} tcp dport != {ports} ip dscp set {dscp}\n"
        "  }\n"
        "}\n"
    )


def unmark_script() -> str:
    # "add" first so the delete succeeds when the table is absent
    return f"add table ip {MARK_TABLE}\ndelete table ip {MARK_TABLE}\n"


class Cluster:
    """The testbed of one benchmark invocation (a context manager)."""

    def __init__(self, setup: Setup, *, progress: Progress | None = None) -> None:
        self.setup = setup
        self._progress = progress
        self._root: Path | None = None
        self._tb: Testbed | None = None
        self.daemons_running = False
        self.variant: str | None = None
        self.log_dir: Path | None = None  # where to keep logs (default: nowhere)
        self.cut: PortCutter | None = None  # the last run's path cut (scenario pathdown)

    # -- lifetime -----------------------------------------------------------
    def __enter__(self) -> Cluster:
        self.up()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.down()

    def up(self) -> Testbed:
        require_root_for_bench()
        tools = ["ip", "nft", "ethtool"]
        if self.setup.scenario == "congested":
            tools.append("iperf3")
        require_tools(tools)
        self._root = Path(tempfile.mkdtemp(prefix="dlcpb-", dir="/tmp"))
        s = self.setup
        kwargs: dict[str, Any] = {
            "hosts": s.hosts + s.servers,  # the servers after the training hosts
            "paths": s.n_paths,
            "rate_bps": s.rate_bps,
            "name": s.testbed_name,
            **({"switch_aggregator": True} if s.mode == "switch" else {}),
        }
        if s.mtu != 1500:
            if "mtu" not in {f.name for f in dataclasses.fields(TestbedSpec)}:
                raise BenchError("this dlcp's testbed has no MTU setting; use --mtu 1500")
            kwargs["mtu"] = s.mtu
        self._say(f"building testbed {s.testbed_name}: {s.describe()}")
        try:
            self._tb = Testbed.up(TestbedSpec(**kwargs), state_root=self._root)
        except BaseException:
            shutil.rmtree(self._root, ignore_errors=True)
            self._root = None
            raise
        return self._tb

    def down(self) -> None:
        tb, self._tb = self._tb, None
        try:
            if tb is not None:
                self._say(f"removing testbed {tb.name}")
                tb.down()
        finally:
            if self._root is not None:
                shutil.rmtree(self._root, ignore_errors=True)
                self._root = None
            self.daemons_running = False

    @property
    def tb(self) -> Testbed:
        if self._tb is None:
            raise BenchError("the benchmark's testbed is not up")
        return self._tb

    @property
    def train_hosts(self) -> tuple[Host, ...]:
        """The testbed's hosts that run ranks (not the parameter servers)."""
        return self.tb.hosts[: self.setup.hosts]

    @property
    def work_dir(self) -> Path:
        """A private directory for logs of this invocation (removed at `down`)."""
        if self._root is None:
            raise BenchError("the benchmark's testbed is not up")
        d = self._root / "work"
        d.mkdir(exist_ok=True)
        return d

    def _say(self, message: str) -> None:
        if self._progress is not None:
            self._progress(message)

    # -- per backend -------------------------------------------------------------
    def mark_tcp(self, dscp: str | None) -> None:
        """Mark the hosts' TCP (Gloo's, not iperf3's) with `dscp`, or stop marking."""
        script = (
            unmark_script()
            if dscp is None
            else unmark_script() + gloo_mark_script(dscp, self.setup.hosts)
        )
        for h in self.tb.hosts:
            done = self.tb.exec(h.index, ["nft", "-f", "-"], input=script, capture=True)
            if done.returncode != 0:
                raise BenchError(f"nft in {h.netns} failed: {done.stderr.strip()}")

    def start_dlcp(self, variant: str, *, timeout_s: float = 60.0) -> None:
        """Start one daemon per host configured for `variant`."""
        extra = dlcp_daemon_config(self.setup, variant, timeout_s=timeout_s)
        host_config: dict[int, Mapping[str, Any]] = {}
        if variant == "dlcp-1path":
            host_config = {
                h.index: {"network": {"addresses": [h.addresses[0]]}} for h in self.tb.hosts
            }
        self._say(f"starting {len(self.tb.hosts)} daemons ({variant})")
        self.tb.start_daemons(extra, host_config=host_config)
        self.daemons_running = True
        self.variant = variant

    def stop_dlcp(self) -> None:
        """Stop the daemons; with `log_dir`, their metrics are saved first."""
        if self.daemons_running:
            if self.log_dir is not None and self.variant is not None:
                self.save_metrics(self.log_dir, self.variant)
            self.tb.stop_daemons()
            self.daemons_running = False
            self.variant = None

    def daemon_pids(self) -> list[int]:
        """The daemons' (the switch aggregator's too: it shares these cores)."""
        procs = [*self.tb.processes("daemon"), *self.tb.processes(SWITCH_ROLE)]
        return [int(p["pid"]) for p in procs if p["alive"]]

    def join_hosts(self, variant: str) -> list[dict[str, Any]]:
        """The `hosts` of a shim-protocol join for the daemons of `variant`
        (in "switch" mode the aggregator last)."""
        one = variant == "dlcp-1path"
        hosts = [
            {"addresses": [h.addresses[0]] if one else list(h.addresses), "udp_port": h.udp_port}
            for h in self.tb.hosts
        ]
        if self.setup.mode == "switch":
            addresses = list(self.tb.switch_addresses)
            hosts.append(
                {"addresses": addresses[:1] if one else addresses, "udp_port": hosts[0]["udp_port"]}
            )
        return hosts

    def run_label(self, backend: str) -> str:
        """'loss5-dlcp', 'congested-gloo': names the logs of one backend run."""
        s = self.setup
        case = f"loss{s.loss_pct:g}" if s.scenario == "loss" else s.scenario
        return f"{case}-{backend}"

    def save_logs(self, dest: Path, backend: str) -> None:
        """Copy the logs of `backend`'s run (its workers', and for dlcp the
        daemons' as `<label>-<host>-dlcpd.log`) into `dest`."""
        dest.mkdir(parents=True, exist_ok=True)
        label = self.run_label(backend)
        if backend.startswith("dlcp"):
            logs = [(h.name, h.log) for h in self.tb.hosts]
            if self.tb.switch_log is not None:
                logs.append(("switch", self.tb.switch_log))
            for name, log in logs:
                with contextlib.suppress(OSError):
                    shutil.copyfile(log, dest / f"{label}-{name}-dlcpd.log")
        for f in self.work_dir.glob(f"*{label}-rank*.log"):
            with contextlib.suppress(OSError):
                shutil.copyfile(f, dest / f.name)

    def save_metrics(self, dest: Path, backend: str) -> None:
        """Each daemon's Prometheus text now, as `<label>-<host>-metrics.txt`
        (taken before the daemons stop: counters of NACKs, repeats, drops)."""
        dest.mkdir(parents=True, exist_ok=True)
        label = self.run_label(backend)
        fetch = (
            "import sys, urllib.request\n"
            "sys.stdout.write(urllib.request.urlopen(sys.argv[1], timeout=5).read().decode())"
        )
        urls = [(h.name, h.metrics_url) for h in self.tb.hosts]
        for a in self.tb.switch_addresses[:1]:  # from host 0, as the hosts' own
            urls.append(("switch", f"http://{a}:{self.tb.spec.metrics_port}/metrics"))
        for name, url in urls:
            with contextlib.suppress(OSError, subprocess.SubprocessError):
                got = self.tb.exec(0, [sys.executable, "-c", fetch, url], capture=True, timeout=15)
                if got.returncode == 0:
                    (dest / f"{label}-{name}-metrics.txt").write_text(got.stdout)

    def daemon_log_tail(self, lines: int = 5) -> str:
        out = []
        for h in self.tb.hosts:
            with contextlib.suppress(OSError):
                tail = h.log.read_text(errors="replace").strip().splitlines()[-lines:]
                if tail:
                    out.append(f"{h.name}: " + " | ".join(tail))
        return "\n".join(out)

    @contextlib.contextmanager
    def disturbed(self) -> Iterator[None]:
        """The scenario's loss, bursts or background traffic, for one backend run."""
        s = self.setup
        tb = self.tb
        if s.scenario == "loss" and s.loss_pct > 0:
            tb.set_loss_all(s.loss_pct)
            try:
                yield
            finally:
                tb.set_loss_all(0.0)
        elif s.scenario == "burst":
            burster = Burster(tb, s.burst)
            burster.start()
            try:
                yield
            finally:
                burster.stop()
        elif s.scenario == "pathdown":
            cut = self.cut = PortCutter(tb, s.path_down)
            cut.start()
            try:
                yield
            finally:
                cut.stop()
        elif s.scenario == "congested":
            c = s.congestion
            link = s.rate_bps or 10**9
            tb.start_background(
                "both",
                udp_rate_bps=max(1, round(c.udp_share * link)),
                parallel=c.tcp_streams,
                pattern="ring",
            )
            try:
                time.sleep(2.0)  # let TCP fill the queues
                yield
            finally:
                tb.stop_background()
        else:
            yield


def cut_steps(
    starts: Sequence[float], times: Sequence[float], down_at: float, n: int = 20
) -> dict[str, float | int | None]:
    """Steps (or rounds) around a path cut: `starts` their start times on the
    cutter's clock (time.monotonic), `times` their durations. The median of
    the `n` that started before the cut and of the `n` after it (those in
    flight at the cut included), and the longest from the cut on."""
    before = [t for s, t in zip(starts, times, strict=True) if s + t <= down_at][-n:]
    after = [t for s, t in zip(starts, times, strict=True) if s + t > down_at]
    return {
        "steps_before": len(before),
        "median_before_s": statistics.median(before) if before else None,
        "median_after_s": statistics.median(after[:n]) if after else None,
        "max_after_s": max(after) if after else None,
    }


def require_root_for_bench() -> None:
    """A clear one-line error when not root."""
    try:
        require_root()
    except Exception:
        raise BenchError(
            "dlcp bench and dlcp demo build network namespaces and need root: run them with sudo"
        ) from None


@dataclass
class Timer:
    """Wall-clock start/stop helper for progress messages."""

    start: float = field(default_factory=time.monotonic)

    def elapsed(self) -> float:
        return time.monotonic() - self.start
