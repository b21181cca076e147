"""The emulated cluster: network namespaces, a bridged switch, shaping, loss, traffic.

    with Testbed.up(TestbedSpec(hosts=3, paths=2, rate_bps=10**9)) as tb:
        tb.exec("h0", ["ip", "addr"])
        tb.set_loss("h1", 5.0)

`up` records everything it makes in the state directory (see `dlcp.testbed.state`)
so that `Testbed.attach(name)` and `down(name)` work from other processes.
A `Testbed` composes its parts, each owning what it changes: the switch
(`dlcp.testbed.switch`: bridges, ports, loss, shaping), the hosts' processes
(`dlcp.testbed.procs`: commands, background traffic, daemons) and the switch
aggregator (`dlcp.testbed.switchagg`); this module builds the namespaces,
runs the build steps in order, shows the testbed and removes it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from dlcp import signals
from dlcp.testbed import kernel, system
from dlcp.testbed.host import Host, make_host
from dlcp.testbed.plan import (
    DEFAULT_NAME,
    TestbedError,
    TestbedSpec,
    bridge_name,
    check_path,
    format_rate,
    host_label,
    owned_netns,
    parse_host,
    switch_netns,
)
from dlcp.testbed.procs import DEFAULT_DAEMON_COMMAND, HostProcesses
from dlcp.testbed.state import StateRecord, load_state, state_dir
from dlcp.testbed.switch import Switch, tc_modules
from dlcp.testbed.switchagg import SWITCH_ROLE, SwitchAggregator

__all__ = ["DEFAULT_DAEMON_COMMAND", "Host", "Testbed", "down"]

_SOCKET_PATH_MAX = 107  # sun_path holds 108 bytes with the terminating NUL
_BASE_TOOLS = ("ip", "bridge", "nft", "ethtool")

Progress = Callable[[str], None]


class Testbed:
    """A built (or attached) testbed. Create it with `up` or `attach`.

    Its parts: `switch` (`Switch`), `procs` (`HostProcesses`) and
    `aggregator` (`SwitchAggregator`); their public methods are the
    testbed's (`tb.exec`, `tb.set_loss`, `tb.start_daemons`, ...).
    """

    __test__ = False  # not a pytest test class

    def __init__(
        self, spec: TestbedSpec, directory: Path, *, progress: Progress | None = None
    ) -> None:
        self.spec = spec
        self.state_dir = directory
        self.switch_netns = switch_netns(spec.name)
        self.hosts: tuple[Host, ...] = tuple(
            make_host(spec, directory, i) for i in range(spec.hosts)
        )
        self._progress = progress
        self.record = StateRecord(directory, spec)
        self.aggregator = SwitchAggregator(
            spec, self.hosts, directory, self.switch_netns, self.record
        )
        self.switch = Switch(spec, self.hosts, self.switch_netns, self.record, self.aggregator)
        self.procs = HostProcesses(spec, self.hosts, directory, self.record, self.aggregator)
        # what the parts answer, as the testbed's own methods
        self.env = self.procs.env
        self.exec = self.procs.exec
        self.popen = self.procs.popen
        self.processes = self.procs.processes
        self.start_background = self.procs.start_background
        self.stop_background = self.procs.stop_background
        self.start_daemons = self.procs.start_daemons
        self.stop_daemons = self.procs.stop_daemons
        self.tc_stats = self.switch.tc_stats
        self.set_loss = self.switch.set_loss
        self.set_loss_all = self.switch.set_loss_all
        self.set_port = self.switch.set_port
        self.ports_down = self.switch.ports_down
        self.loss = self.switch.loss

    # --- construction -------------------------------------------------------------

    @classmethod
    def up(
        cls,
        spec: TestbedSpec,
        *,
        state_root: Path | str | None = None,
        progress: Progress | None = None,
    ) -> Testbed:
        """Build the testbed of `spec`, replacing any testbed of the same name.

        If building fails or is interrupted (SIGINT/SIGTERM), everything made so
        far is removed and the error re-raised.
        """
        system.require_root()
        tools = [*_BASE_TOOLS, *(["iperf3"] if spec.background != "none" else [])]
        system.require_tools(tools)
        directory = state_dir(spec.name, state_root)
        longest = directory / host_label(spec.hosts - 1) / "dlcpd.sock"
        if len(os.fsencode(longest)) > _SOCKET_PATH_MAX:
            raise TestbedError(
                f"state directory {directory} is too long for Unix socket paths; "
                "set DLCP_TESTBED_DIR to a shorter directory"
            )
        if spec.rate_bps is not None:
            tc_modules()  # fail before building anything
        down(spec.name, state_root=state_root)
        tb = cls(spec, directory, progress=progress)
        owner = os.getpid()
        with _interrupt_on_signals():
            try:
                tb._build()
            except BaseException:
                if os.getpid() != owner:  # never clean up from a forked child
                    raise
                with _signals_ignored():
                    try:
                        tb.down()
                    except Exception as cleanup_error:  # report, but raise the cause
                        print(
                            f"dlcp testbed: cleanup after failed up: {cleanup_error}",
                            file=sys.stderr,
                        )
                raise
        return tb

    @classmethod
    def attach(cls, name: str = DEFAULT_NAME, *, state_root: Path | str | None = None) -> Testbed:
        """The testbed `name` built earlier (possibly by another process)."""
        directory = state_dir(name, state_root)
        data = load_state(directory)
        if data is None:
            raise TestbedError(
                f"no testbed named {name!r} (no {directory / 'state.json'}); "
                f"start one with: dlcp testbed up --name {name} --hosts N"
            )
        return cls(TestbedSpec.from_json(data["spec"]), directory)

    def __enter__(self) -> Testbed:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.down()

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def namespaces(self) -> list[str]:
        return [self.switch_netns, *(h.netns for h in self.hosts)]

    @property
    def switch_ports(self) -> list[str]:
        return self.switch.ports

    @property
    def switch_socket(self) -> Path | None:
        """The switch aggregator daemon's socket (None: the testbed has none)."""
        return self.aggregator.socket

    @property
    def switch_log(self) -> Path | None:
        """The switch aggregator daemon's log (None: the testbed has none)."""
        return self.aggregator.log

    @property
    def switch_addresses(self) -> tuple[str, ...]:
        return self.aggregator.addresses

    def host(self, host: str | int) -> Host:
        """'h1', '1' or 1 -> that host."""
        return self.hosts[parse_host(host, self.spec.hosts)]

    def address(self, host: str | int, path: int = 0) -> str:
        return self.host(host).addresses[check_path(path, self.spec.paths)]

    # --- build steps (each its own method, so tests can break one) ---------------

    def _build(self) -> None:
        self.record.update(lambda st: None)  # state exists from the start
        for h in self.hosts:
            (self.state_dir / h.name).mkdir(parents=True, exist_ok=True)
        self._say(f"creating {len(self.namespaces)} namespaces")
        self._create_namespaces()
        self._say(f"wiring {self.spec.hosts} hosts x {self.spec.paths} path(s) to the switch")
        self.switch.create_links()
        if self.spec.switch_aggregator:
            self._say("giving the switch an aggregator's addresses")
            self.aggregator.wire()
        kernel.tune_offloads(
            [(h.netns, h.interfaces) for h in self.hosts], segments=self.spec.segments
        )
        self._apply_loss()
        if self.spec.rate_bps is not None:
            self._say(f"shaping switch ports to {format_rate(self.spec.rate_bps)}")
            self.switch.apply_tc()
        self.record.update(lambda st: st.update(complete=True))
        if self.spec.background != "none":
            self._say(f"starting background traffic ({self.spec.background})")
            self.start_background(
                self.spec.background,
                duration_s=self.spec.background_s,
                udp_rate_bps=self.spec.udp_rate_bps,
                pattern=self.spec.background_pattern,
            )
        if self.spec.daemons:
            self._say("starting daemons")
            self.start_daemons()

    def _create_namespaces(self) -> None:
        # Recorded before they exist: a crash in between still gets them removed.
        self.record.update(lambda st: st["netns"].extend(self.namespaces))
        for ns in self.namespaces:
            system.run(["ip", "netns", "add", ns])
            system.run(["ip", "-n", ns, "link", "set", "lo", "up"])
            kernel.disable_ipv6(ns)
        decoupled = kernel.decouple_senders(self.switch_netns)
        self.record.update(lambda st: st.update(senders_decoupled=decoupled))
        if not decoupled:
            self._say(
                f"warning: no br_netfilter ({kernel.BRIDGE_NF} missing, modprobe failed): "
                "the switch's queues will hold back their senders' sockets"
            )

    def _apply_loss(self) -> None:
        self.switch.apply_loss()

    # --- runtime controls ------------------------------------------------------

    def apply_tc(self, **tc_options: Any) -> None:
        """(Re)apply the dlcp.tc plan on every switch port; `tc_options` go to
        `TcConfig` (e.g. `rate_bps`, `queue_packets`)."""
        self.switch.apply_tc(force=True, **tc_options)

    # --- show / down --------------------------------------------------------------------

    def show(self) -> dict[str, Any]:
        """What the testbed is: `{"hosts": [...], "switches": [...]}` and more."""
        procs = self.processes()
        daemons = {p["host"]: p for p in procs if p["role"] == "daemon"}
        loss = self.loss()
        state = self.record.read()
        return {
            "name": self.name,
            "state_dir": str(self.state_dir),
            "rate_bps": self.spec.rate_bps,
            "paths": self.spec.paths,
            "loss_pct": self.spec.loss_pct,
            "segmentation": self.spec.segments,
            "senders_decoupled": bool(state.get("senders_decoupled")),
            "complete": bool(state.get("complete")),
            "hosts": [
                {
                    "name": h.name,
                    "index": h.index,
                    "netns": h.netns,
                    "addresses": list(h.addresses),
                    "interfaces": list(h.interfaces),
                    "udp_port": h.udp_port,
                    "socket": str(h.socket),
                    "metrics_url": h.metrics_url,
                    "config": str(h.config),
                    "log": str(h.log),
                    "daemon_pid": daemons[h.index]["pid"] if h.index in daemons else None,
                    "daemon_alive": daemons[h.index]["alive"] if h.index in daemons else False,
                }
                for h in self.hosts
            ],
            "switches": [
                {
                    "netns": self.switch_netns,
                    "ports": self.switch_ports,
                    "bridges": [bridge_name(p) for p in range(self.spec.paths)],
                    "loss_pct": loss,
                    "ports_down": self.ports_down(),
                    "aggregator": self.aggregator.show(procs),
                }
            ],
            "background": [p for p in procs if p["role"].startswith("background")],
            "processes": procs,
        }

    def down(self, *, keep_logs: bool = False) -> None:
        """Remove everything this testbed made; fine if parts are already gone."""
        down(
            self.name,
            state_root=self.state_dir.parent,
            keep_logs=keep_logs,
            popens=self.procs.popens,
        )
        self.procs.popens.clear()

    # --- helpers ----------------------------------------------------------------------------

    def _say(self, message: str) -> None:
        if self._progress is not None:
            self._progress(message)


def down(
    name: str = DEFAULT_NAME,
    *,
    state_root: Path | str | None = None,
    keep_logs: bool = False,
    popens: Sequence[subprocess.Popen[Any]] = (),
) -> bool:
    """Remove testbed `name`: its processes, namespaces (also ones with its
    prefix the state does not know, e.g. after a crash) and state directory.

    Succeeds when parts are already gone; returns whether anything was there.
    """
    system.require_root()
    system.require_tools(["ip"])
    directory = state_dir(name, state_root)
    try:
        data = load_state(directory) or {}
    except TestbedError:
        data = {}  # corrupt state: the namespace sweep still finds everything
    recorded = data.get("processes", [])
    namespaces = sorted(set(data.get("netns", [])) | set(owned_netns(name, system.list_netns())))

    # Processes first: a namespace with processes in it outlives `ip netns del`.
    grace = 10.0 if any(p.get("role") in ("daemon", SWITCH_ROLE) for p in recorded) else 3.0
    groups = [(int(p["pid"]), p.get("start")) for p in recorded]
    for proc in groups:
        system.signal_process(proc, signal.SIGTERM, group=True)
    inside = [system.proc_of(pid) for ns in namespaces for pid in system.netns_pids(ns)]
    ours = [(p.pid, None) for p in popens if p.poll() is None]
    system.terminate([*inside, *ours], grace_s=grace)
    for proc in system.wait_gone(groups, 1.0):
        system.signal_process(proc, signal.SIGKILL, group=True)
    for p in popens:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=2.0)

    for ns in namespaces:
        system.run(["ip", "netns", "del", ns], check=False)
    left = [ns for ns in owned_netns(name, system.list_netns()) if ns in namespaces]

    if keep_logs:
        with contextlib.suppress(FileNotFoundError):
            (directory / "state.json").unlink()
    else:
        shutil.rmtree(directory, ignore_errors=True)
    if left:
        raise TestbedError(f"could not remove namespaces: {', '.join(left)}")
    return bool(data) or bool(namespaces)


# --- module helpers -----------------------------------------------------------------------


_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _interrupt_on_signals() -> contextlib.AbstractContextManager[None]:
    """SIGINT and SIGTERM raise KeyboardInterrupt inside the block (main thread only)."""
    return signals.interrupt_on(_SIGNALS)


def _signals_ignored() -> contextlib.AbstractContextManager[None]:
    """SIGINT and SIGTERM are ignored inside the block, so cleanup runs to its end."""
    return signals.ignored(_SIGNALS)
