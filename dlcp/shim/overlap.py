"""Overlap mode: the next forward pass overlaps the buckets still in flight.

    state = dlcp.init(codec="thc8", loss_bound=0.01, model=model)
    ddp.register_comm_hook(state, dlcp.hook)
    opt = dlcp.overlap(ddp, state, torch.optim.SGD, lr=0.1, momentum=0.9)
    for x, y in loader:
        loss_fn(ddp(x), y).backward()  # returns once the last bucket is handed over
        opt.step()                     # records the step; updates happen layer by layer
    opt.flush()                        # before evaluation, checkpoints, reading parameters

Plain DDP waits for every bucket's future before `backward()` returns, so
the next forward starts after the step's last byte. Here the hook hands DDP
an already-finished future (the bucket's own local gradient: DDP copies it
into `.grad`, which overlap mode never reads) and keeps the round in flight.
Before each parameter-owning module runs in the next forward, a forward
pre-hook waits for the round of each of its parameters' buckets, agrees it
with the other ranks (one small all-reduce a bucket: failed anywhere? the
next THC scales), decodes it into a tensor of its own (never DDP's buffer,
which the next backward fills) and applies a per-parameter functional
optimizer (`dlcp.shim.overlap_optim`) to that bucket's parameters. Front
layers' buckets are what the forward needs first, which is why the daemon
sends them first (layer priority). Every rank runs the same modules in the
same order, so the agreements pair up; buckets no module asked for are
resolved at the next step's first bucket, before anything new is submitted.

A bucket whose round failed (on any rank) falls back alone: every rank
restores its error feedback and all-reduces that bucket's local gradient
(kept aside at submit) over the process group; the others keep their
results. The state detaches once the step's last bucket is resolved.

Overlap starts with the second backward pass: DDP rebuilds its buckets after
the first, and until then (and while the state is detached, where buckets go
over the process group) `step()` applies the same per-parameter optimizer
from `.grad` at once, as plain training does.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from dlcp.errors import LocalError
from dlcp.shim.auto import AUTO
from dlcp.shim.layers import param_offsets
from dlcp.shim.overlap_optim import (
    defaults_of,
    functional_for,
    sync_hyper,
    whole_gradient_error,
)
from dlcp.shim.stepstate import ShimError, _Pending

if TYPE_CHECKING:
    from dlcp.shim.state import DlcpState

__all__ = ["OverlapOptimizer", "overlap"]

_IN_FLIGHT = "dlcp.overlap: updates are in flight: call opt.flush() on every rank first"


@dataclass(eq=False)
class _Bucket:
    """One bucket of a step in flight: its round, parameters and where their
    gradients lie in it, and its local gradient (for a fallback)."""

    pending: _Pending
    params: list[torch.Tensor]
    offsets: list[int]
    local: torch.Tensor
    step: _Step
    resolved: bool = False


@dataclass(eq=False)
class _Step:
    buckets: list[_Bucket] = field(default_factory=list)
    due: bool = False  # step() was called for it: apply its updates
    failure: str | None = None
    began: float = 0.0


class OverlapOptimizer(torch.optim.Optimizer):
    """SGD, Adam or AdamW applied bucket by bucket as the next forward needs them
    (see the module docstring). A torch.optim.Optimizer: `param_groups`,
    `zero_grad()`, `state_dict()`/`load_state_dict()` and LR schedulers work."""

    def __init__(
        self,
        ddp: torch.nn.parallel.DistributedDataParallel,
        state: DlcpState,
        optimizer: type,
        params: Iterable[Any] | None = None,
        *,
        enabled: bool = True,
        **kwargs: Any,
    ) -> None:
        if state.codec == AUTO:
            raise LocalError("dlcp.overlap does not run with codec='auto'; name a codec")
        for whole in ("max_grad_norm", "clip_grad_norm", "grad_scaler"):
            if whole in kwargs:
                raise whole_gradient_error(whole)
        defaults = defaults_of(optimizer, kwargs)
        if optimizer is torch.optim.Adam and defaults.get("decoupled_weight_decay"):
            raise LocalError("dlcp.overlap: use torch.optim.AdamW for decoupled weight decay")
        module = ddp.module
        super().__init__(
            list(params) if params is not None else [p for p in module.parameters()], defaults
        )
        self._kind = optimizer
        self._functionals = [
            functional_for(optimizer, list(g["params"]), g, self.state) for g in self.param_groups
        ]
        pairs = zip(self._functionals, self.param_groups, strict=True)
        self._fn_of = {id(p): f for f, g in pairs for p in g["params"]}
        self._dlcp = state
        self.enabled = bool(enabled)
        self._backwards = 0  # backward passes seen (overlap from the second on)
        self._in_backward = False
        self._current = _Step()  # the step whose buckets are being handed over
        self._inflight: list[_Step] = []  # handed over, not yet all resolved
        self._where: dict[int, _Bucket] = {}  # id(param) -> its bucket in flight
        self._plain: list[list[torch.Tensor]] = []  # buckets step() applies from .grad
        self._scratch: dict[tuple[int, int], torch.Tensor] = {}
        self._step_supports_amp_scaling = True  # GradScaler then passes itself: refused
        self._hooks = [
            m.register_forward_pre_hook(self._pre_forward)
            for m in module.modules()
            if any(True for _ in m.parameters(recurse=False))
        ]
        state.overlap_optimizer = self

    # -- what the state's hook calls --------------------------------------------------
    @property
    def active(self) -> bool:
        """Whether this backward's buckets stay in flight past backward()."""
        return self.enabled and self._backwards >= 1

    def bucket_entered(self) -> None:
        """A bucket reaches the hook: the first of a backward resolves what the
        last step left in flight (before anything new is submitted or attached)."""
        if not self._in_backward:
            self._in_backward = True
            self._plain = []  # a backward without step(): like zero_grad
            self._resolve_all()

    def handed(self, p: _Pending, bucket: dist.GradBucket, last: bool) -> torch.futures.Future[Any]:
        """Keep a launched bucket in flight; DDP gets a finished future."""
        flat = p.buffer
        b = _Bucket(
            pending=p,
            params=list(bucket.parameters()),
            offsets=param_offsets(flat, bucket.gradients()),
            local=flat.clone(),
            step=self._current,
        )
        if not self._current.buckets:
            self._current.began = time.perf_counter()
        self._current.buckets.append(b)
        for param in b.params:
            self._where[id(param)] = b
        if last:
            self.backward_done()
            self._dlcp.finisher.end_step()
        fut: torch.futures.Future[Any] = torch.futures.Future()
        fut.set_result(bucket.buffer())
        return fut

    def plain_bucket(self, bucket: dist.GradBucket) -> None:
        """A bucket that DDP waits for (plain mode, the fallback): `step()`
        applies it from what DDP writes into `.grad`."""
        self._plain.append(list(bucket.parameters()))

    def backward_done(self) -> None:
        """The step's last bucket was handed over: its buckets in flight leave the
        state's step (whose end they no longer wait for) for this object."""
        self._backwards += 1
        self._in_backward = False
        if self._current.buckets:
            self._dlcp.step_buckets.release(x.pending for x in self._current.buckets)
            self._inflight.append(self._current)
            self._current = _Step()

    # -- the optimizer ------------------------------------------------------------------
    @torch.no_grad()
    def step(  # type: ignore[override]
        self, closure: Callable[[], float] | None = None, grad_scaler: Any = None
    ) -> None:
        """Record the step: buckets in flight are applied as the next forward needs
        them; buckets DDP waited for (plain mode, the first step) are applied now.
        (`grad_scaler`: what GradScaler passes, and is refused.)"""
        if closure is not None:
            raise whole_gradient_error("step(closure)")
        if grad_scaler is not None:
            raise whole_gradient_error("GradScaler")
        for f, g in zip(self._functionals, self.param_groups, strict=True):
            sync_hyper(f, g)  # this step's hyperparameters, whenever its updates happen
        if self._inflight:
            self._inflight[-1].due = True
        plain, self._plain = self._plain, []
        for params in plain:
            for param in params:
                f = self._fn_of.get(id(param))
                if f is not None and param.grad is not None:
                    f.step_param(param, param.grad)

    def flush(self) -> None:
        """Collective: apply every update still in flight now (before evaluation,
        checkpoints or reading parameters; every rank must call it)."""
        self._resolve_all()

    def clip_grad_norm_(self, *args: Any, **kwargs: Any) -> None:
        raise whole_gradient_error("global-norm clipping")

    def state_dict(self) -> dict[str, Any]:
        if self._inflight:
            raise LocalError(_IN_FLIGHT)
        return super().state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self._inflight:
            raise LocalError(_IN_FLIGHT)
        super().load_state_dict(state_dict)
        for f in self._functionals:  # load_state_dict made a new state dict
            f.state = self.state

    def close(self) -> None:
        """Collective (it flushes first): remove the forward pre-hooks, leave the state."""
        self._resolve_all()
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self._dlcp.overlap_optimizer is self:
            self._dlcp.overlap_optimizer = None

    # -- resolving buckets --------------------------------------------------------------
    def _pre_forward(self, module: torch.nn.Module, args: Any) -> None:
        for param in module.parameters(recurse=False):
            b = self._where.get(id(param))
            if b is not None and not b.resolved:
                self._resolve(b)

    def _resolve_all(self) -> None:
        for step in list(self._inflight):
            for b in step.buckets:
                if not b.resolved:
                    self._resolve(b)

    @torch.no_grad()
    def _resolve(self, b: _Bucket) -> None:
        """Wait for one bucket, agree it, decode it, apply its parameters' updates."""
        st, p, step = self._dlcp, b.pending, b.step
        finisher = st.finisher
        b.resolved = True
        for param in b.params:
            if self._where.get(id(param)) is b:
                del self._where[id(param)]
        reason, maxima = finisher.agree_one(p)
        if reason is not None:
            step.failure = step.failure or reason
            if st.strict:
                self._end(step)
                raise ShimError(f"dlcp all-reduce failed: {reason}")
            grad = b.local
            finisher.fallback(grad)
        else:
            key = (p.bucket, p.buffer.numel())
            into = self._scratch.get(key)
            if into is None or into.dtype != p.buffer.dtype or into.device != p.buffer.device:
                into = self._scratch[key] = torch.empty_like(p.buffer)
            _, grad = finisher.bucket_done(p, maxima, 0, into)
        if step.due:
            for param, off in zip(b.params, b.offsets, strict=True):
                f = self._fn_of.get(id(param))  # None: a parameter this optimizer does not hold
                if f is not None:
                    f.step_param(param, grad[off : off + param.numel()].view_as(param))
        if all(x.resolved for x in step.buckets):
            self._end(step)

    def _end(self, step: _Step) -> None:
        """A step's buckets are all resolved: free its regions; detach if one failed."""
        if step in self._inflight:
            self._inflight.remove(step)
        st = self._dlcp
        st.attachment.reserve_for_next_step()
        st.timeline.end_step(time.perf_counter() - step.began)
        if step.failure is not None and st.attached:
            st.finisher.fail(step.failure)


def overlap(
    ddp: torch.nn.parallel.DistributedDataParallel,
    state: DlcpState,
    optimizer: type,
    params: Iterable[Any] | None = None,
    **kwargs: Any,
) -> OverlapOptimizer:
    """`optimizer` (torch.optim.SGD, Adam or AdamW, with its usual arguments)
    applied bucket by bucket as the next forward pass needs each layer; see
    `dlcp.shim.overlap`. `enabled=False`: the same per-parameter optimizer
    applied at `step()` from `.grad` (plain mode)."""
    return OverlapOptimizer(ddp, state, optimizer, params, **kwargs)
