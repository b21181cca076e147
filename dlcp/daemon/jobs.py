"""Jobs the daemon takes part in, and the local rounds that sum ranks on this host."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dlcp.core.engine import JobSpec
from dlcp.daemon.outbox import Peer
from dlcp.errors import LocalError

__all__ = ["HostAddr", "JobState", "LocalPart", "LocalRound", "OpKey", "parse_hosts"]

OpKey = tuple[int, int, int]  # (job, round, bucket): a local round's key


@dataclass(frozen=True)
class HostAddr:
    addresses: tuple[str, ...]
    udp_port: int


def parse_hosts(raw: Any) -> tuple[HostAddr, ...]:
    if not isinstance(raw, list) or not 1 <= len(raw) <= 257:
        raise LocalError("hosts must be a list of 1..257 hosts")
    hosts = []
    for i, h in enumerate(raw):
        if not isinstance(h, dict) or set(h) - {"addresses", "udp_port"}:
            raise LocalError(f"hosts[{i}] must be {{addresses, udp_port}}")
        addrs = h.get("addresses")
        if not isinstance(addrs, list) or not 1 <= len(addrs) <= 8:
            raise LocalError(f"hosts[{i}].addresses must list 1..8 addresses")
        try:
            parsed = tuple(str(ipaddress.IPv4Address(a)) for a in addrs)
        except (ValueError, TypeError):
            raise LocalError(f"hosts[{i}].addresses: not IPv4 addresses") from None
        port = h.get("udp_port")
        if not isinstance(port, int) or isinstance(port, bool) or not 1 <= port <= 65535:
            raise LocalError(f"hosts[{i}].udp_port must be 1..65535")
        hosts.append(HostAddr(parsed, port))
    if len({h.addresses for h in hosts}) != len(hosts):
        raise LocalError("hosts lists a daemon twice")
    return tuple(hosts)


@dataclass(eq=False)
class JobState:
    spec: JobSpec
    hosts: tuple[HostAddr, ...]
    local_ranks: int
    mode: str
    static: bool = False  # from the config: stays without clients
    peers: dict[int, Peer] = field(default_factory=dict)  # node -> peer
    node_of: dict[str, int] = field(default_factory=dict)  # source address -> node
    clients: set[object] = field(default_factory=set)
    rounds_completed: int = 0
    rounds_failed: int = 0

    def signature(self) -> tuple[object, ...]:
        s = self.spec
        return (
            s.key,
            s.me,
            s.contributors,
            s.owners,
            s.payload,
            s.ranks,
            self.hosts,
            self.local_ranks,
        )

    def describe(self) -> dict[str, Any]:
        s = self.spec
        return {
            "job": s.job,
            "mode": self.mode,
            "me": s.me,
            "hosts": [{"addresses": list(h.addresses), "udp_port": h.udp_port} for h in self.hosts],
            "contributors": list(s.contributors),
            "owners": list(s.owners),
            "local_ranks": self.local_ranks,
            "ranks": s.ranks,
            "clients": len(self.clients),
            "rounds_completed": self.rounds_completed,
            "rounds_failed": self.rounds_failed,
        }


@dataclass(eq=False)
class LocalPart:
    """One rank's submit, waiting for its reply."""

    client: Any
    rid: int
    out: tuple[int, int]
    data: np.ndarray  # copy of the lanes (uint8)
    layers: np.ndarray | None
    norms: np.ndarray | None
    block_max: np.ndarray | None
    n_layers: int | None = None  # the model's layer count ("layers" of the submit)


@dataclass(eq=False)
class LocalRound:
    job: int
    round: int
    bucket: int
    codec: int
    total: int
    bound: float
    scale: float
    expected: int
    started: float
    parts: list[LocalPart] = field(default_factory=list)
    submitted: bool = False
    kind: str = "allreduce"  # what the round moves (dlcp.core.records.ROUND_KINDS)

    def same(self, codec: int, total: int, bound: float, scale: float, kind: str) -> bool:
        mine = (self.codec, self.total, self.bound, self.scale, self.kind)
        return mine == (codec, total, bound, scale, kind)
