"""`dlcp testbed up|show|exec|loss|port|down`: the emulated cluster from the command line."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from dlcp.testbed.plan import (
    BACKGROUND_KINDS,
    BACKGROUND_PATTERNS,
    DEFAULT_NAME,
    LOSS_DIRECTIONS,
    TestbedError,
    TestbedSpec,
    format_rate,
)
from dlcp.testbed.testbed import Testbed, down

__all__ = ["exec_command", "format_show", "parse_rate_arg", "register", "spec_from_args"]


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "testbed",
        help="emulated cluster in network namespaces (needs root)",
        description="An emulated cluster: one network namespace per host, a switch "
        "namespace with one bridge per path, shaped and prioritised switch ports "
        "(dlcp.tc), random loss (nftables) and background traffic (iperf3).",
    )
    sub = parser.add_subparsers(dest="testbed_command", metavar="ACTION")
    sub.required = True

    up = sub.add_parser("up", help="build a testbed (replacing one of the same name)")
    up.add_argument("--hosts", type=int, required=True, metavar="N", help="number of hosts")
    up.add_argument(
        "--rate",
        default="1gbit",
        help="rate of each switch port, e.g. 1gbit or 200mbit; 'none' leaves "
        "links unshaped (default: %(default)s)",
    )
    up.add_argument(
        "--paths",
        type=int,
        default=1,
        metavar="1|2",
        help="parallel paths (bridges) between hosts (default: %(default)s)",
    )
    up.add_argument(
        "--loss",
        type=float,
        default=0.0,
        metavar="PCT",
        help="random loss in percent on every switch port, traffic leaving each "
        "host; 0.1 %% steps, e.g. 0.5 (default: 0)",
    )
    up.add_argument(
        "--background",
        choices=BACKGROUND_KINDS,
        default="none",
        help="iperf3 traffic between all hosts, unmarked (default: none)",
    )
    up.add_argument(
        "--background-seconds",
        type=float,
        default=None,
        metavar="S",
        help="stop background traffic after S seconds (default: run until down)",
    )
    up.add_argument(
        "--background-pattern",
        choices=BACKGROUND_PATTERNS,
        default="all",
        help="all: every host sends to every other host; ring: host i to "
        "host i+1 only, fewer processes (default: all)",
    )
    up.add_argument(
        "--udp-rate",
        default=None,
        metavar="RATE",
        help="background UDP offered to each host's switch port in total "
        "(default: 60%% of the link)",
    )
    up.add_argument(
        "--segmentation",
        "--tso",
        dest="segmentation",
        choices=("auto", "on", "off"),
        default="auto",
        help="segmentation offload on the host veths, one policy for TCP (TSO) "
        "and UDP (GSO) alike; auto: off when shaped, so the switch queues MTU "
        "packets as a ToR does, on when unshaped. Receive offload (GRO) is "
        "always on on the host veths, as on a real NIC, for TCP and UDP; the "
        "switch ports have neither (default: auto)",
    )
    up.add_argument(
        "--mtu",
        type=int,
        default=1500,
        help="link MTU; 9000 for jumbo frames (the daemons' payload follows) (default: 1500)",
    )
    up.add_argument("--daemons", action="store_true", help="start one dlcp daemon per host")
    up.add_argument(
        "--switch-aggregator",
        action="store_true",
        help="an aggregator in the switch: each bridge gets the address 10.77.P.254, "
        "each host's traffic to it is shaped to the port's rate on its way in, and "
        "with --daemons a dlcp daemon runs there (jobs in mode 'switch' sum through "
        "it; its socket is DLCP_SWITCH_SOCKET in `exec`)",
    )
    _common(up)
    up.set_defaults(func=_up)

    show = sub.add_parser("show", help="describe the testbed")
    show.add_argument("--json", action="store_true", help="machine-readable output")
    _common(show, quiet=False)
    show.set_defaults(func=_show)

    exec_ = sub.add_parser(
        "exec",
        help="run a command in a host's namespace",
        description="Run CMD in HOST's namespace with DLCP_SOCKET set to its daemon's "
        "socket; the exit code passes through.",
        usage="dlcp testbed exec [--name NAME] HOST -- CMD...",
    )
    exec_.add_argument("host", metavar="HOST", help="host name like h0, or index like 0")
    exec_.add_argument("cmd", nargs=argparse.REMAINDER, metavar="CMD")
    _common(exec_, quiet=False)
    exec_.set_defaults(func=_exec)

    loss = sub.add_parser("loss", help="set random loss on switch ports at runtime")
    loss.add_argument("pct", type=float, metavar="PCT", help="loss in percent (0.1 %% steps)")
    loss.add_argument("--host", default="all", help="host whose port to change (default: all)")
    loss.add_argument("--path", type=int, default=None, help="path (default: all)")
    loss.add_argument(
        "--direction",
        choices=LOSS_DIRECTIONS,
        default="in",
        help="in: traffic from the host (default); out: traffic toward it",
    )
    _common(loss, quiet=False)
    loss.set_defaults(func=_loss)

    port = sub.add_parser(
        "port",
        help="set a host's switch port on one path down or up (a path failure)",
        description="Set HOST's switch port on --path down or up at runtime: the host's "
        "interface on that path loses its carrier and nothing crosses that port, as when "
        "a link or switch port fails. dlcp's daemons stop using the path and probe it.",
    )
    port.add_argument("host", metavar="HOST", help="host name like h0, or index like 0")
    port.add_argument("state", choices=("down", "up"), help="the port's new state")
    port.add_argument("--path", type=int, default=0, help="path (default: 0)")
    _common(port, quiet=False)
    port.set_defaults(func=_port)

    down_ = sub.add_parser("down", help="remove the testbed and everything it started")
    down_.add_argument("--keep-logs", action="store_true", help="keep logs in the state dir")
    _common(down_)
    down_.set_defaults(func=_down)


def _common(parser: argparse.ArgumentParser, *, quiet: bool = True) -> None:
    parser.add_argument(
        "--name",
        default=DEFAULT_NAME,
        help="testbed name, prefix of its namespaces (default: %(default)s)",
    )
    if quiet:
        parser.add_argument("--quiet", "-q", action="store_true", help="no progress output")


def parse_rate_arg(text: str) -> int | None:
    """'none' -> None; anything else through dlcp.tc's rate parser (e.g. '1gbit')."""
    if text.strip().lower() == "none":
        return None
    try:
        from dlcp.tc.plan import parse_rate
    except ImportError as exc:
        raise TestbedError(
            f"rates need dlcp.tc, which cannot be imported ({exc}); use --rate none"
        ) from exc
    return int(parse_rate(text))


def spec_from_args(args: argparse.Namespace) -> TestbedSpec:
    return TestbedSpec(
        hosts=args.hosts,
        paths=args.paths,
        rate_bps=parse_rate_arg(args.rate),
        loss_pct=args.loss,
        background=args.background,
        background_s=args.background_seconds,
        background_pattern=args.background_pattern,
        udp_rate_bps=None if args.udp_rate is None else parse_rate_arg(args.udp_rate),
        daemons=args.daemons,
        name=args.name,
        segmentation={"auto": None, "on": True, "off": False}[args.segmentation],
        mtu=args.mtu,
        switch_aggregator=args.switch_aggregator,
    )


def _up(args: argparse.Namespace) -> int:
    spec = spec_from_args(args)

    def progress(message: str) -> None:
        print(f"testbed {spec.name}: {message}", file=sys.stderr, flush=True)

    tb = Testbed.up(spec, progress=None if args.quiet else progress)
    if not args.quiet:
        print(format_show(tb.show()))
        print(f"remove with: dlcp testbed down --name {spec.name}", file=sys.stderr)
    return 0


def _show(args: argparse.Namespace) -> int:
    info = Testbed.attach(args.name).show()
    print(json.dumps(info, indent=2) if args.json else format_show(info))
    return 0


def exec_command(args: argparse.Namespace) -> list[str]:
    """CMD of `dlcp testbed exec HOST -- CMD...`, without the `--`."""
    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        raise TestbedError("exec needs a command: dlcp testbed exec HOST -- CMD...")
    return cmd


def _exec(args: argparse.Namespace) -> int:
    cmd = exec_command(args)
    tb = Testbed.attach(args.name)
    rc = tb.exec(args.host, cmd).returncode
    return 128 - rc if rc < 0 else rc


def _loss(args: argparse.Namespace) -> int:
    tb = Testbed.attach(args.name)
    hosts = [h.index for h in tb.hosts] if args.host == "all" else [tb.host(args.host).index]
    paths = range(tb.spec.paths) if args.path is None else [args.path]
    for host in hosts:
        for path in paths:
            tb.set_loss(host, args.pct, path, direction=args.direction)
    return 0


def _port(args: argparse.Namespace) -> int:
    tb = Testbed.attach(args.name)
    tb.set_port(args.host, args.path, args.state == "up")
    return 0


def _down(args: argparse.Namespace) -> int:
    found = down(args.name, keep_logs=args.keep_logs)
    if not args.quiet:
        print(
            f"testbed {args.name}: {'removed' if found else 'nothing to remove'}", file=sys.stderr
        )
    return 0


def format_show(info: dict[str, Any]) -> str:
    """The human table of `Testbed.show()`."""
    lines = [
        f"testbed {info['name']}: {len(info['hosts'])} hosts, {info['paths']} path(s), "
        f"rate {format_rate(info.get('rate_bps'))}, "
        f"state {info['state_dir']}",
        "",
        f"{'HOST':<5} {'NETNS':<16} {'ADDRESSES':<28} {'DAEMON':<10} SOCKET",
    ]
    for h in info["hosts"]:
        daemon = (
            "-"
            if h["daemon_pid"] is None
            else (f"{h['daemon_pid']}" + ("" if h["daemon_alive"] else " (dead)"))
        )
        lines.append(
            f"{h['name']:<5} {h['netns']:<16} {', '.join(h['addresses']):<28} "
            f"{daemon:<10} {h['socket']}"
        )
    for sw in info["switches"]:
        lines += ["", f"switch {sw['netns']}: bridges {', '.join(sw['bridges'])}"]
        agg = sw.get("aggregator")
        if agg is not None:
            daemon = "-" if agg["daemon_pid"] is None else str(agg["daemon_pid"])
            if agg["daemon_pid"] is not None and not agg["daemon_alive"]:
                daemon += " (dead)"
            lines.append(
                f"  aggregator {', '.join(agg['addresses'])} daemon {daemon} {agg['socket']}"
            )
        for port in sw["ports"]:
            loss = sw["loss_pct"].get(port, {})
            state = " (down)" if port in sw.get("ports_down", ()) else ""
            lines.append(
                f"  {port:<8} loss in {loss.get('in', 0):g} %, out {loss.get('out', 0):g} %{state}"
            )
    background = info.get("background") or []
    if background:
        alive = sum(1 for p in background if p["alive"])
        lines += ["", f"background: {len(background)} iperf3 processes, {alive} running"]
    return "\n".join(lines)
