"""Data-parallel training of a small MLP on scikit-learn's digits, through dlcp.

    torchrun --nproc-per-node 3 examples/train_digits.py --codec thc8 --loss-bound 0.05
    torchrun --nproc-per-node 3 examples/train_digits.py --backend gloo   # the baseline

Every rank needs a dlcp daemon on its host (`DLCP_SOCKET` or --socket; without
one the hook falls back to Gloo with a warning, unless --strict). With
`--json FILE` rank 0 writes the run's summary: final test accuracy, the
accuracy curve ([seconds, accuracy] per epoch), steps, whether all replicas
ended with identical parameters, and the shim's counters. Without
scikit-learn (or with --synthetic) a synthetic 10-class data set of the same
shape is used.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

import dlcp.shim as dlcp


def load_data(seed: int, synthetic: bool) -> tuple[np.ndarray, np.ndarray, str]:
    """Features in [0, 1] (n, 64), labels (n,), and the data set's name."""
    if not synthetic:
        try:
            from sklearn.datasets import load_digits
        except ImportError:
            print("scikit-learn is not installed: using synthetic digits", file=sys.stderr)
        else:
            x, y = load_digits(return_X_y=True)
            return x.astype(np.float32) / 16.0, y.astype(np.int64), "digits"
    rng = np.random.default_rng(seed + 7)
    protos = rng.uniform(0, 1, (10, 64)).astype(np.float32)
    y = rng.integers(0, 10, 1797)
    x = protos[y] + rng.normal(0, 0.35, (1797, 64)).astype(np.float32)
    return np.clip(x, 0, 1).astype(np.float32), y.astype(np.int64), "synthetic"


def split(x: np.ndarray, y: np.ndarray, seed: int) -> tuple[torch.Tensor, ...]:
    perm = np.random.default_rng(seed).permutation(len(y))
    test = perm[: len(y) // 5]
    train = perm[len(y) // 5 :]
    t = torch.from_numpy
    return t(x[train]), t(y[train]), t(x[test]), t(y[test])


def make_model(hidden: int) -> nn.Module:
    return nn.Sequential(
        nn.Linear(64, hidden),
        nn.ReLU(),
        nn.Linear(hidden, hidden),
        nn.ReLU(),
        nn.Linear(hidden, 10),
    )


def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return float((model(x).argmax(1) == y).float().mean())


def params_digest(model: nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().cpu().numpy().tobytes())
    return h.hexdigest()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--backend", choices=("dlcp", "gloo"), default="dlcp")
    ap.add_argument("--codec", default="fp32", choices=dlcp.CODEC_NAMES)
    ap.add_argument("--loss-bound", type=float, default=0.0)
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--batch-size", type=int, default=32, help="per rank")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--target-acc", type=float, default=None, help="stop once reached")
    ap.add_argument("--socket", default=None, help="daemon socket (default: DLCP_SOCKET)")
    ap.add_argument("--strict", action="store_true", help="fail instead of falling back")
    ap.add_argument("--retry-steps", type=int, default=20)
    ap.add_argument("--synthetic", action="store_true", help="synthetic data, no scikit-learn")
    ap.add_argument("--json", default=None, help="rank 0 writes the summary here")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    dist.init_process_group(backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    x, y, name = load_data(args.seed, args.synthetic)
    x_train, y_train, x_test, y_test = split(x, y, args.seed)
    model = nn.parallel.DistributedDataParallel(make_model(args.hidden))
    state: dlcp.DlcpState | None = None
    if args.backend == "dlcp":
        state = dlcp.init(
            codec=args.codec,
            loss_bound=args.loss_bound,
            socket=args.socket,
            strict=args.strict,
            model=model.module,
            retry_steps=args.retry_steps,
        )
        model.register_comm_hook(state, dlcp.hook)
    else:
        model.register_comm_hook(None, allreduce_hook)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()

    n = len(y_train)
    per_step = args.batch_size * world
    steps_per_epoch = n // per_step
    curve: list[list[float]] = []
    steps = 0
    start = time.monotonic()
    acc = 0.0
    for epoch in range(args.epochs):
        order = torch.from_numpy(np.random.default_rng(args.seed + epoch).permutation(n))
        for i in range(steps_per_epoch):
            idx = order[i * per_step : (i + 1) * per_step][rank::world]
            opt.zero_grad()
            loss_fn(model(x_train[idx]), y_train[idx]).backward()
            opt.step()
            steps += 1
        acc = accuracy(model.module, x_test, y_test)
        curve.append([round(time.monotonic() - start, 4), acc])
        if rank == 0:
            print(f"epoch {epoch + 1:3d}  test accuracy {acc:.4f}", flush=True)
        if args.target_acc is not None and acc >= args.target_acc:
            break

    digests: list[Any] = [None] * world
    dist.all_gather_object(digests, params_digest(model.module))
    summary = {
        "backend": args.backend,
        "codec": args.codec if args.backend == "dlcp" else "fp32",
        "loss_bound": args.loss_bound,
        "data": name,
        "world": world,
        "final_acc": acc,
        "steps": steps,
        "tta_s": curve[-1][0] if curve else 0.0,
        "curve": curve,
        "replicas_identical": len(set(digests)) == 1,
        "shim": state.stats() if state is not None else None,
    }
    if rank == 0:
        print(json.dumps({k: v for k, v in summary.items() if k != "curve"}), flush=True)
        if args.json:
            tmp = f"{args.json}.tmp{os.getpid()}"
            with open(tmp, "w") as f:
                json.dump(summary, f, indent=1)
            os.replace(tmp, args.json)
    if state is not None:
        state.close()
    dist.barrier()  # leave together: gloo aborts when a peer tears down mid-exchange
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    dlcp.exit_process(main())  # not sys.exit: see dlcp.shim.leave
