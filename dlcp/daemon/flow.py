"""Flow control between daemons: each peer's window, and the credits that open it.

A sender sends a peer at most its window of bytes that the peer has not yet
credited; the peer credits it (a CONTROL packet, dlcp/wire/credit.py) each
time CREDIT_STEP more of its bytes have left its sockets. The functions
here are the sender's side of it on the outbox's `Peer` (`window_room`,
`take_credit`) and the windows and grants a daemon's jobs give
(`size_windows`); docs/operations.md, "Socket buffers and flow control".
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dlcp.core.rate import RateConfig
    from dlcp.daemon.outbox import Peer

__all__ = [
    "CREDIT_STEP",
    "CREDIT_TIMEOUT",
    "PROBE_BACKOFF",
    "WINDOW_MIN",
    "probe_wait",
    "size_windows",
    "take_credit",
    "window_room",
]

# Flow control (`Outbox(window_bytes=...)`): a peer is sent at most its window
# of bytes that it has not yet credited (`take_credit`: it says how many bytes it
# has taken from its socket). Without it a flush puts a whole leg of a bucket
# into the peer's socket before the peer reads, and past the socket's buffer
# the kernel drops the rest (a 400 MB bucket on two hosts lost 100,000
# datagrams a round and ran at 0.14x Gloo). A sender at a full window that has
# heard no credit for this long (a credit lost, bytes lost, or the peer
# restarted) sends a probe of CREDIT_STEP bytes, whose arrival draws a credit.
CREDIT_TIMEOUT = 0.05
# Each probe more without a credit in between waits twice as long, up to
# 2**PROBE_BACKOFF timeouts (0.8 s): a peer that does not read is not sent a
# probe every 50 ms, each on top of what its socket holds
PROBE_BACKOFF = 4
# A receiver credits a peer each time this many more bytes from it have left
# its sockets; a window is at least WINDOW_MIN (4 steps), so that credits
# come back before it fills
CREDIT_STEP = 2 << 20
WINDOW_MIN = 4 * CREDIT_STEP


def probe_wait(peer: Peer) -> float:
    """How long `peer`'s full window waits for a credit before a probe goes."""
    return CREDIT_TIMEOUT * (1 << min(peer.probes, PROBE_BACKOFF))


def window_room(peer: Peer, now: float, need: int) -> int:
    """Bytes `peer`'s window lets go now: at least `need` (the next
    datagram), or 0 (then `stalled_since` says since when). A window full
    for CREDIT_TIMEOUT lets a probe of CREDIT_STEP go."""
    granted, limit = peer.granted, peer.window  # `peer.limit`, `peer.in_flight` inline
    if granted and granted < limit:
        limit = granted
    room = limit - (peer.sent_total - peer.credited)
    if room >= need:
        peer.stalled_since = None
        return room
    if peer.stalled_since is None:
        peer.stalled_since = now
        peer.window_stalls += 1
        return 0
    if now < peer.stalled_since + probe_wait(peer):  # as the flush's wake-up time says
        return 0
    # No credit for that long: the credit was lost, or bytes were (a peer
    # never counts what its socket dropped), or the peer restarted. Not
    # the whole window (the peer may still hold it: sending it again
    # overflowed the socket and lost more, which held the window shut
    # again), only a probe of CREDIT_STEP, whose arrival draws a credit;
    # the next credit sent when the peer's sockets were empty (`on_credit`)
    # is matched to what was sent by then.
    peer.credited = max(peer.credited, peer.sent_total - limit + max(CREDIT_STEP, need))
    peer.credit_resync = True
    peer.stalled_since = None
    peer.window_resets += 1
    peer.probes += 1
    return limit - peer.in_flight


def take_credit(
    peer: Peer,
    received: int,
    epoch: int,
    drained: bool = False,
    window: int = 0,
    now: float | None = None,
) -> None:
    """`peer` has taken `received` bytes from us off its sockets, in the
    count it calls `epoch`; `drained`: its sockets held nothing then. A
    count new to us (the first, or a restarted peer's), or the first
    drained one after a probe, is matched to what we have sent at once:
    everything sent until now counts as credited (except for the first
    count, when it is no more than we sent: then it counts from our first
    byte as ours does). After a probe a count from a peer whose sockets
    still hold our bytes is matched as before: taking it for all we sent
    wrote off what waited in its socket, the next window went on top of
    it, and the socket overflowed (300-400 MB buckets lost up to 400,000
    datagrams a round, after a daemon had not read for 50 ms).

    `window` is what the peer grants: from now on at most that much,
    never below WINDOW_MIN, is in flight to it, however large this
    daemon's own share for it (`Peer.limit`); 0 (a peer without flow
    control, or an older daemon): this daemon's own share alone.

    With `now`, the bytes a count credits beyond the last (matched as
    before, not a new count's) acknowledge as much to the peer's rate
    control: its slow start grows during a leg, not only when the peer's
    results come back. Without it a first round on an unshaped link went
    its whole data leg at the initial 1 Gbit/s (0.71 s against 0.25 for
    the next 100 MB rounds on two hosts)."""
    peer.probes = 0
    peer.granted = max(WINDOW_MIN, window) if window else 0
    if epoch != peer.credit_epoch or (peer.credit_resync and drained):
        first = peer.credit_epoch is None and not peer.credit_resync
        peer.credit_epoch = epoch
        peer.credit_resync = False
        if not (first and received <= peer.sent_total):
            peer.credit_offset = peer.sent_total - received
            peer.credited = peer.sent_total
            return
        peer.credit_offset = 0
    before = peer.credited
    peer.credited = max(peer.credited, min(peer.sent_total, received + peer.credit_offset))
    if now is not None and peer.credited > before:
        peer.rate.on_ack(peer.credited - before, None, now)


def size_windows(jobs: Iterable[Any], window_bytes: int, rate: RateConfig) -> int:
    """Each peer's pacing cap, the link's rate shared among the hosts that send to it in
    `jobs` (`RateConfig.fan_in_rate`: incast fills the peer's port at most to
    `rate.utilization`), and its flow-control window: `window_bytes` shared among those
    hosts (itself included), at least WINDOW_MIN: what they may all have in flight at once
    then fits the peer's socket as one sender's window does (a transpose job of H hosts: H-1
    senders a host; "ps": the contributors to an aggregator, the aggregators to a
    contributor; "switch": as "ps", but each contributor reaches the aggregator in the
    switch on its own port, paced at its link). Returns the window this daemon grants in its
    credits: `window_bytes` shared among all the hosts that send to it in all its jobs,
    which a sender in only some of them cannot know of (its `Peer.limit` takes the smaller);
    0 without flow control."""
    senders: dict[Peer, set[Any]] = {}
    switches: set[Peer] = set()
    mine: set[Any] = set()
    for job in jobs:
        spec = job.spec
        mine.update(job.hosts[i] for i in spec.senders_to(spec.me))
        for node, peer in job.peers.items():
            senders.setdefault(peer, set()).update(job.hosts[i] for i in spec.senders_to(node))
            if job.mode == "switch" and node in spec.owners:
                switches.add(peer)
    for peer, hosts in senders.items():  # each peer's pacing cap
        # an aggregator in the switch takes each sender on its own port: no incast
        cap = rate.fan_in_rate(1 if peer in switches else len(hosts))
        if cap is not None:
            peer.rate.set_max_rate(cap)
    if not window_bytes:
        return 0
    for peer, hosts in senders.items():
        peer.window = max(WINDOW_MIN, window_bytes // max(1, len(hosts)))
    return max(WINDOW_MIN, window_bytes // max(1, len(mine)))
