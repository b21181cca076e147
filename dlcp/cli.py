"""`dlcp`: the command-line front end. Each part registers its own subcommands.

A part is a module with `register(subparsers)` that adds its parser(s) and sets
`func` (taking the parsed args, returning an exit code) as the default.
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
import threading
from collections.abc import Sequence
from typing import Any

from dlcp import __version__
from dlcp.errors import DlcpError

__all__ = ["main"]

# Modules that add subcommands, in the order they are listed in --help.
PARTS: tuple[str, ...] = (
    "dlcp.demo",
    "dlcp.bench.cli",
    "dlcp.daemon.cli",
    "dlcp.plan_cli",
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


class _Interrupts:
    """SIGTERM and SIGHUP (systemd stop, a closed terminal, `kill`) unwind like
    Ctrl-C while a command runs, so long commands (bench, demo, testbed) remove
    what they made. Only in the process that installed it: a forked child gets
    the default action (it must not run its parent's cleanup). The previous
    handlers come back when the command returns."""

    SIGNALS = (signal.SIGTERM, signal.SIGHUP)

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.saved: dict[int, Any] = {}

    def _handle(self, signum: int, _frame: object) -> None:
        if os.getpid() != self.pid:  # a forked child: die as it would have
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        raise KeyboardInterrupt(signal.Signals(signum).name)

    def __enter__(self) -> _Interrupts:
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                if signal.getsignal(sig) in (signal.SIG_DFL, None):
                    self.saved[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *_exc: object) -> None:
        for sig, old in self.saved.items():
            signal.signal(sig, old)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        with _Interrupts():
            return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("dlcp: interrupted", file=sys.stderr)
        return 130
    except (DlcpError, OSError) as exc:
        print(f"dlcp: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
