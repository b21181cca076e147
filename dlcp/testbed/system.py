"""Thin wrappers over the system: commands, namespaces, processes."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

from dlcp.testbed.plan import TestbedError

__all__ = [
    "NETNS_DIR",
    "TOOL_PACKAGES",
    "Proc",
    "batch",
    "is_alive",
    "list_netns",
    "log_tail",
    "netns_argv",
    "netns_pids",
    "proc_of",
    "proc_start_time",
    "require_root",
    "require_tools",
    "run",
    "signal_process",
    "terminate",
    "wait_gone",
    "wait_listening",
    "wait_socket",
]

NETNS_DIR = Path("/run/netns")

# Executable -> the Debian package that provides it.
TOOL_PACKAGES: dict[str, str] = {
    "ip": "iproute2",
    "bridge": "iproute2",
    "nft": "nftables",
    "ethtool": "ethtool",
    "iperf3": "iperf3",
}


def require_root() -> None:
    if os.geteuid() != 0:
        raise TestbedError("testbed needs root (network namespaces)")


def require_tools(tools: Iterable[str]) -> None:
    for tool in tools:
        if shutil.which(tool) is None:
            package = TOOL_PACKAGES.get(tool, tool)
            raise TestbedError(f"testbed needs {tool!r}: install the Debian package {package}")


def netns_argv(netns: str | None, argv: Sequence[str]) -> list[str]:
    return [*(("ip", "netns", "exec", netns) if netns else ()), *argv]


def run(
    argv: Sequence[str],
    *,
    netns: str | None = None,
    input: str | None = None,
    check: bool = True,
    timeout: float = 30.0,
) -> subprocess.CompletedProcess[str]:
    """Run a command (in `netns`), capturing output; failures raise a one-line error."""
    full = netns_argv(netns, argv)
    try:
        done = subprocess.run(
            full, input=input, capture_output=True, text=True, timeout=timeout, check=False
        )
    except FileNotFoundError as exc:
        raise TestbedError(
            f"{full[0]!r} not found: install the Debian package "
            f"{TOOL_PACKAGES.get(full[0], full[0])}"
        ) from exc
    except subprocess.TimeoutExpired as exc:
        raise TestbedError(f"timed out after {timeout:g} s: {' '.join(full)}") from exc
    if check and done.returncode != 0:
        lines = (done.stderr or done.stdout).strip().splitlines()
        why = "; ".join(lines[-3:]) if lines else f"exit status {done.returncode}"
        raise TestbedError(f"command failed: {' '.join(full)}: {why}")
    return done


def batch(tool: str, netns: str, commands: Sequence[str]) -> None:
    """Run `ip` or `bridge` commands in `netns` in one process."""
    if commands:
        run([tool, "-n", netns, "-batch", "-"], input="\n".join(commands) + "\n")


def list_netns() -> list[str]:
    try:
        return sorted(os.listdir(NETNS_DIR))
    except FileNotFoundError:
        return []


def netns_pids(netns: str) -> list[int]:
    """Processes inside `netns` (empty if it does not exist)."""
    done = run(["ip", "netns", "pids", netns], check=False)
    if done.returncode != 0:
        return []
    return [int(tok) for tok in done.stdout.split() if tok.isdigit()]


def _stat(pid: int) -> list[str] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # Fields after the parenthesised command name, which may contain spaces.
    return text[text.rindex(")") + 2 :].split()


def proc_start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (guards against pid reuse)."""
    fields = _stat(pid)
    return int(fields[19]) if fields else None


Proc = tuple[int, int | None]  # pid and start time (None: unchecked)


def proc_of(pid: int) -> Proc:
    return (pid, proc_start_time(pid))


def is_alive(proc: Proc) -> bool:
    """True while the process runs; zombies and reused pids count as gone."""
    pid, start = proc
    fields = _stat(pid)
    if fields is None or fields[0] in ("Z", "X"):
        return False
    return start is None or int(fields[19]) == start


def signal_process(proc: Proc, sig: int, *, group: bool = False) -> bool:
    """Send `sig` to the process (or its process group) if it is still the one we mean."""
    pid = proc[0]
    if pid <= 0 or pid == os.getpid() or not is_alive(proc):
        return False
    try:
        if group:
            try:
                os.killpg(pid, sig)
                return True
            except ProcessLookupError:
                pass
        os.kill(pid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def wait_gone(procs: Iterable[Proc], timeout_s: float) -> list[Proc]:
    """Wait until none of `procs` runs; return those still running at the deadline."""
    left = list(procs)
    deadline = time.monotonic() + timeout_s
    while True:
        left = [proc for proc in left if is_alive(proc)]
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.02)


def terminate(procs: Iterable[Proc], *, grace_s: float, group: bool = False) -> None:
    """SIGTERM, wait up to `grace_s`, then SIGKILL what is left."""
    procs = list(dict.fromkeys(procs))
    for proc in procs:
        signal_process(proc, signal.SIGTERM, group=group)
    left = wait_gone(procs, grace_s)
    for proc in left:
        signal_process(proc, signal.SIGKILL, group=group)
    wait_gone(left, 2.0)


def log_tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    tail = text.strip().splitlines()[-lines:]
    return "\n".join(tail) if tail else "(log is empty)"


def _listening(pid: int, address: str, port: int) -> bool:
    """Whether process `pid`'s namespace has a TCP listener on address:port."""
    want = f"{socket.inet_aton(address)[::-1].hex().upper()}:{port:04X}"
    try:
        lines = Path(f"/proc/{pid}/net/tcp").read_text().splitlines()[1:]
    except OSError:
        return False
    return any(f[1] == want and f[3] == "0A" for f in (line.split() for line in lines))


def wait_listening(proc: Proc, address: str, port: int, log: Path) -> None:
    """Until `proc` (an iperf3 server) listens on address:port; its log's end if it died."""
    deadline = time.monotonic() + 10.0
    while not _listening(proc[0], address, port):
        if not is_alive(proc):
            tail = log_tail(log, 3)
            raise TestbedError(f"iperf3 server on {address}:{port} exited: {tail}")
        if time.monotonic() > deadline:
            raise TestbedError(f"iperf3 server on {address}:{port} did not start listening")
        time.sleep(0.01)


def wait_socket(
    proc: Proc, path: Path, what: str, log: Path, deadline: float, timeout_s: float
) -> None:
    """Until `proc` (`what`, e.g. a host's daemon) creates the socket `path`."""
    while not path.exists():
        if not is_alive(proc):
            raise TestbedError(
                f"{what} exited before creating {path}; end of {log}:\n{log_tail(log)}"
            )
        if time.monotonic() > deadline:
            raise TestbedError(
                f"{what} did not create {path} within {timeout_s:g} s; "
                f"end of {log}:\n{log_tail(log)}"
            )
        time.sleep(0.02)
