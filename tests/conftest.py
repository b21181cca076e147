"""Shared test fixtures: root/namespace gating and cleanup helpers."""

from __future__ import annotations

import os
import shutil

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--run-slow", action="store_true", help="run long variants")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_slow = pytest.mark.skip(reason="long variant: pass --run-slow")
    not_root = os.geteuid() != 0
    no_ip = shutil.which("ip") is None
    for item in items:
        if "slow" in item.keywords and not config.getoption("--run-slow"):
            item.add_marker(skip_slow)
        if "netns" in item.keywords:
            if not_root:
                item.add_marker(pytest.mark.skip(reason="needs root for network namespaces"))
            elif no_ip:
                item.add_marker(pytest.mark.skip(reason="iproute2 (ip) is not installed"))
