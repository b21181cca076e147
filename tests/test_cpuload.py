"""dlcp.bench.cpuload: readings from a fake /proc, and the CPU-bound rule."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dlcp.bench import cpuload
from dlcp.bench.cpuload import CpuSnapshot


def _proc(
    root: Path, cpu: list[int], tasks: dict[int, tuple[int, dict[int, tuple[int, int]]]]
) -> Path:
    """A fake /proc: the aggregate cpu line, and pid -> (ppid, {tid: (run_ns, wait_ns)})."""
    root.mkdir(exist_ok=True)
    (root / "stat").write_text("cpu  " + " ".join(map(str, cpu)) + "\ncpu0 1 2 3\n")
    for pid, (ppid, threads) in tasks.items():
        d = root / str(pid)
        (d / "task").mkdir(parents=True, exist_ok=True)
        (d / "stat").write_text(f"{pid} (python3 (x)) S {ppid} 1 1 0\n")
        for tid, (run, wait) in threads.items():
            (d / "task" / str(tid)).mkdir(exist_ok=True)
            (d / "task" / str(tid) / "schedstat").write_text(f"{run} {wait} 7\n")
    (root / "self").mkdir(exist_ok=True)  # not a pid: skipped
    return root


def test_snapshot_reads_the_machine_and_every_thread_of_a_process_tree(tmp_path: Path) -> None:
    hz = os.sysconf("SC_CLK_TCK")
    # user nice system idle iowait irq softirq steal guest guest_nice
    cpu = [10 * hz, 0, 5 * hz, 80 * hz, 5 * hz, 0, 2 * hz, 1 * hz, 3 * hz, 0]
    proc = _proc(
        tmp_path / "proc",
        cpu,
        {
            100: (1, {100: (2_000_000_000, 500_000_000), 101: (1_000_000_000, 0)}),
            200: (100, {200: (3_000_000_000, 1_000_000_000)}),  # a child of 100
            300: (200, {300: (1, 1)}),  # a grandchild
            400: (1, {400: (9, 9)}),  # not ours
        },
    )
    assert sorted(cpuload.children([100], proc=proc)) == [100, 200, 300]
    snap = cpuload.snapshot([100], proc=proc)
    assert snap.busy_s == pytest.approx(18.0)  # guest time is inside user: not counted twice
    assert snap.idle_s == pytest.approx(85.0)
    assert snap.tasks[(100, 101)] == (1.0, 0.0)
    assert snap.tasks[(200, 200)] == (3.0, 1.0)
    assert set(snap.tasks) == {(100, 100), (100, 101), (200, 200), (300, 300)}
    assert cpuload.snapshot([12345], proc=proc).tasks == {}  # gone: nothing, no error


def test_load_takes_the_most_waiting_process_over_the_wall_time() -> None:
    before = CpuSnapshot(
        10.0, 50.0, {(1, 1): (1.0, 0.5), (1, 2): (0.0, 0.0), (9, 9): (5.0, 5.0)}, 100.0
    )
    after = CpuSnapshot(
        28.0,
        52.0,
        {(1, 1): (3.0, 1.0), (1, 2): (1.0, 0.5), (2, 2): (0.5, 0.2), (9, 9): (6.0, 5.1)},
        110.0,
    )
    got = cpuload.load(before, after)
    assert got["machine_cpu_s"] == pytest.approx(18.0)
    assert got["idle_frac"] == pytest.approx(0.1)
    # process 1 waited 0.5 + 0.5 s of 10 s; process 2 (new) 0.2; process 9 0.1
    assert got["runq_wait_frac"] == pytest.approx(0.1)
    assert got["cpu_bound"] is False  # 10 % idle, and nobody waited long


@pytest.mark.parametrize(
    ("idle", "wait", "bound"),
    [  # readings of 10 MB and 100 MB runs on a 2-core VM
        (0.51, 0.23, False),  # Gloo at 200 Mbit/s: a woken vCPU makes threads wait
        (0.18, 0.25, False),  # dlcp at 200 Mbit/s
        (0.35, 0.31, False),  # gloo-prio under congestion at 200 Mbit/s
        (0.12, 0.79, True),  # Gloo at 1 Gbit/s
        (0.08, 0.32, True),  # dlcp at 1 Gbit/s
        (0.01, 0.05, True),  # unshaped: ranks and daemons take turns, nobody waits
    ],
)
def test_the_cpu_bound_rule(idle: float, wait: float, bound: bool) -> None:
    assert cpuload.bound(idle, wait) is bound


def test_marks_and_baseline_notes() -> None:
    recs = [
        {"backend": "dlcp", "scenario": "clean", "cpu_bound": True},
        {"backend": "gloo", "scenario": "clean", "cpu_bound": False},
        {
            "backend": "gloo",
            "scenario": "loss",
            "cpu_bound": True,
            "idle_frac": 0.04,
            "runq_wait_frac": 0.61,
        },
        {"backend": "gloo-prio", "scenario": "loss", "cpu_bound": True},
    ]
    assert [cpuload.mark(r) for r in recs] == ["cpu", "net", "cpu", "cpu"]
    assert cpuload.mark({"backend": "gloo"}) == "-"
    (note,) = cpuload.baseline_notes(recs, lambda r: r["scenario"])
    assert note == (
        "loss: Gloo's run was CPU-bound (machine 4 % idle, a process's threads waited for a CPU "
        "61 % of the run, summed): not a network result"
    )


def test_this_machine_can_be_read() -> None:
    if not Path("/proc/stat").exists():
        pytest.skip("no /proc on this system")
    snap = cpuload.snapshot([os.getpid()])
    assert snap.busy_s > 0 and snap.idle_s >= 0
    assert any(pid == os.getpid() for pid, _ in snap.tasks)


def test_processes_cpu_s_sees_a_few_milliseconds() -> None:
    """A process's CPU time is read to better than the 10 ms clock tick: a
    short run of a daemon is not 0 (`dlcp bench ddp`'s smoke run read 0.0)."""
    import os
    import time

    before = cpuload.processes_cpu_s([os.getpid()])
    start = time.process_time()
    while time.process_time() - start < 0.003:  # 3 ms of this process's CPU
        pass
    took = cpuload.processes_cpu_s([os.getpid()]) - before
    assert 0 < took < 1.0
    assert cpuload.processes_cpu_s([2**22 + 12345]) == 0.0  # no such process
