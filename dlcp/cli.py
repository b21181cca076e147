"""`dlcp`: the command-line front end. Each part registers its own subcommands.

A part is a module with `register(subparsers)` that adds its parser(s) and sets
`func` (taking the parsed args, returning an exit code) as the default.
"""

from __future__ import annotations

import argparse
import importlib
import signal
import sys
from collections.abc import Sequence

from dlcp import __version__
from dlcp.errors import DlcpError
from dlcp.signals import interrupt_on

__all__ = ["main"]

# Modules that add subcommands, in the order they are listed in --help.
PARTS: tuple[str, ...] = (
    "dlcp.demo",
    "dlcp.bench.cli",
    "dlcp.daemon.cli",
    "dlcp.plan_cli",
    "dlcp.decode_cli",
    "dlcp.sim.cli",
    "dlcp.tc.cli",
    "dlcp.testbed.cli",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dlcp",
        description="dlcp: gradient-aware transport for data-parallel training",
    )
    parser.add_argument("--version", action="version", version=f"dlcp {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in PARTS:
        importlib.import_module(name).register(sub)
    return parser


# SIGTERM and SIGHUP (systemd stop, a closed terminal, `kill`) unwind like
# Ctrl-C while a command runs, so long commands (bench, demo, testbed) remove
# what they made. A handler the caller installed is kept.
INTERRUPTS = (signal.SIGTERM, signal.SIGHUP)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        with interrupt_on(INTERRUPTS, only_default=True):
            return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("dlcp: interrupted", file=sys.stderr)
        return 130
    except (DlcpError, OSError) as exc:
        print(f"dlcp: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
