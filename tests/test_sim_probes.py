"""The daemons' probe budget in `dlcp simulate` (dlcp/core/probeplan.py): 12
hosts on 3 leaves and 4 spines, 44 probed paths a daemon, more than the
default budget of 32 a probe interval; the record counts the probes."""

from __future__ import annotations

from typing import Any

import pytest

from dlcp.sim.run import simulate
from dlcp.sim.settings import Settings

HOSTS, INTERVAL = 12, 0.01


def run(budget: int) -> dict[str, Any]:
    s = Settings(
        hosts=HOSTS, topology="leafspine", hosts_per_leaf=4, rate_bps=1e9,
        size_bytes=2_000_000, iters=3, warmup=0, probe_budget=budget,
    )  # fmt: skip
    return simulate(s, ["dlcp"])[0]


@pytest.fixture(scope="module")
def records() -> dict[int, dict[str, Any]]:
    return {b: run(b) for b in (0, 32)}


def bound(rec: dict[str, Any], budget: int) -> float:
    """Each daemon's budget over the run, its bucket's first fill, and the
    probes of suspect paths (outside the budget: a few each)."""
    routine = HOSTS * (budget + budget / INTERVAL * rec["virtual_s"])
    return routine + 5 * rec["probes"]["to_suspect"]


def test_the_budget_bounds_each_daemons_probes(records: dict[int, dict[str, Any]]) -> None:
    rec = records[32]
    assert rec["probe_budget"] == 32 and rec["completed"] == 3
    assert 0.9 * bound(rec, 32) <= rec["probes"]["sent"] <= bound(rec, 32)
    assert rec["probes"]["held"] > 0  # the budget bound: 44 paths, 32 tokens


def test_without_a_budget_every_path_is_probed_every_interval(
    records: dict[int, dict[str, Any]],
) -> None:
    rec = records[0]
    assert rec["probe_budget"] == 0 and rec["completed"] == 3 and rec["probes"]["held"] == 0
    every = HOSTS * 11 * 4 * rec["virtual_s"] / INTERVAL
    assert rec["probes"]["sent"] == pytest.approx(every, rel=0.05)
    assert rec["probes"]["sent"] > bound(records[32], 32)


def test_the_rounds_and_their_losses_do_not_depend_on_the_budget(
    records: dict[int, dict[str, Any]],
) -> None:
    free, bounded = records[0], records[32]
    assert free["probes"]["to_down"] == bounded["probes"]["to_down"] == 0
    assert bounded["p50_s"] == pytest.approx(free["p50_s"], rel=0.05)
    assert bounded["loss_frac"] == pytest.approx(free["loss_frac"], rel=0.05, abs=1e-3)
