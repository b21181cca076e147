"""Where a `mode="ps"` job sums its buckets: parameter servers, as users of
BytePS-style parameter servers place them.

A BytePS job runs its summation on server processes: on CPU machines of their
own (dedicated servers), or one on each training machine (co-located), or
both. Here a server is a dlcp daemon that owns shards of every bucket:

* dedicated: `servers=[socket, ...]` (or `DLCP_PS_SERVERS`, comma-separated)
  names the sockets of daemons on hosts without ranks; rank 0 puts the job on
  each (as a BytePS scheduler hands servers their workers) and holds it there.
  They sum and send back, and contribute nothing;
* co-located: no servers (or `colocate=True`): every training host's daemon
  also owns shards;
* both: `servers=[...]` and `colocate=True`.

Each bucket is cut into `dlcp.core.records.ps_shards` shards (at least 8,
the same number for each aggregator, dealt round robin: BytePS's partitions),
so a server sums and returns one shard while the next comes in.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from dlcp.core.records import ps_shards
from dlcp.errors import LocalError

__all__ = ["SERVERS_ENV", "Placement", "placement", "ps_fields"]

SERVERS_ENV = "DLCP_PS_SERVERS"


@dataclass(frozen=True)
class Placement:
    """A "ps" job's aggregators: dedicated servers' sockets, and whether the
    training hosts aggregate too."""

    servers: tuple[str, ...]
    colocate: bool


def placement(
    mode: str, servers: Sequence[str] | str | None, colocate: bool | None
) -> Placement | None:
    """The placement that `servers` and `colocate` ask for (None outside mode
    "ps"), or a `LocalError` that says why it cannot work: servers or
    colocate outside mode "ps", an empty or duplicated server list, neither
    servers nor co-located aggregators."""
    if mode != "ps":
        if servers or colocate is not None:
            raise LocalError(f"servers= and colocate= are for mode='ps', not {mode!r}")
        return None
    if servers is None:
        servers = os.environ.get(SERVERS_ENV) or None
    if isinstance(servers, str):
        servers = [s.strip() for s in servers.split(",")]
    given = servers is not None
    names = tuple(str(s) for s in servers or ())
    if given and not names:
        raise LocalError("mode='ps': servers= is an empty list; name a server or leave it out")
    if any(not s for s in names):
        raise LocalError(f"mode='ps': servers= has an empty socket path: {list(names)}")
    twice = sorted({s for s in names if names.count(s) > 1})
    if twice:
        raise LocalError(f"mode='ps': servers= names {twice} twice")
    on_hosts = (not names) if colocate is None else bool(colocate)
    if not names and not on_hosts:
        raise LocalError("mode='ps' with colocate=False needs servers= (or DLCP_PS_SERVERS)")
    return Placement(names, on_hosts)


def ps_fields(hosts: int, servers: int, colocated: bool) -> dict[str, Any]:
    """A "ps" job's shape in a `join`: `hosts` training hosts, then `servers`
    dedicated servers; the aggregators (the servers, then the training hosts
    when co-located), the contributors (the training hosts) and the shards."""
    aggs = [*range(hosts, hosts + servers), *(range(hosts) if colocated else ())]
    return {"aggregators": aggs, "contributors": list(range(hosts)), "shards": ps_shards(len(aggs))}
