"""`dlcp demo`: the main job (placeholder until the benchmark issue lands)."""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["register"]


def register(sub: Any) -> None:
    p = sub.add_parser("demo", help="dlcp vs Gloo on an emulated congested cluster (root)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    print("dlcp demo: not yet (the emulated-cluster demo lands with the benchmark issue)")
    return 0
