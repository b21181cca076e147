"""The agreement's hedge (dlcp.shim.hedge): the first op to complete is taken,
failed ones are passed over, slower ones keep their buffers until they
complete; over a real 3-process Gloo job on loopback the hedged agreement
gives the plain one's answers on every rank, also with one group delayed."""

from __future__ import annotations

import queue
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from dlcp.shim import pg
from dlcp.shim.backend import _work_from_future
from dlcp.shim.hedge import HEDGE_ENV, Hedge, ways_from_env
from tests.test_shim import spawn

# -- the selection, with fake groups ------------------------------------------------


class _FakeWork:
    """A Work whose completion the test decides: `finish` writes `value` into
    the op's tensor (as Gloo writes the reduced values) or fails it."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t
        self.fut: torch.futures.Future[Any] = torch.futures.Future()

    def finish(self, value: float | None) -> None:
        if value is None:
            self.fut.set_exception(RuntimeError("connection reset"))
        else:
            self.t.fill_(value)
            self.fut.set_result([self.t])

    def get_future(self) -> torch.futures.Future[Any]:
        return self.fut

    def wait(self) -> bool:
        self.fut.wait()  # raises the op's error
        return True

    def is_completed(self) -> bool:
        return self.fut.done()


class _FakePg:
    """What `DirectGroup` calls: `allreduce([t], opts)`; each op is kept, and
    completes at once with `now` if given (None: fails), else when told."""

    def __init__(self, now: float | None = None, *, instant: bool = False) -> None:
        self.works: list[_FakeWork] = []
        self.now, self.instant = now, instant
        self.ops: list[Any] = []

    def allreduce(self, tensors: list[torch.Tensor], opts: Any) -> _FakeWork:
        self.ops.append(opts.reduceOp)
        w = _FakeWork(tensors[0])
        self.works.append(w)
        if self.instant:
            w.finish(self.now)
        return w


def _groups(*pgs: _FakePg) -> list[pg.Group]:
    return [pg.DirectGroup(p, 0, 2) for p in pgs]


def test_the_first_op_to_complete_is_the_answer_and_the_slower_keeps_its_buffer() -> None:
    slow, fast = _FakePg(), _FakePg(7.0, instant=True)
    hedge = Hedge(_groups(slow, fast))
    failed, maxima = pg.agree(True, torch.tensor([1.0, 2.0]), hedge)
    assert failed and maxima.tolist() == [7.0, 7.0]
    assert hedge.wins == [0, 1] and hedge.count == 1
    assert slow.ops == [dist.ReduceOp.MAX] and fast.ops == [dist.ReduceOp.MAX]
    # the slow op's own buffer (not the answer's) is still held while it runs
    assert hedge.in_flight == 1
    held = slow.works[0].t
    assert held.data_ptr() != maxima.data_ptr() and held.tolist() == [1.0, 1.0, 2.0]
    slow.works[0].finish(7.0)
    assert hedge.in_flight == 0


def test_a_failed_op_is_passed_over_for_the_next_to_complete() -> None:
    broken, late = _FakePg(None, instant=True), _FakePg()
    hedge = Hedge(_groups(broken, late))
    out: list[torch.Tensor] = []
    runner = threading.Thread(target=lambda: out.append(hedge.max_(torch.tensor([0.0, 3.0]))))
    runner.start()
    while not late.works:
        time.sleep(0.001)
    assert runner.is_alive()  # a failure is no answer: it waits for the other group
    late.works[0].finish(5.0)
    runner.join(10)
    assert out[0].tolist() == [5.0, 5.0] and hedge.wins == [0, 1]


def test_every_op_failing_raises() -> None:
    hedge = Hedge(_groups(_FakePg(None, instant=True), _FakePg(None, instant=True)))
    with pytest.raises(RuntimeError, match="connection reset"):
        pg.agree(False, None, hedge)
    assert hedge.count == 0


def test_one_way_is_the_group_alone_and_the_environment_sets_the_ways(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    one = _FakePg(4.0, instant=True)
    hedge = Hedge(_groups(one))
    assert pg.agree(False, torch.tensor([1.0]), hedge)[1].tolist() == [4.0]
    assert hedge.describe()["count"] == 1 and hedge.describe()["wins"] == [1]
    monkeypatch.setenv(HEDGE_ENV, "1")
    assert ways_from_env() == 1
    monkeypatch.delenv(HEDGE_ENV)
    assert ways_from_env() == 3
    # a one-rank group is not hedged: no Gloo group is made for it
    assert Hedge.make(pg.DirectGroup(one, 0, 1), dist.HashStore(), "p").ways == 1


# -- real Gloo groups on loopback --------------------------------------------------


class _Delayed(pg.DirectGroup):
    """A group whose ops start `delay` seconds late on this rank, in issue order
    (one thread), as a TCP connection waiting for a retransmission would."""

    __slots__ = ("delay", "jobs")

    def __init__(self, inner: pg.DirectGroup, delay: float) -> None:
        super().__init__(inner.pg, inner.rank, inner.size)
        self.delay = delay
        self.jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while True:  # issue order kept: Gloo pairs ops by their order
            t, op, fut = self.jobs.get()
            time.sleep(self.delay)
            work = pg.DirectGroup.all_reduce(self, t, op, async_op=True)
            work.get_future().then(lambda _f, fut=fut, t=t: fut.set_result([t]))

    def all_reduce(self, t: torch.Tensor, op: Any, *, async_op: bool = False) -> Any:
        fut: torch.futures.Future[Any] = torch.futures.Future()
        self.jobs.put((t, op, fut))
        return _work_from_future(fut)


def _hedge_worker(rank: int, world: int, delay: float) -> dict[str, Any]:
    store = dist.distributed_c10d._get_default_store()
    hedge = Hedge.make(None, store, "test/agree", ways=3)
    groups: list[Any] = hedge._groups
    if delay:
        groups[0] = _Delayed(groups[0], delay if rank == 1 else 0.0)
    plain, hedged = [], []
    gen = torch.Generator().manual_seed(rank)
    for i in range(12):
        maxima = torch.rand(5, generator=gen) * (rank + 1)
        failed = rank == i % 4  # rank 3 never exists: every fourth is clean
        plain.append(pg.agree(failed, maxima, None))
        hedged.append(pg.agree(failed, maxima, hedge))
    deadline = time.monotonic() + 60
    while hedge.in_flight and time.monotonic() < deadline:
        time.sleep(0.01)
    return {
        "plain": [(f, m.tolist()) for f, m in plain],
        "hedged": [(f, m.tolist()) for f, m in hedged],
        "stats": hedge.describe(),
        "left": hedge.in_flight,
    }


@pytest.mark.parametrize("delay", [0.0, 0.3])
def test_hedged_agreement_equals_the_plain_one_on_every_rank(tmp_path: Path, delay: float) -> None:
    results = spawn(_hedge_worker, 3, tmp_path, delay=delay)
    first = results[0]
    assert [f for f, _ in first["plain"]] == [True, True, True, False] * 3
    for res in results:
        assert res["hedged"] == first["plain"]  # the same answer, on every rank
        assert res["plain"] == first["plain"]
        assert res["stats"]["ways"] == 3 and res["stats"]["count"] == 12
        assert res["left"] == 0  # the slower ops all completed
    if delay:  # rank 1 waits 0.3 s for group 0's every op: the others answer first
        assert results[1]["stats"]["wins"][0] == 0


# -- through the DDP hook: made at the first attach, used while detached ------------


def _hook_worker(rank: int, world: int, ways: str, steps: int) -> dict[str, Any]:
    import os

    from torch import nn

    import dlcp.shim as dlcp
    from tests.test_shim import NO_DAEMON, make_model, reference_grads, train_steps

    os.environ[HEDGE_ENV] = ways
    ddp_kw = {"bucket_cap_mb": 0.01}
    # no daemon: the first attach fails (the hedge is made before it); with
    # retry_s every step's end agrees whether any rank's clock says to retry
    state = dlcp.DlcpState(
        codec="fp32", socket=NO_DAEMON, retry_steps=None, retry_s=3600.0, connect_timeout_s=1.0
    )
    model = nn.parallel.DistributedDataParallel(make_model(), **ddp_kw)
    model.register_comm_hook(state, dlcp.hook)
    with pytest.warns(RuntimeWarning, match="dlcp"):
        grads = train_steps(model, rank, steps)
    return {"grads": grads, "ref": reference_grads(rank, steps, **ddp_kw), "stats": state.stats()}


@pytest.mark.parametrize("ways", ["3", "1"])
def test_the_hook_agrees_through_the_hedge_and_falls_back_as_before(
    tmp_path: Path, ways: str
) -> None:
    steps = 4
    results = spawn(_hook_worker, 3, tmp_path, ways=ways, steps=steps)
    for res in results:
        for got, want in zip(res["grads"], res["ref"], strict=True):
            for g, w in zip(got, want, strict=True):
                torch.testing.assert_close(g, w, rtol=0, atol=0)
        stats = res["stats"]
        assert not stats["attached"] and stats["failures"] == 1 and stats["attaches"] == 0
        agreements = stats["agreements"]
        assert agreements["ways"] == int(ways)
        assert agreements["count"] == steps and sum(agreements["wins"]) == steps


# -- the groups' TCP connections marked into the control class -------------------


def _marked_worker(rank: int, world: int, dscp: str) -> dict[str, Any]:
    import os

    from dlcp.shim import sockmark

    os.environ[sockmark.DSCP_ENV] = dscp
    store = dist.distributed_c10d._get_default_store()
    before = sockmark.inet_stream_fds()  # the process group's and the store's
    hedge = Hedge.make(None, store, "test/marked", ways=2)
    new = sockmark.inet_stream_fds() - before
    answer = pg.agree(rank == 1, torch.tensor([float(rank)]), hedge)
    return {
        "new": sorted(sockmark.tos_of(fd) for fd in new),
        "old": sorted(sockmark.tos_of(fd) for fd in before),
        "stats": hedge.describe(),
        "answer": (answer[0], answer[1].tolist()),
    }


@pytest.mark.parametrize("dscp", ["", "0"])
def test_the_hedges_own_connections_are_marked_into_the_control_class(
    tmp_path: Path, dscp: str
) -> None:
    results = spawn(_marked_worker, 3, tmp_path, dscp=dscp)
    want = 48 << 2 if dscp == "" else 0  # CS6, class 0's DSCP; "0": as Gloo made them
    for res in results:
        # two groups of three ranks: at least two connections each
        assert len(res["new"]) >= 4
        assert set(res["new"]) == {want}
        assert res["stats"]["marked"] == (len(res["new"]) if want else 0)
        assert set(res["old"]) == {0}  # the user's process group is left alone
        assert res["answer"] == (True, [2.0])


def test_a_bad_dscp_in_the_environment_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from dlcp.errors import LocalError
    from dlcp.shim import sockmark

    monkeypatch.setenv(sockmark.DSCP_ENV, "cs9")
    with pytest.raises(LocalError, match="bad DSCP 'cs9'"):
        sockmark.dscp_from_env()
    monkeypatch.setenv(sockmark.DSCP_ENV, "af41")
    assert sockmark.dscp_from_env() == 34
