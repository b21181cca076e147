"""Worker processes in the hosts' namespaces, driven by JSON lines.

A worker writes one JSON object per line to stdout ({"event": ...}); the
orchestrator writes "go" lines to its stdin to release barriers. stderr goes to
a log file whose tail is shown when a worker fails.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO, Any

import dlcp
from dlcp.bench.common import BenchError
from dlcp.testbed import Testbed

__all__ = [
    "STALL_S",
    "RunBound",
    "RunStopped",
    "WorkerGroup",
    "WorkerTimeout",
    "worker_argv",
    "worker_env",
]

# a backend whose workers report nothing (a join, a finished round or step)
# for this long is stopped: two round timeouts of the benches' default
STALL_S = 120.0


class WorkerTimeout(BenchError):
    """A worker did not send the awaited event in time (it may still be running)."""


class RunStopped(BenchError):
    """A backend's run went past its `RunBound`: `why` is "stall" or "budget"."""

    def __init__(self, message: str, why: str) -> None:
        super().__init__(message)
        self.why = why


@dataclass(frozen=True)
class RunBound:
    """How long a backend's workers may go on: stopped when, once released
    (the orchestrator's first go, after their joins: starting Python and
    torch is not a round), none of them reported anything (a warm-up's end, a
    finished round or step) for `stall_s`, or once `budget_s` (None: no
    budget) passed since they started. Every wait of a `WorkerGroup` holds to
    it, whatever its own timeout."""

    stall_s: float = STALL_S
    budget_s: float | None = None

    def __post_init__(self) -> None:
        for name, v in (("stall", self.stall_s), ("budget", self.budget_s)):
            if v is not None and not (math.isfinite(v) and v > 0):
                raise BenchError(f"--{name} must be > 0 seconds, not {v}")


def worker_argv(module: str, args: Sequence[str]) -> list[str]:
    return [sys.executable, "-u", "-m", module, *args]


def worker_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment additions for workers: PYTHONPATH that finds this dlcp even
    when it is not installed, one compute thread, then `extra`."""
    root = str(Path(dlcp.__file__).resolve().parent.parent)
    existing = os.environ.get("PYTHONPATH")
    return {
        "PYTHONPATH": f"{root}{os.pathsep}{existing}" if existing else root,
        "OMP_NUM_THREADS": "1",
        **(extra or {}),
    }


class _Worker:
    def __init__(self, rank: int, proc: subprocess.Popen[str], log: Path) -> None:
        self.rank = rank
        self.proc = proc
        self.log = log
        self.events: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            line = line.strip()
            if not line.startswith("{"):
                continue
            try:
                msg = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(msg, dict):
                self.events.put(msg)
        self.events.put(None)  # end of output

    def tail(self, lines: int = 6) -> str:
        try:
            text = self.log.read_text(errors="replace").strip().splitlines()
        except OSError:
            return ""
        keep = [t for t in text if t.strip()][-lines:]
        return " | ".join(keep)


class WorkerGroup:
    """One worker per host, started with `Testbed.popen` (a context manager that
    kills what is left on exit)."""

    def __init__(
        self,
        tb: Testbed,
        argvs: Sequence[Sequence[str]],
        *,
        log_dir: Path,
        label: str,
        env: dict[str, str] | None = None,
        bound: RunBound | None = None,
    ) -> None:
        self.label = label
        self.bound = bound or RunBound()
        self.started = time.monotonic()
        self.heard: float | None = None  # since the first go: the last event from any worker
        self.workers: list[_Worker] = []
        try:
            for rank, argv in enumerate(argvs):
                log = log_dir / f"{label}-rank{rank}.log"
                err: IO[Any]
                with open(log, "w") as err:
                    proc = tb.popen(
                        rank,
                        list(argv),
                        env=env,
                        stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE,
                        stderr=err,
                        text=True,
                        bufsize=1,
                    )
                self.workers.append(_Worker(rank, proc, log))
        except BaseException:
            self.kill()
            raise

    def __enter__(self) -> WorkerGroup:
        return self

    def pids(self) -> list[int]:
        """The workers' process ids (each is its rank's program: `ip netns exec` execs it)."""
        return [w.proc.pid for w in self.workers]

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.kill()

    def _fail(self, w: _Worker, what: str) -> BenchError:
        code = w.proc.poll()
        why = f"exited with status {code}" if code is not None else what
        tail = w.tail()
        return BenchError(
            f"{self.label} rank {w.rank} {why}" + (f": {tail}" if tail else f" (log {w.log})")
        )

    def _bounded(self, timeout_s: float) -> tuple[float, str | None]:
        """A wait of `timeout_s` cut to the run's bound: how long it may last,
        and which bound cut it ("stall", "budget"; None: its own timeout)."""
        now = time.monotonic()
        waits: list[tuple[float, str | None]] = [(timeout_s, None)]
        if self.heard is not None:
            waits.append((self.heard + self.bound.stall_s - now, "stall"))
        if self.bound.budget_s is not None:
            waits.append((self.started + self.bound.budget_s - now, "budget"))
        wait, why = min(waits, key=lambda x: x[0])
        return max(0.0, wait), why

    def _stopped(self, w: _Worker, why: str) -> RunStopped:
        """The run stopped by its bound (the caller's `with` kills the workers)."""
        b = self.bound
        if why == "stall":
            what = f"no round finished within {b.stall_s:g} s (--stall)"
        else:
            what = f"still running after its budget of {b.budget_s:g} s (--budget)"
        tail = w.tail()
        return RunStopped(
            f"{self.label} stopped: {what}; waiting for rank {w.rank}"
            + (f": {tail}" if tail else ""),
            why,
        )

    def next_event(self, w: _Worker, timeout_s: float) -> dict[str, Any]:
        wait, why = self._bounded(timeout_s)
        try:
            msg = w.events.get(timeout=wait)
        except queue.Empty:
            if why is not None:
                raise self._stopped(w, why) from None
            raise self._fail(w, f"sent nothing for {timeout_s:g} s") from None
        self._heard()
        if msg is None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                w.proc.wait(timeout=5)
            raise self._fail(w, "closed its output")
        if msg.get("event") == "error":
            raise BenchError(f"{self.label} rank {w.rank}: {msg.get('error', 'failed')}")
        return msg

    def expect(
        self,
        event: str,
        timeout_s: float,
        *,
        on_other: Callable[[int, dict[str, Any]], None] | None = None,
    ) -> list[dict[str, Any]]:
        """Wait for `event` from every worker (within `timeout_s` overall);
        other events go to `on_other(rank, msg)`."""
        deadline = time.monotonic() + timeout_s
        out = []
        for w in self.workers:
            while True:
                left = max(0.1, deadline - time.monotonic())
                msg = self.next_event(w, left)
                if msg.get("event") == event:
                    out.append(msg)
                    break
                if on_other is not None:
                    on_other(w.rank, msg)
        return out

    def expect_any(
        self,
        event: str,
        timeout_s: float,
        on_other: Callable[[int, dict[str, Any]], None],
    ) -> list[dict[str, Any]]:
        """Like `expect`, but serves every worker's other events as they come
        (progress from any rank is seen while waiting for another)."""
        deadline = time.monotonic() + timeout_s
        results: dict[int, dict[str, Any]] = {}
        while len(results) < len(self.workers):
            idle = True
            for w in self.workers:
                if w.rank in results:
                    continue
                try:
                    msg = w.events.get_nowait()
                except queue.Empty:
                    continue
                idle = False
                self._heard()
                if msg is None:
                    w.events.put(None)
                    raise self._fail(w, "closed its output")
                if msg.get("event") == "error":
                    raise BenchError(f"{self.label} rank {w.rank}: {msg.get('error', 'failed')}")
                if msg.get("event") == event:
                    results[w.rank] = msg
                else:
                    on_other(w.rank, msg)
            left, why = self._bounded(deadline - time.monotonic())
            if left <= 0:
                late = next(w for w in self.workers if w.rank not in results)
                if why is not None:
                    raise self._stopped(late, why)
                raise WorkerTimeout(str(self._fail(late, f"did not finish within {timeout_s:g} s")))
            if idle:
                time.sleep(0.02)
        return [results[w.rank] for w in self.workers]

    def _heard(self) -> None:
        if self.heard is not None:
            self.heard = time.monotonic()

    def send(self, line: str = "go") -> None:
        if self.heard is None:  # released: the stall bound holds from here
            self.heard = time.monotonic()
        for w in self.workers:
            try:
                assert w.proc.stdin is not None
                w.proc.stdin.write(line + "\n")
                w.proc.stdin.flush()
            except (BrokenPipeError, OSError):
                raise self._fail(w, "went away") from None

    def wait(self, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        for w in self.workers:
            with contextlib.suppress(OSError):
                if w.proc.stdin is not None:
                    w.proc.stdin.close()
            try:
                w.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                w.proc.kill()

    def kill(self) -> None:
        for w in self.workers:
            if w.proc.poll() is None:
                w.proc.terminate()
        for w in self.workers:
            try:
                w.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                w.proc.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    w.proc.wait(timeout=5)
            for stream in (w.proc.stdin, w.proc.stdout):
                with contextlib.suppress(OSError, ValueError):
                    if stream is not None:
                        stream.close()
