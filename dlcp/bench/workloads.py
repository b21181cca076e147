"""The models `dlcp bench train --model` trains, on data that ships offline.

- `mlp`: the MLP on scikit-learn's 8x8 digits (5 x 512 hidden: 1.09M
  parameters); target: test accuracy 0.90.
- `cnn`: a small CNN (three 3x3 convolutions, two fully connected layers,
  0.62M parameters) on the same digits upsampled to 16x16 (bilinear); target:
  test accuracy 0.95.
- `gpt`: a byte-level transformer language model (4 blocks, width 128, 64
  bytes of context, weight-tied: 0.83M parameters) on Python's own standard
  library sources (the top-level .py files of this interpreter's stdlib, 4 MB
  in name order; the last tenth held out); target: validation loss 3.0 nats
  a byte (an untrained model: 5.5; the bytes' unigram entropy is about 3.3;
  one process at batch 12 reaches 3.0 in about 75 steps). Its "accuracy" is
  the held-out next-byte accuracy.

Sized so that on a 2-core host (three ranks sharing it) a step's compute and
its communication at 200 Mbit/s are of the same order.
"""

from __future__ import annotations

import math
import sysconfig
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

__all__ = ["MODELS", "Data", "Workload", "workload"]


@dataclass
class Data:
    """What a rank trains and evaluates on: `batch(n, gen)` a training batch of
    this rank's shard; `evaluate(model)` (accuracy, loss) on the held-out set."""

    batch: Callable[[int, torch.Generator], tuple[torch.Tensor, torch.Tensor]]
    evaluate: Callable[[nn.Module], tuple[float, float]]


@dataclass(frozen=True)
class Workload:
    name: str
    metric: str  # "acc" (higher is better) or "val_loss" (lower is better)
    target: float
    lr: float
    optimizer: str  # torch.optim class name
    describe: str

    def reached(self, acc: float, loss: float) -> bool:
        return acc >= self.target if self.metric == "acc" else loss <= self.target


MODELS: dict[str, Workload] = {
    w.name: w
    for w in (
        Workload("mlp", "acc", 0.90, 2e-3, "Adam", "MLP on the 8x8 digits, to test accuracy 0.90"),
        Workload(
            "cnn", "acc", 0.95, 1e-3, "Adam", "CNN on the digits at 16x16, to test accuracy 0.95"
        ),
        Workload(
            "gpt",
            "val_loss",
            3.0,
            2e-3,
            "AdamW",
            "byte-level transformer on the stdlib's sources, to validation loss 3.0 nats/byte",
        ),
    )
}


def workload(name: str) -> Workload:
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; valid: {', '.join(MODELS)}")
    return MODELS[name]


# -- the digits (mlp, cnn) -------------------------------------------------------------


def _digits(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
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


def _classifier_data(
    xtr: torch.Tensor,
    ytr: torch.Tensor,
    xte: torch.Tensor,
    yte: torch.Tensor,
    rank: int,
    world: int,
) -> Data:
    mine = torch.arange(rank, len(xtr), world)

    def batch(n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        idx = mine[torch.randint(0, len(mine), (n,), generator=gen)]
        return xtr[idx], ytr[idx]

    def evaluate(model: nn.Module) -> tuple[float, float]:
        with torch.no_grad():
            out = model(xte)
            loss = float(nn.functional.cross_entropy(out, yte))
            return float((out.argmax(1) == yte).float().mean()), loss

    return Data(batch, evaluate)


def mlp_model(hidden: list[int], seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    width = 64
    for h in hidden:
        layers += [nn.Linear(width, h), nn.ReLU()]
        width = h
    layers.append(nn.Linear(width, 10))
    return nn.Sequential(*layers)


def _upsample(x: torch.Tensor) -> torch.Tensor:
    img = x.reshape(-1, 1, 8, 8)
    return nn.functional.interpolate(img, size=(16, 16), mode="bilinear", align_corners=False)


def cnn_model(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(32, 64, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),  # 8x8
        nn.Conv2d(64, 128, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),  # 4x4
        nn.Flatten(),
        nn.Linear(128 * 16, 256),
        nn.ReLU(),
        nn.Linear(256, 10),
    )


# -- the byte-level language model (gpt) ----------------------------------------------

CONTEXT = 64
TEXT_BYTES = 4 << 20


def stdlib_text(limit: int = TEXT_BYTES) -> bytes:
    """The top-level .py files of this interpreter's standard library, in name
    order, joined, up to `limit` bytes (text that ships with Python itself)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    parts: list[bytes] = []
    size = 0
    for path in sorted(root.glob("*.py")):
        blob = path.read_bytes()
        parts.append(blob)
        size += len(blob)
        if size >= limit:
            break
    text = b"".join(parts)[:limit]
    if len(text) < 100_000:
        raise RuntimeError(f"the standard library at {root} has only {len(text)} bytes of .py")
    return text


class _Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class ByteGPT(nn.Module):
    """A small decoder-only transformer over bytes (256 symbols), weight-tied."""

    def __init__(self, width: int = 128, depth: int = 4, heads: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, width)
        self.pos = nn.Embedding(CONTEXT, width)
        self.blocks = nn.ModuleList(_Block(width, heads) for _ in range(depth))
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, 256, bias=False)
        self.head.weight = self.embed.weight
        nn.init.normal_(self.embed.weight, std=0.02)  # tied: logits start small
        nn.init.normal_(self.pos.weight, std=0.02)
        mask = torch.triu(torch.full((CONTEXT, CONTEXT), -math.inf), diagonal=1)
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.embed(idx) + self.pos(torch.arange(t, device=idx.device))
        mask = self.mask[:t, :t]  # type: ignore[index]
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.ln(x))  # (batch, t, 256)


def gpt_model(seed: int) -> ByteGPT:
    torch.manual_seed(seed)
    return ByteGPT()


def _gpt_data(rank: int, world: int, seed: int) -> Data:
    text = torch.frombuffer(bytearray(stdlib_text()), dtype=torch.uint8).long()
    cut = len(text) * 9 // 10
    train, held = text[:cut], text[cut:]
    # this rank's windows start in its own slice of the training text
    span = (len(train) - CONTEXT - 1) // world
    lo = rank * span
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(held) - CONTEXT - 1, (64,), generator=gen)
    vx = torch.stack([held[s : s + CONTEXT] for s in starts])
    vy = torch.stack([held[s + 1 : s + CONTEXT + 1] for s in starts])

    def batch(n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        s = lo + torch.randint(0, span, (n,), generator=g)
        x = torch.stack([train[i : i + CONTEXT] for i in s])
        y = torch.stack([train[i + 1 : i + CONTEXT + 1] for i in s])
        return x, y

    def evaluate(model: nn.Module) -> tuple[float, float]:
        with torch.no_grad():
            out = model(vx)
            loss = float(nn.functional.cross_entropy(out.reshape(-1, 256), vy.reshape(-1)))
            return float((out.argmax(-1) == vy).float().mean()), loss

    return Data(batch, evaluate)


def build(
    name: str, *, rank: int, world: int, seed: int, hidden: list[int]
) -> tuple[nn.Module, Data]:
    """The model (the same on every rank: seeded) and this rank's data."""
    if name == "gpt":
        return gpt_model(seed), _gpt_data(rank, world, seed)
    xtr, ytr, xte, yte = _digits(0)
    if name == "cnn":
        return cnn_model(seed), _classifier_data(
            _upsample(xtr), ytr, _upsample(xte), yte, rank, world
        )
    return mlp_model(hidden, seed), _classifier_data(xtr, ytr, xte, yte, rank, world)


def loss_of(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Cross entropy over classes, or over every position's next byte."""
    if out.dim() == 3:
        return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
    return nn.functional.cross_entropy(out, y)
