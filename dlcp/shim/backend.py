"""dlcp as a torch.distributed backend: `init_process_group("cpu:dlcp,cuda:dlcp")`.

Importing `dlcp.shim` registers the backend "dlcp". Its process group carries
the collectives that move gradients and parameters through the daemons:

- `all_reduce` (SUM and AVG) of floating tensors: one daemon round each;
- `reduce_scatter_tensor` (FSDP's gradient reduction): the DATA leg of a
  round (submit kind "reduce_scatter"): shard r of the round is rank r's
  chunk, owned by rank r's host, whose sum of it is rank r's output; no
  result goes back;
- `all_gather_into_tensor` (FSDP's parameter all-gather): the RESULT leg of a
  round (kind "all_gather"): rank r's input is shard r, which its host sends
  to every other as the result, losslessly and bit for bit (loss bound 0
  whatever the group's).

Each rank's chunk is padded to whole data packets, so that the round's
shards are the ranks' chunks. One leg needs one rank a host (the hosts in
rank order, as `plan_membership` gives them to one rank each) in a transpose
job; with several ranks on a host (their daemon sums them before the
network) or a switch or ps job, and for a reduce-scatter with a codec other
than fp32, both collectives are a full all-reduce of the padded input, as
they were before: a reduce-scatter keeps its chunk of the sums, an all-gather
sums each rank's input placed in its slot among zeros (exact in fp32: x + 0).

Everything else (broadcast, barrier, send/recv, gather/scatter, the object
collectives, all_reduce of integers or with MIN/MAX/PRODUCT) is delegated to
a Gloo group made from the same store: dlcp does not carry it. The codec and
loss bound are the backend's options (`set_options`, or DLCP_BACKEND_CODEC /
DLCP_BACKEND_LOSS_BOUND in the environment): exact fp32 with bound 0 by
default, as FSDP's all-gather needs. If the daemon is unreachable the
collectives fall back to the Gloo group, as the DDP hook does.

The daemon's rounds are blocking in the shim, so `async_op=True` work runs on
one thread of the group, in the order it was issued (every rank issues the
same order); `Work.wait()` and `get_future()` behave as Gloo's. The shim's
own agreement runs on a second Gloo group, so it never interleaves with the
delegated collectives issued from the caller's thread. A one-leg collective's
work completes as soon as this rank's round is in, while the ranks'
agreement (did any rank's round fail?) is still in flight on the worker
(`StepFinisher.finish_early`): FSDP issues its next collective only once
this one is done, and no longer waits for the agreement too. That is safe
because each rank's result of one leg comes from its own round alone: a
reduce-scatter's shard only its rank holds, an all-gather exact. If another
rank's round failed, every rank all-reduces the collective's input over the
process group, the failed rank takes its result from that, the others'
stand, and every rank detaches, before the next collective starts.

A one-leg collective moves half an all-reduce's bytes, as Gloo's do.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as _c10d  # Work from a future, AllgatherOptions

from dlcp.core.layout import lanes_per_packet
from dlcp.errors import LocalError
from dlcp.shim.pg import DirectGroup
from dlcp.wire.header import Codec

__all__ = ["BACKEND", "DlcpProcessGroup", "groups", "options", "register", "set_options"]

BACKEND = "dlcp"
log = logging.getLogger(__name__)
_SUM_OPS = (dist.ReduceOp.SUM, dist.ReduceOp.AVG)
_EXACT_IN_FP32 = (torch.float32, torch.bfloat16, torch.float16)  # gathered through fp32 sums
_options: dict[str, Any] = {}
_groups: weakref.WeakSet[DlcpProcessGroup] = weakref.WeakSet()


def groups() -> list[DlcpProcessGroup]:
    """This process's dlcp process groups (their `state` has the shim's stats)."""
    return list(_groups)


def set_options(*, codec: str = "fp32", loss_bound: float = 0.0, **state_options: Any) -> None:
    """The codec, loss bound and other `DlcpState` settings of process groups
    made after this call (before `init_process_group`)."""
    from dlcp.codecs import CODEC_NAMES

    if codec not in CODEC_NAMES:
        raise LocalError(f"unknown codec {codec!r}; valid: {', '.join(CODEC_NAMES)}")
    _options.clear()
    _options.update(state_options, codec=codec, loss_bound=float(loss_bound))


def options() -> dict[str, Any]:
    """The settings a new dlcp process group takes: `set_options`' or the
    environment's (DLCP_BACKEND_CODEC, DLCP_BACKEND_LOSS_BOUND) or fp32, bound 0."""
    if _options:
        return dict(_options)
    return {
        "codec": os.environ.get("DLCP_BACKEND_CODEC", "fp32"),
        "loss_bound": float(os.environ.get("DLCP_BACKEND_LOSS_BOUND", "0")),
    }


_c10d_any: Any = _c10d  # (not in the stubs)
_work_from_future: Callable[[torch.futures.Future[Any]], dist.Work] = (
    _c10d_any._create_work_from_future
)


_Job = Callable[[Callable[[Any], None]], Any]  # called with `done` (`_Worker`)


def _done(result: Any) -> dist.Work:
    fut: torch.futures.Future[Any] = torch.futures.Future()
    fut.set_result(result)
    return _work_from_future(fut)


class _Worker:
    """One thread running the group's dlcp collectives in issue order.

    A job is called with `done`: it may hand its work's result over with
    `done(result)` before it returns (a one-leg collective once its round is
    in, while the ranks' agreement is still in flight: `deliver` in
    `DlcpState.all_reduce`); the next job starts when it returns."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[tuple[_Job, torch.futures.Future[Any]] | None]
        self._jobs = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="dlcp-collectives", daemon=True)
        self._thread.start()

    def submit(self, fn: _Job) -> dist.Work:
        fut: torch.futures.Future[Any] = torch.futures.Future()
        self._jobs.put((fn, fut))
        return _work_from_future(fut)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            self._one(*job)

    @staticmethod
    def _one(fn: _Job, fut: torch.futures.Future[Any]) -> None:
        handed: list[bool] = []

        def done(result: Any) -> None:
            if not handed:
                handed.append(True)
                fut.set_result(result)

        try:
            done(fn(done))
        except BaseException as exc:
            if not handed:
                fut.set_exception(exc)
            else:  # its result stands; what broke after (the agreement) is the next's
                log.warning("dlcp: after a collective's result was handed over: %s", exc)

    def stop(self) -> None:
        self._jobs.put(None)


# the stubs' overloads of ProcessGroup's methods are the C++ ones (with `root`,
# `timeout`, ...): a Python group implements the option-object forms
_ProcessGroup: Any = dist.ProcessGroup


class DlcpProcessGroup(_ProcessGroup):
    """The process group of backend "dlcp" (see the module's docstring)."""

    def __init__(self, store: dist.Store, rank: int, size: int, timeout: timedelta) -> None:
        super().__init__(rank, size)
        self._rank, self._size = rank, size
        # delegated collectives (the caller's thread) and the shim's agreement
        # (the worker's) on groups of their own: their orders never mix
        gloo = dist.ProcessGroupGloo(dist.PrefixStore("gloo", store), rank, size, timeout)
        self._gloo: Any = gloo
        agree = dist.ProcessGroupGloo(dist.PrefixStore("agree", store), rank, size, timeout)
        self._agree = DirectGroup(agree, rank, size)
        self._store = dist.PrefixStore("shim", store)
        self._options = options()
        self._state: Any = None
        self._group_name = self._group_desc = ""
        self._worker = _Worker()
        _groups.add(self)

    # -- what torch.distributed asks of a group ---------------------------------------
    def getBackendName(self) -> str:
        return BACKEND

    # a Python group has no C++ backends to keep these (DeviceMesh reads them)
    def _set_group_name(self, name: str) -> None:
        self._group_name = name

    @property
    def group_name(self) -> str:
        return self._group_name

    def _set_group_desc(self, desc: str) -> None:
        self._group_desc = desc

    @property
    def group_desc(self) -> str:
        return self._group_desc

    @property
    def state(self) -> Any:
        """The shim's state behind this group (attached on first use): stats,
        timeline, fallbacks."""
        if self._state is None:
            from dlcp.shim.state import DlcpState

            self._state = DlcpState(process_group=self._agree, store=self._store, **self._options)
        return self._state

    @contextlib.contextmanager
    def _exact(self) -> Iterator[None]:
        """Loss bound 0 for one collective (the all-gather's parameters are
        the ranks' bytes whatever bound the gradients get). The state is the
        worker thread's alone, so this changes nothing anyone else reads."""
        state = self.state
        bound, state.loss_bound = state.loss_bound, 0.0
        try:
            yield
        finally:
            state.loss_bound = bound

    def _one_leg(self, codec: str) -> bool:
        """Whether a collective of `codec` may go as one leg of a round (the
        module's docstring); the same answer on every rank (it depends on the
        job's membership only, which attaching agrees)."""
        state = self.state
        a = state.attachment
        if a.due:
            state.attach()
        link = a.link
        if link is None or codec != "fp32":
            return False
        m = link.membership
        return (
            m.switch is None
            and not m.ps
            and m.local_ranks == 1
            and list(m.host_of_rank) == list(range(self._size))
        )

    def _padded(self, n: int) -> int:
        """A rank's chunk of `n` values padded to whole fp32 data packets."""
        link = self.state.attachment.link
        assert link is not None
        per = lanes_per_packet(Codec.FP32, link.membership.payload)
        return -(-n // per) * per

    def _dlcp(self, fn: _Job) -> dist.Work:
        return self._worker.submit(fn)

    # -- all-reduce -------------------------------------------------------------------
    def allreduce(self, tensors: Sequence[torch.Tensor], opts: Any = None) -> dist.Work:
        op = _op(opts)
        if op not in _SUM_OPS or not all(t.is_floating_point() for t in tensors):
            return self._gloo.allreduce(list(tensors), _allreduce_opts(op))
        average = op == dist.ReduceOp.AVG

        def run(_: Any) -> list[torch.Tensor]:
            for t in tensors:
                self._reduce_in_place(t, average)
            return list(tensors)

        return self._dlcp(run)

    def allreduce_coalesced(self, tensors: Sequence[torch.Tensor], opts: Any = None) -> dist.Work:
        return self.allreduce(tensors, opts)

    def _reduce_in_place(self, t: torch.Tensor, average: bool) -> None:
        flat = t.detach().reshape(-1)
        work = flat if flat.dtype == torch.float32 and flat.data_ptr() == t.data_ptr() else None
        buf = work if work is not None else flat.to(torch.float32, copy=True)
        if average or self.state.codec in ("fp32", "fp16"):
            self.state.all_reduce(buf, average=average)
        else:  # a lossy codec averages: the sum is that mean times the ranks
            self.state.all_reduce(buf)
            buf.mul_(self._size)
        if work is None:
            t.detach().copy_(buf.view_as(t))

    # -- FSDP's two ------------------------------------------------------------------
    def _reduce_scatter_base(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> dist.Work:
        op = _op(opts)
        if op not in _SUM_OPS or not input.is_floating_point():
            return self._gloo._reduce_scatter_base(output, input, _rs_opts(op))
        if input.numel() != output.numel() * self._size:
            raise LocalError(
                f"reduce_scatter_tensor: input of {input.numel()} values for {self._size} "
                f"ranks' outputs of {output.numel()}"
            )
        average = op == dist.ReduceOp.AVG

        def run(done: Callable[[Any], None]) -> torch.Tensor:
            n = output.numel()
            if n and self._one_leg(self.state.codec):
                m = self._padded(n)
                buf = torch.zeros(self._size * m, dtype=torch.float32)
                buf.view(self._size, m)[:, :n] = input.detach().reshape(self._size, n)

                def deliver(sums: torch.Tensor) -> None:
                    mine = sums[self._rank * m : self._rank * m + n]
                    if average:
                        mine.div_(self._size)
                    output.detach().copy_(mine.view_as(output))
                    done(output)

                self._one_leg_round(buf, "reduce_scatter", deliver)
                return output
            buf = input.detach().reshape(-1).to(torch.float32, copy=True)
            self._reduce_in_place(buf, average)
            output.detach().copy_(buf[self._rank * n : (self._rank + 1) * n].view_as(output))
            return output

        return self._dlcp(run)

    def reduce_scatter_tensor_coalesced(
        self, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor], opts: Any = None
    ) -> dist.Work:
        pairs = zip(outputs, inputs, strict=True)
        works = [self._reduce_scatter_base(o, i, opts) for o, i in pairs]
        return works[-1] if works else _done(None)

    def _allgather_base(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> dist.Work:
        if input.dtype not in _EXACT_IN_FP32:
            return self._gloo._allgather_base(output, input)
        if output.numel() != input.numel() * self._size:
            raise LocalError(
                f"all_gather_into_tensor: output of {output.numel()} values for {self._size} "
                f"ranks' inputs of {input.numel()}"
            )

        def run(done: Callable[[Any], None]) -> torch.Tensor:
            n = input.numel()
            one_leg = n > 0 and self._one_leg("fp32")
            m = self._padded(n) if one_leg else n
            buf = torch.zeros(self._size * m, dtype=torch.float32)
            # the rank's input in its slot among zeros: one leg sends that slot
            # alone; a full all-reduce (and the Gloo fallback of either) sums
            # it with the zeros, exact in fp32, none lost
            buf.view(self._size, m)[self._rank, :n] = input.detach().reshape(-1)

            def deliver(sums: torch.Tensor) -> None:
                output.detach().copy_(sums.view(self._size, m)[:, :n].reshape(output.shape))
                done(output)

            with self._exact():
                if one_leg:
                    self._one_leg_round(buf, "all_gather", deliver)
                else:
                    self.state.all_reduce(buf, average=False, codec="fp32")
                    deliver(buf)
            return output

        return self._dlcp(run)

    def _one_leg_round(
        self, buf: torch.Tensor, kind: str, deliver: Callable[[torch.Tensor], None]
    ) -> None:
        """One leg of an fp32 round over `buf`; `deliver` gets the sums once:
        as soon as this rank's round is in (before the ranks agree), or
        where the state took another path (detached, the fallback) after."""
        delivered: list[bool] = []

        def once(sums: torch.Tensor) -> None:
            delivered.append(True)
            deliver(sums)

        self.state.all_reduce(buf, average=False, codec="fp32", kind=kind, deliver=once)
        if not delivered:
            deliver(buf)

    def allgather_into_tensor_coalesced(
        self, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor], opts: Any = None
    ) -> dist.Work:
        pairs = zip(outputs, inputs, strict=True)
        works = [self._allgather_base(o, i, opts) for o, i in pairs]
        return works[-1] if works else _done(None)

    # the names torch.distributed calls them by (2.13: *_single; before: *_base)
    reduce_scatter_single = _reduce_scatter_base
    all_gather_single = _allgather_base
    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced
    all_gather_single_coalesced = allgather_into_tensor_coalesced

    # -- delegated to Gloo: dlcp does not carry these ----------------------------------
    def _after_dlcp(self) -> None:
        """Wait for the dlcp collectives issued before a delegated one: a caller
        that reads their tensors after, say, a barrier sees them done."""
        self._worker.submit(lambda _: None).wait()

    def barrier(self, opts: Any = None) -> dist.Work:
        self._after_dlcp()
        return self._gloo.barrier(dist.BarrierOptions() if opts is None else opts)

    def broadcast(self, tensors: Sequence[torch.Tensor], opts: Any = None) -> dist.Work:
        self._after_dlcp()
        opts = dist.BroadcastOptions() if opts is None else opts
        return self._gloo.broadcast(list(tensors), opts)

    def allgather(self, outputs: Any, inputs: Any, opts: Any = None) -> dist.Work:
        self._after_dlcp()
        return self._gloo.allgather(outputs, inputs, opts or _c10d.AllgatherOptions())

    def allgather_coalesced(self, outputs: Any, inputs: Any, opts: Any = None) -> dist.Work:
        self._after_dlcp()
        return self._gloo.allgather_coalesced(outputs, inputs, opts or _c10d.AllgatherOptions())

    def gather(self, outputs: Any, inputs: Any, opts: Any = None) -> dist.Work:
        self._after_dlcp()
        return self._gloo.gather(outputs, inputs, dist.GatherOptions() if opts is None else opts)

    def scatter(self, outputs: Any, inputs: Any, opts: Any = None) -> dist.Work:
        self._after_dlcp()
        return self._gloo.scatter(outputs, inputs, dist.ScatterOptions() if opts is None else opts)

    def reduce(self, tensors: Any, opts: Any = None) -> dist.Work:
        self._after_dlcp()
        return self._gloo.reduce(tensors, dist.ReduceOptions() if opts is None else opts)

    def reduce_scatter(self, outputs: Any, inputs: Any, opts: Any = None) -> dist.Work:
        self._after_dlcp()
        return self._gloo.reduce_scatter(outputs, inputs, opts or dist.ReduceScatterOptions())

    def alltoall_base(self, *args: Any) -> dist.Work:
        self._after_dlcp()
        return self._gloo.alltoall_base(*args)

    def send(self, tensors: Any, dst: int, tag: int = 0) -> dist.Work:
        self._after_dlcp()
        return self._gloo.send(tensors, dst, tag)

    def recv(self, tensors: Any, src: int, tag: int = 0) -> dist.Work:
        self._after_dlcp()
        return self._gloo.recv(tensors, src, tag)

    def recv_anysource(self, tensors: Any, tag: int = 0) -> dist.Work:
        self._after_dlcp()
        return self._gloo.recv_anysource(tensors, tag)

    def shutdown(self) -> None:
        self._worker.stop()
        if self._state is not None:
            self._state.close()


def _op(opts: Any) -> Any:
    """The options' reduction as a ReduceOp.RedOpType (a ReduceOp object compares
    equal to one, but not the other way round: `in` a tuple of them fails)."""
    op = dist.ReduceOp.SUM if opts is None else opts.reduceOp
    return getattr(op, "op", op)


def _allreduce_opts(op: Any) -> Any:
    o = dist.AllreduceOptions()
    o.reduceOp = op
    return o


def _rs_opts(op: Any) -> Any:
    o = dist.ReduceScatterOptions()
    o.reduceOp = op
    return o


def _create(store: dist.Store, rank: int, size: int, timeout: timedelta) -> DlcpProcessGroup:
    return DlcpProcessGroup(store, rank, size, timeout)


def register() -> None:
    """Register backend "dlcp" with torch.distributed (once; `import dlcp.shim` does)."""
    if hasattr(dist.Backend, BACKEND.upper()):
        return
    dist.Backend.register_backend(BACKEND, _create, devices=["cpu", "cuda"])
