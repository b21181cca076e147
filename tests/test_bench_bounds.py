"""A bench never hangs (`dlcp.bench.procs.RunBound`): a backend whose workers
stop reporting is stopped, its record marked failed with the reason, and the
bench goes on with the next backend and still writes its JSON and table.

The workers are small local programs that speak the bench's JSON lines
(no namespaces, no root): one reports its join and warm-up and then never a
round. The bounds are tiny; no test asserts how fast anything is.
"""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import Any

import pytest

from dlcp.bench import allreduce
from dlcp.bench.allreduce import AllreduceOptions
from dlcp.bench.cluster import Setup
from dlcp.bench.procs import RunBound, RunStopped, WorkerGroup, WorkerTimeout

# the behaviours of a fake worker (argv[1]): "stall" joins and then never
# reports a round (not even its warm-up's); "one" finishes one round and then
# none; "chatty" reports forever and never a result; "ok"
# runs the bench's protocol to the end (dlcp.bench.ar_worker's events)
WORKER = r"""
import json, sys, time
how, iters = sys.argv[1], int(sys.argv[2])
def emit(event, **kw):
    print(json.dumps({"event": event, **kw}), flush=True)
emit("joined")
sys.stdin.readline()
if how == "stall":
    time.sleep(3600)
emit("warm")
while how == "chatty":
    emit("eval", t=0.0, acc=0.0)
    time.sleep(0.01)
for i in range(iters):
    sys.stdin.readline()
    emit("iter", i=i, t=0.001)
    if how == "one":
        time.sleep(3600)
emit("result", times_s=[0.001] * iters, cpu_s=0.0, lost_lanes=0, total_lanes=0, error=None)
sys.stdin.readline()
"""


class _Host:
    def __init__(self, index: int) -> None:
        self.index = index
        self.name = f"h{index}"
        self.socket = Path(f"/nonexistent/h{index}.sock")


class _Testbed:
    """What the bench's worker code uses of a testbed: popen runs the fake
    worker with the behaviour of the run (one behaviour per group of `world`)."""

    def __init__(self, world: int, behaviours: list[str], iters: int) -> None:
        self.hosts = tuple(_Host(i) for i in range(world))
        self.behaviours = behaviours
        self.iters = iters
        self.calls = 0
        self.procs: list[subprocess.Popen[Any]] = []

    def address(self, host: int, path: int = 0) -> str:
        return "127.0.0.1"

    def popen(
        self, host: int, argv: list[str], *, env: Any = None, **kw: Any
    ) -> subprocess.Popen[Any]:
        how = self.behaviours[self.calls // len(self.hosts)]
        self.calls += 1
        proc = subprocess.Popen([sys.executable, "-c", WORKER, how, str(self.iters)], **kw)
        self.procs.append(proc)
        return proc


class _Cluster:
    """A stand-in for `dlcp.bench.cluster.Cluster` around a `_Testbed`."""

    made: list[_Cluster] = []

    def __init__(self, setup: Setup, *, progress: Any = None) -> None:
        self.setup = setup
        self.tb = _Testbed(setup.hosts, self.behaviours, self.iters)
        self.log_dir: Path | None = None
        self.daemons_running = False
        self.made.append(self)

    behaviours: list[str] = []
    iters = 3
    work: Path = Path("/tmp")

    def __enter__(self) -> _Cluster:
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        pass

    @property
    def train_hosts(self) -> tuple[_Host, ...]:
        return self.tb.hosts

    @property
    def work_dir(self) -> Path:
        return self.work

    def run_label(self, backend: str) -> str:
        return f"clean-{backend}"

    @contextlib.contextmanager
    def disturbed(self) -> Iterator[None]:
        yield

    def mark_tcp(self, dscp: str | None) -> None:
        pass


def _group(tmp_path: Path, how: str, bound: RunBound, world: int = 2) -> WorkerGroup:
    tb = _Testbed(world, [how], iters=3)
    g = WorkerGroup(tb, [["fake"]] * world, log_dir=tmp_path, label="t", bound=bound)  # type: ignore[arg-type]
    return g


def test_a_worker_that_never_finishes_a_round_is_stopped(tmp_path: Path) -> None:
    g = _group(tmp_path, "stall", RunBound(stall_s=0.5))
    with g:
        g.expect("joined", 600.0)  # the stall bound holds from the first go on
        g.send("go")
        with pytest.raises(RunStopped) as e:
            g.expect("warm", 600.0)  # its own timeout is far off: the stall bound stops it
    assert e.value.why == "stall" and "no round finished within 0.5 s" in str(e.value)
    assert all(w.proc.poll() is not None for w in g.workers)  # and it is gone


def test_a_run_past_its_budget_is_stopped_however_much_it_reports(tmp_path: Path) -> None:
    g = _group(tmp_path, "chatty", RunBound(stall_s=600.0, budget_s=1.0))
    with g:
        g.send("go")
        with pytest.raises(RunStopped) as e:
            g.expect_any("result", 600.0, on_other=lambda rank, msg: None)
    # it reports all along (the stall bound would never stop it), and never a result
    assert e.value.why == "budget" and "budget of 1 s" in str(e.value)


def test_a_wait_shorter_than_the_bounds_keeps_its_own_timeout(tmp_path: Path) -> None:
    g = _group(tmp_path, "stall", RunBound(stall_s=600.0))
    with g:
        g.expect("joined", 600.0)
        g.send("go")
        with pytest.raises(WorkerTimeout):
            g.expect_any("warm", 0.2, on_other=lambda rank, msg: None)


@pytest.mark.parametrize(("stall", "budget"), [(0.0, None), (float("nan"), None), (1.0, -1.0)])
def test_bounds_must_be_positive(stall: float, budget: float | None) -> None:
    with pytest.raises(Exception, match="must be > 0 seconds"):
        RunBound(stall, budget)


def test_the_bench_marks_a_stalled_backend_failed_and_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_Cluster, "behaviours", ["one", "ok"])
    monkeypatch.setattr(_Cluster, "work", tmp_path)
    monkeypatch.setattr(allreduce, "Cluster", _Cluster)
    opts = AllreduceOptions(
        setup=Setup(hosts=2, rate_bps=None),
        size_bytes=4000,
        iters=3,
        backends=("gloo", "gloo-prio"),
        progress=False,
        predict=False,
        stall_s=5.0,  # the healthy steps answer within it: only a lost round waits it out
    )
    said: list[str] = []
    records = allreduce.run_allreduce(opts, said.append)
    stalled, ok = records
    assert stalled["backend"] == "gloo" and stalled["stopped"] == "stall"
    assert "no round finished within 5 s" in stalled["error"]
    assert stalled["times_s"] == [0.001]  # the round it finished is kept
    assert ok["backend"] == "gloo-prio" and "error" not in ok and len(ok["times_s"]) == 3
    assert all(p.poll() is not None for p in _Cluster.made[-1].tb.procs)  # none left running
    allreduce.save(records, tmp_path / "r.json")
    assert [r["backend"] for r in json.loads((tmp_path / "r.json").read_text())] == [
        "gloo",
        "gloo-prio",
    ]
    table = allreduce.format_table(records)
    assert re.search(r"\bgloo +fp32 +FAILED: ", table) and "stopped" in table
    assert any("FAILED" in s for s in said)


def test_the_default_budget_grows_with_the_work() -> None:
    small = AllreduceOptions(setup=Setup(hosts=3, rate_bps=200_000_000), size_bytes=10**7, iters=40)
    assert small.run_bound.budget_s == small.default_budget_s
    big = AllreduceOptions(setup=Setup(hosts=3, rate_bps=200_000_000), size_bytes=10**8, iters=40)
    assert big.default_budget_s > small.default_budget_s
    fixed = AllreduceOptions(setup=Setup(hosts=3), budget_s=30.0)
    assert fixed.run_bound.budget_s == 30.0
