"""The digits MLP (scikit-learn's 8x8 digits): data, model, simulated data-parallel
training through a codec, and sample gradients for calibration.

The same model as `dlcp bench train` (hidden 1024, 768, 256 by default);
features scaled to [0, 1], a stratified 75/25 split.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from dlcp.codecs import get_codec
from dlcp.codecs.base import Codec, CodecState
from dlcp.costmodel.exchange import average
from dlcp.costmodel.profile import DEFAULT_BUCKET_MB, ModelProfile, measure_profile

__all__ = [
    "DIGITS_HIDDEN",
    "TrainResult",
    "build_mlp",
    "digits_profile",
    "flat_grad",
    "load_digits_data",
    "sample_gradients",
    "train_simulated",
]

DIGITS_HIDDEN: tuple[int, ...] = (1024, 768, 256)
Data = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def load_digits_data(seed: int = 0) -> Data:
    """(x_train, y_train, x_test, y_test): float32 features in [0, 1], int64 labels."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    xtr, xte, ytr, yte = train_test_split(x, y, test_size=0.25, random_state=seed, stratify=y)
    return (
        torch.from_numpy(xtr),
        torch.from_numpy(ytr.astype(np.int64)),
        torch.from_numpy(xte),
        torch.from_numpy(yte.astype(np.int64)),
    )


def build_mlp(hidden: Sequence[int] = DIGITS_HIDDEN, seed: int = 0) -> torch.nn.Sequential:
    """64 -> hidden... -> 10 with ReLUs."""
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    layers: list[torch.nn.Module] = []
    width = 64
    for h in hidden:
        layers += [torch.nn.Linear(width, h), torch.nn.ReLU()]
        width = h
    layers.append(torch.nn.Linear(width, 10))
    torch.random.set_rng_state(gen_state)
    return torch.nn.Sequential(*layers)


def flat_grad(model: torch.nn.Module) -> torch.Tensor:
    """All parameter gradients as one float32 vector (parameter order)."""
    return torch.cat(
        [
            (p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
            for p in model.parameters()
        ]
    )


def _set_grad(model: torch.nn.Module, flat: torch.Tensor) -> None:
    at = 0
    for p in model.parameters():
        n = p.numel()
        p.grad = flat[at : at + n].view_as(p).clone()
        at += n


def _accuracy(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return float((model(x).argmax(dim=1) == y).float().mean())


@dataclass
class TrainResult:
    accuracy: float
    steps: int
    curve: list[float] = field(default_factory=list)  # test accuracy after each epoch


def train_simulated(
    codec: str | Codec | None,
    *,
    workers: int = 3,
    epochs: int = 10,
    batch: int = 32,
    hidden: Sequence[int] = (128,),
    lr: float = 0.05,
    momentum: float = 0.9,
    seed: int = 0,
    error_feedback: bool = True,
) -> TrainResult:
    """Data-parallel SGD on digits with `workers` simulated workers in one process.

    Every step each worker takes its own `batch` examples, computes its
    gradient, and the averaged gradient comes out of `codec` (None: exact fp32
    mean). Same seed, same data order for every codec.
    """
    xtr, ytr, xte, yte = load_digits_data(seed)
    model = build_mlp(hidden, seed)
    c = get_codec(codec) if isinstance(codec, str) else codec
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    states = [CodecState() for _ in range(workers)] if error_feedback else None
    gen = torch.Generator().manual_seed(seed)
    loss_fn = torch.nn.CrossEntropyLoss()
    steps = 0
    curve: list[float] = []
    per_step = workers * batch
    for _ in range(epochs):
        order = torch.randperm(xtr.shape[0], generator=gen)
        for start in range(0, order.numel() - per_step + 1, per_step):
            grads = []
            for w in range(workers):
                idx = order[start + w * batch : start + (w + 1) * batch]
                model.zero_grad(set_to_none=True)
                loss_fn(model(xtr[idx]), ytr[idx]).backward()
                grads.append(flat_grad(model))
            if c is None:
                mean = torch.stack(grads).mean(dim=0)
            else:
                mean = average(c, grads, states, seed=seed * 1_000_003 + steps).mean
            _set_grad(model, mean)
            opt.step()
            steps += 1
        curve.append(_accuracy(model, xte, yte))
    return TrainResult(accuracy=curve[-1] if curve else 0.0, steps=steps, curve=curve)


def sample_gradients(
    workers: int = 3,
    *,
    hidden: Sequence[int] = DIGITS_HIDDEN,
    batch: int = 32,
    warm_steps: int = 20,
    seed: int = 0,
) -> list[torch.Tensor]:
    """One flat gradient per worker (own minibatch) of a digits MLP trained
    `warm_steps` steps, so the gradients look like mid-training ones."""
    xtr, ytr, _, _ = load_digits_data(seed)
    model = build_mlp(hidden, seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(seed)
    loss_fn = torch.nn.CrossEntropyLoss()
    for _ in range(warm_steps):
        idx = torch.randint(0, xtr.shape[0], (batch * workers,), generator=gen)
        opt.zero_grad()
        loss_fn(model(xtr[idx]), ytr[idx]).backward()
        opt.step()
    grads = []
    for w in range(workers):
        idx = torch.randint(0, xtr.shape[0], (batch,), generator=gen)
        model.zero_grad(set_to_none=True)
        loss_fn(model(xtr[idx]), ytr[idx]).backward()
        grads.append(flat_grad(model).clone())
        del w
    return grads


def digits_profile(
    *,
    bucket_mb: float = DEFAULT_BUCKET_MB,
    batch: int = 32,
    hidden: Sequence[int] = DIGITS_HIDDEN,
    iters: int = 10,
    threads: int | None = 1,
) -> ModelProfile:
    """The digits MLP's profile measured now on this host (`threads` torch threads)."""
    old = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        xtr, ytr, _, _ = load_digits_data(0)
        gen = torch.Generator().manual_seed(0)

        def make_batch() -> tuple[torch.Tensor, torch.Tensor]:
            idx = torch.randint(0, xtr.shape[0], (batch,), generator=gen)
            return xtr[idx], ytr[idx]

        return measure_profile(
            "digits-mlp",
            build_mlp(hidden),
            make_batch,
            torch.nn.CrossEntropyLoss(),
            cap_mb=bucket_mb,
            iters=iters,
            warmup=3,
        )
    finally:
        torch.set_num_threads(old)
