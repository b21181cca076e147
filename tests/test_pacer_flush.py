"""The pacer calls a flush makes in one (`Pacer.retune`, `Pacer.budget`) are
the calls they stand for, state for state, and refuse what those refuse."""

from __future__ import annotations

import math
import random

import pytest

from dlcp.core.rate import Pacer
from dlcp.errors import LocalError


def _state(p: Pacer) -> tuple[float, float, float, float]:
    return (p.rate_bps, p.burst_bytes, p._tokens, p._updated)


def _pair(seed: int) -> tuple[Pacer, Pacer]:
    kw = {"rate_bps": 2e8, "burst_bytes": 65536, "burst_seconds": 0.004, "tokens": 0.0}
    return Pacer(**kw), Pacer(**kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("seed", range(6))
def test_retune_and_budget_are_the_calls_they_stand_for(seed: int) -> None:
    rng = random.Random(seed)
    one, two = _pair(seed)
    now = 0.0
    rate = 2e8
    for _ in range(3000):
        now += rng.choice((0.0, 1e-6, 1e-4, 1e-3, 5e-3, 0.03))
        if rng.random() < 0.05:
            now -= 1e-3  # a clock that steps back earns nothing, either way
        if rng.random() < 0.3:  # a new rate (higher or lower), else the same one
            rate = rng.choice((1e6, 5e7, 2e8, 1e9, 1e10, rate * 0.7, rate * 1.3))
        late = rng.choice((0.0, -1e-3, 1e-5, 2e-3, 0.02, float("nan")))
        # what `_flush_peer` did before, and what it does now
        if late > 0:
            one.catch_up(late, now)
        one.set_rate(rate, now)
        two.retune(rate, late, now)
        assert _state(one) == _state(two)
        got = two.budget(now)
        assert got == (one.delay(1.0, now), one.tokens(now))
        assert _state(one) == _state(two)
        nbytes = rng.choice((0, 1408, 44 * 1450, 300_000))
        assert one.consume(nbytes, now) == two.consume(nbytes, now)
        if rng.random() < 0.1:
            one.settle(now, 1000.0)
            two.settle(now, 1000.0)
        assert _state(one) == _state(two)


@pytest.mark.parametrize(
    ("rate", "late"),
    [
        (0.0, 0.0),
        (-5.0, 0.0),
        (math.inf, 0.0),
        (math.nan, 0.0),
        (True, 0.0),
        ("1e9", 0.0),
        (1e9, math.inf),
    ],
)
def test_retune_refuses_what_catch_up_and_set_rate_refuse(rate: object, late: float) -> None:
    one, two = _pair(0)
    with pytest.raises(LocalError) as want:
        if late > 0:
            one.catch_up(late, 1.0)
        one.set_rate(rate, 1.0)  # type: ignore[arg-type]
    with pytest.raises(LocalError) as got:
        two.retune(rate, late, 1.0)  # type: ignore[arg-type]
    assert str(got.value) == str(want.value)


def test_retune_takes_int_rates_as_set_rate_does() -> None:
    one, two = _pair(0)
    one.set_rate(300_000_000, 0.5)
    two.retune(300_000_000, 0.0, 0.5)
    assert _state(one) == _state(two)
    assert type(two.rate_bps) is float
