"""dlcpd: `python -m dlcp.daemon --config FILE` (also the `dlcpd` console script)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from dlcp.errors import DlcpError

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="dlcpd",
        description="dlcp's per-host transport daemon (see systemd/dlcpd.toml for the config).",
    )
    parser.add_argument("--config", "-c", help="TOML config file (defaults for every key)")
    parser.add_argument("--log-level", choices=("debug", "info", "warning", "error"))
    parser.add_argument("--check", action="store_true", help="validate the config and exit")
    args = parser.parse_args(argv)
    from dlcp.daemon.config import Config, load

    try:
        config = load(args.config) if args.config else Config()
    except DlcpError as exc:
        print(f"dlcpd: error: {exc}", file=sys.stderr)
        return 2
    if args.check:
        print(f"dlcpd: {args.config or 'defaults'}: ok")
        return 0
    logging.basicConfig(
        level=(args.log_level or config.log_level).upper(),
        format="%(asctime)s dlcpd[%(process)d] %(levelname)s %(message)s",
        stream=sys.stderr,
    )
    from dlcp.daemon.memory import tune_process
    from dlcp.daemon.server import Daemon

    tune_process()

    try:
        import uvloop
    except ImportError:  # plain asyncio works too
        uvloop = None  # type: ignore[assignment]

    async def run() -> None:
        await Daemon(config).serve()

    try:
        if uvloop is not None:
            uvloop.run(run())
        else:
            asyncio.run(run())
    except (DlcpError, OSError) as exc:
        print(f"dlcpd: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
