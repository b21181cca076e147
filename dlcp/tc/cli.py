"""`dlcp tc apply|show|clear`: build, inspect and remove dlcp's queueing on a device."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from dlcp.errors import LocalError
from dlcp.tc.apply import apply_plan, clear, is_applied, read_stats, root_qdisc
from dlcp.tc.plan import DEFAULT_DSCP, TcConfig, build_plan, parse_dscp_list, parse_rate
from dlcp.tc.stats import format_table, stats_as_dict

__all__ = ["register"]


def _int_set(text: str) -> frozenset[int]:
    try:
        return frozenset(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise LocalError(f"bad class list {text!r}: expected e.g. 7 or 6,7") from None


def register(subparsers: Any) -> None:
    """Add `tc` and its subcommands to the `dlcp` parser."""
    tc = subparsers.add_parser(
        "tc",
        help="Linux traffic control: priority classes by DSCP",
        description="Build dlcp's HTB priority classes, DSCP filters and fifo queues on a "
        "device, show their counters, or remove them. Needs root (CAP_NET_ADMIN).",
    )
    sub = tc.add_subparsers(dest="tc_command", metavar="ACTION")
    sub.required = True

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--dev", required=True, metavar="IF", help="network device")
        p.add_argument("--netns", metavar="NS", help="network namespace (ip netns name)")

    p = sub.add_parser(
        "apply",
        help="build the classes, filters and queues (idempotent)",
        description="Replace the device's root qdisc with dlcp's HTB layout: class i "
        "(1:1i) has prio i and ceil = RATE, and takes the packets whose DSCP is the "
        "i-th entry of --dscp.",
    )
    common(p)
    p.add_argument("--rate", required=True, help="link rate, e.g. 1gbit, 200mbit, 10000000 (bit/s)")
    p.add_argument("--force", action="store_true",
                   help="replace a root qdisc that dlcp did not make")  # fmt: skip
    p.add_argument(
        "--dscp",
        default=",".join(map(str, DEFAULT_DSCP)),
        help="class 0..7 -> DSCP, 8 comma-separated values or names (default: %(default)s)",
    )
    p.add_argument("--default-class", type=int, default=6, metavar="N",
                   help="class for unmatched traffic (default: %(default)s)")  # fmt: skip
    p.add_argument("--droppable", default="7", metavar="LIST",
                   help="classes with short queues (default: %(default)s)")  # fmt: skip
    p.add_argument("--queue", type=int, default=1000, metavar="PKTS",
                   help="queue length of normal classes (default: %(default)s)")  # fmt: skip
    p.add_argument("--short-queue", type=int, default=16, metavar="PKTS",
                   help="queue length of droppable classes (default: %(default)s)")  # fmt: skip
    p.add_argument("--ipv6", action="store_true", help="classify IPv6 by traffic class too")
    p.add_argument("--dry-run", action="store_true", help="print the tc commands only")
    p.set_defaults(func=_apply)

    p = sub.add_parser("show", help="per-class sent/dropped/backlog counters")
    common(p)
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=_show)

    p = sub.add_parser(
        "clear",
        help="remove dlcp's root qdisc (no error if none)",
        description="Remove the root qdisc that `dlcp tc apply` built; the kernel puts "
        "its default back. A root qdisc dlcp did not make is left alone unless --force.",
    )
    common(p)
    p.add_argument("--force", action="store_true",
                   help="also remove a root qdisc that dlcp did not make")  # fmt: skip
    p.set_defaults(func=_clear)


def _apply(args: argparse.Namespace) -> int:
    cfg = TcConfig(
        dev=args.dev,
        rate_bps=parse_rate(args.rate),
        dscp=parse_dscp_list(args.dscp),
        default_class=args.default_class,
        droppable_classes=_int_set(args.droppable),
        queue_packets=args.queue,
        short_queue_packets=args.short_queue,
        match_ipv6=args.ipv6,
    )
    plan = build_plan(cfg)
    if args.dry_run:
        print("\n".join(str(op) for op in plan))
        return 0
    if is_applied(plan, netns=args.netns):
        print(f"tc: {args.dev}: already applied, nothing changed")
        return 0
    apply_plan(plan, netns=args.netns, force=args.force)
    print(f"tc: {args.dev}: {len(plan)} operations applied ({cfg.rate_bps} bit/s)")
    return 0


def _show(args: argparse.Namespace) -> int:
    stats = read_stats(args.dev, netns=args.netns)
    if args.json:
        json.dump(stats_as_dict(stats), sys.stdout, indent=2)
        print()
        return 0
    if not stats:
        root = root_qdisc(args.dev, netns=args.netns)
        what = "none" if root is None else " ".join(root)
        print(f"tc: {args.dev}: no dlcp classes (root qdisc: {what})")
        return 0
    print(format_table(stats))
    return 0


def _clear(args: argparse.Namespace) -> int:
    clear(args.dev, netns=args.netns, force=args.force)
    return 0
