"""A step's end in the shim: in the hook of the step's last bucket each rank
waits for its replies, then all ranks agree in one small all-reduce whether
any failed (and the next THC scales); if none did every rank decodes its
buckets, else every rank restores its error feedback, detaches and sends the
step's buckets over the process group (see `dlcp.shim.state`'s docstring).

`StepFinisher` owns the step count and the counts of what steps did (pickled
with the state); it works on the collaborators it is given.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from dlcp.shim import pg
from dlcp.shim.attachment import Attachment
from dlcp.shim.auto_steps import AutoDriver
from dlcp.shim.exchange import Decoded, decode_round
from dlcp.shim.launch import BucketLauncher
from dlcp.shim.scales import Scales
from dlcp.shim.settings import ShimSettings
from dlcp.shim.staging import Staging
from dlcp.shim.stepstate import ShimError, StepBuckets, _Pending, wait_replies
from dlcp.shim.timeline import Timeline

__all__ = ["StepFinisher"]


class StepFinisher:
    """Ending a step: replies, the ranks' agreement, decoding or falling back.

    Stats (pickled through `DlcpState`): round (steps ended), rounds (bucket
    rounds decoded), lost_lanes / total_lanes, saturated (THC values clamped).
    """

    def __init__(
        self,
        settings: ShimSettings,
        attachment: Attachment,
        step: StepBuckets,
        launcher: BucketLauncher,
        scales: Scales,
        staging: Staging,
        auto: AutoDriver,
        timeline: Timeline,
        *,
        round_: int = 0,
        rounds: int = 0,
        lost_lanes: int = 0,
        total_lanes: int = 0,
        saturated: int = 0,
    ) -> None:
        self._settings = settings
        self._attachment = attachment
        self._step = step
        self._launcher = launcher
        self._scales = scales
        self._staging = staging
        self._auto = auto
        self._timeline = timeline
        self.round = round_
        self.rounds = rounds
        self.lost_lanes = lost_lanes
        self.total_lanes = total_lanes
        self.saturated = saturated
        # the DDP buckets' means decoded ahead of the agreement, by (bucket, numel)
        self._scratch: dict[tuple[int, int], torch.Tensor] = {}

    # -- the end of a step -----------------------------------------------------------
    def finish(self) -> None:
        """The step's last bucket is in: agree, then decode or fall back; end the step."""
        step, s, group = self._step, self._settings, self._attachment.group
        auto = self._auto.in_step()
        learned = False
        began = time.perf_counter()
        try:
            step.wait(time.monotonic() + s.round_timeout_s, s.round_timeout_s)
            local = step.first_error()
            pending = list(step)
            maxima = self._scales.carried(pending)
            if auto is not None:  # this rank's wish for an auto decision rides along
                wish = torch.tensor([1.0 if auto.link_changed() else 0.0])
                maxima = wish if maxima is None else torch.cat([maxima.reshape(-1), wish])
            answer = pg.agree_start(local is not None, maxima, self._attachment.agreement)
            ahead = self._decode_ahead(pending) if local is None else {}
            failed, maxima = answer()
            if auto is not None:
                maxima, wished = maxima[:-1], bool(maxima[-1] > 0.0)
            if failed:
                self._step_failed(pending, local or "another rank could not use dlcp in this step")
            else:
                at = 0
                for p in pending:
                    into, dec = ahead.get(id(p), (p.buffer, None))
                    at, _ = self.bucket_done(p, maxima, at, into, dec)
            link = self._attachment.link
            if auto is not None and link is not None:
                learned = True
                left = self._auto.step(link, group, wished, pending)
                if left is not None:  # the old codec's feedback and scales
                    self._launcher.drop_codec(left)
                    self._scales.drop_codec(left)
        finally:
            if auto is not None and not learned:
                auto.discard_step()  # a failed step teaches nothing
            step.take()
            self._auto.step_over()
            self._attachment.reserve_for_next_step()
            self._timeline.end_step(time.perf_counter() - began)
            self.end_step()

    def finish_early(self, deliver: Callable[[torch.Tensor], None]) -> None:
        """The step's one bucket, an exact fp32 leg whose result each rank reads
        from its own round alone (the backend's reduce-scatter, whose shard
        only its rank holds, and all-gather, exact: `dlcp.shim.backend`), with
        `deliver` called with the round's sums as soon as this rank's round is
        in, before the ranks' agreement answers (2-3 ms a collective of
        FSDP's, whose next one waits for this one). The agreement still runs
        before anything else of the shim's: if another rank's round failed,
        every rank detaches and all-reduces the bucket's input over the
        process group (the failed rank's result, `deliver`ed then; this
        rank's already delivered result stands: the same sums, from its own
        round). Not for `strict` (its error must reach the caller)."""
        step, s = self._step, self._settings
        began = time.perf_counter()
        try:
            step.wait(time.monotonic() + s.round_timeout_s, s.round_timeout_s)
            local = step.first_error()
            (p,) = list(step)
            answer = pg.agree_start(local is not None, None, self._attachment.agreement)
            into = self._scratch_for(-1, p.buffer)
            dec: Decoded | None = None
            if local is None:
                assert p.sub is not None
                plan, region = p.sub.plan, p.sub.region
                try:
                    dec = decode_round(
                        plan, region, p.buffer.device, self._staging, into, average=p.average
                    )
                except Exception:  # raised again after the agreement, as `finish` does
                    dec = None
                else:
                    deliver(dec.mean)
            failed, maxima = answer()
            if failed:
                self._step_failed([p], local or "another rank could not use dlcp in this step")
                if dec is None:
                    deliver(p.buffer)  # the process group's sums
            else:
                _, mean = self.bucket_done(p, maxima, 0, into, dec)
                if dec is None:
                    deliver(mean)
        finally:
            step.take()
            self._auto.step_over()
            self._attachment.reserve_for_next_step()
            self._timeline.end_step(time.perf_counter() - began)
            self.end_step()

    def _scratch_for(self, bucket: int, buf: torch.Tensor) -> torch.Tensor:
        """A tensor like `buf` kept for bucket `bucket` from step to step."""
        key = (bucket, buf.numel())
        into = self._scratch.get(key)
        if into is None or into.dtype != buf.dtype:
            into = self._scratch[key] = torch.empty_like(buf)
        return into

    def end_step(self) -> None:
        """Count the step; while detached, see whether to reattach."""
        self.round += 1
        self._launcher.layers.end_step()
        self._attachment.step_ended(self.round)

    def _decode_ahead(self, pending: list[_Pending]) -> dict[int, tuple[torch.Tensor, Decoded]]:
        """While the step's agreement is in flight: the DDP buckets on the CPU
        decoded into tensors of their own (kept from step to step, as overlap
        mode's), not into the buckets, which a failed step still needs as
        they were (the fallback sends them). The agreement waits for the
        slowest rank's round; this rank's decoding (3-4 ms of a 10 MB fp16
        bucket) then no longer follows it. A bucket whose decode raises is
        left to `bucket_done`, after the agreement, as before."""
        ahead: dict[int, tuple[torch.Tensor, Decoded]] = {}
        for p in pending:
            buf = p.buffer
            if p.future is None or p.sub is None or p.reply is None or buf.device.type != "cpu":
                continue
            into = self._scratch_for(p.bucket, buf)
            if p.times is not None:
                p.times.decoding = time.perf_counter()
            try:
                dec = decode_round(
                    p.sub.plan, p.sub.region, buf.device, self._staging, into, average=p.average
                )
            except Exception:  # raised again where it was before: after the agreement
                continue
            ahead[id(p)] = into, dec
        return ahead

    def bucket_done(
        self,
        p: _Pending,
        maxima: torch.Tensor,
        at: int,
        into: torch.Tensor,
        dec: Decoded | None = None,
    ) -> tuple[int, torch.Tensor]:
        """One agreed bucket: its mean decoded into `into` (the bucket in plain
        mode; overlap mode's own tensor, `dlcp.shim.overlap`; a tensor of its
        own decoded `dec` ahead of the agreement, `_decode_ahead`), its
        counters and next scale (from `maxima[at:]`), its future completed
        with `into`. Returns where its successor's maxima start, and the mean."""
        assert p.sub is not None and p.reply is not None
        plan = p.sub.plan
        if dec is None:
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
        at = self._scales.learn(p, plan, maxima, at)
        if p.future is not None:
            p.future.set_result(into)
        if p.times is not None:
            p.times.completed = time.perf_counter()
        return at, into

    def agree_one(self, p: _Pending) -> tuple[str | None, torch.Tensor]:
        """Overlap mode: wait for one bucket's reply and agree it alone. Returns
        why it failed (None: it did not, on any rank) and the maxima agreed."""
        timeout = self._settings.round_timeout_s
        wait_replies([p], time.monotonic() + timeout, timeout)
        local = p.error
        agreement = self._attachment.agreement
        failed, maxima = pg.agree(local is not None, self._scales.carried([p]), agreement)
        if failed:
            restore(p)
            return local or "another rank could not use dlcp for a bucket", maxima
        return None, maxima

    def fallback(self, tensor: torch.Tensor, *, average: bool = True) -> None:
        """All-reduce `tensor` over the process group instead (counted)."""
        pg.fallback_all_reduce(tensor, self.group, average=average)
        self._attachment.count_fallbacks(1)

    def fail(self, reason: str) -> None:
        """Every rank decided to leave the daemon (`Attachment.fail`)."""
        self._attachment.fail(reason, round_=self.round, in_step=bool(self._step))

    @property
    def group(self) -> pg.Group:
        return self._attachment.group

    def _step_failed(self, pending: list[_Pending], reason: str) -> None:
        for p in pending:
            restore(p)
        self.fail(reason)
        if self._settings.strict:
            err = ShimError(f"dlcp all-reduce failed: {reason}")
            for p in pending:
                if p.future is not None:
                    p.future.set_exception(err)  # type: ignore[arg-type]
            if not any(p.future is not None for p in pending):
                raise err
            return
        for p in pending:
            self.fallback(p.buffer, average=p.average)
            if p.future is not None:
                p.future.set_result(p.buffer)


def restore(p: _Pending) -> None:
    """Put bucket `p`'s error feedback back as it was before its failed round."""
    if p.ef is not None and p.snapshot is not None:
        p.ef.residual, p.ef.rounds, p.ef.saturated = p.snapshot
