"""Rendezvous of the job's daemons through the process group's store.

Every rank says `hello` to its local daemon and publishes the outcome; ranks
whose daemons share a `daemon.id` are one host; hosts are ordered by their
lowest global rank; rank 0 also publishes a random job id and key. Then every
rank `join`s and publishes that outcome too. Both exchanges are all-gathers
through the store, so every rank sees the same entries and takes the same
decision: attached only if every rank's hello and join succeeded.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol

from dlcp.core.records import SWITCH_SHARDS
from dlcp.errors import DlcpError, LocalError
from dlcp.shim.placement import ps_fields

__all__ = ["Membership", "Store", "all_gather", "job_secret", "plan_membership"]


class Store(Protocol):
    """The part of `torch.distributed.Store` the rendezvous uses."""

    def set(self, key: str, value: str) -> None: ...
    def get(self, key: str) -> bytes: ...
    def wait(self, keys: list[str], timeout: timedelta) -> None: ...


@dataclass(frozen=True)
class Membership:
    """This rank's view of the job: what it sends in `join`."""

    job: int
    key: str  # hex
    hosts: list[dict[str, Any]]  # {"addresses": [...], "udp_port": N} in agreed order
    me: int
    local_ranks: int
    payload: int
    host_of_rank: list[int]
    # mode "switch": the aggregator in the switch ({"addresses", "udp_port"}),
    # the job's last host after the training hosts
    switch: dict[str, Any] | None = None
    # mode "ps" (`dlcp.shim.placement`): the dedicated servers' daemons, after
    # the training hosts, and whether the training hosts aggregate too
    servers: tuple[dict[str, Any], ...] = ()
    colocated: bool = False

    @property
    def ps(self) -> bool:
        return bool(self.servers) or self.colocated

    @property
    def job_hosts(self) -> list[dict[str, Any]]:
        """Every daemon of the job: the training hosts, then the switch's
        aggregator or the dedicated servers."""
        return [*self.hosts, *([self.switch] if self.switch is not None else []), *self.servers]

    @property
    def ps_fields(self) -> dict[str, Any]:
        """Mode "ps": the job's aggregators, contributors and shards in a join."""
        return ps_fields(len(self.hosts), len(self.servers), self.colocated)

    @property
    def aggregators(self) -> list[int]:
        """Mode "ps": the job's hosts that own shards (the servers, then the
        training hosts when co-located)."""
        aggs: list[int] = self.ps_fields["aggregators"]
        return aggs

    @property
    def shards(self) -> int:
        """How the job's buckets are cut (the daemons' `JobSpec` owners)."""
        if self.switch is not None:
            return SWITCH_SHARDS
        return int(self.ps_fields["shards"]) if self.ps else len(self.hosts)

    def join_fields(
        self, mode: str, *, at_switch: bool = False, server: int | None = None
    ) -> dict[str, Any]:
        """The `join` of this rank at its daemon, or (`at_switch`) the job's
        join at the switch's aggregator, or at dedicated server `server`."""
        me = self.me
        if at_switch or server is not None:
            me = len(self.hosts) + (server or 0)
        fields = {
            "job": self.job,
            "key": self.key,
            "hosts": self.job_hosts,
            "me": me,
            "local_ranks": self.local_ranks if me == self.me else 1,
            "ranks": len(self.host_of_rank),  # the job's every contribution
            "mode": mode,
            "payload": self.payload,
        }
        if self.ps:
            fields.update(self.ps_fields)
        return fields


def job_secret() -> dict[str, Any]:
    """A fresh job id (u32) and 32-byte key, drawn by rank 0."""
    return {"job": secrets.randbits(32), "key": secrets.token_hex(32)}


def all_gather(
    store: Store, prefix: str, rank: int, world: int, value: dict[str, Any], timeout: float
) -> list[dict[str, Any]]:
    """Every rank's `value` (JSON), in rank order; blocks until all have published."""
    store.set(f"{prefix}/{rank}", json.dumps(value, separators=(",", ":")))
    keys = [f"{prefix}/{r}" for r in range(world)]
    store.wait(keys, timedelta(seconds=timeout))
    out: list[dict[str, Any]] = []
    for k in keys:
        raw = store.get(k)
        try:
            entry = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise DlcpError(f"rendezvous entry {k} is not JSON: {exc}") from None
        if not isinstance(entry, dict):
            raise DlcpError(f"rendezvous entry {k} is not an object")
        out.append(entry)
    return out


def first_failure(entries: Sequence[dict[str, Any]]) -> str | None:
    """ "rank R: reason" of the first entry that is not ok, or None if all are."""
    for rank, e in enumerate(entries):
        if not e.get("ok"):
            return f"rank {rank}: {e.get('error', 'failed')}"
    return None


def plan_membership(
    daemons: Sequence[dict[str, Any]],
    rank: int,
    secret: dict[str, Any],
    switch: dict[str, Any] | None = None,
    servers: Sequence[dict[str, Any]] = (),
    colocated: bool = False,
) -> Membership:
    """Hosts, this rank's host index and its host's rank count, from every rank's
    daemon descriptor (rank order), and in mode "ps" the dedicated servers'
    descriptors (`servers`, after the hosts). Pure: the same inputs give every
    rank the same hosts in the same order. A server that is another server's
    daemon or a training host's is a `LocalError` (a placement that cannot work)."""
    if not 0 <= rank < len(daemons):
        raise DlcpError(f"rank {rank} outside the {len(daemons)} descriptors")
    host_ids: list[str] = []  # in order of lowest rank
    members: dict[str, list[int]] = {}
    for r, d in enumerate(daemons):
        did = str(d["id"])
        if did not in members:
            members[did] = []
            host_ids.append(did)
        members[did].append(r)
    hosts = []
    for did in host_ids:
        d = daemons[members[did][0]]
        hosts.append({"addresses": list(d["addresses"]), "udp_port": int(d["udp_port"])})
    index = {did: i for i, did in enumerate(host_ids)}
    mine = str(daemons[rank]["id"])
    payloads = [int(d["payload"]) for d in daemons]
    at_switch = None
    if switch is not None:
        at_switch = {"addresses": list(switch["addresses"]), "udp_port": int(switch["udp_port"])}
        payloads.append(int(switch["payload"]))
    seen = {did: f"training host {i}" for i, did in enumerate(host_ids)}
    for k, d in enumerate(servers):
        did = str(d["id"])
        if did in seen:
            also = " (to aggregate there, pass colocate=True)" if did in index else ""
            raise LocalError(f"mode='ps': server {k} is the same daemon as {seen[did]}{also}")
        seen[did] = f"server {k}"
        payloads.append(int(d["payload"]))
    return Membership(
        job=int(secret["job"]),
        key=str(secret["key"]),
        hosts=hosts,
        me=index[mine],
        local_ranks=len(members[mine]),
        payload=min(payloads),
        host_of_rank=[index[str(d["id"])] for d in daemons],
        switch=at_switch,
        servers=tuple(
            {"addresses": list(d["addresses"]), "udp_port": int(d["udp_port"])} for d in servers
        ),
        colocated=colocated,
    )
