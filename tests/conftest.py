"""Shared test fixtures: root/namespace gating and cleanup helpers."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator

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


@pytest.fixture(autouse=True)
def _poison_uninitialised(monkeypatch: pytest.MonkeyPatch) -> None:
    """The aggregation core leaves its big accumulators unzeroed (new or reused
    buffers) and writes every element before reading it
    (`dlcp.core.accumulator._uninitialised`). In every test they start as
    all-ones bytes instead (NaN in float lanes, 65535 in integer ones), so a
    lane the core forgot to write shows in the sums."""
    import numpy as np

    from dlcp.core import accumulator

    real = accumulator._uninitialised

    def poisoned(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        out = real(shape, dtype)
        out.reshape(-1).view(np.uint8)[:] = 0xFF
        return out

    monkeypatch.setattr(accumulator, "_uninitialised", poisoned)


@pytest.fixture(autouse=True)
def _close_ranks() -> Iterator[None]:
    """Ranks (tests/daemons.py) a test made and left open, as when it failed
    between making them and its own cleanup: their connections closed and
    /dev/shm segments removed. Ranks of wider-scoped fixtures (set up before
    this one) are theirs to close."""
    from tests.daemons import OPEN_RANKS

    before = set(OPEN_RANKS)
    yield
    for rank in list(OPEN_RANKS - before):
        rank.close()
