"""Attaching a rank to its local daemon: hello, rendezvous, join, segment.

`attach` is collective over the job's ranks (through the store): every rank
calls it at the same point and all of them come out attached, or none does.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Any

from dlcp import ipc
from dlcp.shim.arena import Arena
from dlcp.shim.client import DaemonClient
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
    # mode "switch", rank 0: its connection to the switch's aggregator, which
    # holds the job there (the aggregator drops a job when its last client goes)
    switch: DaemonClient | None = None

    @property
    def alive(self) -> bool:
        return self.client.alive and (self.switch is None or self.switch.alive)

    def close(self, *, leave: bool = True) -> None:
        """Leave the job (best effort) and drop the connection and segments."""
        for client in (self.client, self.switch):
            if client is None:
                continue
            if leave and client.alive:
                with contextlib.suppress(Exception):
                    client.call("leave", timeout=2.0, job=self.membership.job)
            client.close()
        self.arena.close()


@dataclass(frozen=True)
class AttachFailed:
    """Why the job is not attached (the same reason on every rank)."""

    reason: str


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
    timeout: float = 10.0,
    store_timeout: float = 300.0,
) -> Link | AttachFailed:
    """Attach every rank of the job, or none.

    Any failure on any rank (daemon unreachable, refused join, segment not
    mapped) makes every rank return the same `AttachFailed`. `prefix` must be
    new for every attempt and the same on every rank. In mode "switch" rank 0
    also puts the job on the switch's aggregator (`switch_socket`), as a
    switch's controller would, and holds it there.
    """
    client: DaemonClient | None = None
    switch: DaemonClient | None = None
    entry: dict[str, Any]
    try:
        client, daemon = _hello(socket, fallbacks, timeout)
        entry = {"ok": True, "daemon": daemon}
    except Exception as exc:
        entry = {"ok": False, "error": f"{socket}: {type(exc).__name__}: {exc}"}
    if rank == 0:
        entry["secret"] = job_secret()
        if mode == "switch" and entry["ok"]:
            try:
                if not switch_socket:
                    raise ValueError("no socket: pass switch_socket= or set DLCP_SWITCH_SOCKET")
                switch, entry["switch"] = _hello(switch_socket, 0, timeout)
            except Exception as exc:
                entry = {"ok": False, "error": f"switch aggregator {switch_socket}: {exc}"}
    entries = all_gather(store, f"{prefix}/hello", rank, world, entry, store_timeout)
    failed = first_failure(entries)
    if failed is not None:
        for c in (client, switch):
            if c is not None:
                c.close()
        return AttachFailed(f"daemon unavailable ({failed})")
    assert client is not None

    link: Link | None = None
    try:
        first = entries[0]
        membership = plan(
            [e["daemon"] for e in entries], rank, first["secret"], first.get("switch")
        )
        if switch is not None:
            switch.call("join", timeout=timeout, **membership.join_fields(mode, at_switch=True))
        client.call("join", timeout=timeout, **membership.join_fields(mode))
        arena = Arena(client, segment_name, segment_bytes)
        link = Link(client, daemon, membership, arena, mode, switch)
        result: dict[str, Any] = {"ok": True}
    except Exception as exc:
        result = {"ok": False, "error": f"join: {type(exc).__name__}: {exc}"}
    results = all_gather(store, f"{prefix}/join", rank, world, result, store_timeout)
    failed = first_failure(results)
    if failed is not None:
        if link is not None:
            link.close()
        else:
            for c in (client, switch):
                if c is not None:
                    c.close()
        return AttachFailed(f"could not join ({failed})")
    assert link is not None
    return link
