"""sd_notify(3) without libsystemd: READY=1, STOPPING=1, WATCHDOG=1, STATUS=..."""

from __future__ import annotations

import os
import socket

__all__ = ["notify", "watchdog_interval"]


def notify(*states: str) -> bool:
    """Send `states` to $NOTIFY_SOCKET; False when not run by systemd (or it failed)."""
    path = os.environ.get("NOTIFY_SOCKET")
    if not path:
        return False
    addr = "\0" + path[1:] if path.startswith("@") else path
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.connect(addr)
            s.sendall("\n".join(states).encode())
        return True
    except OSError:
        return False


def watchdog_interval() -> float | None:
    """Seconds between WATCHDOG=1 pings (half of $WATCHDOG_USEC), None without a watchdog."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or (pid and pid != str(os.getpid())):
        return None
    try:
        return max(0.01, int(usec) / 2e6)
    except ValueError:
        return None
