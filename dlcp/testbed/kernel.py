"""How the testbed sets each namespace's kernel: sysctls and offloads.

Two facts of the Linux kernel shape what a benchmark on veths and a bridge
measures, and both are set here so that TCP and UDP, Gloo and dlcp, see a
switch as they would on real hardware:

- **Segmentation and receive offloads** (`tune_offloads`): GRO on every host
  veth, as on a real NIC; TSO and UDP GSO follow one policy.
- **A switch does not push back on its senders** (`decouple_senders`). A
  bridged frame keeps its sending socket's reference (`skb->sk`) across the
  veth and the bridge until it leaves the switch port's queue, so the
  sender's send buffer is charged for packets queued in the *switch*: a UDP
  sender at 1.5x a port's rate is held to the port's rate and never loses a
  packet, and TCP Small Queues counts switch queueing as its own. A real
  switch has no such back channel. With br_netfilter's IPv4 hooks on in the
  switch namespace the bridge hands each frame through the IP layer, which
  drops the socket reference at the switch's ingress: the sender is charged
  only until its frame reaches the switch, as with a NIC's TX completion.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from dlcp.testbed import system

__all__ = ["BRIDGE_NF", "decouple_senders", "disable_ipv6", "tune_offloads"]

# Run in every namespace before links exist, so no veth ever gets IPv6 (router
# solicitations and MLD reports would otherwise show up in the switch's queues).
_NO_IPV6 = (
    "for f in /proc/sys/net/ipv6/conf/all/disable_ipv6"
    " /proc/sys/net/ipv6/conf/default/disable_ipv6; do"
    ' if [ -e "$f" ]; then echo 1 > "$f" || exit 1; fi; done'
)

BRIDGE_NF = Path("/proc/sys/net/bridge/bridge-nf-call-iptables")
_DECOUPLE = f"echo 1 > {BRIDGE_NF}"


def disable_ipv6(netns: str) -> None:
    system.run(["sh", "-c", _NO_IPV6], netns=netns)


def decouple_senders(switch_netns: str) -> bool:
    """Make the switch namespace release each frame's sending socket at its
    ingress (see the module's docstring). Loads br_netfilter where it is not
    loaded and can be. Returns whether it holds: False where the kernel lacks
    br_netfilter, and then senders are paced by the switch's queues."""
    if not BRIDGE_NF.exists():
        system.run(["sh", "-c", "modprobe br_netfilter 2>/dev/null; true"])
    if not BRIDGE_NF.exists():
        return False
    system.run(["sh", "-c", _DECOUPLE], netns=switch_netns)
    return True


def tune_offloads(hosts: Sequence[tuple[str, Sequence[str]]], *, segments: bool) -> None:
    """Host veths as a real NIC's: receive offload (GRO) on for every
    protocol, and one segmentation policy for TCP and UDP alike (TSO and UDP
    GSO both on, or both off). `hosts` holds (netns, interfaces) pairs. The
    switch ports get neither: a switch forwards frames as they come."""
    state = "on" if segments else "off"
    for netns, interfaces in hosts:
        script = "; ".join(
            f"ethtool -K {ifname} gro on tso {state} tx-udp-segmentation {state} 2>/dev/null"
            for ifname in interfaces
        )
        system.run(["sh", "-c", script + "; true"], netns=netns)
