"""Where a testbed records what it made, so later processes can show, use and remove it.

State lives in `<root>/<name>/state.json`; root is $DLCP_TESTBED_DIR, or
/run/dlcp-testbed. The same directory holds per-host daemon configs, sockets
and logs, and the background traffic logs.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from dlcp.testbed.plan import TestbedError, TestbedSpec

__all__ = [
    "DEFAULT_ROOT",
    "STATE_ENV",
    "StateRecord",
    "load_state",
    "locked",
    "save_state",
    "state_dir",
]

STATE_VERSION = 1

STATE_ENV = "DLCP_TESTBED_DIR"
DEFAULT_ROOT = Path("/run/dlcp-testbed")
STATE_FILE = "state.json"
LOCK_FILE = ".lock"


def state_dir(name: str, root: Path | str | None = None) -> Path:
    """`<root>/<name>`; root defaults to $DLCP_TESTBED_DIR, else /run/dlcp-testbed."""
    base = Path(root) if root is not None else Path(os.environ.get(STATE_ENV) or DEFAULT_ROOT)
    return base.absolute() / name


def load_state(directory: Path) -> dict[str, Any] | None:
    try:
        text = (directory / STATE_FILE).read_text()
    except FileNotFoundError:
        return None
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise TestbedError(f"corrupt testbed state {directory / STATE_FILE}: {exc}") from exc
    if not isinstance(data, dict):
        raise TestbedError(f"corrupt testbed state {directory / STATE_FILE}: not an object")
    return data


def save_state(directory: Path, data: dict[str, Any]) -> None:
    """Write state.json atomically (a reader never sees half a file)."""
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / f".{STATE_FILE}.{os.getpid()}"
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, directory / STATE_FILE)


@contextlib.contextmanager
def locked(directory: Path) -> Iterator[None]:
    """Serialise read-modify-write of the state among processes."""
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / LOCK_FILE, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


class StateRecord:
    """The state file of one testbed: what its parts made, read and changed
    under the directory's lock (other processes attached to the testbed
    read and change it too)."""

    def __init__(self, directory: Path, spec: TestbedSpec) -> None:
        self.directory = directory
        self.spec = spec

    def fresh(self) -> dict[str, Any]:
        return {
            "version": STATE_VERSION,
            "name": self.spec.name,
            "spec": self.spec.to_json(),
            "created": time.time(),
            "complete": False,
            "netns": [],
            "loss_permille": {},
            "processes": [],
        }

    def read(self) -> dict[str, Any]:
        return load_state(self.directory) or self.fresh()

    def update(self, change: Callable[[dict[str, Any]], object]) -> None:
        """Apply `change` to the recorded state, atomically among processes."""
        with locked(self.directory):
            data = self.read()
            change(data)
            save_state(self.directory, data)
