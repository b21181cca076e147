"""Layer priority against the whole model: the daemon ranks a packet's layer
against the model's layer count that the shim sends with every bucket
(`"layers"` of the submit), not against its own bucket's highest layer."""

from __future__ import annotations

import os
from collections import Counter
from concurrent.futures import Future
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from dlcp.codecs import get_codec
from dlcp.core.layout import Layout
from dlcp.core.records import JobSpec
from dlcp.daemon.config import Config
from dlcp.daemon.jobs import LocalPart, LocalRound
from dlcp.daemon.rounds import RoundLifecycle
from dlcp.policies import from_config
from dlcp.shim.arena import Arena
from dlcp.shim.exchange import RoundPlan, submit_round
from dlcp.shim.regions import region_sizes
from dlcp.shim.staging import Staging
from dlcp.wire.header import Codec

PAYLOAD = 1408


def _rounds(submitted: list[dict[str, Any]]) -> RoundLifecycle:
    """The daemon's round start alone: what the engine is handed goes to `submitted`."""
    return RoundLifecycle(
        config=Config(),
        engine=SimpleNamespace(submit=lambda **kw: submitted.append(kw)),  # type: ignore[arg-type]
        outbox=None,  # type: ignore[arg-type]
        priority=from_config("priority", "layer_magnitude"),
        drop=from_config("drop", "smallest_norm"),
        counters=Counter(),
        requests=Counter(),
        clock=lambda: 0.0,
        pump=lambda: None,
        call_later=lambda *a: None,
        windows_changed=lambda: None,
    )


def _classes(layers: list[int], n_layers: int | None) -> np.ndarray:
    """The classes the daemon gives one single-rank fp32 bucket whose packets
    carry `layers` (equal norms: only the layer ranks them)."""
    n = len(layers)
    total = n * (PAYLOAD // 4)
    assert Layout(total, Codec.FP32, 1, PAYLOAD).packets == n
    submitted: list[dict[str, Any]] = []
    rounds = _rounds(submitted)
    part = LocalPart(
        client=SimpleNamespace(segment=None),
        rid=1,
        out=(0, 0),
        data=np.zeros(total * 4, np.uint8),
        layers=np.asarray(layers, np.int64),
        norms=np.ones(n),
        block_max=None,
        n_layers=n_layers,
    )
    lr = LocalRound(1, 0, 0, int(Codec.FP32), total, 0.0, 0.0, expected=1, started=0.0)
    lr.parts.append(part)
    job = SimpleNamespace(
        spec=JobSpec(job=1, key=b"k" * 32, me=0, contributors=(0,), owners=(0,), payload=PAYLOAD)
    )
    rounds._start_round(lr, job)  # type: ignore[arg-type]
    return np.asarray(submitted[0]["classes"])


FRONT = [0, 1, 2, 3]  # a 10-layer model's first bucket
BACK = [6, 7, 8, 9]  # and its last


def test_a_front_buckets_packets_rank_above_a_back_buckets_with_the_models_layers() -> None:
    front, back = _classes(FRONT, 10), _classes(BACK, 10)
    assert front.max() < back.min()  # every front packet in a better (lower) class
    # the same layer ranks the same wherever its bucket sits
    assert _classes([3], 10)[0] == front[3]


def test_the_old_rule_ranked_a_front_layer_below_a_back_one() -> None:
    """Without the model's count (an older shim), each bucket ranks against its
    own highest layer: the front bucket's layer 3 ends in the worst class,
    no better than the back bucket's layer 6. The rule above is what prevents it."""
    front, back = _classes(FRONT, None), _classes(BACK, None)
    assert not front.max() < back.min()
    assert front[3] >= back[0]


def test_a_count_below_the_buckets_layers_is_raised_to_them() -> None:
    assert (_classes(BACK, 2) == _classes(BACK, None)).all()


class _Client:
    def __init__(self) -> None:
        self.fields: dict[str, Any] = {}
        self.segments: list[str] = []

    def segment(self, seg: object) -> None:
        self.segments.append(str(seg))

    def submit(self, **fields: Any) -> Future[dict[str, Any]]:
        self.fields = fields
        return Future()


def test_the_shim_sends_the_models_layer_count_with_every_bucket() -> None:
    client = _Client()
    arena = Arena(client, f"dlcp-layers-{os.getpid()}", 1 << 20)  # type: ignore[arg-type]
    try:
        codec = get_codec("fp32")
        plan = RoundPlan.make(codec, 1000, shards=1, payload=PAYLOAD, round_=0, bucket=0)
        region = arena.take(region_sizes(plan.layout))
        layers = np.zeros(plan.packets, np.uint16)
        x = torch.ones(1000)
        kw: dict[str, Any] = dict(
            job=1, bound=0.0, layers=layers, state=None, generator=None, staging=Staging()
        )
        submit_round(client, region, plan, x, n_layers=10, **kw)  # type: ignore[arg-type]
        assert client.fields["layers"] == 10
        submit_round(client, arena.take(region_sizes(plan.layout)), plan, x, **kw)  # type: ignore[arg-type]
        assert "layers" not in client.fields
    finally:
        arena.close()
