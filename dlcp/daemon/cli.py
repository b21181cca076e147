"""`dlcp status`: what the running daemon is doing."""

from __future__ import annotations

import argparse
import json
from typing import Any

from dlcp.errors import DlcpError

__all__ = ["register"]


def register(sub: Any) -> None:
    p = sub.add_parser(
        "status",
        help="jobs, peers, paths, rates and counters of the running dlcpd",
        description="Ask the local dlcpd (over its Unix socket) what it is doing.",
    )
    p.add_argument("--socket", help="daemon socket (default: $DLCP_SOCKET or /run/dlcp/dlcpd.sock)")
    p.add_argument("--json", action="store_true", help="print the raw status as JSON")
    p.set_defaults(func=run)


def _rate(bps: float) -> str:
    for unit, div in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bps >= div:
            return f"{bps / div:.1f} {unit}"
    return f"{bps:.0f} bit/s"


def run(args: argparse.Namespace) -> int:
    from dlcp.shim.client import DaemonClient, default_socket

    path = args.socket or default_socket()
    try:
        client = DaemonClient(path, timeout=3.0)
    except OSError as exc:
        raise DlcpError(f"cannot reach dlcpd at {path}: {exc.strerror or exc}") from None
    with client:
        st = client.status()
    if args.json:
        print(json.dumps(st, indent=2, sort_keys=True))
        return 0
    d = st["daemon"]
    print(
        f"dlcpd {d['id']}  host {d['host_index']}  udp/{d['udp_port']}  "
        f"metrics :{d['metrics_port']}  up {st['uptime_s']:.0f}s"
        + ("  DRAINING" if st["draining"] else "")
    )
    print(
        f"clients {st['clients']}  rounds in flight {st['rounds_in_flight']}  "
        f"MAC {st.get('mac', '?')}"
    )
    print("paths:")
    for p in st["paths"]:
        print(
            f"  {p['address']}:{p['port']}  gso={'on' if p['gso'] else 'off'} "
            f"gro={'on' if p['gro'] else 'off'}"
        )
    print("jobs:")
    if not st["jobs"]:
        print("  (none)")
    for j in st["jobs"]:
        print(
            f"  job {j['job']}  {j['mode']}  me={j['me']} of {len(j['hosts'])} hosts  "
            f"local ranks {j['local_ranks']}  clients {j['clients']}  "
            f"rounds ok {j['rounds_completed']} failed {j['rounds_failed']}"
        )
        for a in j.get("nack_answers", []):
            answered = (
                f"answers NACKs in {a['answer_s'] * 1e3:.1f} ms "
                f"(+-{a['deviation_s'] * 1e3:.1f}, {a['answers']} timed)"
                if a["answer_s"] is not None
                else "no NACK answer timed yet"
            )
            print(
                f"    node {a['node']} ({a['peer'] or '?'}): {answered}, "
                f"repeat after {a['repeat_after_s'] * 1e3:.1f} ms"
            )
    print("peers:")
    if not st["peers"]:
        print("  (none)")
    for p in st["peers"]:
        print(
            f"  peer {p['peer']}  rate {_rate(p['rate_bps'])}  queued {p['queued']}  "
            f"sent {p['sent_packets']} pkts  lost {p['lost_packets']}"
            + (
                f"  window {p['limit_bytes'] >> 20} MiB, in flight {p['in_flight_bytes'] >> 20} MiB"
                if p.get("limit_bytes")
                else ""
            )
        )
        if len(p.get("paths", ())) > 1:  # one path: not probed, nothing to say
            for i, ps in enumerate(p["paths"]):
                rtt = ps.get("probe_rtt_s")
                print(
                    f"    path {i}  {ps.get('state', '?'):<8}  share {ps['weight']:.2f}  "
                    f"loss {100 * ps['loss_rate']:.1f} %"
                    + ("" if rtt is None else f"  probe rtt {rtt * 1e3:.1f} ms")
                )
    print("counters:")
    for k, v in sorted(st["counters"].items()):
        print(f"  {k:28} {v}")
    if st["rejects"]:
        print("rejected datagrams:")
        for k, v in sorted(st["rejects"].items()):
            print(f"  {k:28} {v}")
    return 0
