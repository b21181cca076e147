"""Per-codec costs measured on this host: encode, aggregate and decode times (a
fixed part plus a part per value), bytes on the wire per value, and error.

`calibrate(specs, grads, hosts=...)` runs each codec's `Pipeline` in-process on
sample gradients at two sizes and fits `seconds = fixed + per_value * n` to
each step; wire bytes come from the same runs. Results are cached as JSON
(`save`/`load`, default `~/.cache/dlcp/calibration-h<hosts>.json`).

Codec specs are registry names with options: `fft`, `fft:theta=0.8`,
`sketch:keep=0.05`, `thc4:rotate=false`.

Several ranks sharing a machine (emulated hosts, daemons) can calibrate together
with `sync`: every step then starts on all ranks at once and counts until the
slowest rank is done with it (its makespan), which is what the exchange after
the step waits for. Those costs carry the contention of `together` ranks.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dlcp.errors import LocalError

__all__ = [
    "DEFAULT_CODECS",
    "Calibration",
    "CodecCost",
    "Linear",
    "StepSync",
    "calibrate",
    "default_cache",
    "make_codec",
    "measure_steps",
    "parse_codec_spec",
]

DEFAULT_CODECS: tuple[str, ...] = ("fp32", "fp16", "thc8", "thc4", "fft", "sketch")
FORMAT = 2  # 2: THC pulls in the bits their sums need (lanes.narrow_sums)
# Runs `step` on every rank at once and returns the seconds the slowest rank took
# (e.g. a barrier, the step, an all-reduce MAX of the time): see `calibrate`.
StepSync = Callable[[Callable[[], None]], float]


def _value(text: str) -> Any:
    low = text.lower()
    if low in ("none", "null"):
        return None
    if low in ("true", "false"):
        return low == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def parse_codec_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """'sketch:keep=0.05,load=1.3' -> ('sketch', {'keep': 0.05, 'load': 1.3})."""
    name, _, rest = spec.strip().partition(":")
    params: dict[str, Any] = {}
    for item in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, val = item.partition("=")
        if not eq or not key:
            raise LocalError(f"codec option {item!r} in {spec!r} is not key=value")
        params[key.strip()] = _value(val.strip())
    return name, params


def make_codec(spec: str) -> Any:
    """The codec of a spec (`dlcp.codecs.get_codec` with the spec's options)."""
    from dlcp.codecs import get_codec

    name, params = parse_codec_spec(spec)
    return get_codec(name, **params)


@dataclass(frozen=True)
class Linear:
    """seconds = fixed_s + per_value_s * n."""

    fixed_s: float
    per_value_s: float

    def __call__(self, n: float) -> float:
        return self.fixed_s + self.per_value_s * n

    @classmethod
    def fit(cls, n1: int, t1: float, n2: int, t2: float) -> Linear:
        """Through two measurements, with both parts kept >= 0."""
        slope = max(0.0, (t2 - t1) / (n2 - n1)) if n2 != n1 else 0.0
        fixed = max(0.0, t1 - slope * n1)
        if fixed == 0.0 and n2:
            slope = max(slope, t2 / n2)
        return cls(fixed, slope)

    def scaled(self, factor: float) -> Linear:
        return Linear(self.fixed_s * factor, self.per_value_s * factor)


@dataclass(frozen=True)
class CodecCost:
    """One codec's costs for one shard of n values with `hosts` contributions."""

    spec: str
    push: tuple[float, ...]  # bytes a worker pushes per value, per phase
    pull: tuple[float, ...]  # result bytes per value, per phase
    encode: Linear  # a worker's steps for one shard (all phases)
    aggregate: Linear  # the owner adding `hosts` contributions (all phases)
    decode: Linear  # a worker turning the result into the mean
    rel_error: float  # relative L2 error of one round's mean
    hosts: int
    together: int = 1  # ranks that ran each step at once (its makespan over them)

    @property
    def phases(self) -> int:
        return len(self.push)

    @property
    def ratio(self) -> float:
        """fp32 bytes over the bytes this codec moves (push and pull together)."""
        return 8.0 / (sum(self.push) + sum(self.pull))

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> CodecCost:
        return cls(
            spec=str(d["spec"]),
            push=tuple(float(x) for x in d["push"]),
            pull=tuple(float(x) for x in d["pull"]),
            encode=Linear(**d["encode"]),
            aggregate=Linear(**d["aggregate"]),
            decode=Linear(**d["decode"]),
            rel_error=float(d["rel_error"]),
            hosts=int(d["hosts"]),
            together=int(d.get("together", 1)),
        )


@dataclass
class Calibration:
    """Codec costs measured on one host (see `calibrate`)."""

    codecs: dict[str, CodecCost]
    host: str = field(default_factory=platform.node)
    cpus: int = field(default_factory=lambda: os.cpu_count() or 1)
    threads: int = 1
    load_avg: float = 0.0  # 1-minute load average when calibrated
    created: float = field(default_factory=time.time)

    def __getitem__(self, spec: str) -> CodecCost:
        try:
            return self.codecs[spec]
        except KeyError:
            raise LocalError(
                f"codec {spec!r} is not calibrated ({', '.join(self.codecs)})"
            ) from None

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "host": self.host,
            "cpus": self.cpus,
            "threads": self.threads,
            "load_avg": self.load_avg,
            "created": self.created,
            "codecs": {k: v.to_json() for k, v in self.codecs.items()},
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Calibration:
        if d.get("format") != FORMAT:
            raise LocalError("calibration file of another format; calibrate again")
        return cls(
            codecs={k: CodecCost.from_json(v) for k, v in d["codecs"].items()},
            host=str(d["host"]),
            cpus=int(d["cpus"]),
            threads=int(d["threads"]),
            load_avg=float(d["load_avg"]),
            created=float(d["created"]),
        )

    def save(self, path: Path | str | None = None) -> Path:
        hosts = next(iter(self.codecs.values())).hosts if self.codecs else 3
        p = Path(path) if path is not None else default_cache(hosts)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(self.to_json(), indent=1))
        return p

    @classmethod
    def load(cls, path: Path | str | None = None, *, hosts: int = 3) -> Calibration:
        p = Path(path) if path is not None else default_cache(hosts)
        try:
            return cls.from_json(json.loads(p.read_text()))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise LocalError(f"cannot read calibration {p}: {exc}") from exc


def default_cache(hosts: int = 3) -> Path:
    """Where calibrations for `hosts` contributors are cached ($XDG_CACHE_HOME/dlcp)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "dlcp" / f"calibration-h{hosts}.json"


@dataclass
class _Round:
    encode: float  # seconds per worker: begin, encodes and absorbs of all phases
    aggregate: float
    decode: float
    push: list[int]  # bytes a worker pushed, per phase
    pull: list[int]


def _alone(step: Callable[[], None]) -> float:
    t = time.perf_counter()
    step()
    return time.perf_counter() - t


def _time_round(
    pipe: Any, grads: Sequence[Any], ctxs: Sequence[Any], seed: int, sync: StepSync | None = None
) -> _Round:
    """One round of `pipe` over all workers, timed step by step (with `sync`, each
    step's time is the slowest rank's)."""
    timed = sync if sync is not None else _alone
    result = b""
    payloads: list[bytes] = []
    push: list[int] = []
    pull: list[int] = []

    def begin() -> None:
        for ctx, g in zip(ctxs, grads, strict=True):
            pipe.begin(ctx, g, seed)

    enc = timed(begin)
    agg = 0.0
    maxima = [pipe.local_max(c) for c in ctxs]  # THC's first-round agreement: not timed
    if all(m is not None for m in maxima):
        for c in ctxs:
            c.scale = max(m for m in maxima if m is not None)
    for phase in range(pipe.phases):

        def encode(phase: int = phase) -> None:
            payloads[:] = [pipe.encode(c, phase) for c in ctxs]

        def aggregate(phase: int = phase) -> None:
            nonlocal result
            result = pipe.aggregate(phase, payloads, ctxs[0].numel)

        def absorb(phase: int = phase) -> None:
            for c in ctxs:
                pipe.absorb(c, phase, result)

        enc += timed(encode)
        agg += timed(aggregate)
        push.append(max(len(p) for p in payloads))
        pull.append(len(result))
        if phase < pipe.phases - 1:
            enc += timed(absorb)
    dec = timed(lambda: pipe.decode(ctxs[0], result, len(ctxs)))
    for c in ctxs[1:]:  # fft: every worker learns the next set (not timed: decode did)
        pipe.learn(c, result, len(ctxs))
    for c in ctxs:
        c.scale = None
    return _Round(enc / len(ctxs), agg, dec, push, pull)


def _rounds(
    spec: str, grads: Sequence[Any], repeats: int, sync: StepSync | None = None
) -> list[_Round]:
    from dlcp.costmodel.pipeline import ShardContext, pipeline_for

    pipe = pipeline_for(make_codec(spec))
    ctxs = [ShardContext(grads[0].numel()) for _ in grads]
    _time_round(pipe, grads, ctxs, 0, sync)  # warm-up (and a first residual)
    return [_time_round(pipe, grads, ctxs, r + 1, sync) for r in range(repeats)]


def measure_steps(
    spec: str, grads: Sequence[Any], repeats: int = 3, *, best: bool = False
) -> tuple[float, float, float]:
    """Seconds of (a worker's encode, the owner's aggregate, a decode) of one shard
    holding all of `grads` (one per contributor), with error feedback, after a
    warm-up round: the median of `repeats` rounds, or with `best` the fastest
    (what the codec costs when nothing else competes for the CPU)."""
    runs = _rounds(spec, grads, repeats)
    pick = min if best else statistics.median
    return (
        pick(r.encode for r in runs),
        pick(r.aggregate for r in runs),
        pick(r.decode for r in runs),
    )


def calibrate(
    specs: Sequence[str] = DEFAULT_CODECS,
    grads: Sequence[Any] | None = None,
    *,
    hosts: int = 3,
    small: int = 1 << 14,
    repeats: int = 3,
    threads: int | None = 1,
    sync: StepSync | None = None,
    together: int = 1,
) -> Calibration:
    """Time every codec of `specs` on this host.

    grads: one flat float32 gradient per contributor (`hosts` of them); the
        default samples the digits MLP (about 1.05 M values each). Times are
        taken on `small` values and on the whole gradients and fitted linearly;
        bytes on the wire are those of the last timed round (error feedback on);
        the error is that of one round without error-feedback history.
    threads: torch intra-op threads while timing (None leaves it alone).
    sync: when `together` ranks sharing this machine calibrate at once, runs each
        step on all of them together and returns the slowest one's time. Each
        step then costs its makespan over the ranks, what the exchange after it
        waits for, as they contend for the cores as they do in training; without
        it, steps are timed in this process alone (`together` 1). The fit takes
        the median of `repeats` rounds at each size either way.
    """
    import torch

    from dlcp.codecs.base import CodecState
    from dlcp.costmodel.exchange import average

    if hosts < 1:
        raise LocalError(f"hosts must be >= 1, got {hosts}")
    if together < 1 or (sync is None and together != 1):
        raise LocalError(f"together {together}: want 1 without sync, >= 1 with it")
    if grads is None:
        from dlcp.costmodel.digits import sample_gradients

        grads = sample_gradients(max(hosts, 1))
    grads = [g.reshape(-1).to(torch.float32) for g in grads[:hosts]]
    if len(grads) < hosts:
        raise LocalError(f"{len(grads)} sample gradients for {hosts} hosts")
    n = grads[0].numel()
    small = max(1, min(small, n // 4))
    old_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        truth = torch.stack(grads).mean(dim=0)
        costs: dict[str, CodecCost] = {}
        for spec in specs:
            codec = make_codec(spec)
            states = [CodecState() for _ in grads]
            if codec.agreed:  # fft: the error of a round on the set agreed by a dense one
                average(codec, grads, states, error_feedback=False)
            ex = average(codec, grads, states, error_feedback=False)
            err = float((ex.mean - truth).norm() / truth.norm().clamp(min=1e-30))
            small_runs = _rounds(spec, [g[:small].clone() for g in grads], repeats, sync)
            runs = _rounds(spec, grads, repeats, sync)
            steady = runs[-1]  # bytes with error feedback under way (sketch's union grows)

            def fit(
                step: str, small_runs: list[_Round] = small_runs, runs: list[_Round] = runs
            ) -> Linear:
                t1 = statistics.median(getattr(r, step) for r in small_runs)
                t2 = statistics.median(getattr(r, step) for r in runs)
                return Linear.fit(small, t1, n, t2)

            costs[spec] = CodecCost(
                spec=spec,
                push=tuple(b / n for b in steady.push),
                pull=tuple(b / n for b in steady.pull),
                encode=fit("encode"),
                aggregate=fit("aggregate"),
                decode=fit("decode"),
                rel_error=err,
                hosts=hosts,
                together=together,
            )
    finally:
        torch.set_num_threads(old_threads)
    return Calibration(
        codecs=costs,
        threads=threads or old_threads,
        load_avg=os.getloadavg()[0],
    )
