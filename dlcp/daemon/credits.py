"""The receiver's side of flow control: the window this daemon grants the
hosts that send to it, and the credits that tell each one how many of its
bytes have left the sockets (`dlcp.daemon.flow` is the sender's side).

`Credits` owns the grant (`rx_grant`) and writes each peer's receive credit
bookkeeping (`rx_credited`, `rx_granted`); the network-in path calls `send`
when a peer's bytes have been taken, the round lifecycle `size_windows` when
the jobs change.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from dlcp.core.engine import Engine
from dlcp.core.rate import RateConfig
from dlcp.daemon.flow import size_windows
from dlcp.daemon.jobs import JobState
from dlcp.daemon.outbox import Outbox, Peer
from dlcp.daemon.transport import UdpPath

__all__ = ["Credits"]


class Credits:
    """Credits sent to the peers, and the window they grant."""

    def __init__(
        self,
        *,
        engine: Engine,
        paths: Sequence[UdpPath],
        outbox: Outbox,
        jobs: dict[int, JobState],
        window_bytes: int,
        rate: RateConfig,
        counters: Counter[str],
    ) -> None:
        self.engine = engine
        self.paths = paths  # the daemon's list: the sockets whose emptiness a credit tells
        self.outbox = outbox
        self.jobs = jobs  # read only: the round lifecycle keeps it
        self.window_bytes = window_bytes
        self.rate = rate
        self.counters = counters
        # the window granted in credits to each host that sends here (`size_windows`)
        self.rx_grant = 0

    def send(self, peer: Peer, job: JobState) -> None:
        """Tell `peer` how many of its bytes this daemon has taken from its
        sockets, and whether they are empty now (a CONTROL packet of `job`,
        sent at once, past the queues: a credit must never wait for the window
        it opens)."""
        drained = all(p.empty() for p in self.paths)
        dg = self.engine.credit_datagram(
            job.spec.job, peer.rx_epoch, peer.rx_bytes, drained, self.rx_grant
        )
        if dg is None:
            return
        try:
            live = peer.live_path()  # path 0 unless it is out of use
            sent = peer.local[live].send([dg], peer.dest(live), self.outbox.tos[0])
        except OSError:
            sent = 0
        if not sent:  # socket full or an error: a later credit says as much (a count)
            self.counters["credits_unsent"] += 1
            return
        peer.rx_credited = peer.rx_bytes
        peer.rx_granted = self.rx_grant
        self.counters["credits_sent"] += 1

    def size_windows(self) -> None:
        """Each peer's pacing cap and flow-control window, and the window this
        daemon grants in its credits (`flow.size_windows`), told at once."""
        self.rx_grant = size_windows(self.jobs.values(), self.window_bytes, self.rate)
        if self.rx_grant:
            self.announce_grant()

    def announce_grant(self) -> None:
        """Credit at once each host that has sent here and was told another
        grant (a job joining or leaving changed it), rather than after its
        next 2 MiB, in the job it last sent in (one its daemon has). A host
        that has not sent yet starts at WINDOW_MIN (`Outbox.peer`) until its
        first credit tells it the grant."""
        for peer in self.outbox.peers.values():
            job = self.jobs.get(peer.rx_job) if peer.rx_job is not None else None
            if job is not None and peer.rx_granted != self.rx_grant:
                self.send(peer, job)

    def path_down(self, peer: Peer) -> None:
        """A path to `peer` went down: credit it again on the live paths
        (credits go on the first path in use, which may have been the one)."""
        job = self.jobs.get(peer.rx_job) if peer.rx_job is not None else None
        if job is not None and peer.usable is not None:
            self.send(peer, job)
