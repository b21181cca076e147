"""Attaching a rank to its local daemon: hello, rendezvous, join, segment.

`attach` is collective over the job's ranks (through the store): every rank
calls it at the same point and all of them come out attached, or none does.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from dlcp import ipc
from dlcp.errors import DlcpError, LocalError
from dlcp.shim.arena import Arena
from dlcp.shim.client import DaemonClient
from dlcp.shim.placement import Placement
from dlcp.shim.rendezvous import Membership, Store, all_gather, first_failure, job_secret
from dlcp.shim.rendezvous import plan_membership as plan

__all__ = ["AttachFailed", "Link", "attach"]


@dataclass
class Link:
    """A rank attached to a job on its daemon."""

    client: DaemonClient
    daemon: dict[str, Any]
    membership: Membership
    arena: Arena
    mode: str = "transpose"
    # rank 0: its connections to the switch's aggregator (mode "switch") or to
    # the dedicated servers (mode "ps"), which hold the job there (a daemon
    # drops a job when its last client goes)
    held: tuple[DaemonClient, ...] = ()

    @property
    def alive(self) -> bool:
        return self.client.alive and all(c.alive for c in self.held)

    def close(self, *, leave: bool = True) -> None:
        """Leave the job (best effort) and drop the connection and segments."""
        for client in (self.client, *self.held):
            if leave and client.alive:
                with contextlib.suppress(Exception):
                    client.call("leave", timeout=2.0, job=self.membership.job)
            client.close()
        self.arena.close()


@dataclass(frozen=True)
class AttachFailed:
    """Why the job is not attached (the same reason on every rank); `fatal`:
    the settings cannot work (retrying will not help)."""

    reason: str
    fatal: bool = False


def _hello(socket: str, fallbacks: int, timeout: float) -> tuple[DaemonClient, dict[str, Any]]:
    client = DaemonClient(socket, timeout=timeout)
    try:
        daemon = client.call(
            "hello",
            timeout=timeout,
            version=ipc.PROTOCOL_VERSION,
            pid=os.getpid(),
            fallbacks=fallbacks,
        )["daemon"]
        for key in ("id", "addresses", "udp_port", "payload"):
            if key not in daemon:
                raise KeyError(f"daemon descriptor lacks {key!r}")
    except BaseException:
        client.close()
        raise
    return client, dict(daemon)


def _close(clients: Sequence[DaemonClient | None]) -> None:
    for c in clients:
        if c is not None:
            c.close()


def _hold(
    mode: str, switch_socket: str | None, placement: Placement | None, timeout: float
) -> tuple[list[DaemonClient], dict[str, Any]]:
    """Rank 0's hellos to the daemons it puts the job on (the switch's
    aggregator, the dedicated servers), and their descriptors for the entry."""
    held: list[DaemonClient] = []
    what = f"switch aggregator {switch_socket}"
    try:
        if mode == "switch":
            if not switch_socket:
                raise ValueError("no socket: pass switch_socket= or set DLCP_SWITCH_SOCKET")
            client, switch = _hello(switch_socket, 0, timeout)
            held.append(client)
            return held, {"switch": switch}
        servers = []
        for k, sock in enumerate(placement.servers if placement is not None else ()):
            what = f"server {k} ({sock})"
            client, daemon = _hello(sock, 0, timeout)
            held.append(client)
            servers.append(daemon)
        return held, {"servers": servers} if servers else {}
    except BaseException as exc:
        _close(held)
        if not isinstance(exc, Exception):
            raise
        raise DlcpError(f"{what}: {exc}") from exc


def attach(
    *,
    socket: str,
    store: Store,
    rank: int,
    world: int,
    prefix: str,
    segment_name: str,
    segment_bytes: int,
    fallbacks: int = 0,
    mode: str = "transpose",
    switch_socket: str | None = None,
    placement: Placement | None = None,
    timeout: float = 10.0,
    store_timeout: float = 300.0,
) -> Link | AttachFailed:
    """Attach every rank of the job, or none.

    Any failure on any rank (daemon unreachable, refused join, segment not
    mapped) makes every rank return the same `AttachFailed`. `prefix` must be
    new for every attempt and the same on every rank. In mode "switch" rank 0
    also puts the job on the switch's aggregator (`switch_socket`), as a
    switch's controller would, and in mode "ps" on each dedicated server of
    `placement` (`dlcp.shim.placement`), and holds it there.
    """
    client: DaemonClient | None = None
    held: list[DaemonClient] = []
    entry: dict[str, Any]
    try:
        client, daemon = _hello(socket, fallbacks, timeout)
        entry = {"ok": True, "daemon": daemon}
    except Exception as exc:
        entry = {"ok": False, "error": f"{socket}: {type(exc).__name__}: {exc}"}
    if rank == 0:
        entry["secret"] = job_secret()
        if entry["ok"]:
            try:
                held, found = _hold(mode, switch_socket, placement, timeout)
                entry.update(found)
            except DlcpError as exc:
                entry = {"ok": False, "error": str(exc)}
    entries = all_gather(store, f"{prefix}/hello", rank, world, entry, store_timeout)
    failed = first_failure(entries)
    if failed is not None:
        _close([client, *held])
        return AttachFailed(f"daemon unavailable ({failed})")
    assert client is not None

    link: Link | None = None
    try:
        first = entries[0]
        membership = plan(
            [e["daemon"] for e in entries],
            rank,
            first["secret"],
            first.get("switch"),
            first.get("servers", ()),
            placement is not None and placement.colocate,
        )
    except LocalError as exc:  # the same on every rank: nothing to gather
        _close([client, *held])
        return AttachFailed(str(exc), fatal=True)
    try:
        for k, at in enumerate(held):  # rank 0's: the switch's aggregator or the servers
            there = {"at_switch": True} if mode == "switch" else {"server": k}
            at.call("join", timeout=timeout, **membership.join_fields(mode, **there))
        client.call("join", timeout=timeout, **membership.join_fields(mode))
        arena = Arena(client, segment_name, segment_bytes)
        link = Link(client, daemon, membership, arena, mode, tuple(held))
        result: dict[str, Any] = {"ok": True}
    except Exception as exc:
        result = {"ok": False, "error": f"join: {type(exc).__name__}: {exc}"}
    results = all_gather(store, f"{prefix}/join", rank, world, result, store_timeout)
    failed = first_failure(results)
    if failed is not None:
        if link is not None:
            link.close()
        else:
            _close([client, *held])
        return AttachFailed(f"could not join ({failed})")
    assert link is not None
    return link
