"""Worker processes in the hosts' namespaces, driven by JSON lines.

A worker writes one JSON object per line to stdout ({"event": ...}); the
orchestrator writes "go" lines to its stdin to release barriers. stderr goes to
a log file whose tail is shown when a worker fails.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Any

import dlcp
from dlcp.bench.common import BenchError
from dlcp.testbed import Testbed

__all__ = ["WorkerGroup", "WorkerTimeout", "worker_argv", "worker_env"]


class WorkerTimeout(BenchError):
    """A worker did not send the awaited event in time (it may still be running)."""


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
    ) -> None:
        self.label = label
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

    def next_event(self, w: _Worker, timeout_s: float) -> dict[str, Any]:
        try:
            msg = w.events.get(timeout=timeout_s)
        except queue.Empty:
            raise self._fail(w, f"sent nothing for {timeout_s:g} s") from None
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
                if msg is None:
                    w.events.put(None)
                    raise self._fail(w, "closed its output")
                if msg.get("event") == "error":
                    raise BenchError(f"{self.label} rank {w.rank}: {msg.get('error', 'failed')}")
                if msg.get("event") == event:
                    results[w.rank] = msg
                else:
                    on_other(w.rank, msg)
            if time.monotonic() > deadline:
                late = next(w for w in self.workers if w.rank not in results)
                raise WorkerTimeout(str(self._fail(late, f"did not finish within {timeout_s:g} s")))
            if idle:
                time.sleep(0.02)
        return [results[w.rank] for w in self.workers]

    def send(self, line: str = "go") -> None:
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
