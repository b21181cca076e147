"""Was a benchmark run CPU-bound? The machine's idle time and the run queue.

A benchmark measures the network only while the cores have time to spare. Two
readings, each taken before and after a backend's timed iterations, decide it:

- the machine's idle share (`/proc/stat`: idle and iowait over all CPU time,
  every core): the kernel's forwarding through the emulated switch and the
  softirq threads count as busy, wherever they run;
- the time each of the backend's processes (ranks, daemons and their
  children) spent runnable but waiting for a CPU, summed over its threads
  (`/proc/PID/task/TID/schedstat`), as a share of the run's wall time.

A run is CPU-bound when the machine was less than `IDLE_BOUND` idle, or
when one of the backend's processes waited for a CPU more than `WAIT_BOUND`
of the wall time. A busy machine alone says it even where nobody waits: a
rank and its daemon that take turns on a core wait for each other, not for
a CPU, and background traffic that fills the cores is part of the question
(that is what the congested scenario at 1 Gbit/s measured). Waiting alone
needs a high bar on these machines: a virtual CPU woken from halt makes a
thread wait even on an idle machine (Gloo at 200 Mbit/s, machine half idle:
a rank's threads wait 23 % of the wall time, against 79 % at 1 Gbit/s).

`machine_cpu_s` is the machine's busy CPU seconds over the run: a
backend's whole cost including the kernel work charged to no process of its
own (Gloo's TCP receive in ksoftirqd, say), which the processes' own CPU
seconds (`cpu_s`) leave out; background traffic counts in it too.

`snapshot` reads; `load` is pure arithmetic on two snapshots.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "IDLE_BOUND",
    "WAIT_BOUND",
    "CpuSnapshot",
    "baseline_notes",
    "bound",
    "children",
    "load",
    "machine_s",
    "mark",
    "processes_cpu_s",
    "snapshot",
    "window_bound",
]


def processes_cpu_s(pids: Iterable[int], *, proc: Path = Path("/proc")) -> float:
    """CPU seconds of these processes so far: their threads' time on a CPU, in
    nanoseconds (`_tasks`, the schedstat that `snapshot` reads too; /proc/PID/stat's
    clock ticks are 10 ms, and a daemon's few milliseconds over a short run read
    as 0 or 10 ms). A process that is gone counts 0."""
    return sum(run for run, _ in _tasks(pids, proc).values())


IDLE_BOUND = 0.10  # the machine idle below this share of all CPU time: CPU-bound
WAIT_BOUND = 0.5  # a process waiting for a CPU above this share of the wall time: CPU-bound


def bound(idle_frac: float, wait_frac: float) -> bool:
    """CPU-bound, from the machine's idle share and the most waiting process's wait share."""
    return idle_frac < IDLE_BOUND or wait_frac > WAIT_BOUND


@dataclass(frozen=True)
class CpuSnapshot:
    """CPU counters at one moment: the machine's, in seconds since boot
    (all cores summed), and per task (thread id) its run and wait seconds."""

    busy_s: float
    idle_s: float
    tasks: dict[tuple[int, int], tuple[float, float]] = field(default_factory=dict)
    at: float = 0.0  # time.monotonic() of the reading


def _machine(proc: Path) -> tuple[float, float]:
    """(busy, idle) CPU seconds of every core since boot, from `/proc/stat`."""
    with open(proc / "stat") as f:
        first = f.readline().split()
    if not first or first[0] != "cpu":
        raise ValueError("no aggregate cpu line in /proc/stat")
    ticks = [int(v) for v in first[1:]]
    # user nice system idle iowait irq softirq steal guest guest_nice; guest
    # time is already inside user and nice, so it is not counted twice.
    total = sum(ticks[:8])
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)
    hz = os.sysconf("SC_CLK_TCK")
    return (total - idle) / hz, idle / hz


def machine_s(*, proc: Path = Path("/proc")) -> tuple[float, float]:
    """The machine's (busy, idle) CPU seconds since boot, every core summed:
    two readings around a span of time give its idle share (`window_bound`)."""
    return _machine(proc)


def window_bound(busy_s: float, idle_s: float) -> dict[str, Any]:
    """The machine-load keys of the spans of one backend summed (busy and
    idle CPU seconds within them): `step_machine_cpu_s`, `step_idle_frac`."""
    total = busy_s + idle_s
    return {
        "step_machine_cpu_s": busy_s,
        "step_idle_frac": idle_s / total if total > 0 else 1.0,
    }


def children(pids: Iterable[int], *, proc: Path = Path("/proc")) -> list[int]:
    """`pids` and every live descendant of them."""
    parent: dict[int, int] = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        parent[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found = [p for p in pids]
    seen = set(found)
    i = 0
    while i < len(found):
        for pid, ppid in parent.items():
            if ppid == found[i] and pid not in seen:
                seen.add(pid)
                found.append(pid)
        i += 1
    return found


def _tasks(pids: Iterable[int], proc: Path) -> dict[tuple[int, int], tuple[float, float]]:
    """Run and wait seconds of every thread of `pids`, by (pid, tid); gone ones are skipped."""
    out: dict[tuple[int, int], tuple[float, float]] = {}
    for pid in pids:
        try:
            tids = list((proc / str(pid) / "task").iterdir())
        except OSError:
            continue
        for task in tids:
            try:
                run_ns, wait_ns, _ = (task / "schedstat").read_text().split()
            except (OSError, ValueError):
                continue
            out[(pid, int(task.name))] = (int(run_ns) / 1e9, int(wait_ns) / 1e9)
    return out


def snapshot(pids: Iterable[int] = (), *, proc: Path = Path("/proc")) -> CpuSnapshot:
    """The machine's counters and those of every thread of `pids` and their children."""
    busy, idle = _machine(proc)
    return CpuSnapshot(busy, idle, _tasks(children(pids, proc=proc), proc), time.monotonic())


def load(before: CpuSnapshot, after: CpuSnapshot) -> dict[str, Any]:
    """What happened between two snapshots, as bench record keys:
    `machine_cpu_s`, `idle_frac`, `runq_wait_frac` (the most any one process
    waited for a CPU, summed over its threads, as a share of the wall time
    between the snapshots) and `cpu_bound`.

    A task seen only in `after` counts from zero (it started in between); one
    seen only in `before` is left out (it ended, taking its counters along).
    """
    busy = max(0.0, after.busy_s - before.busy_s)
    idle = max(0.0, after.idle_s - before.idle_s)
    wall = max(after.at - before.at, 1e-9)
    waits: dict[int, float] = {}
    for key, (_, w1) in after.tasks.items():
        _, w0 = before.tasks.get(key, (0.0, 0.0))
        waits[key[0]] = waits.get(key[0], 0.0) + max(0.0, w1 - w0)
    idle_frac = idle / (busy + idle) if busy + idle > 0 else 1.0
    wait_frac = max(waits.values(), default=0.0) / wall
    return {
        "machine_cpu_s": busy,
        "idle_frac": idle_frac,
        "runq_wait_frac": wait_frac,
        "cpu_bound": bound(idle_frac, wait_frac),
    }


def mark(rec: dict[str, Any]) -> str:
    """A record's mark for tables: "cpu" (CPU-bound), "net", or "-" (not measured)."""
    bound = rec.get("cpu_bound")
    return "-" if bound is None else ("cpu" if bound else "net")


def baseline_notes(records: Iterable[dict[str, Any]], label: Any) -> list[str]:
    """One line per scenario whose Gloo baseline was CPU-bound: such a
    scenario's ratios compare CPUs, not networks. `label(rec)` names it."""
    notes = []
    for r in records:
        if r.get("backend") == "gloo" and r.get("cpu_bound"):
            idle = 100 * float(r.get("idle_frac") or 0.0)
            wait = 100 * float(r.get("runq_wait_frac") or 0.0)
            notes.append(
                f"{label(r)}: Gloo's run was CPU-bound (machine {idle:.0f} % idle, "
                f"a process's threads waited for a CPU {wait:.0f} % of the run, summed): "
                "not a network result"
            )
    return notes
