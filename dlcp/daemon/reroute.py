"""Sending around paths out of use (path health, dlcp/core/pathhealth.py).

The outbox asks its balancer for a path per packet as always; for a peer
whose probes found some path down, probing or degraded, `reroute` moves what
the balancer put there to the paths in use. The urgent datagrams sent on each
path (DONEs, NACKs, retransmissions, ACKs) are kept a short while
(`remember`), so that a path found down has them sent again on the live
ones (`Sending.path_down`).
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dlcp.daemon.outbox import Peer

__all__ = ["RESEND_HORIZON", "remember", "reroute"]

# Urgent datagrams (DONEs, NACKs, retransmissions) sent on a path of a peer
# whose paths are probed are kept this long: a path found down had them
# queued again on the live ones (`Sending.path_down`). Longer than a dead
# path goes unnoticed (three probe deadlines, about 75 ms at the defaults).
RESEND_HORIZON = 0.25


def reroute(peer: Peer, assign: list[int], usable: list[bool]) -> None:
    """Move what `assign` puts on paths that are not `usable` to the usable
    ones, round robin (a path found down carries nothing but probes)."""
    live = [p for p, u in enumerate(usable) if u]
    k = peer.reroute_next
    for i, p in enumerate(assign):
        if not usable[p]:
            assign[i] = live[k % len(live)]
            k += 1
    peer.reroute_next = k
    for p, u in enumerate(usable):
        if not u:
            peer.paths[p].weight = 0.0


def remember(peer: Peer, p: int, cls: int, urgent: list[bytes], now: float) -> None:
    """Keep the urgent datagrams (DONEs, NACKs, retransmissions, ACKs) just
    sent on path `p` for RESEND_HORIZON, for `Sending.path_down`."""
    recent = peer.recent.setdefault(p, deque())
    recent.extend((now, cls, dg) for dg in urgent)
    horizon = now - RESEND_HORIZON
    while recent and recent[0][0] < horizon:
        recent.popleft()
