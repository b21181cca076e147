"""The daemon's way out: the engine's batches queued in the outbox (each
run of consecutive batches for one peer in one push), a flush that survives
a send error, and what a path found down asks for.

`NetworkOut` is given the jobs (whose peers the batches go to), the outbox,
the credits and the counters; it keeps no state of its own.
"""

from __future__ import annotations

import logging
import struct
from collections import Counter

from dlcp.core.engine import SendBatch
from dlcp.daemon.credits import Credits
from dlcp.daemon.jobs import JobState
from dlcp.daemon.outbox import Outbox, Peer

__all__ = ["NetworkOut"]

log = logging.getLogger("dlcpd")

_JOB = struct.Struct("!I")


class NetworkOut:
    """The engine's output to the outbox's queues and sockets."""

    def __init__(
        self,
        *,
        jobs: dict[int, JobState],
        outbox: Outbox,
        credits: Credits,
        counters: Counter[str],
    ) -> None:
        self.jobs = jobs  # read only: the round lifecycle keeps it
        self.outbox = outbox
        self.credits = credits
        self.counters = counters

    def enqueue(self, batches: list[SendBatch], now: float) -> None:
        """Queue the engine's datagrams: each run of consecutive batches for the
        same peer at once (`Outbox.push_many`, as `push` one by one, in order).
        A batch's datagrams all belong to one job: its id is read once."""
        jobs = self.jobs
        run: Peer | None = None
        parts: list[SendBatch] = []
        for b in batches:
            if not b.datagrams:
                continue
            job = jobs.get(_JOB.unpack(b.datagrams[0][8:12])[0])  # bytes or Gathered
            peer = None if job is None else job.peers.get(b.node)
            if peer is None:
                continue
            if peer.health is not None:  # its paths are probed while it has traffic
                assert job is not None
                peer.tx_job = job.spec.job
                peer.health.touch(now)
            if peer is not run:
                if run is not None:
                    self._push_run(run, parts)
                run, parts = peer, []
            parts.append(b)
        if run is not None:
            self._push_run(run, parts)

    def _push_run(self, peer: Peer, parts: list[SendBatch]) -> None:
        if len(parts) == 1:  # the usual case: the lists as the engine made them
            self.outbox.push_many(peer, parts[0].datagrams, parts[0].priorities)
            return
        # new lists: the engine keeps some of its batches' lists (result
        # datagrams); joined by list extends, no Python step a datagram
        dgs: list[bytes] = []
        prios: list[int] = []
        for b in parts:
            dgs += b.datagrams
            prios += b.priorities
        self.outbox.push_many(peer, dgs, prios)

    def path_down(self, peer: Peer, path: int, now: float) -> None:
        """`path` to `peer` was found down: what urgent went on it lately goes
        again on the live paths, and so does a credit (credits go on the
        first path in use, which may have been this one)."""
        self.outbox.path_down(peer, path, now)
        self.credits.path_down(peer)

    def flush(self, now: float) -> None:
        """`Outbox.flush` (`Sending.flush`); a send error is logged and
        counted, and the batch at the head dropped: it never wedges the loop."""
        try:
            self.outbox.flush(now)
        except OSError as exc:
            log.error("send failed, dropping the batch at the head: %s", exc)
            self.counters["send_errors"] += 1
            self.outbox.drop_head()
