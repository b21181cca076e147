"""What the simulated ranks hand their daemons: the bench's buffers and the
daemon's policy decisions on them.

`bench_buffers` is `dlcp bench allreduce`'s data (dlcp/bench/ar_worker.py's
`position_scales` and `make_data`, imported); `contribution` is what
`dlcp.daemon.rounds.RoundsMixin._start_round` computes from a rank's
submit with the daemon's own policies (`from_config`): per-packet L2 norms,
the bench's equal synthetic layers, classes from the priority policy,
droppable packets per shard from the drop policy within the bound. It is
written out here because the daemon's version reads a rank's shared-memory
submit.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dlcp.core.layout import Layout
from dlcp.daemon.config import Config
from dlcp.policies import apply_droppable, from_config
from dlcp.wire import Codec

__all__ = ["N_LAYERS", "Contribution", "bench_buffers", "contribution"]

N_LAYERS = 16  # the bench's synthetic layers (ar_worker.N_LAYERS)


def bench_buffers(elements: int, contributors: int, seed: int) -> list[np.ndarray]:
    """Each contributor's fp32 buffer as the bench's worker makes it."""
    from dlcp.bench.ar_worker import make_data, position_scales  # imports torch: late

    scales = position_scales(elements, seed)
    return [make_data(elements, seed, h, scales).astype("<f4") for h in range(contributors)]


@dataclass(frozen=True)
class Contribution:
    lanes: np.ndarray
    classes: np.ndarray
    droppable: np.ndarray
    layers: np.ndarray
    class_bounds: np.ndarray | None = None  # the policy's `lowest`


def contribution(x: np.ndarray, lay: Layout, bound: float, config: Config) -> Contribution:
    """One host's submit of `x` as the daemon turns it into packets' metadata."""
    n, per = lay.packets, lay.per_packet
    counts = lay.packet_counts()
    padded = np.zeros(n * per, np.float64)
    padded[: x.size] = x
    norms = np.sqrt((padded.reshape(n, per) ** 2).sum(axis=1))
    layers = (np.arange(n, dtype=np.int64) * per * N_LAYERS // max(1, x.size)).clip(0, N_LAYERS - 1)
    priority = from_config("priority", {**config.priority, "dscp": list(config.dscp)})
    n_layers = int(layers.max()) + 1
    classes = priority.classify(layers=layers, n_layers=n_layers, norms=norms, counts=counts)
    lowest = priority.lowest(layers=layers, n_layers=n_layers)
    drop = np.zeros(n, dtype=bool)
    policy = from_config("drop", config.drop)
    for s in range(lay.shards):
        r = lay.shard_packets(s)
        if bound > 0 and len(r):
            drop[r.start : r.stop] = policy.droppable(
                norms=norms[r.start : r.stop], counts=counts[r.start : r.stop], bound=bound
            )
    return Contribution(
        x, apply_droppable(classes, drop), drop, layers.astype(np.uint16), lowest
    )


def layout_of(elements: int, shards: int, payload: int) -> Layout:
    return Layout(total=elements, codec=Codec.FP32, shards=shards, payload=payload)
