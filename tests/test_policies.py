"""Policies: registry, priority, dropping, loss-bound schedules, load balancing."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dlcp.errors import LocalError
from dlcp.policies import (
    DEFAULT_DSCP,
    DROPPABLE_CLASS,
    KINDS,
    AdaptiveBalancer,
    DropPolicy,
    FlowBalancer,
    LayerMagnitudePriority,
    LoadBalancer,
    LossSchedule,
    PathState,
    PhaseSchedule,
    PriorityPolicy,
    SmallestNormDrop,
    SprayBalancer,
    WeightedBalancer,
    apply_droppable,
    create,
    deadline_drops,
    from_config,
    lane_budget,
    names,
    register,
)
from dlcp.policies import registry as registry_mod
from dlcp.policies.drop import NoDrop

FAST = settings(max_examples=60, deadline=None)

# --------------------------------------------------------------------- registry

BUILTIN = {
    "priority": {"layer_magnitude", "flow"},
    "drop": {"smallest_norm", "none"},
    "schedule": {"constant", "diminishing", "phase"},
    "balance": {"flow", "spray", "weighted", "adaptive"},
}


@pytest.mark.parametrize("kind", KINDS)
def test_builtin_names_registered(kind: str) -> None:
    assert BUILTIN[kind] <= set(names(kind))


@pytest.mark.parametrize(
    ("kind", "name", "params", "needle"),
    [
        ("priority", "nope", {}, "known: flow, layer_magnitude"),
        ("drop", "nope", {}, "smallest_norm"),
        ("schedule", "nope", {}, "diminishing"),
        ("balance", "nope", {}, "adaptive"),
        ("colour", "x", {}, "unknown policy kind"),
        ("priority", "layer_magnitude", {"layer_wieght": 0.5}, "layer_weight"),
        ("priority", "layer_magnitude", {"layer_weight": 1.5}, "layer_weight"),
        ("priority", "layer_magnitude", {"layer_weight": "a"}, "number"),
        ("priority", "layer_magnitude", {"magnitude_quantiles": [0.5, 0.2]}, "increasing"),
        ("priority", "flow", {"gradient_class": 6}, "gradient_class"),
        ("priority", "flow", {"dscp": [0] * 7}, "8 entries"),
        ("priority", "flow", {"dscp": [64, 0, 0, 0, 0, 0, 0, 0]}, "dscp[0]"),
        ("drop", "smallest_norm", {"magnitude_cut": -0.1}, "magnitude_cut"),
        ("drop", "none", {"magnitude_cut": 0.5}, "unexpected keyword"),
        ("schedule", "constant", {"p": 0.6}, "<= 0.5"),
        ("schedule", "constant", {"p": math.nan}, "finite"),
        ("schedule", "diminishing", {"p0": 0.01, "p_min": 0.02}, "p_min"),
        ("schedule", "diminishing", {"per": "step"}, "per"),
        ("schedule", "phase", {"low": 0.2, "high": 0.1}, "low"),
        ("schedule", "phase", {"warmup_epochs": -1}, "warmup_epochs"),
        ("balance", "weighted", {"weights": [0, 0]}, "not all 0"),
        ("balance", "weighted", {"weights": [1, -1]}, "weights"),
        ("balance", "adaptive", {"min_share": 2}, "min_share"),
        ("balance", "flow", {"key": 3}, "string"),
    ],
)
def test_create_rejects(kind: str, name: str, params: dict[str, object], needle: str) -> None:
    with pytest.raises(LocalError) as info:
        create(kind, name, **params)
    assert needle in str(info.value)


def test_from_config_name_and_table() -> None:
    assert isinstance(from_config("balance", "spray"), SprayBalancer)
    pol = from_config("priority", {"name": "layer_magnitude", "layer-weight": 0.25})
    assert isinstance(pol, LayerMagnitudePriority)
    assert pol.layer_weight == 0.25
    assert pol.name == "layer_magnitude"
    sched = from_config("schedule", {"name": "constant", "p": 0.1})
    assert sched.bound(round=0, epoch=0, grad_norm=None) == 0.1
    with pytest.raises(LocalError, match="string 'name'"):
        from_config("drop", {"magnitude_cut": 0.5})
    with pytest.raises(LocalError, match="name or a table"):
        from_config("drop", 3)  # type: ignore[call-overload]


def test_register_custom_and_conflict() -> None:
    @register("drop", "test_everything")
    class Everything(DropPolicy):
        def droppable(self, *, norms: np.ndarray, counts: np.ndarray, bound: float) -> np.ndarray:
            return np.ones(len(norms), dtype=np.bool_)

    try:
        pol = create("drop", "test_everything")
        assert pol.droppable(norms=np.ones(3), counts=np.ones(3), bound=0.0).all()
        with pytest.raises(LocalError, match="already registered"):

            @register("drop", "test_everything")
            class Other(DropPolicy):
                def droppable(
                    self, *, norms: np.ndarray, counts: np.ndarray, bound: float
                ) -> np.ndarray:
                    return np.zeros(len(norms), dtype=np.bool_)

    finally:
        registry_mod._REGISTRY["drop"].pop("test_everything", None)


# --------------------------------------------------------------------- priority


def bucket(draw: st.DrawFn, *, same_counts: bool = False) -> tuple[np.ndarray, ...]:
    n = draw(st.integers(1, 60))
    n_layers = draw(st.integers(1, 12))
    layers = np.array(draw(st.lists(st.integers(0, n_layers - 1), min_size=n, max_size=n)))
    # Few distinct values, so equal magnitudes and equal layers both occur.
    norms = np.array(
        draw(st.lists(st.sampled_from([0.0, 0.1, 1.0, 2.5, 40.0]), min_size=n, max_size=n))
    )
    if same_counts:
        counts = np.full(n, 352)
    else:
        counts = np.array(draw(st.lists(st.integers(1, 400), min_size=n, max_size=n)))
    return layers, np.array(n_layers), norms, counts


@st.composite
def buckets(draw: st.DrawFn) -> tuple[np.ndarray, ...]:
    return bucket(draw)


@st.composite
def equal_count_buckets(draw: st.DrawFn) -> tuple[np.ndarray, ...]:
    return bucket(draw, same_counts=True)


weights = st.sampled_from([0.0, 0.25, 0.5, 0.8, 1.0])


@FAST
@given(buckets(), weights)
def test_classes_in_range(b: tuple[np.ndarray, ...], w: float) -> None:
    layers, n_layers, norms, counts = b
    for pol in (LayerMagnitudePriority(layer_weight=w), create("priority", "flow")):
        classes = pol.classify(layers=layers, n_layers=int(n_layers), norms=norms, counts=counts)
        assert classes.dtype == np.uint8
        assert classes.shape == layers.shape
        assert classes.min() >= 1 and classes.max() <= 5


@FAST
@given(equal_count_buckets(), weights)
def test_front_layers_and_big_norms_never_worse(b: tuple[np.ndarray, ...], w: float) -> None:
    layers, n_layers, norms, counts = b
    classes = (
        LayerMagnitudePriority(layer_weight=w)
        .classify(layers=layers, n_layers=int(n_layers), norms=norms, counts=counts)
        .astype(int)
    )
    same_norm = norms[:, None] == norms[None, :]
    same_layer = layers[:, None] == layers[None, :]
    worse = classes[:, None] > classes[None, :]  # i gets a worse class than j
    # i in front of j at equal magnitude: never worse.
    assert not (same_norm & (layers[:, None] < layers[None, :]) & worse).any()
    # i bigger than j at equal layer: never worse.
    assert not (same_layer & (norms[:, None] > norms[None, :]) & worse).any()


@pytest.mark.parametrize(
    ("layer_weight", "layers", "norms", "expected"),
    [
        # layer only: five layers spread over the five classes, front first
        (1.0, [0, 1, 2, 3, 4], [1, 1, 1, 1, 1], [1, 2, 3, 4, 5]),
        # magnitude only: quantile bands of the bucket
        (0.0, [0, 0, 0, 0, 0], [5, 4, 3, 2, 1], [1, 2, 3, 4, 5]),
        # equal mix: front+large best, back+small worst; a packet counts the
        # cuts it strictly exceeds, so 5 (tying the 0.8 cut) scores 3/4
        (0.5, [0, 4, 0, 4, 2], [5, 1, 1, 5, 3], [1, 5, 3, 4, 3]),
        (0.5, [0, 4, 0, 4, 2], [5, 1, 1, 4, 3], [1, 5, 3, 4, 3]),
    ],
)
def test_layer_magnitude_table(
    layer_weight: float, layers: list[int], norms: list[float], expected: list[int]
) -> None:
    pol = LayerMagnitudePriority(layer_weight=layer_weight)
    got = pol.classify(
        layers=np.array(layers), n_layers=5, norms=np.array(norms, float), counts=np.full(5, 10)
    )
    assert got.tolist() == expected


def test_magnitude_is_per_lane_and_nonfinite_is_largest() -> None:
    pol = LayerMagnitudePriority(layer_weight=0.0)
    # Same RMS per lane: a short last packet is not penalised for its size.
    counts = np.array([100, 100, 100, 25])
    norms = np.array([1.0, 2.0, 3.0, 1.5])  # last: 1.5 / 5 == 3 / 10
    classes = pol.classify(layers=np.zeros(4, int), n_layers=1, norms=norms, counts=counts)
    assert classes[3] == classes[2]
    norms = np.array([1.0, np.nan, 3.0, np.inf])
    classes = pol.classify(layers=np.zeros(4, int), n_layers=1, norms=norms, counts=counts)
    assert classes[1] <= classes[2] and classes[3] <= classes[2]


def test_flow_priority_and_dscp() -> None:
    pol = create("priority", "flow", gradient_class=3)
    classes = pol.classify(layers=np.arange(4), n_layers=4, norms=np.ones(4), counts=np.ones(4))
    assert classes.tolist() == [3, 3, 3, 3]
    assert pol.dscp(np.arange(8)).tolist() == list(DEFAULT_DSCP)
    custom = create("priority", "flow", dscp=tuple(range(10, 18)))
    assert custom.dscp(np.array([0, 7, 3])).tolist() == [10, 17, 13]
    with pytest.raises(LocalError):
        pol.dscp(np.array([8]))


@pytest.mark.parametrize(
    ("layers", "n_layers", "norms", "counts", "needle"),
    [
        ([0, 5], 5, [1, 1], [1, 1], "layers"),
        ([0, -1], 5, [1, 1], [1, 1], "layers"),
        ([0, 1], 0, [1, 1], [1, 1], "n_layers"),
        ([0, 1], 5, [1, 1, 1], [1, 1], "length"),
        ([0, 1], 5, [1, -1], [1, 1], "norms"),
        ([0, 1], 5, [1, 1], [1, 0], "counts"),
    ],
)
def test_classify_rejects(
    layers: list[int], n_layers: int, norms: list[float], counts: list[int], needle: str
) -> None:
    pol: PriorityPolicy = LayerMagnitudePriority()
    with pytest.raises(LocalError, match=needle):
        pol.classify(
            layers=np.array(layers),
            n_layers=n_layers,
            norms=np.array(norms),
            counts=np.array(counts),
        )


def test_empty_bucket() -> None:
    e = np.zeros(0)
    assert LayerMagnitudePriority().classify(layers=e, n_layers=3, norms=e, counts=e).size == 0
    assert SmallestNormDrop().droppable(norms=e, counts=e, bound=0.1).size == 0


def test_apply_droppable() -> None:
    got = apply_droppable(np.array([1, 2, 5], np.uint8), np.array([False, True, True]))
    assert got.tolist() == [1, DROPPABLE_CLASS, DROPPABLE_CLASS]
    assert got.dtype == np.uint8


# --------------------------------------------------------------------- dropping


@pytest.mark.parametrize(
    ("bound", "total", "expected"),
    [
        (0.0, 100, 0),
        (0.1, 10, 1),
        (0.01, 100, 1),
        (0.01, 99, 0),
        (0.5, 3, 1),
        (0.5, 0, 0),
        (1.0, 5, 5),
        (0.3, 10, 3),
        (0.07, 1000, 70),
    ],
)
def test_lane_budget(bound: float, total: int, expected: int) -> None:
    assert lane_budget(bound, total) == expected


@FAST
@given(st.floats(0, 1), st.integers(0, 10**9))
def test_lane_budget_consistent(bound: float, total: int) -> None:
    b = lane_budget(bound, total)
    assert 0 <= b <= total
    if total:
        assert b / total <= bound and total - b >= (1.0 - bound) * total


@st.composite
def drop_inputs(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray, float, float]:
    n = draw(st.integers(0, 80))
    norms = np.array(
        draw(st.lists(st.floats(0, 1e6, allow_nan=False), min_size=n, max_size=n)), float
    )
    # Mostly full packets, a short last one, as a bucket is cut.
    full = draw(st.integers(1, 400))
    counts = np.full(n, full)
    if n:
        counts[-1] = draw(st.integers(1, full))
    bound = draw(st.floats(0, 0.5))
    cut = draw(st.sampled_from([0.0, 0.25, 0.5, 0.9, 1.0]))
    return norms, counts, bound, cut


@FAST
@given(drop_inputs())
def test_droppable_share_within_bound(inputs: tuple[np.ndarray, np.ndarray, float, float]) -> None:
    norms, counts, bound, cut = inputs
    drop = SmallestNormDrop(magnitude_cut=cut).droppable(norms=norms, counts=counts, bound=bound)
    assert drop.dtype == np.bool_ and drop.shape == norms.shape
    total = int(counts.sum())
    assert int(counts[drop].sum()) <= lane_budget(bound, total)
    if total:
        assert counts[drop].sum() / total <= bound
    dens = norms / np.sqrt(counts)
    if drop.any() and not drop.all():
        # smallest first
        assert dens[drop].max() <= dens[~drop].min()
    # the magnitude cut: at most floor(cut * n) droppable, none tying a protected one
    n = len(norms)
    k = math.floor(cut * n)
    assert drop.sum() <= k
    if drop.any() and k < n:
        assert dens[drop].max() < np.sort(dens)[k]


@FAST
@given(drop_inputs())
def test_nothing_droppable_at_bound_zero(
    inputs: tuple[np.ndarray, np.ndarray, float, float],
) -> None:
    norms, counts, _, cut = inputs
    for pol in (SmallestNormDrop(magnitude_cut=cut), NoDrop()):
        assert not pol.droppable(norms=norms, counts=counts, bound=0.0).any()
    assert not NoDrop().droppable(norms=norms, counts=counts, bound=0.5).any()


def test_top_magnitude_never_droppable() -> None:
    rng = np.random.default_rng(7)
    norms = rng.exponential(size=1000)
    counts = np.full(1000, 352)
    drop = create("drop", "smallest_norm").droppable(norms=norms, counts=counts, bound=0.5)
    # The bound would allow half, but the top half by magnitude is protected.
    top = np.argsort(norms)[500:]
    assert not drop[top].any()
    assert drop.sum() == 500 - 0  # the whole bottom half fits 0.5 exactly
    # With a small bound: exactly the smallest packets that fit.
    drop = create("drop", "smallest_norm").droppable(norms=norms, counts=counts, bound=0.05)
    assert set(np.flatnonzero(drop)) == set(np.argsort(norms)[:50].tolist())
    # NaN / inf norms (a blown-up gradient) are never dropped.
    norms[:3] = [np.nan, np.inf, np.nan]
    drop = create("drop", "smallest_norm", magnitude_cut=1.0).droppable(
        norms=norms, counts=counts, bound=0.5
    )
    assert not drop[:3].any()


def test_drop_rejects_bad_bound() -> None:
    for bound in (-0.1, 1.5, math.nan):
        with pytest.raises(LocalError):
            SmallestNormDrop().droppable(norms=np.ones(3), counts=np.ones(3), bound=bound)


def _dd(**kw: object) -> list[int]:
    base: dict[str, object] = {
        "droppable": [True, True, False, True, True],
        "counts": [10, 10, 10, 10, 10],
        "norms": [4.0, 1.0, 0.5, 3.0, 2.0],
        "need": 1.0,
        "left": 0.5,
        "budget": 100,
        "used": 0,
    }
    base.update(kw)
    return np.flatnonzero(deadline_drops(**base)).tolist()  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kw", "expected"),
    [
        ({"left": 2.0}, []),  # the backlog makes the deadline
        ({"left": 1.0}, []),
        ({"left": 0.9}, [1]),  # shed 10 % of 50 lanes: the smallest droppable
        ({"left": 0.75}, [1, 4]),  # 25 % -> 12.5 lanes -> two packets
        ({"left": 0.5}, [1, 4, 3]),  # 50 %: three packets; the non-droppable 0.5 stays
        ({"left": -1.0}, [0, 1, 3, 4]),  # past the deadline: every droppable one
        ({"left": -1.0, "budget": 25}, [1, 4]),  # but never beyond the budget
        ({"left": -1.0, "budget": 25, "used": 10}, [1]),  # already spent part of it
        ({"left": -1.0, "budget": 25, "used": 30}, []),
        ({"left": 0.9, "sizes": [100, 1, 100, 100, 100]}, [1, 4]),  # byte-weighted
        ({"need": 0.0, "left": -1.0}, []),
        (
            {"left": -1.0, "groups": [0, 1, 0, 1, 0], "budget": [10, 20], "used": [0, 0]},
            [1, 3, 4],  # bucket 0 may lose one packet (4 over 0), bucket 1 both
        ),
    ],
)
def test_deadline_drops(kw: dict[str, object], expected: list[int]) -> None:
    assert sorted(_dd(**kw)) == sorted(expected)


@FAST
@given(
    st.lists(st.tuples(st.booleans(), st.integers(1, 50), st.floats(0, 10)), max_size=60),
    st.floats(0.01, 5),
    st.floats(-1, 5),
    st.integers(0, 500),
    st.integers(0, 500),
)
def test_deadline_drops_properties(
    queue: list[tuple[bool, int, float]], need: float, left: float, budget: int, used: int
) -> None:
    flags = np.array([q[0] for q in queue], bool)
    counts = np.array([q[1] for q in queue], np.int64)
    norms = np.array([q[2] for q in queue], float)
    out = deadline_drops(
        droppable=flags, counts=counts, norms=norms, need=need, left=left, budget=budget, used=used
    )
    assert not (out & ~flags).any()
    assert counts[out].sum() <= max(0, budget - used)
    if need <= max(left, 0):
        assert not out.any()


# --------------------------------------------------------------------- schedules


def test_constant_schedule() -> None:
    s = create("schedule", "constant", p=0.03)
    assert [s.bound(round=r, epoch=e, grad_norm=None) for r, e in [(0, 0), (9, 4)]] == [0.03] * 2


@pytest.mark.parametrize(
    ("params", "t", "expected"),
    [
        ({"p0": 0.08, "decay": 2.0, "p_min": 0.01}, 0, 0.08),
        ({"p0": 0.08, "decay": 2.0, "p_min": 0.01}, 2, 0.04),
        ({"p0": 0.08, "decay": 2.0, "p_min": 0.01}, 6, 0.02),
        ({"p0": 0.08, "decay": 2.0, "p_min": 0.01}, 100, 0.01),
        ({"p0": 0.1, "decay": 100.0, "p_min": 0.0, "per": "round"}, 300, 0.025),
        ({}, 0, 0.05),
    ],
)
def test_diminishing_values(params: dict[str, object], t: int, expected: float) -> None:
    s = create("schedule", "diminishing", **params)
    by_round = params.get("per") == "round"
    got = s.bound(round=t if by_round else 0, epoch=0 if by_round else t, grad_norm=None)
    assert got == pytest.approx(expected)


@FAST
@given(st.floats(0, 0.5), st.floats(0.1, 100), st.floats(0, 0.5))
def test_diminishing_monotone_in_range(p0: float, decay: float, p_min: float) -> None:
    p_min = min(p_min, p0)
    s = create("schedule", "diminishing", p0=p0, decay=decay, p_min=p_min)
    values = [s.bound(round=0, epoch=e, grad_norm=None) for e in range(0, 200, 7)]
    assert all(p_min <= v <= p0 <= 0.5 for v in values)
    assert all(b <= a for a, b in itertools.pairwise(values))


def run_phase(schedule: LossSchedule, means: list[float], rounds: int = 4) -> list[float]:
    """Bound of each epoch's first round, feeding each epoch `rounds` norms around its mean."""
    out = []
    r = 0
    jitter = (-0.25, 0.125, -0.125, 0.25)  # sums to 0 exactly
    for epoch, mean in enumerate(means):
        for i in range(rounds):
            b = schedule.bound(round=r, epoch=epoch, grad_norm=mean + jitter[i % 4])
            if i == 0:
                out.append(b)
            r += 1
    return out


def test_phase_schedule_warmup_and_critical_epochs() -> None:
    s = PhaseSchedule(low=0.01, high=0.1, warmup_epochs=2, threshold=0.5)
    #        epoch:  0    1    2    3    4    5    6    7    8    9
    means = [10, 10, 10, 4.0, 4.0, 6.0, 6.1, 12.2, 12.0, 12.0]
    got = run_phase(s, means)
    # epoch 4 follows the -60 % change of epoch 3; epoch 8 the +100 % of 7;
    # +50 % (4 -> 6, epoch 5) counts, as the threshold is inclusive.
    expected = [0.01, 0.01, 0.1, 0.1, 0.01, 0.1, 0.01, 0.1, 0.01, 0.1]
    assert got == expected
    assert s.critical_epochs == [4, 6, 8]
    assert s.epoch_means[3] == pytest.approx(4.0)


def test_phase_schedule_details() -> None:
    s = create("schedule", "phase", warmup_epochs=0, hold_epochs=2, low=0.0, high=0.2)
    assert run_phase(s, [1, 1, 3, 3, 3, 3]) == [0.2, 0.2, 0.2, 0.0, 0.0, 0.2]
    # The same round reported twice counts once (its latest value).
    s = PhaseSchedule(warmup_epochs=0)
    s.observe(round=0, epoch=0, grad_norm=100.0)
    s.observe(round=0, epoch=0, grad_norm=1.0)
    s.observe(round=1, epoch=0, grad_norm=1.0)
    s.bound(round=2, epoch=1, grad_norm=None)
    assert s.epoch_means[0] == 1.0
    # Non-finite norms are ignored.
    s.observe(round=2, epoch=1, grad_norm=math.inf)
    s.observe(round=3, epoch=1, grad_norm=1.2)
    assert s.bound(round=4, epoch=2, grad_norm=None) == s.high


# --------------------------------------------------------------------- balancing


def make_paths(n: int) -> list[PathState]:
    return [PathState(key=("10.0.0.1", f"10.0.{i}.2")) for i in range(n)]


@FAST
@given(st.integers(1, 6), st.lists(st.integers(0, 300), max_size=30))
def test_spray_exact(n_paths: int, sizes: list[int]) -> None:
    paths = make_paths(n_paths)
    bal = create("balance", "spray")
    total = np.zeros(n_paths, int)
    for n in sizes:
        a = bal.assign(n=n, paths=paths)
        assert len(a) == n and (a >= 0).all() and (a < n_paths).all()
        total += np.bincount(a, minlength=n_paths)
        assert total.max() - total.min() <= 1


def test_flow_one_path_stable() -> None:
    paths = make_paths(4)
    chosen = set()
    for key in (f"peer{i}" for i in range(20)):
        bal = FlowBalancer(key=key)
        a = np.concatenate([bal.assign(n=n, paths=paths) for n in (5, 100, 0, 7)])
        assert len(set(a.tolist())) == 1
        again = FlowBalancer(key=key).assign(n=1, paths=paths)  # stable hash, not hash()
        assert again[0] == a[0]
        chosen.add(int(a[0]))
    assert len(chosen) > 1  # different peers spread over paths, ECMP-like
    # Without a key: the paths' keys pick, fixed after first use.
    bal = FlowBalancer()
    assert len(set(bal.assign(n=50, paths=paths).tolist())) == 1


@FAST
@given(
    st.lists(st.integers(0, 20), min_size=2, max_size=5).filter(lambda w: sum(w) > 0),
    st.lists(st.integers(0, 200), min_size=1, max_size=25),
)
def test_weighted_proportions(weights: list[int], sizes: list[int]) -> None:
    paths = make_paths(len(weights))
    bal = create("balance", "weighted", weights=weights)
    share = np.array(weights, float) / sum(weights)
    total = np.zeros(len(weights))
    # Stride scheduling keeps each path within 0.5 + share * (P - 2) / 2 packets.
    slack = 0.5 + share * (len(weights) - 2) / 2 + 1e-6
    for n in sizes:
        a = bal.assign(n=n, paths=paths)
        assert len(a) == n
        total += np.bincount(a, minlength=len(weights))
        assert (np.abs(total - total.sum() * share) <= slack).all()
    zero = [i for i, w in enumerate(weights) if w == 0]
    assert (total[zero] == 0).all()


def test_weighted_smooth_and_default() -> None:
    a = WeightedBalancer(weights=[5, 1, 1]).assign(n=7, paths=make_paths(3))
    assert a.tolist() == [0, 0, 0, 1, 2, 0, 0]  # interleaved, not 0 0 0 0 0 1 2
    even = WeightedBalancer().assign(n=9, paths=make_paths(3))
    assert np.bincount(even).tolist() == [3, 3, 3]
    with pytest.raises(LocalError, match="2 weights configured for 3 paths"):
        WeightedBalancer(weights=[1, 2]).assign(n=1, paths=make_paths(3))


def simulate(
    bal: LoadBalancer,
    paths: list[PathState],
    loss: list[float],
    rtt: list[float],
    rounds: int,
    rng: np.random.Generator,
    per_round: int = 2000,
) -> list[np.ndarray]:
    """Rounds of sending, random loss per path and RTT samples; the share per round."""
    shares = []
    for r in range(rounds):
        a = bal.assign(n=per_round, paths=paths)
        bal.record_sent(paths, a)
        sent = np.bincount(a, minlength=len(paths))
        shares.append(sent / per_round)
        now = 0.01 * (r + 1)
        for i, p in enumerate(paths):
            bal.on_loss(p, int(rng.binomial(sent[i], loss[i])), now)
            bal.on_rtt(p, rtt[i] * rng.uniform(0.9, 1.1), now)
    return shares


def test_adaptive_shifts_away_from_lossy_path() -> None:
    rng = np.random.default_rng(3)
    paths = make_paths(3)
    bal = create("balance", "adaptive")
    shares = simulate(bal, paths, [0.0, 0.10, 0.0], [1e-3] * 3, rounds=6, rng=rng)
    assert shares[0][1] == pytest.approx(1 / 3, abs=1e-3)  # nothing known yet: even
    # Within a few rounds the lossy path has lost most of its traffic ...
    assert all(s[1] < 0.1 for s in shares[2:])
    # ... but keeps the probe floor, and the clean paths share the rest evenly.
    assert shares[-1][1] >= 0.05 - 1e-3
    assert shares[-1][0] == pytest.approx(shares[-1][2], abs=0.01)
    assert paths[1].lost > 0 and paths[1].loss_rate == pytest.approx(0.1, abs=0.03)


def test_adaptive_recovers_and_follows_delay() -> None:
    rng = np.random.default_rng(4)
    paths = make_paths(2)
    bal = AdaptiveBalancer()
    simulate(bal, paths, [0.0, 0.2], [1e-3, 1e-3], rounds=4, rng=rng)
    assert paths[1].weight < 0.1
    shares = simulate(bal, paths, [0.0, 0.0], [1e-3, 1e-3], rounds=40, rng=rng)
    assert shares[-1][1] > 0.4  # probes saw the path heal
    # Delay alone: twice the RTT, about half the traffic.
    paths = make_paths(2)
    shares = simulate(AdaptiveBalancer(), paths, [0, 0], [1e-3, 2e-3], rounds=10, rng=rng)
    assert shares[-1][0] == pytest.approx(2 / 3, abs=0.05)


def test_adaptive_weighs_random_loss_by_goodput() -> None:
    """Loss within the tolerance is random: the path keeps its goodput share
    (1 - loss); loss beyond it is congestion, or worse: traffic moves off."""
    rng = np.random.default_rng(5)
    paths = make_paths(2)
    bal = AdaptiveBalancer(loss_tolerance=0.15, delay_exponent=0.0)  # loss alone
    shares = simulate(bal, paths, [0.0, 0.10], [1e-3] * 2, rounds=6, rng=rng)
    lossy = paths[1].loss_rate
    assert 0.05 < lossy < 0.15
    assert bal.shares(paths)[1] == pytest.approx((1 - lossy) / (2 - lossy))
    assert shares[-1][1] == pytest.approx((1 - lossy) / (2 - lossy), abs=0.03)
    assert shares[-1][1] < 0.5  # less than a clean path, but far above the floor
    # The same path at 30 % loss: within a few rounds it is down to the floor.
    shares = simulate(bal, paths, [0.0, 0.30], [1e-3] * 2, rounds=12, rng=rng)
    assert paths[1].loss_rate > 0.2
    assert all(s[1] < 0.1 for s in shares[-4:])
    assert shares[-1][1] == pytest.approx(0.05, abs=1e-3)
    # keep() is continuous at the tolerance and falls steeply beyond it.
    k = bal.keep(np.array([0.0, 0.1, 0.15, 0.15 + 1e-9, 0.2, 0.3]))
    assert k[:3].tolist() == pytest.approx([1.0, 0.9, 0.85])
    assert k[3] == pytest.approx(0.85) and k[4] < 0.15 and k[5] < 0.01
    # Without a tolerance (the default) every loss is penalised steeply, as before.
    plain = AdaptiveBalancer()
    assert plain.keep(np.array([0.1]))[0] == pytest.approx(0.9**30)
    with pytest.raises(LocalError, match="loss_tolerance"):
        AdaptiveBalancer(loss_tolerance=1.0)


def test_daemon_gives_adaptive_the_rate_loss_tolerance() -> None:
    from dlcp.daemon.config import parse
    from dlcp.daemon.server import Daemon

    d = Daemon(parse({"policies": {"balance": "adaptive"}, "rate": {"loss_tolerance": 0.12}}))
    bal = d._balancer_factory()
    assert isinstance(bal, AdaptiveBalancer) and bal.loss_tolerance == 0.12
    own = {"balance": {"name": "adaptive", "loss-tolerance": 0.0}}
    d = Daemon(parse({"policies": own, "rate": {"loss_tolerance": 0.12}}))
    assert d._balancer_factory().loss_tolerance == 0.0  # its own setting wins
    d = Daemon(parse({"policies": {"balance": "spray"}}))
    assert isinstance(d._balancer_factory(), SprayBalancer)


def test_spray_and_weighted_keep_to_ready_paths() -> None:
    """Paths without pacing budget are skipped, and forgo their turns."""
    paths = make_paths(3)
    spray = SprayBalancer()
    assert spray.assign(n=4, paths=paths).tolist() == [0, 1, 2, 0]
    ready = np.array([True, False, True])
    assert spray.assign(n=4, paths=paths, ready=ready).tolist() == [2, 0, 2, 0]
    assert spray.assign(n=3, paths=paths).tolist() == [1, 2, 0]  # round robin goes on
    # none ready or all ready: no restriction (the caller waits when none is)
    assert spray.assign(n=3, paths=paths, ready=np.zeros(3, bool)).tolist() == [1, 2, 0]
    with pytest.raises(LocalError, match="3 booleans"):
        spray.assign(n=1, paths=paths, ready=np.array([True, False]))

    bal = WeightedBalancer(weights=[1, 1])
    two = make_paths(2)
    only0 = np.array([True, False])
    a = bal.assign(n=40, paths=two, ready=only0)
    assert (a == 0).all()
    # path 1 is ready again: it gets its share from now on, not a catch-up burst
    b = bal.assign(n=10, paths=two)
    assert np.bincount(b, minlength=2).tolist() in ([5, 5], [4, 6])


def test_flow_and_adaptive_do_not_follow_ready() -> None:
    paths = make_paths(2)
    flow = FlowBalancer(key="k")
    pick = int(flow.assign(n=1, paths=paths)[0])
    other = np.array([i != pick for i in range(2)])
    assert (flow.assign(n=5, paths=paths, ready=other) == pick).all()
    ad = AdaptiveBalancer()
    a = ad.assign(n=100, paths=paths, ready=np.array([True, False]))
    assert np.bincount(a, minlength=2).tolist() == [50, 50]  # waits for path 1's budget


def test_adaptive_weighs_path_rates() -> None:
    paths = make_paths(2)
    bal = AdaptiveBalancer()
    paths[0].rate_bps, paths[1].rate_bps = 300e6, 100e6  # path 1 paced slower
    assert bal.shares(paths).tolist() == pytest.approx([0.75, 0.25])
    paths[1].rate_bps = None  # unknown: counts as the fastest
    assert bal.shares(paths).tolist() == pytest.approx([0.5, 0.5])


def test_path_state_hooks() -> None:
    bal = SprayBalancer()
    p = PathState()
    assert p.loss_rate == 0.0
    bal.on_sent(p, 100)
    bal.on_loss(p, 10, now=1.0)
    assert (p.sent, p.lost, p.last_loss) == (100, 10, 1.0)
    assert p.loss_rate == pytest.approx(0.1)
    bal.on_rtt(p, 0.002, now=1.0)
    bal.on_rtt(p, 0.010, now=2.0)
    assert p.rtt_min == 0.002 and 0.002 < (p.rtt_ewma or 0) < 0.010
    with pytest.raises(LocalError):
        bal.on_rtt(p, 0.0, now=3.0)
    with pytest.raises(LocalError):
        bal.assign(n=3, paths=[])
    with pytest.raises(LocalError):
        bal.record_sent([p], np.array([0, 1]))


def _smallest_fitting_by_sort(
    dens: np.ndarray, lanes: np.ndarray, budget: int, k: int
) -> np.ndarray:
    """smallest_norm's choice as it was first written: a stable sort of the bucket."""
    n = len(dens)
    order = np.argsort(dens, kind="stable")
    ranked = dens[order]
    limit = n if k >= n else int(np.searchsorted(ranked, ranked[k], side="left"))
    used = np.cumsum(lanes[order[:limit]])
    return order[: int(np.searchsorted(used, budget, side="right"))]


def test_smallest_norm_and_magnitude_ranks_equal_their_sorted_definitions() -> None:
    """The partition-based choices equal the sort-based ones, ties (kept in
    index order) and infinities included."""
    from dlcp.policies.drop import _smallest_fitting

    rng = np.random.default_rng(11)
    prio = from_config("priority", "layer_magnitude")
    for trial in range(600):
        n = int(rng.integers(1, 4000))
        kind = trial % 4
        if kind == 0:
            dens = rng.uniform(0, 1, n)
        elif kind == 1:
            dens = rng.integers(0, 5, n).astype(np.float64)  # many ties
        elif kind == 2:
            dens = np.where(rng.random(n) < 0.1, np.inf, rng.exponential(1, n))
        else:
            dens = np.zeros(n)
        lanes = rng.integers(1, 353, n) if trial % 3 == 0 else np.full(n, 352)
        if n > 1 and trial % 5 == 0:
            lanes[-1] = 1
        budget = int(0.05 * lanes.sum()) if trial % 2 else int(rng.integers(0, lanes.sum() + 2))
        k = int(rng.integers(0, n + 2))
        np.testing.assert_array_equal(
            _smallest_fitting(dens, lanes, budget, k),
            _smallest_fitting_by_sort(dens, lanes, budget, k),
        )
        cuts = np.quantile(dens, prio._levels, method="lower")
        np.testing.assert_array_equal(
            prio.magnitude_score(dens), np.searchsorted(cuts, dens, side="left") / len(cuts)
        )
