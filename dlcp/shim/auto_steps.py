"""codec="auto" through the shim: `AutoDriver`, what a `DlcpState` does with
its `AutoCodec`.

The shim's part of the cost model's codec choice (dlcp/shim/auto.py decides):
the host's codec costs and the daemon's per-peer rates read once attached
(`prepare`, `poll_link`: never blocking a step for them), each bucket's
exchange timed (`handed`), and at a decision the ranks' agreement on the
next codec (`step`: the argmin of their averaged predictions, two small
all-reduces); the caller drops the old codec's error feedback and scales.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from typing import Any

import torch

from dlcp.shim import pg
from dlcp.shim.auto import AUTO, AutoCodec, available, host_calibration, link_from_status
from dlcp.shim.link import Link
from dlcp.shim.stepstate import _Pending

__all__ = ["AutoDriver", "time_exchange"]

log = logging.getLogger("dlcp.shim")


class AutoDriver:
    """The `AutoCodec` of one state (`codec`: pickled; None until auto is first
    used), the daemon's rates asked for and not yet read, and whether the step
    under way runs through auto."""

    def __init__(
        self,
        link_bps: float | str | None,
        options: dict[str, Any],
        codec: AutoCodec | None = None,
        *,
        now: bool = False,
    ) -> None:
        self._link_bps = link_bps
        self._options = options
        self.codec = codec
        if now and codec is None:
            self.codec = self._new()  # fail early on bad settings
        self._status: Future[dict[str, Any]] | None = None
        self._used = False  # the step under way went through auto

    def _new(self) -> AutoCodec:
        return AutoCodec(link_bps=self._link_bps, **self._options)

    def for_name(self, name: str, link: Link | None) -> AutoCodec | None:
        """The auto state when `name` is auto (made on first use); marks the step."""
        if name != AUTO:
            return None
        if self.codec is None:
            self.codec = self._new()
            self.prepare(link)
        self._used = True
        return self.codec

    def in_step(self) -> AutoCodec | None:
        """The auto state if the step under way went through auto."""
        return self.codec if self._used else None

    def step_over(self) -> None:
        self._used = False

    def handed(self, p: _Pending) -> None:
        """Bucket `p` left the hook (submitted): time its exchange."""
        time_exchange(p)
        if self.codec is not None:
            self.codec.bucket_left(time.perf_counter())

    def prepare(self, link: Link | None) -> None:
        """Once attached: this host's codec costs (cached per host, calibrated on
        first use) and a first read of the daemon's rates. A rank without costs
        predicts only its current codec, so the average keeps every rank on it."""
        auto = self.codec
        if auto is None or link is None:
            return
        if auto.calibration is None:
            try:
                auto.calibration = host_calibration(auto.candidates, len(link.membership.hosts))
            except Exception as exc:
                log.warning("dlcp: auto has no codec costs (%s); it stays on %s", exc, auto.current)
        self._status = None
        self.poll_link(link, auto, wait=False)

    def poll_link(self, link: Link, auto: AutoCodec, *, wait: bool) -> None:
        """Read the daemon's per-peer rates (`status`) without blocking the step:
        a reply is taken at a later step's end (`wait`: now, for a decision)."""
        if not auto.reads_link:
            return
        fut = self._status
        if fut is not None and (wait or fut.done()):
            self._status = None
            try:
                status = fut.result(timeout=2.0)["status"]
                m = link.membership
                peers = [
                    f"{h['addresses'][0]}:{h['udp_port']}"
                    for i, h in enumerate(m.hosts)
                    if i != m.me
                ]
                auto.observe_link(link_from_status(status, peers))
            except Exception as exc:
                log.debug("dlcp: auto could not read the daemon's rates: %s", exc)
        if self._status is None and (auto.poll_due() or auto.link_bps is None):
            try:
                self._status = link.client.request("status")
            except Exception as exc:
                log.debug("dlcp: auto could not ask the daemon's rates: %s", exc)

    def step(
        self, link: Link, group: pg.Group, wished: bool, pending: list[_Pending]
    ) -> str | None:
        """End of a step through auto, every rank attached: learn from the step, and
        at a decision (scheduled, or some rank's link moved) agree the codec of the
        next steps: the argmin of the ranks' averaged predictions (two small
        all-reduces). Returns the codec left when it switched (None: kept)."""
        auto = self.codec
        assert auto is not None
        hosts = len(link.membership.hosts)
        exchanges = [
            (p.buffer.numel(), p.sent_at, p.replied_at)
            for p in pending
            if p.sent_at is not None and p.replied_at is not None
        ]
        auto.end_step(
            exchanges if len(exchanges) == len(pending) else (),
            hosts=hosts,
            now=time.perf_counter(),
        )
        decide = auto.scheduled() or wished
        self.poll_link(link, auto, wait=decide)
        if not decide:
            return None
        if wished:  # some rank's link moved: what was measured no longer holds
            auto.forget()
        times = auto.local_times(hosts)
        mean = pg.average(torch.tensor(times, dtype=torch.float32), group).tolist()
        mine = auto.proposal(mean)
        agreed = int(pg.global_max(torch.tensor([float(mine)]), group)[0])
        before = auto.adopt(agreed, mean)
        _log_decision(auto, before)
        return before


def _log_decision(auto: AutoCodec, before: str | None) -> None:
    summary = ", ".join(
        f"{c} {1e3 * t:.1f}" if available(t) else f"{c} -" for c, t in auto.predicted.items()
    )
    rate = "unknown" if auto.link_bps is None else f"{auto.link_bps / 1e6:.0f} Mbit/s"
    measured = ", ".join(f"{c} {g / 1e6:.0f}" for c, g in auto.goodput_bps.items())
    if measured:
        rate += f"; measured goodput Mbit/s: {measured}"
    if before is None:
        log.debug("dlcp: auto keeps %s (predicted ms: %s; link %s)", auto.codec, summary, rate)
        return
    log.info(
        "dlcp: auto switches %s -> %s after step %d (predicted ms: %s; link %s)",
        before,
        auto.codec,
        auto.steps,
        summary,
        rate,
    )


def time_exchange(p: _Pending) -> None:
    """Note when `p` went to the daemon and when its reply comes (goodput)."""
    if p.sub is None or p.error is not None:
        return
    p.sent_at = time.perf_counter()

    def replied(_: Future[dict[str, Any]]) -> None:
        if p.replied_at is None:
            p.replied_at = time.perf_counter()

    p.sub.reply.add_done_callback(replied)
