"""codec="auto" at a step's end: what `DlcpState` does with its `AutoCodec`.

The shim's part of the cost model's codec choice (dlcp/shim/auto.py decides):
the host's codec costs and the daemon's per-peer rates read once attached
(`prepare`, `poll_link`: never blocking a step for them), each bucket's
exchange timed (`time_exchange`), and at a decision the ranks' agreement on
the next codec (`step`: the argmin of their averaged predictions, two small
all-reduces), the old codec's error feedback and scales dropped.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import torch

from dlcp.shim import pg
from dlcp.shim.auto import AutoCodec, available, host_calibration, link_from_status

if TYPE_CHECKING:
    from dlcp.shim.state import DlcpState
    from dlcp.shim.stepstate import _Pending

__all__ = ["poll_link", "prepare", "step", "time_exchange"]

log = logging.getLogger("dlcp.shim")


def prepare(state: DlcpState) -> None:
    """Once attached: this host's codec costs (cached per host, calibrated on
    first use) and a first read of the daemon's rates. A rank without costs
    predicts only its current codec, so the average keeps every rank on it."""
    auto, link = state._auto, state._link
    if auto is None or link is None:
        return
    if auto.calibration is None:
        try:
            auto.calibration = host_calibration(auto.candidates, len(link.membership.hosts))
        except Exception as exc:
            log.warning("dlcp: auto has no codec costs (%s); it stays on %s", exc, auto.current)
    state._status = None
    poll_link(state, auto, wait=False)


def poll_link(state: DlcpState, auto: AutoCodec, *, wait: bool) -> None:
    """Read the daemon's per-peer rates (`status`) without blocking the step:
    a reply is taken at a later step's end (`wait`: now, for a decision)."""
    link = state._link
    if link is None or not auto.reads_link:
        return
    fut = state._status
    if fut is not None and (wait or fut.done()):
        state._status = None
        try:
            status = fut.result(timeout=2.0)["status"]
            m = link.membership
            peers = [
                f"{h['addresses'][0]}:{h['udp_port']}" for i, h in enumerate(m.hosts) if i != m.me
            ]
            auto.observe_link(link_from_status(status, peers))
        except Exception as exc:
            log.debug("dlcp: auto could not read the daemon's rates: %s", exc)
    if state._status is None and (auto.poll_due() or auto.link_bps is None):
        try:
            state._status = link.client.request("status")
        except Exception as exc:
            log.debug("dlcp: auto could not ask the daemon's rates: %s", exc)


def time_exchange(p: _Pending) -> None:
    """Note when `p` went to the daemon and when its reply comes (goodput)."""
    if p.sub is None or p.error is not None:
        return
    p.sent_at = time.perf_counter()

    def replied(_: Future[dict[str, Any]]) -> None:
        if p.replied_at is None:
            p.replied_at = time.perf_counter()

    p.sub.reply.add_done_callback(replied)


def step(state: DlcpState, auto: AutoCodec, wished: bool, pending: list[_Pending]) -> None:
    """End of a step through auto, every rank attached: learn from the step, and
    at a decision (scheduled, or some rank's link moved) agree the codec of the
    next steps: the argmin of the ranks' averaged predictions (two small
    all-reduces)."""
    assert state._link is not None
    hosts = len(state._link.membership.hosts)
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
    poll_link(state, auto, wait=decide)
    if not decide:
        return
    if wished:  # some rank's link moved: what was measured no longer holds
        auto.forget()
    times = auto.local_times(hosts)
    mean = pg.average(torch.tensor(times, dtype=torch.float32), state._group).tolist()
    mine = auto.proposal(mean)
    agreed = int(pg.global_max(torch.tensor([float(mine)]), state._group)[0])
    before = auto.adopt(agreed, mean)
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
    for table in (state._ef, state._scales):  # the old codec's feedback and scales
        for k in [k for k in table if len(k) > 2 and k[1] == before]:
            del table[k]
