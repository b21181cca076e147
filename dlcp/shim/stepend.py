"""A step's end in the shim: in the hook of the step's last bucket each rank
waits for its replies, then all ranks agree in one small all-reduce whether
any failed (and the next THC scales); if none did every rank decodes its
buckets, else every rank restores its error feedback, detaches and sends the
step's buckets over the process group (see `dlcp.shim.state`'s docstring).

A part of `dlcp.shim.state.DlcpState` (a mixin, no slots of its own); what
it reads of the state is declared below for the type checker.
"""

from __future__ import annotations

import logging
import math
import time
import warnings
import weakref
from typing import TYPE_CHECKING, Any, cast

import torch

from dlcp.shim import auto_steps, pg
from dlcp.shim.arena import Arena
from dlcp.shim.auto import AutoCodec
from dlcp.shim.exchange import decode_round
from dlcp.shim.layers import LayerMap
from dlcp.shim.link import Link
from dlcp.shim.staging import Staging
from dlcp.shim.stepstate import Key, ShimError, _Pending, with_headroom
from dlcp.shim.timeline import Timeline

if TYPE_CHECKING:
    from dlcp.shim.state import DlcpState

__all__ = ["StepEnd"]

log = logging.getLogger("dlcp.shim")


class StepEnd:
    """Ending a step: replies, the ranks' agreement, decoding or falling back."""

    if not TYPE_CHECKING:  # no slots of its own (DlcpState has them); mypy checks the declarations
        __slots__ = ()

    if TYPE_CHECKING:
        _attach_due: bool
        _auto: AutoCodec | None
        _auto_used: bool
        _detached_round: int | None
        _finalizer: weakref.finalize[Any, Any] | None
        _group: pg.Group
        _last_attempt: float
        _layers: LayerMap
        _link: Link | None
        _pending: list[_Pending]
        _scales: dict[Key, torch.Tensor]
        _staging: Staging
        _timeline: Timeline
        _unreported: int
        _warned: bool
        failures: int
        fallbacks: int
        last_error: str | None
        lost_lanes: int
        retry_s: float | None
        retry_steps: int | None
        round: int
        round_timeout_s: float
        rounds: int
        saturated: int
        scale_mode: str
        segment_bytes: int | None
        strict: bool
        total_lanes: int

        def _scale_from(self, maxima: torch.Tensor) -> torch.Tensor: ...

    # -- the end of a step -----------------------------------------------------------
    def _wait_replies(self, deadline: float, pending: list[_Pending] | None = None) -> None:
        """Wait for the replies of `pending` (the step's buckets by default)."""
        for p in self._pending if pending is None else pending:
            if p.sub is None or p.error is not None or p.reply is not None:
                continue
            try:
                p.reply = p.sub.reply.result(timeout=max(0.0, deadline - time.monotonic()))
                if p.times is not None:
                    p.times.seen = time.perf_counter()
                    p.times.daemon_s = float(p.reply.get("elapsed_s", math.nan))
                if p.sent_at is not None and p.replied_at is None:  # (callbacks run late)
                    p.replied_at = time.perf_counter()
            except TimeoutError:
                p.error = f"no reply within {self.round_timeout_s:g} s"
            except Exception as exc:
                p.error = f"{type(exc).__name__}: {exc}"

    def _finish_step(self) -> None:
        pending = self._pending
        auto = self._auto if self._auto_used else None
        learned = False
        began = time.perf_counter()
        try:
            self._wait_replies(time.monotonic() + self.round_timeout_s)
            local = next((p.error for p in pending if p.error), None)
            maxima = self._maxima(pending)
            if auto is not None:  # this rank's wish for an auto decision rides along
                wish = torch.tensor([1.0 if auto.link_changed() else 0.0])
                maxima = wish if maxima is None else torch.cat([maxima.reshape(-1), wish])
            failed, maxima = pg.agree(local is not None, maxima, self._group)
            if auto is not None:
                maxima, wished = maxima[:-1], bool(maxima[-1] > 0.0)
            if failed:
                self._step_failed(local or "another rank could not use dlcp in this step")
            else:
                self._step_done(maxima)
            if auto is not None and self._link is not None:
                learned = True
                auto_steps.step(cast("DlcpState", self), auto, wished, pending)
        finally:
            if auto is not None and not learned:
                auto.discard_step()  # a failed step teaches nothing
            self._pending = []
            self._auto_used = False
            if self._link is not None:
                self._reserve_for_next_step(self._link.arena)
            self._timeline.end_step(time.perf_counter() - began)
            self._end_step()

    def _reserve_for_next_step(self, arena: Arena) -> None:
        """Free the step's regions; if the step outgrew the segment, size it for
        the whole step now, between steps, so the next one does not grow it
        bucket by bucket (each growth waits for the buckets in flight)."""
        taken = arena.step_bytes
        arena.reset()
        try:
            if taken > arena.segment.size and arena.reserve(with_headroom(taken)):
                self.segment_bytes = max(self.segment_bytes or 0, arena.segment.size)
        except Exception as exc:  # the next step grows it, or fails over
            log.debug("dlcp: could not grow the segment between steps: %s", exc)

    def _maxima(self, pending: list[_Pending]) -> torch.Tensor | None:
        """What the agreement carries for the next THC scales: per bucket its max
        ("bucket") or its per-packet maxima ("packet"); nothing for "exact".
        Zeros where this rank has none: the length is the same on every rank."""
        if self.scale_mode == "exact":
            return None
        parts = []
        for p in pending:
            if p.plan is None or not p.plan.scaled:
                continue
            n = p.plan.packets if self.scale_mode == "packet" else 1
            if p.sub is None:
                parts.append(torch.zeros(n))
            elif n == 1:
                parts.append(p.sub.block_max.max().reshape(1))
            else:
                parts.append(p.sub.block_max)
        return torch.cat(parts) if parts else None

    def _step_done(self, maxima: torch.Tensor) -> None:
        at = 0
        for p in self._pending:
            at, _ = self._bucket_done(p, maxima, at, p.buffer)

    def _bucket_done(
        self, p: _Pending, maxima: torch.Tensor, at: int, into: torch.Tensor
    ) -> tuple[int, torch.Tensor]:
        """One agreed bucket: its mean decoded into `into` (the bucket in plain
        mode; overlap mode's own tensor, `dlcp.shim.overlap`), its counters and
        next scale (from `maxima[at:]`), its future completed. Returns where its
        successor's maxima start, and the mean."""
        assert p.sub is not None and p.reply is not None
        plan = p.sub.plan
        if p.times is not None:
            p.times.decoding = time.perf_counter()
        dec = decode_round(
            plan, p.sub.region, p.buffer.device, self._staging, into, average=p.average
        )
        if p.ef is not None and dec.sums is not None:  # fft: the next coefficient set
            plan.codec.learn(
                p.ef, dec.sums, dec.counts, per_packet=plan.per_packet, maxima=dec.maxima
            )
        if dec.mean is not into:
            into.copy_(dec.mean.to(into.dtype))
        if p.times is not None:
            p.times.decoded = time.perf_counter()
        self.rounds += 1
        self.lost_lanes += int(p.reply.get("lost_lanes", 0))
        self.total_lanes += int(p.reply.get("total_lanes", 0))
        self.saturated += p.sub.saturated
        if plan.scaled and self.scale_mode != "exact":
            n = plan.packets if self.scale_mode == "packet" else 1
            if p.keep:
                seen = maxima[at : at + n].expand(plan.packets)
                self._scales[p.key] = self._scale_from(seen)
            at += n
        if p.future is not None:
            p.future.set_result(p.buffer)
        if p.times is not None:
            p.times.completed = time.perf_counter()
        return at, into

    def _step_failed(self, reason: str) -> None:
        for p in self._pending:
            if p.ef is not None and p.snapshot is not None:
                p.ef.residual, p.ef.rounds, p.ef.saturated = p.snapshot
        self._fail(reason)
        if self.strict:
            err = ShimError(f"dlcp all-reduce failed: {reason}")
            for p in self._pending:
                if p.future is not None:
                    p.future.set_exception(err)  # type: ignore[arg-type]
            if not any(p.future is not None for p in self._pending):
                raise err
            return
        for p in self._pending:
            pg.fallback_all_reduce(p.buffer, self._group, average=p.average)
            self._count_fallbacks(1)
            if p.future is not None:
                p.future.set_result(p.buffer)

    def _end_step(self) -> None:
        self.round += 1
        self._layers.end_step()
        if self._link is not None or self._detached_round is None:
            return
        since = self.round - self._detached_round
        due = self.retry_steps is not None and since % self.retry_steps == 0
        if self.retry_s is not None:
            mine = time.monotonic() - self._last_attempt >= self.retry_s
            any_due, _ = pg.agree(mine, None, self._group)
            due = due or any_due
        if due:
            self._attach_due = True

    # -- helpers ----------------------------------------------------------------------
    def _fail(self, reason: str) -> None:
        """Every rank decided to leave the daemon: detach, warn once, or raise."""
        self._close_link()
        self.failures += 1
        self.last_error = reason
        self._detached_round = self.round
        if self.strict:
            self._attach_due = True
            raise_now = not self._pending
            if raise_now:
                raise ShimError(f"dlcp is unavailable: {reason}")
            return
        message = f"dlcp: {reason}; using the process group's all-reduce until it is back"
        if not self._warned:  # warn once; later failures (e.g. reattach attempts) only log
            self._warned = True
            warnings.warn(message, RuntimeWarning, stacklevel=4)
        else:
            log.info(message)

    def _require_fallback(self) -> None:
        if self.strict:
            raise ShimError(f"dlcp is unavailable: {self.last_error or 'not attached'}")

    def _count_fallbacks(self, n: int) -> None:
        self.fallbacks += n
        self._unreported += n

    def _close_link(self) -> None:
        link, self._link = self._link, None
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        if link is not None:
            link.close()
