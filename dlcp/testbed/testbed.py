"""The emulated cluster: network namespaces, a bridged switch, shaping, loss, traffic.

    with Testbed.up(TestbedSpec(hosts=3, paths=2, rate_bps=10**9)) as tb:
        tb.exec("h0", ["ip", "addr"])
        tb.set_loss("h1", 5.0)

`up` records everything it makes in the state directory (see `dlcp.testbed.state`)
so that `Testbed.attach(name)` and `down(name)` work from other processes.
This module builds, changes and removes the network; the processes run in its
hosts (commands, background traffic, daemons) are `dlcp.testbed.procs`'s.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from dlcp import signals
from dlcp.testbed import kernel, system
from dlcp.testbed.plan import (
    DEFAULT_NAME,
    LOSS_DIRECTIONS,
    PREFIX_LEN,
    TestbedError,
    TestbedSpec,
    bridge_name,
    format_rate,
    host_address,
    host_ifname,
    host_label,
    host_mac,
    host_netns,
    loss_permille,
    loss_script,
    owned_netns,
    parse_host,
    switch_netns,
    switch_port,
)
from dlcp.testbed.procs import DEFAULT_DAEMON_COMMAND, HostProcesses
from dlcp.testbed.state import load_state, locked, save_state, state_dir
from dlcp.testbed.switchagg import SWITCH_ROLE, SwitchAggregator

__all__ = ["DEFAULT_DAEMON_COMMAND", "Host", "Testbed", "down"]

STATE_VERSION = 1
_SOCKET_PATH_MAX = 107  # sun_path holds 108 bytes with the terminating NUL
_BASE_TOOLS = ("ip", "bridge", "nft", "ethtool")

Progress = Callable[[str], None]


@dataclass(frozen=True)
class Host:
    """One emulated host: its namespace, addresses (one per path) and daemon files."""

    index: int
    name: str
    netns: str
    addresses: tuple[str, ...]
    interfaces: tuple[str, ...]
    switch_ports: tuple[str, ...]
    udp_port: int
    socket: Path
    config: Path
    log: Path
    metrics_url: str


class Testbed(HostProcesses, SwitchAggregator):
    """A built (or attached) testbed. Create it with `up` or `attach`."""

    __test__ = False  # not a pytest test class

    def __init__(
        self, spec: TestbedSpec, directory: Path, *, progress: Progress | None = None
    ) -> None:
        self.spec = spec
        self.state_dir = directory
        self.switch_netns = switch_netns(spec.name)
        self.hosts: tuple[Host, ...] = tuple(self._make_host(i) for i in range(spec.hosts))
        self._progress = progress
        self._popens: list[subprocess.Popen[Any]] = []

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
            _tc_modules()  # fail before building anything
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
        return [port for h in self.hosts for port in h.switch_ports]

    def host(self, host: str | int) -> Host:
        """'h1', '1' or 1 -> that host."""
        return self.hosts[parse_host(host, self.spec.hosts)]

    def address(self, host: str | int, path: int = 0) -> str:
        return self.host(host).addresses[self._path(path)]

    # --- build steps (each its own method, so tests can break one) ---------------

    def _build(self) -> None:
        self._update(lambda st: None)  # state exists from the start
        for h in self.hosts:
            (self.state_dir / h.name).mkdir(parents=True, exist_ok=True)
        self._say(f"creating {len(self.namespaces)} namespaces")
        self._create_namespaces()
        self._say(f"wiring {self.spec.hosts} hosts x {self.spec.paths} path(s) to the switch")
        self._create_links()
        if self.spec.switch_aggregator:
            self._say("giving the switch an aggregator's addresses")
            self._wire_switch_aggregator()
        kernel.tune_offloads(
            [(h.netns, h.interfaces) for h in self.hosts], segments=self.spec.segments
        )
        self._apply_loss()
        if self.spec.rate_bps is not None:
            self._say(f"shaping switch ports to {format_rate(self.spec.rate_bps)}")
            self._apply_tc()
        self._update(lambda st: st.update(complete=True))
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
        self._update(lambda st: st["netns"].extend(self.namespaces))
        for ns in self.namespaces:
            system.run(["ip", "netns", "add", ns])
            system.run(["ip", "-n", ns, "link", "set", "lo", "up"])
            kernel.disable_ipv6(ns)
        decoupled = kernel.decouple_senders(self.switch_netns)
        self._update(lambda st: st.update(senders_decoupled=decoupled))
        if not decoupled:
            self._say(
                f"warning: no br_netfilter ({kernel.BRIDGE_NF} missing, modprobe failed): "
                "the switch's queues will hold back their senders' sockets"
            )

    def _create_links(self) -> None:
        sw = self.switch_netns
        commands = []
        for p in range(self.spec.paths):
            commands += [
                f"link add {bridge_name(p)} type bridge stp_state 0 mcast_snooping 0",
                f"link set {bridge_name(p)} up",
            ]
        fdb = []
        for h in self.hosts:
            for p, (port, ifname) in enumerate(zip(h.switch_ports, h.interfaces, strict=True)):
                mac = host_mac(h.index, p)
                commands += [
                    f"link add {port} type veth peer name {ifname} address {mac} netns {h.netns}",
                    f"link set {port} mtu {self.spec.mtu} master {bridge_name(p)} up",
                ]
                fdb.append(f"fdb replace {mac} dev {port} master static")
        system.batch("ip", sw, commands)
        system.batch("bridge", sw, fdb)
        for h in self.hosts:
            commands = []
            for p, (addr, ifname) in enumerate(zip(h.addresses, h.interfaces, strict=True)):
                commands += [
                    f"addr add {addr}/{PREFIX_LEN} dev {ifname}",
                    f"link set {ifname} mtu {self.spec.mtu} up",
                ]
                commands += [
                    f"neigh replace {host_address(other.index, p)} "
                    f"lladdr {host_mac(other.index, p)} dev {ifname} nud permanent"
                    for other in self.hosts
                    if other is not h
                ]
            system.batch("ip", h.netns, commands)

    def _apply_loss(self) -> None:
        n = loss_permille(self.spec.loss_pct)
        ports = self.switch_ports
        permille = {(port, "in"): n for port in ports} if n else {}
        system.run(
            ["nft", "-f", "-"],
            netns=self.switch_netns,
            input=loss_script(ports, permille, create=True),
        )

        def record(st: dict[str, Any]) -> None:
            st["loss_permille"] = {
                f"{port}/{d}": (n if d == "in" else 0) for port in ports for d in LOSS_DIRECTIONS
            }

        self._update(record)

    def _apply_tc(self, *, force: bool = False, **tc_options: Any) -> None:
        tc_plan, tc_apply = _tc_modules()
        rate = tc_options.pop("rate_bps", self.spec.rate_bps)
        tc_options.setdefault("mtu", self.spec.mtu)
        for port in self.switch_ports:
            plan = tc_plan.build_plan(tc_plan.TcConfig(dev=port, rate_bps=rate, **tc_options))
            tc_apply.apply_plan(plan, netns=self.switch_netns, force=force)
        if self.spec.switch_aggregator:
            self._shape_uplinks(tc_plan, tc_apply, rate, **tc_options)

    # --- runtime controls ------------------------------------------------------

    def apply_tc(self, **tc_options: Any) -> None:
        """(Re)apply the dlcp.tc plan on every switch port; `tc_options` go to
        `TcConfig` (e.g. `rate_bps`, `queue_packets`)."""
        self._apply_tc(force=True, **tc_options)

    def tc_stats(self, host: str | int, path: int = 0) -> Any:
        """`dlcp.tc.apply.read_stats` of the switch port toward `host` on `path`."""
        _, tc_apply = _tc_modules()
        port = self.host(host).switch_ports[self._path(path)]
        return tc_apply.read_stats(port, netns=self.switch_netns)

    def set_loss(
        self, host: str | int, pct: float, path: int = 0, *, direction: str = "in"
    ) -> None:
        """Random loss on one switch port: `direction="in"` drops traffic coming
        from `host` (netdev ingress, the default, as `--loss` does); "out" drops
        traffic toward `host` before the port's queue (netdev egress)."""
        port = self.host(host).switch_ports[self._path(path)]
        self._set_loss({(port, direction): loss_permille(pct)})

    def set_loss_all(self, pct: float, *, direction: str = "in") -> None:
        """The same random loss on every switch port."""
        n = loss_permille(pct)
        self._set_loss({(port, direction): n for port in self.switch_ports})

    def _set_loss(self, permille: dict[tuple[str, str], int]) -> None:
        script = loss_script(self.switch_ports, permille, create=False)
        system.run(["nft", "-f", "-"], netns=self.switch_netns, input=script)

        def record(st: dict[str, Any]) -> None:
            for (port, direction), n in permille.items():
                st["loss_permille"][f"{port}/{direction}"] = n

        self._update(record)

    def set_port(self, host: str | int, path: int, up: bool) -> None:
        """Set `host`'s switch port on `path` up or down (`ip link set`): a path
        failure as a host sees it when its link or switch port dies (no
        carrier on its interface; its datagrams and those toward it on that
        path are dropped). Recorded, so that `show` lists the ports down."""
        port = self.host(host).switch_ports[self._path(path)]
        system.run(["ip", "-n", self.switch_netns, "link", "set", port, "up" if up else "down"])

        def record(st: dict[str, Any]) -> None:
            down = set(st.get("ports_down", []))
            if up:
                down.discard(port)
            else:
                down.add(port)
            st["ports_down"] = sorted(down)

        self._update(record)

    def ports_down(self) -> list[str]:
        """The switch ports set down with `set_port` (and not up again)."""
        return list(self._state().get("ports_down", []))

    def loss(self) -> dict[str, dict[str, float]]:
        """Loss percent per switch port and direction, e.g. {"h0p0": {"in": 5.0, "out": 0.0}}."""
        recorded = self._state().get("loss_permille", {})
        return {
            port: {d: recorded.get(f"{port}/{d}", 0) / 10 for d in LOSS_DIRECTIONS}
            for port in self.switch_ports
        }

    # --- show / down --------------------------------------------------------------------

    def show(self) -> dict[str, Any]:
        """What the testbed is: `{"hosts": [...], "switches": [...]}` and more."""
        procs = self.processes()
        daemons = {p["host"]: p for p in procs if p["role"] == "daemon"}
        loss = self.loss()
        state = self._state()
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
                    "aggregator": self._show_aggregator(procs),
                }
            ],
            "background": [p for p in procs if p["role"].startswith("background")],
            "processes": procs,
        }

    def _show_aggregator(self, procs: list[dict[str, Any]]) -> dict[str, Any] | None:
        if self.switch_socket is None:
            return None
        daemon = next((p for p in procs if p["role"] == SWITCH_ROLE), None)
        return {
            "addresses": list(self.switch_addresses),
            "udp_port": self.spec.udp_port,
            "socket": str(self.switch_socket),
            "daemon_pid": None if daemon is None else daemon["pid"],
            "daemon_alive": False if daemon is None else daemon["alive"],
        }

    def down(self, *, keep_logs: bool = False) -> None:
        """Remove everything this testbed made; fine if parts are already gone."""
        down(self.name, state_root=self.state_dir.parent, keep_logs=keep_logs, popens=self._popens)
        self._popens.clear()

    # --- helpers ----------------------------------------------------------------------------

    def _make_host(self, index: int) -> Host:
        spec = self.spec
        addresses = tuple(host_address(index, p) for p in range(spec.paths))
        directory = self.state_dir / host_label(index)
        return Host(
            index=index,
            name=host_label(index),
            netns=host_netns(spec.name, index),
            addresses=addresses,
            interfaces=tuple(host_ifname(p) for p in range(spec.paths)),
            switch_ports=tuple(switch_port(index, p) for p in range(spec.paths)),
            udp_port=spec.udp_port,
            socket=directory / "dlcpd.sock",
            config=directory / "dlcpd.toml",
            log=directory / "dlcpd.log",
            metrics_url=f"http://{addresses[0]}:{spec.metrics_port}/metrics",
        )

    def _path(self, path: int) -> int:
        if not 0 <= path < self.spec.paths:
            raise TestbedError(f"no path {path}: the testbed has paths 0..{self.spec.paths - 1}")
        return path

    def _say(self, message: str) -> None:
        if self._progress is not None:
            self._progress(message)

    def _fresh_state(self) -> dict[str, Any]:
        return {
            "version": STATE_VERSION,
            "name": self.name,
            "spec": self.spec.to_json(),
            "created": time.time(),
            "complete": False,
            "netns": [],
            "loss_permille": {},
            "processes": [],
        }

    def _state(self) -> dict[str, Any]:
        return load_state(self.state_dir) or self._fresh_state()

    def _update(self, change: Callable[[dict[str, Any]], object]) -> None:
        with locked(self.state_dir):
            data = self._state()
            change(data)
            save_state(self.state_dir, data)


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


def _tc_modules() -> tuple[Any, Any]:
    try:
        from dlcp.tc import apply as tc_apply
        from dlcp.tc import plan as tc_plan
    except ImportError as exc:
        raise TestbedError(
            f"link shaping needs dlcp.tc, which cannot be imported ({exc}); use --rate none"
        ) from exc
    return tc_plan, tc_apply


_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _interrupt_on_signals() -> contextlib.AbstractContextManager[None]:
    """SIGINT and SIGTERM raise KeyboardInterrupt inside the block (main thread only)."""
    return signals.interrupt_on(_SIGNALS)


def _signals_ignored() -> contextlib.AbstractContextManager[None]:
    """SIGINT and SIGTERM are ignored inside the block, so cleanup runs to its end."""
    return signals.ignored(_SIGNALS)
