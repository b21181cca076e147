"""Path probes on the wire: what `PathHealth` asks for, sent, and the peers' probes echoed.

The health of each path to a peer with two or more paths is kept in the
core (dlcp/core/pathhealth.py, sans-IO); this module only moves its probes:
before each flush the daemon calls `run`, which sends the probes due (a
CONTROL packet on the path itself, past the queues, as credits go; which are
due, within the daemon's probe budget, `ProbePlan` says), logs the paths'
state changes and gives the outbox the paths in use (`Peer.usable`).
A probe from a peer is echoed at once on the path index it names.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Protocol

from dlcp.core.pathhealth import PathStatus
from dlcp.core.probeplan import ProbePlan
from dlcp.daemon.outbox import Peer
from dlcp.wire.probe import Probe, probe_payload

__all__ = ["Prober"]

log = logging.getLogger("dlcp.daemon")


class _Builds(Protocol):
    def control_datagram(self, job: int, payload: bytes) -> bytes | None: ...


class Prober:
    """Sends `peers`' probes and echoes; `tos()` is the control class's TOS byte.
    `count(name)` counts a send that failed (socket full or an error).
    `budget`: at most that many probes a probe interval over all peers and
    paths (0: no bound; dlcp/core/probeplan.py). `peers()` only grows (new
    peers are appended, as `Outbox.multipath`)."""

    def __init__(
        self,
        peers: Callable[[], Sequence[Peer]],
        engine: _Builds,
        tos: Callable[[], int],
        count: Callable[[str], None],
        budget: int = 0,
    ) -> None:
        self._peers = peers
        self._engine = engine
        self._tos = tos
        self._count = count
        self.plan: ProbePlan[Peer] = ProbePlan(budget)

    def _add_new(self) -> None:
        peers, plan = self._peers(), self.plan
        for peer in peers[len(plan) :]:
            assert peer.health is not None
            plan.add(peer, peer.health)

    def run(self, now: float) -> list[tuple[Peer, int]]:
        """Send the probes due (of the active multi-path peers, within the
        budget); update `usable` of the peers whose paths changed state.
        Returns the (peer, path) found down now."""
        self._add_new()
        plan = self.plan
        for peer, path, seq in plan.due(now):
            job = peer.tx_job if peer.tx_job is not None else peer.rx_job
            dg = (
                None
                if job is None
                else self._engine.control_datagram(job, probe_payload(path, seq))
            )
            if dg is None:  # (the job is gone: its deadline will say so)
                continue
            self._send(peer, path, dg)
        down: list[tuple[Peer, int]] = []
        touched = plan.touched
        if touched:
            for peer in touched:
                self._changed(peer, down)
            touched.clear()
        return down

    def _changed(self, peer: Peer, down: list[tuple[Peer, int]]) -> None:
        """Log `peer`'s paths' state changes, note those gone down, set `usable`."""
        health = peer.health
        assert health is not None
        for path, old, new, _at in health.changes:
            if new == PathStatus.DOWN:
                down.append((peer, path))
            # down and back up are worth an operator's attention; a
            # suspect path (one late probe) is not, on its own
            loud = new in (PathStatus.DOWN, PathStatus.DEGRADED) or (
                new == PathStatus.UP and old in (PathStatus.PROBING, PathStatus.DEGRADED)
            )
            level = logging.WARNING if loud else logging.INFO
            log.log(
                level, "path %d to %s: %s -> %s", path, peer.addresses[path], old.label, new.label
            )
        health.changes.clear()
        peer.usable = health.usable(degraded=peer.balancer.weighs_paths)

    def reset_usable(self) -> None:
        """Every peer's `usable` anew (the balancers changed: whether a degraded
        path carries data depends on theirs); `run` sets it on changes only."""
        for peer in self._peers():
            if peer.health is not None:
                peer.usable = peer.health.usable(degraded=peer.balancer.weighs_paths)

    def next_timer(self) -> float | None:
        """When `run` has probes to send or deadlines to judge next."""
        self._add_new()
        return self.plan.next_timer()

    def on_probe(self, peer: Peer, job: int, probe: Probe, now: float) -> None:
        """A probe or an echo from `peer` (in `job`) arrived at `now`."""
        if probe.echo:
            if peer.health is not None:
                rtt = peer.health.on_echo(probe.path, probe.seq, now)
                if rtt is not None and rtt > 0:  # the balancer's delay statistics
                    peer.balancer.on_rtt(peer.paths[probe.path], rtt, now)
            return
        if not 0 <= probe.path < len(peer.paths):
            return
        dg = self._engine.control_datagram(job, probe_payload(probe.path, probe.seq, echo=True))
        if dg is not None:
            self._send(peer, probe.path, dg)

    def _send(self, peer: Peer, path: int, dg: bytes) -> None:
        try:
            sent = peer.local[path].send([dg], peer.dest(path), self._tos())
        except OSError:
            sent = 0
        if not sent:
            self._count("probes_unsent")
