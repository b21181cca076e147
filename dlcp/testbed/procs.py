"""Processes in the testbed's hosts: commands run or started in a host's
namespace with the testbed's environment, the background traffic (iperf3
flows), and one dlcp daemon per host.

`HostProcesses` is the testbed's set of processes: it records what it
starts in the testbed's state file (`StateRecord`), so that another process
attached to the testbed can stop it, and keeps the `Popen`s it started
itself, so that `down` reaps them.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import dlcp
from dlcp.testbed import system
from dlcp.testbed.config import daemon_config, merge_config, to_toml
from dlcp.testbed.host import Host
from dlcp.testbed.plan import (
    IperfFlow,
    TestbedSpec,
    background_flows,
    check_path,
    host_address,
    iperf_client_argv,
    iperf_server_argv,
    parse_host,
)
from dlcp.testbed.state import StateRecord
from dlcp.testbed.switchagg import SWITCH_ROLE

if TYPE_CHECKING:
    from dlcp.testbed.switchagg import SwitchAggregator

__all__ = ["DEFAULT_DAEMON_COMMAND", "HostProcesses"]

# "{config}", "{socket}" and "{host}" in these arguments are replaced per host.
DEFAULT_DAEMON_COMMAND: tuple[str, ...] = (
    sys.executable,
    "-m",
    "dlcp.daemon",
    "--config",
    "{config}",
)


class HostProcesses:
    """Running, starting and stopping processes in the hosts."""

    def __init__(
        self,
        spec: TestbedSpec,
        hosts: tuple[Host, ...],
        state_dir: Path,
        record: StateRecord,
        switch: SwitchAggregator,
    ) -> None:
        self.spec = spec
        self.hosts = hosts
        self.state_dir = state_dir
        self._record = record
        self._switch = switch  # its socket is in the hosts' environment; its daemon ours
        self.popens: list[subprocess.Popen[Any]] = []  # started here: `down` reaps them

    def host(self, host: str | int) -> Host:
        return self.hosts[parse_host(host, self.spec.hosts)]

    # --- processes in hosts -------------------------------------------------------

    def env(self, host: str | int, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """The environment of commands in `host`: ours plus DLCP_SOCKET (and
        DLCP_SWITCH_SOCKET where the testbed has a switch aggregator)."""
        env = dict(os.environ)
        env["DLCP_SOCKET"] = str(self.host(host).socket)
        if self._switch.socket is not None:
            env["DLCP_SWITCH_SOCKET"] = str(self._switch.socket)
        env.update(extra or {})
        return env

    def exec(
        self,
        host: str | int,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        check: bool = False,
        capture: bool = False,
        input: str | None = None,
        timeout: float | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run `argv` in `host`'s namespace (DLCP_SOCKET set) and wait for it."""
        h = self.host(host)
        return subprocess.run(
            system.netns_argv(h.netns, argv),
            env=self.env(h.index, env),
            check=check,
            capture_output=capture,
            text=True,
            input=input,
            timeout=timeout,
        )

    def popen(
        self,
        host: str | int,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        **kwargs: Any,
    ) -> subprocess.Popen[Any]:
        """Start `argv` in `host`'s namespace; `down` stops it if it still runs."""
        h = self.host(host)
        proc = subprocess.Popen(
            system.netns_argv(h.netns, argv), env=self.env(h.index, env), **kwargs
        )
        self.popens.append(proc)
        return proc

    def spawn(
        self,
        role: str,
        host: int,
        argv: Sequence[str],
        log: Path,
        env: Mapping[str, str] | None = None,
        netns: str | None = None,
    ) -> system.Proc:
        """Start a detached process (own session, output to `log`) and record it;
        in host `host`'s namespace, or in `netns` (e.g. the switch's)."""
        log.parent.mkdir(parents=True, exist_ok=True)
        environ = self.env(host, env) if netns is None else {**os.environ, **(env or {})}
        with open(log, "ab") as out:
            proc = subprocess.Popen(
                system.netns_argv(netns or self.hosts[host].netns, argv),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=environ,
            )
        self.popens.append(proc)
        start = system.proc_start_time(proc.pid)
        record = {
            "role": role,
            "host": host,
            "pid": proc.pid,
            "start": start,
            "argv": list(argv),
            "log": str(log),
        }
        self._record.update(lambda st: st["processes"].append(record))
        return (proc.pid, start)

    def processes(self, role: str | None = None) -> list[dict[str, Any]]:
        """Recorded processes (optionally of one role), each with "alive"."""
        procs = [p for p in self._record.read().get("processes", []) if role in (None, p["role"])]
        return [{**p, "alive": system.is_alive((p["pid"], p["start"]))} for p in procs]

    def _stop(self, roles: Sequence[str], *, grace_s: float) -> None:
        recorded = [p for p in self._record.read().get("processes", []) if p["role"] in roles]
        system.terminate([(p["pid"], p["start"]) for p in recorded], grace_s=grace_s, group=True)
        self._reap()
        pids = {p["pid"] for p in recorded}
        self._record.update(
            lambda st: st.update(processes=[p for p in st["processes"] if p["pid"] not in pids])
        )

    def _reap(self) -> None:
        for proc in list(self.popens):
            if proc.poll() is not None:
                self.popens.remove(proc)

    # --- background traffic -------------------------------------------------------

    def start_background(
        self,
        kind: str = "both",
        *,
        duration_s: float | None = None,
        udp_rate_bps: int | None = None,
        paths: Sequence[int] | None = None,
        parallel: int = 1,
        pattern: str = "all",
    ) -> list[IperfFlow]:
        """Unmarked (DSCP 0) iperf3 traffic from every host to every other host
        (`pattern="all"`, or only to the next, "ring") on `paths` (default: all),
        so every switch egress port is congested.

        TCP flows use `parallel` streams each; UDP offers `udp_rate_bps` in total
        to each destination port (default 60 % of the link). Runs `duration_s`
        seconds, or until `stop_background`/`down`. Replaces running background.
        Returns the flows; logs are in `<state_dir>/background/`.
        """
        system.require_tools(["iperf3"])
        self.stop_background()
        chosen = (
            list(range(self.spec.paths))
            if paths is None
            else [check_path(p, self.spec.paths) for p in paths]
        )
        flows = background_flows(
            self.spec.hosts,
            chosen,
            kind,
            link_bps=self.spec.rate_bps,
            udp_rate_bps=udp_rate_bps,
            pattern=pattern,
        )
        logs = self.state_dir / "background"
        try:
            servers = [
                (
                    flow,
                    self.spawn(
                        "background-server",
                        flow.dst,
                        iperf_server_argv(flow),
                        logs / f"{flow.label}.server.log",
                    ),
                )
                for flow in flows
            ]
            for flow, proc in servers:
                system.wait_listening(
                    proc,
                    host_address(flow.dst, flow.path),
                    flow.port,
                    logs / f"{flow.label}.server.log",
                )
            for flow in flows:
                argv = iperf_client_argv(flow, duration_s=duration_s, parallel=parallel)
                self.spawn("background-client", flow.src, argv, logs / f"{flow.label}.log")
        except BaseException:
            self.stop_background()
            raise
        return flows

    def stop_background(self) -> None:
        self._stop(("background-client", "background-server"), grace_s=2.0)

    # --- daemons ----------------------------------------------------------------------

    def start_daemons(
        self,
        extra_config: Mapping[str, Any] | None = None,
        *,
        host_config: Mapping[int, Mapping[str, Any]] | None = None,
        command: Sequence[str] = DEFAULT_DAEMON_COMMAND,
        env: Mapping[str, str] | None = None,
        timeout_s: float = 30.0,
    ) -> None:
        """Write each host's daemon config, start one daemon per host and wait
        until every daemon has created its socket.

        `extra_config` is merged into every config, `host_config[i]` into host
        i's. In `command`, "{config}", "{socket}" and "{host}" are replaced per
        host. Replaces running daemons; on failure stops them and raises an
        error with the tail of the failing daemon's log.
        """
        self.stop_daemons()
        env = {"PYTHONPATH": _pythonpath(), **(env or {})}
        started: list[tuple[Host, system.Proc]] = []
        try:
            for h in self.hosts:
                extra = merge_config(extra_config or {}, (host_config or {}).get(h.index, {}))
                settings = daemon_config(self.spec, h.index, h.socket, extra)
                files = (h.config, h.socket, h.log)
                proc = self.launch_daemon("daemon", h.index, files, settings, command, env)
                started.append((h, proc))
            deadline = time.monotonic() + timeout_s
            if self.spec.switch_aggregator:
                self._switch.start_daemon(
                    self, extra_config or {}, command, env, deadline, timeout_s
                )
            for h, proc in started:
                system.wait_socket(
                    proc, h.socket, f"daemon of {h.name}", h.log, deadline, timeout_s
                )
        except BaseException:
            self.stop_daemons()
            raise

    def launch_daemon(
        self,
        role: str,
        host: int,
        files: tuple[Path, Path, Path],
        settings: Mapping[str, Any],
        command: Sequence[str],
        env: Mapping[str, str],
        *,
        label: str | None = None,
        netns: str | None = None,
    ) -> system.Proc:
        """Write `settings` to the daemon's config file, remove its old socket
        and log (`files`: config, socket, log) and start `command` with
        "{config}", "{socket}" and "{host}" (`label`, default the host's
        index) replaced, in host `host`'s namespace or `netns`."""
        config, socket, log = files
        config.parent.mkdir(parents=True, exist_ok=True)
        config.write_text(to_toml(settings))
        for path in (socket, log):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        name = str(host) if label is None else label
        argv = [
            a.replace("{config}", str(config))
            .replace("{socket}", str(socket))
            .replace("{host}", name)
            for a in command
        ]
        return self.spawn(role, host, argv, log, env, netns=netns)

    def stop_daemons(self, *, timeout_s: float = 10.0) -> None:
        """SIGTERM the daemons (they drain), SIGKILL after `timeout_s`."""
        self._stop(("daemon", SWITCH_ROLE), grace_s=timeout_s)
        for socket in (*(h.socket for h in self.hosts), self._switch.socket):
            if socket is not None:
                with contextlib.suppress(FileNotFoundError):
                    socket.unlink()


def _pythonpath() -> str:
    """PYTHONPATH that finds this dlcp even when it is not installed."""
    root = str(Path(dlcp.__file__).resolve().parent.parent)
    existing = os.environ.get("PYTHONPATH")
    return f"{root}{os.pathsep}{existing}" if existing else root
