"""The sketch codec on the emulated cluster: one rank per namespace host, 5 %
random loss on one host's link. Lost union packets are NACKed and resent (the
union is never droppable), and the peeled sums give the default hook's
gradients; every replica decodes the same bytes. Needs root; skipped otherwise.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.test_shim_netns import _load, _start_ranks, _wait, cluster

pytestmark = pytest.mark.netns
__all__ = ["cluster"]  # the fixture, imported for this module's tests


def test_sketch_hook_over_a_lossy_link_equals_the_default_hook(
    cluster: Any, tmp_path: Path
) -> None:
    cluster.set_loss(1, 5.0)
    argv = [sys.executable, "-m", "tests.test_shim_netns", "--out", str(tmp_path), "--steps", "8"]
    argv += ["--codec", "sketch", "--bound", "0.05"]
    _wait(_start_ranks(cluster, argv, tmp_path), tmp_path, 300)
    results = _load(tmp_path)
    for res in results:
        stats = res["stats"]
        assert all(res["attached"]) and stats["fallbacks"] == 0, stats["last_error"]
        for got, want in zip(res["grads"], res["ref"], strict=True):
            g = torch.cat([t.reshape(-1) for t in got])
            w = torch.cat([t.reshape(-1) for t in want])
            # peeled exactly, bar a stalled core's few estimated values
            close = torch.isclose(g, w, rtol=1e-4, atol=1e-6)
            assert int((~close).sum()) <= 8
    for res in results[1:]:  # replicas identical
        for a, b in zip(res["grads"], results[0]["grads"], strict=True):
            assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
