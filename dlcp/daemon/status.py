"""A daemon's state as `dlcp status` and /metrics read it (`snapshot` and
the rejects and NACK answers they share; the tc class stats /metrics shows).

Both read the daemon through `DaemonView`, the attributes they may read, so
neither depends on the daemon's module (`dlcp.daemon.server.Daemon` is one).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

from dlcp.errors import DlcpError, Reason
from dlcp.wire import mac

if TYPE_CHECKING:
    from dlcp.core.engine import Engine
    from dlcp.daemon.config import Config
    from dlcp.daemon.jobs import JobState
    from dlcp.daemon.outbox import Outbox
    from dlcp.daemon.transport import UdpPath

__all__ = [
    "DaemonView",
    "TcStats",
    "mac_description",
    "nack_answers",
    "reject_reasons",
    "rejected",
    "snapshot",
]

log = logging.getLogger("dlcp.daemon")

_STARTED = time.monotonic()


class DaemonView(Protocol):
    """What `dlcp status` and /metrics read of a daemon."""

    config: Config
    counters: Counter[str]
    daemon_rejects: Counter[str]
    engine: Engine
    outbox: Outbox
    paths: list[UdpPath]
    requests: Counter[tuple[str, str]]
    tc: TcStats

    @property
    def clients(self) -> set[Any]: ...

    @property
    def draining(self) -> bool: ...

    @property
    def jobs(self) -> dict[int, JobState]: ...

    def describe(self) -> dict[str, Any]: ...


def snapshot(d: DaemonView) -> dict[str, Any]:
    """What `dlcp status` shows: the daemon, its jobs, paths, peers, counters and rejects."""
    return {
        "daemon": d.describe(),
        "draining": d.draining,
        "uptime_s": round(time.monotonic() - _STARTED, 3),
        "jobs": [{**j.describe(), "nack_answers": nack_answers(d, j)} for j in d.jobs.values()],
        "clients": len(d.clients),
        "rounds_in_flight": d.engine.pending_rounds(),
        "mac": mac_description(d.config.mac),
        "paths": [
            {
                "address": p.address,
                "port": p.port,
                "gso": p.gso,
                "gro": p.gro,
                "sendmsg_calls": p.sendmsg_calls,
                "recvmsg_calls": p.recvmsg_calls,
            }
            for p in d.paths
        ],
        "peers": [
            {
                "peer": peer.name,
                "rate_bps": peer.rate.rate_bps,
                "queued": peer.queued,
                "lost_packets": peer.rate.lost_packets,
                "sent_packets": sum(peer.sent_packets.values()),
                "sent_bytes": sum(peer.sent_bytes.values()),
                "window_bytes": peer.window,
                "granted_bytes": peer.granted,
                "limit_bytes": peer.limit,
                "in_flight_bytes": peer.in_flight,
                "window_stalls": peer.window_stalls,
                "window_resets": peer.window_resets,
                "paths": [
                    {
                        # up, suspect, down or probing (dlcp/core/pathhealth.py);
                        # a peer with one path is not probed: always up
                        "state": "up" if peer.health is None else peer.health.status(i).label,
                        "probe_rtt_s": None if peer.health is None else peer.health.rtt(i),
                        "weight": ps.weight,
                        "loss_rate": ps.loss_rate,
                        "sent": ps.sent,
                        "rate_bps": rc.rate_bps,
                    }
                    for i, (ps, rc) in enumerate(zip(peer.paths, peer.rate.paths, strict=True))
                ],
            }
            for peer in d.outbox.peers.values()
        ],
        "counters": {
            **dict(d.engine.stats),
            **dict(d.counters),
            "credits_taken": d.outbox.credits,
        },
        "rejects": {r: rejected(d, r) for r in reject_reasons(d)},
    }


def nack_answers(d: DaemonView, job: JobState) -> list[dict[str, Any]]:
    """How soon each peer of `job` answers this daemon's NACKs (Engine.nack_answers)."""
    out = []
    for node, answer in d.engine.nack_answers(job.spec.job).items():
        peer = job.peers.get(node)
        out.append({"node": node, "peer": None if peer is None else peer.name, **answer})
    return out


def mac_description(name: str) -> str:
    """The packet MAC and, for ghash-aes, whether the C extension computes it."""
    if name != "ghash-aes":
        return name
    return f"ghash-aes ({mac.GhashAesKey(bytes(32)).backend})"


def reject_reasons(d: DaemonView) -> list[str]:
    """Every reason a datagram can be rejected for (series start at 0 for alerts)."""
    return sorted({r.label for r in Reason} | set(d.daemon_rejects) | {"bad_address"})


def rejected(d: DaemonView, reason: str) -> int:
    """Datagrams rejected for `reason`, by the daemon and by its engine."""
    n = d.daemon_rejects.get(reason, 0)
    for r, c in d.engine.rejects.items():
        if r.label == reason:
            n += c
    return n


class TcStats:
    """The tc class stats of `devices` (`[tc] devices`), read once a second
    by `refresh` (netlink in a thread: it blocks) for /metrics to show."""

    def __init__(self, devices: Sequence[str]) -> None:
        self.devices = tuple(devices)
        self.samples: list[dict[str, Any]] = []

    async def refresh(self, stopped: asyncio.Event) -> None:
        if not self.devices:
            return
        from dlcp.tc import read_stats, stats_as_samples

        def read() -> list[dict[str, Any]]:
            out: list[dict[str, Any]] = []
            for dev in self.devices:
                try:
                    out += stats_as_samples(read_stats(dev), dev)
                except (DlcpError, OSError) as exc:
                    log.debug("tc stats of %s: %s", dev, exc)
            return out

        while not stopped.is_set():
            self.samples = await asyncio.to_thread(read)
            await asyncio.sleep(1.0)
