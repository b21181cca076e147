"""What the cost model knows about a model: buckets, when backward makes them
ready, and how long forward, backward and the optimizer step take.

A profile comes from measuring a torch model on this host (`measure_profile`),
from the built-in digits MLP (`digits_profile`), or from a JSON spec:

    {"name": "my-model",
     "forward_s": 0.004, "backward_s": 0.009, "step_s": 0.002,
     "params": [65536, 1024, 786432, 768],     # numel per parameter, forward order
     "bucket_mb": 1.0,                         # DDP-style bucket cap (default 25)
     "density": 1.0}                           # nonzero fraction of a gradient

or with explicit buckets in backward order instead of "params":
`"buckets": [{"numel": 199434, "ready": 0.2}, ...]` (ready: fraction of the
backward pass done when the bucket is complete; default: proportional to the
parameters computed so far).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dlcp.errors import LocalError

__all__ = [
    "DEFAULT_BUCKET_MB",
    "Bucket",
    "ModelProfile",
    "assign_buckets",
    "load_profile",
    "measure_profile",
]

DEFAULT_BUCKET_MB = 25.0  # DDP's bucket_cap_mb
FIRST_BUCKET_MB = 1.0  # DDP's first bucket


@dataclass(frozen=True)
class Bucket:
    numel: int  # float32 gradient values
    ready_s: float  # seconds into the backward pass when the bucket is complete

    @property
    def nbytes(self) -> int:
        return 4 * self.numel


@dataclass(frozen=True)
class ModelProfile:
    name: str
    buckets: tuple[Bucket, ...]  # in the order backward completes them
    forward_s: float
    backward_s: float
    step_s: float = 0.0
    density: float = 1.0  # nonzero fraction of one worker's gradient
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if not self.buckets:
            raise LocalError(f"model {self.name!r} has no buckets")
        for v, what in (
            (self.forward_s, "forward_s"),
            (self.backward_s, "backward_s"),
            (self.step_s, "step_s"),
        ):
            if not v >= 0:
                raise LocalError(f"{what} = {v} must be >= 0")
        if not 0 < self.density <= 1:
            raise LocalError(f"density {self.density} outside (0, 1]")
        if any(
            b.numel < 1 or not 0 <= b.ready_s <= self.backward_s * (1 + 1e-9) + 1e-12
            for b in self.buckets
        ):
            raise LocalError("bucket sizes must be >= 1 and ready times within backward_s")

    @property
    def numel(self) -> int:
        return sum(b.numel for b in self.buckets)

    @property
    def compute_s(self) -> float:
        return self.forward_s + self.backward_s + self.step_s

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["buckets"] = [{"numel": b.numel, "ready_s": b.ready_s} for b in self.buckets]
        return d

    @classmethod
    def from_bucket_sizes(
        cls,
        numels: Sequence[int],
        *,
        backward_s: float,
        forward_s: float = 0.0,
        step_s: float = 0.0,
        density: float = 1.0,
        name: str = "ddp",
    ) -> ModelProfile:
        """What a comm hook sees: bucket sizes in the order they arrive and the backward
        time; buckets are taken to be ready in proportion to the values done."""
        total = sum(numels)
        done = 0
        buckets = []
        for n in numels:
            done += n
            buckets.append(Bucket(int(n), backward_s * done / total if total else 0.0))
        return cls(name, tuple(buckets), forward_s, backward_s, step_s, density)

    def with_times(
        self, *, forward_s: float, backward_s: float, step_s: float | None = None
    ) -> ModelProfile:
        """The same buckets on a pass of other durations (ready times scaled)."""
        f = backward_s / self.backward_s if self.backward_s > 0 else 0.0
        return ModelProfile(
            name=self.name,
            buckets=tuple(Bucket(b.numel, b.ready_s * f) for b in self.buckets),
            forward_s=forward_s,
            backward_s=backward_s,
            step_s=self.step_s if step_s is None else step_s,
            density=self.density,
            extra=self.extra,
        )


def assign_buckets(
    numels: Sequence[int],
    cap_mb: float = DEFAULT_BUCKET_MB,
    first_cap_mb: float | None = FIRST_BUCKET_MB,
) -> list[list[int]]:
    """DDP-style buckets: parameter indices (forward order) grouped in reverse order,
    each bucket filled while under the cap (the first bucket under `first_cap_mb`)."""
    if cap_mb <= 0:
        raise LocalError(f"bucket cap {cap_mb} MB must be > 0")
    buckets: list[list[int]] = []
    current: list[int] = []
    size = 0
    for i in reversed(range(len(numels))):
        cap = (first_cap_mb if not buckets and first_cap_mb else cap_mb) * 2**20
        if current and size + 4 * numels[i] > cap:
            buckets.append(current)
            current, size = [], 0
        current.append(i)
        size += 4 * numels[i]
    if current:
        buckets.append(current)
    return buckets


def buckets_from_params(
    numels: Sequence[int],
    backward_s: float,
    cap_mb: float = DEFAULT_BUCKET_MB,
    first_cap_mb: float | None = FIRST_BUCKET_MB,
) -> tuple[Bucket, ...]:
    """Buckets with ready times proportional to the parameters computed so far."""
    total = sum(numels)
    done = 0
    out = []
    for group in assign_buckets(numels, cap_mb, first_cap_mb):
        n = sum(numels[i] for i in group)
        done += n
        out.append(Bucket(numel=n, ready_s=backward_s * done / total))
    return tuple(out)


def profile_from_spec(spec: dict[str, Any]) -> ModelProfile:
    """A profile from the JSON spec described in the module docstring."""
    try:
        name = str(spec.get("name", "model"))
        fwd = float(spec["forward_s"])
        bwd = float(spec["backward_s"])
        step = float(spec.get("step_s", 0.0))
        density = float(spec.get("density", 1.0))
        if "buckets" in spec:
            buckets = []
            raw = spec["buckets"]
            total = sum(int(b["numel"]) for b in raw)
            done = 0
            for b in raw:
                done += int(b["numel"])
                if "ready_s" in b:
                    ready = float(b["ready_s"])
                elif "ready" in b:
                    ready = float(b["ready"]) * bwd
                else:
                    ready = bwd * done / total
                buckets.append(Bucket(int(b["numel"]), ready))
            bucket_t = tuple(buckets)
        else:
            numels = [int(n) for n in spec["params"]]
            cap = float(spec.get("bucket_mb", DEFAULT_BUCKET_MB))
            first = spec.get("first_bucket_mb", FIRST_BUCKET_MB)
            bucket_t = buckets_from_params(
                numels, bwd, cap, None if first is None else float(first)
            )
    except (KeyError, TypeError, ValueError) as exc:
        raise LocalError(f"bad model spec: {exc!r}") from exc
    return ModelProfile(name, bucket_t, fwd, bwd, step, density)


def load_profile(text: str) -> ModelProfile:
    """A profile from a JSON file path or an inline JSON object."""
    raw = text.strip()
    if raw.startswith("{"):
        source = raw
    else:
        path = Path(raw)
        if not path.is_file():
            raise LocalError(f"no model spec file {raw!r} (want digits-mlp, a .json file or JSON)")
        source = path.read_text()
    try:
        spec = json.loads(source)
    except json.JSONDecodeError as exc:
        raise LocalError(f"model spec is not JSON: {exc}") from exc
    if not isinstance(spec, dict):
        raise LocalError("model spec must be a JSON object")
    return profile_from_spec(spec)


def measure_profile(
    name: str,
    model: Any,
    make_batch: Callable[[], tuple[Any, Any]],
    loss_fn: Any,
    *,
    cap_mb: float = DEFAULT_BUCKET_MB,
    first_cap_mb: float | None = FIRST_BUCKET_MB,
    iters: int = 20,
    warmup: int = 5,
    lr: float = 0.01,
) -> ModelProfile:
    """Time forward, backward (with each bucket's ready time) and an SGD step of a
    torch model on this host; medians over `iters` iterations."""
    import statistics

    import torch

    params = [p for p in model.parameters() if p.requires_grad]
    groups = assign_buckets([p.numel() for p in params], cap_mb, first_cap_mb)
    owner = {i: b for b, g in enumerate(groups) for i in g}
    pending: list[int] = []
    stamps: list[float] = []

    def hook_for(i: int) -> Callable[[torch.Tensor], None]:
        def hook(_: torch.Tensor) -> None:
            b = owner[i]
            pending[b] -= 1
            if pending[b] == 0:
                stamps[b] = time.perf_counter()

        return hook

    handles = [p.register_post_accumulate_grad_hook(hook_for(i)) for i, p in enumerate(params)]
    opt = torch.optim.SGD(params, lr=lr)
    fwd, bwd, step = [], [], []
    ready: list[list[float]] = []
    try:
        for it in range(warmup + iters):
            x, y = make_batch()
            pending[:] = [len(g) for g in groups]
            stamps[:] = [0.0] * len(groups)
            opt.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            loss = loss_fn(model(x), y)
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            opt.step()
            t3 = time.perf_counter()
            if it >= warmup:
                fwd.append(t1 - t0)
                bwd.append(t2 - t1)
                step.append(t3 - t2)
                ready.append([s - t1 for s in stamps])
    finally:
        for h in handles:
            h.remove()
    b_med = statistics.median(bwd)
    buckets = tuple(
        Bucket(
            numel=sum(params[i].numel() for i in g),
            ready_s=min(b_med, statistics.median(r[b] for r in ready)),
        )
        for b, g in enumerate(groups)
    )
    return ModelProfile(
        name=name,
        buckets=buckets,
        forward_s=statistics.median(fwd),
        backward_s=b_med,
        step_s=statistics.median(step),
    )
