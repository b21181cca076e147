"""A `DlcpState`'s attachment to its host's daemon: attaching (collective,
`dlcp.shim.link.attach`), leaving it when every rank decided to (`fail`),
when to try again (`step_ended`: every `retry_steps` steps, or `retry_s`
on any rank's clock), the segment's size, and the counts of all that. The
first attach also makes the agreement's hedge groups (`dlcp.shim.hedge`),
kept for the state's life: `agreement` is what `pg.agree` runs on.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import time
import warnings
import weakref
from typing import Any

import torch.distributed as dist

from dlcp.errors import LocalError
from dlcp.shim import pg
from dlcp.shim.client import default_socket
from dlcp.shim.hedge import Hedge
from dlcp.shim.link import AttachFailed, Link, attach
from dlcp.shim.rendezvous import Store
from dlcp.shim.settings import ShimSettings
from dlcp.shim.stepstate import ShimError, with_headroom

__all__ = ["Attachment"]

log = logging.getLogger("dlcp.shim")

_INSTANCES = itertools.count()


class Attachment:
    """The link to the daemon (None while detached) and its lifecycle.

    Pickled state (`dlcp.shim.fields.PERSISTENT`, through `DlcpState`):
    segment_bytes, attaches, failures, last_error, fallbacks, unreported
    (fallbacks not yet reported to a daemon), detached_round.
    """

    def __init__(
        self,
        settings: ShimSettings,
        group: pg.Group,
        store: Store | None,
        *,
        segment_bytes: int | None = None,
        attaches: int = 0,
        failures: int = 0,
        last_error: str | None = None,
        fallbacks: int = 0,
        unreported: int = 0,
        detached_round: int | None = None,
    ) -> None:
        self._settings = settings
        self._group = group
        self._store = store
        self.segment_bytes = segment_bytes
        self.attaches = attaches
        self.failures = failures
        self.last_error = last_error
        self.fallbacks = fallbacks
        self.unreported = unreported
        self.detached_round = detached_round
        self.link: Link | None = None
        self.due = True  # attach at the next use
        self._finalizer: weakref.finalize[Any, Any] | None = None
        self._instance = next(_INSTANCES)
        self._attempts = 0
        self._last_attempt = -math.inf
        self._warned = False
        self._hedge: Hedge | None = None

    @property
    def group(self) -> pg.Group:
        return self._group

    @property
    def agreement(self) -> Hedge | pg.Group:
        """What the ranks' agreements run on: the hedge made at the first attach
        (the process group itself before that)."""
        return self._group if self._hedge is None else self._hedge

    def agreement_stats(self) -> dict[str, Any] | None:
        """The agreements' counts and times (`Hedge.describe`), once attached."""
        return None if self._hedge is None else self._hedge.describe()

    @property
    def store(self) -> Store | None:
        return self._store

    def attach(self, round_: int) -> bool:
        """Collective, between steps (`round_` the next): (re)attach every rank to
        its daemon. Returns whether attached; on failure raises `ShimError` when
        strict, else warns (`fail`)."""
        self.due = False
        self.close()
        if not dist.is_initialized():
            raise LocalError("dlcp.shim needs torch.distributed: call init_process_group first")
        s = self._settings
        self._attempts += 1
        self._last_attempt = time.monotonic()
        prefix = f"dlcp/{self._instance}/{self._attempts}"
        if self._hedge is None:  # collective: every rank's first attach makes it
            hedge_prefix = f"dlcp/{self._instance}/agree"
            self._hedge = Hedge.make(self._group, self._get_store(), hedge_prefix)
        result = attach(
            socket=s.socket or default_socket(),
            store=self._get_store(),
            rank=pg.group_rank(self._group),
            world=pg.group_size(self._group),
            prefix=prefix,
            segment_name=f"dlcp-{os.getpid()}-{self._instance}-{self._attempts}",
            segment_bytes=self.segment_bytes or 0,
            fallbacks=self.unreported,
            mode=s.mode,
            switch_socket=s.switch_socket,
            placement=s.placement,
            timeout=s.connect_timeout_s,
            store_timeout=s.rendezvous_timeout_s,
        )
        if isinstance(result, AttachFailed):
            if result.fatal:  # the same on every rank: settings that cannot work
                raise LocalError(result.reason)
            self.fail(result.reason, round_=round_, in_step=False)
            return False
        self.unreported = 0
        self.link = result
        self._finalizer = weakref.finalize(self, result.close)
        self.detached_round = None
        self.attaches += 1
        log.info(
            "dlcp: attached job %d as host %d of %d (%d local ranks)",
            result.membership.job,
            result.membership.me,
            len(result.membership.hosts),
            result.membership.local_ranks,
        )
        return True

    def close(self) -> None:
        """Drop the link (leaving the job), if any."""
        link, self.link = self.link, None
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        if link is not None:
            link.close()

    def fail(self, reason: str, *, round_: int, in_step: bool) -> None:
        """Every rank decided to leave the daemon at step `round_`: detach,
        warn once, or (strict) raise now unless a step is under way (`in_step`:
        its buckets' futures carry the error)."""
        self.close()
        self.failures += 1
        self.last_error = reason
        self.detached_round = round_
        if self._settings.strict:
            self.due = True
            if not in_step:
                raise ShimError(f"dlcp is unavailable: {reason}")
            return
        message = f"dlcp: {reason}; using the process group's all-reduce until it is back"
        if not self._warned:  # warn once; later failures (e.g. reattach attempts) only log
            self._warned = True
            warnings.warn(message, RuntimeWarning, stacklevel=5)
        else:
            log.info(message)

    def require_fallback(self) -> None:
        """Raise `ShimError` when strict: the process group must not stand in."""
        if self._settings.strict:
            raise ShimError(f"dlcp is unavailable: {self.last_error or 'not attached'}")

    def count_fallbacks(self, n: int) -> None:
        self.fallbacks += n
        self.unreported += n

    def step_ended(self, round_: int) -> None:
        """Step `round_` - 1 ended: while detached, whether to reattach at the
        next use (a step count every rank shares, or with `retry_s` any rank's
        clock: one tiny all-reduce)."""
        if self.link is not None or self.detached_round is None:
            return
        s = self._settings
        since = round_ - self.detached_round
        due = s.retry_steps is not None and since % s.retry_steps == 0
        if s.retry_s is not None:
            mine = time.monotonic() - self._last_attempt >= s.retry_s
            any_due, _ = pg.agree(mine, None, self.agreement)
            due = due or any_due
        if due:
            self.due = True

    def reserve(self, size: int) -> None:
        """Size the segment for `size` bytes now (not collective), between steps."""
        self.segment_bytes = max(self.segment_bytes or 0, size)
        if self.link is not None:
            self.link.arena.reserve(self.segment_bytes)

    def reserve_for_next_step(self) -> None:
        """Free the step's regions; if the step outgrew the segment, size it for
        the whole step now, between steps, so the next one does not grow it
        bucket by bucket (each growth waits for the buckets in flight)."""
        if self.link is None:
            return
        arena = self.link.arena
        taken = arena.step_bytes
        arena.reset()
        try:
            if taken > arena.segment.size and arena.reserve(with_headroom(taken)):
                self.segment_bytes = max(self.segment_bytes or 0, arena.segment.size)
        except Exception as exc:  # the next step grows it, or fails over
            log.debug("dlcp: could not grow the segment between steps: %s", exc)

    def _get_store(self) -> Store:
        if self._store is None:
            self._store = dist.distributed_c10d._get_default_store()
        return self._store
