"""Iteration time of data-parallel training through a codec (after Agarwal et al.,
MLSys 2022: compression pays only when its encode/decode cost is below the
communication time it saves, once overlap with backward is accounted for).

The timeline of one worker, buckets in the order backward completes them, one
communication worker handling them one after another (as DDP's process group
does), transpose all-reduce over `hosts` (each owns 1/hosts of every bucket):

    forward | backward ......................................| step
                 bucket b ready -> [encode][push][aggregate][pull][decode]
                                    cpu    net   cpu        net   cpu

CPU steps (`CodecCost`, measured by `calibrate`) pause the backward pass (one
compute resource); network steps run beside it. A push moves (hosts-1)/hosts
of the pushed bytes through each host's link, a pull the same share of the
result bytes, each after a fixed latency (`Network.push_s`, `pull_s`) and,
with `jitter_s`, the expected wait for the slowest host. The iteration ends
when both backward and the last bucket are done, plus the optimizer step.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from dlcp.costmodel.calibrate import Calibration, CodecCost
from dlcp.costmodel.profile import ModelProfile
from dlcp.errors import LocalError

__all__ = [
    "STEPS",
    "Network",
    "Prediction",
    "choose_codec",
    "cpu_share_for",
    "expected_max_normal",
    "format_rate",
    "parse_link",
    "predict",
    "predict_all",
]

_RATE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(bit|bps|b)?(?:/s)?\s*$", re.IGNORECASE)
_UNIT = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
STEPS = ("encode", "push", "aggregate", "pull", "decode")
_NETWORK_STEPS = frozenset({"push", "pull"})
# Defaults measured with Gloo between the testbed's namespaces (bench/diag/costmodel.py).
DEFAULT_PUSH_S = 1e-3
DEFAULT_PULL_S = 2e-3
UNTHROTTLED_BPS = 2e9


def parse_link(text: str) -> float | None:
    """'200mbit', '1gbit', '10g', '5e8' -> bits/s; 'none' (unthrottled) -> None."""
    t = text.strip().lower()
    if t in ("none", "unthrottled", "inf", "unlimited"):
        return None
    m = _RATE.match(t)
    if not m:
        try:
            value = float(t)
        except ValueError:
            raise LocalError(f"bad link rate {text!r}: want e.g. 200mbit, 1gbit or none") from None
    else:
        value = float(m.group(1)) * _UNIT[m.group(2)]
    if not value > 0:
        raise LocalError(f"link rate {text!r} must be > 0")
    return value


def format_rate(bps: float | None) -> str:
    if bps is None:
        return "none"
    for unit, div in (("tbit", 1e12), ("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if bps >= div:
            return f"{bps / div:g}{unit}"
    return f"{bps:g}bit"


@dataclass(frozen=True)
class Network:
    """A host's link as the model sees it: goodput and fixed time of a push
    (all-to-all to the shard owners) and of a pull (all-gather of the results).

    `from_rate` derives it from a line rate; `fit` from timed pushes and pulls.
    """

    push_bytes_s: float
    pull_bytes_s: float
    push_s: float = DEFAULT_PUSH_S
    pull_s: float = DEFAULT_PULL_S
    bps: float | None = None  # the nominal line rate (None: unthrottled)

    @classmethod
    def from_rate(
        cls,
        bps: float | None,
        *,
        efficiency: float = 0.95,
        unthrottled_bps: float = UNTHROTTLED_BPS,
        push_s: float = DEFAULT_PUSH_S,
        pull_s: float = DEFAULT_PULL_S,
    ) -> Network:
        """A link of `bps` (None: as fast as the hosts' stacks, `unthrottled_bps`);
        `efficiency` is goodput over line rate (TCP headers over 1500-byte frames)."""
        rate = (bps if bps is not None else unthrottled_bps) * efficiency / 8.0
        return cls(rate, rate, push_s, pull_s, bps)

    @classmethod
    def fit(cls, rows: Sequence[dict[str, float]], hosts: int, bps: float | None = None) -> Network:
        """From timed pushes and pulls: rows of {"bytes", "push_s", "pull_s"} (two
        sizes or more; a least-squares line through each)."""
        if len(rows) < 2 or hosts < 2:
            raise LocalError("fitting a network needs two sizes and two hosts or more")
        share = [r["bytes"] * (hosts - 1) / hosts for r in rows]

        def line(ts: list[float]) -> tuple[float, float]:
            mx, my = sum(share) / len(share), sum(ts) / len(ts)
            sxx = sum((x - mx) ** 2 for x in share)
            slope = sum((x - mx) * (y - my) for x, y in zip(share, ts, strict=True)) / sxx
            slope = max(slope, 1e-12)
            return max(0.0, my - slope * mx), 1.0 / slope

        push_s, push_rate = line([r["push_s"] for r in rows])
        pull_s, pull_rate = line([r["pull_s"] for r in rows])
        return cls(push_rate, pull_rate, push_s, pull_s, bps)

    def push_time(self, nbytes: float, hosts: int) -> float:
        """A push of a bucket whose payloads total `nbytes` per worker."""
        if hosts <= 1:
            return 0.0
        return self.push_s + nbytes * (hosts - 1) / hosts / self.push_bytes_s

    def pull_time(self, nbytes: float, hosts: int) -> float:
        if hosts <= 1:
            return 0.0
        return self.pull_s + nbytes * (hosts - 1) / hosts / self.pull_bytes_s


@dataclass(frozen=True)
class Prediction:
    codec: str
    iteration_s: float
    compute_s: float  # forward + backward + step alone
    encode_s: float  # CPU seconds of codec work per iteration (encode, aggregate, decode)
    network_s: float  # seconds of pushes and pulls (whether hidden or not)
    wire_bytes: float  # bytes each host sends per iteration
    rel_error: float
    steps: dict[str, float] = field(default_factory=dict)  # seconds per step kind (STEPS)

    @property
    def exposed_s(self) -> float:
        """Time the iteration spends beyond computing."""
        return self.iteration_s - self.compute_s


def cpu_share_for(busy: int, cores: int | None = None) -> float:
    """The share of a core each of `busy` processes gets while all of them run
    their codec steps at once on `cores` cores (default: this machine's):
    min(1, cores / busy).

    Hosts of one data-parallel job reach a codec step together (each waits for
    the previous exchange), so when several emulated hosts (or daemons) share a
    machine, `busy` of them compete for its cores in every encode, aggregate
    and decode. With a fair scheduler a step of W seconds alone then ends on
    the last host at busy * W / cores (the makespan), and the next exchange
    waits for that last host: `predict` divides the codec steps by this share.
    """
    if busy < 1:
        raise LocalError(f"busy processes must be >= 1, got {busy}")
    n = cores if cores is not None else (os.cpu_count() or 1)
    if n < 1:
        raise LocalError(f"cores must be >= 1, got {n}")
    return min(1.0, n / busy)


def expected_max_normal(n: int) -> float:
    """E[max of n independent standard normals] (0 for n = 1; 0.846 for n = 3)."""
    if n <= 1:
        return 0.0
    # integrate x * n * phi(x) * Phi(x)^(n-1) over [-10, 10] (Simpson, 4000 steps)
    steps, lo, hi = 4000, -10.0, 10.0
    h = (hi - lo) / steps
    total = 0.0
    for i in range(steps + 1):
        x = lo + i * h
        f = x * n * math.exp(-x * x / 2) / math.sqrt(2 * math.pi)
        f *= (0.5 * (1 + math.erf(x / math.sqrt(2)))) ** (n - 1)
        total += f * (1 if i in (0, steps) else 4 if i % 2 else 2)
    return total * h / 3


def predict(
    profile: ModelProfile,
    cost: CodecCost,
    network: Network,
    hosts: int,
    *,
    cpu_share: float = 1.0,
    jitter_s: float = 0.0,
    exit_skew_s: float = 0.0,
) -> Prediction:
    """Predicted iteration time of `profile` with `cost`'s codec on `network`.

    cpu_share: the share of a core each worker's codec steps get (below 1 when
        emulated hosts share the machine's cores: `cpu_share_for`).
    jitter_s: standard deviation of the hosts' arrival at an exchange (their
        compute jitter, seconds). A push or pull completes when the slowest host
        arrives, `expected_max_normal(hosts) * jitter_s` after the average one
        (stragglers; 0 for identical, quiet hosts).
    exit_skew_s: how much later than the median host the last one leaves a
        collective (measured on hosts contending for cores). Each host's CPU
        steps start when it leaves the previous exchange, and the next exchange
        waits for the last host, so it starts up to this much after the
        makespan of the steps alone. Independent of the compute jitter, the two
        add as standard deviations: the wait per network step is
        sqrt((expected_max_normal(hosts) * jitter_s) ** 2 + exit_skew_s ** 2).
    """
    if hosts < 1:
        raise LocalError(f"hosts must be >= 1, got {hosts}")
    if not 0 < cpu_share <= 1:
        raise LocalError(f"cpu_share {cpu_share} outside (0, 1]")
    if not jitter_s >= 0:
        raise LocalError(f"jitter {jitter_s} must be >= 0")
    if not exit_skew_s >= 0:
        raise LocalError(f"exit skew {exit_skew_s} must be >= 0")
    slow = 1.0 / cpu_share
    lag = math.hypot(expected_max_normal(hosts) * jitter_s, exit_skew_s)
    t = profile.forward_s
    done = 0.0  # backward seconds computed
    wire = 0.0
    totals = dict.fromkeys(STEPS, 0.0)
    if hosts > 1:
        for b in profile.buckets:
            n = b.numel
            shard = n / hosts
            if done < b.ready_s:
                t += b.ready_s - done
                done = b.ready_s
            chain = [("encode", hosts * cost.encode(shard) * slow)]
            for phase in range(cost.phases):
                push = n * cost.push[phase]
                pull = n * cost.pull[phase]
                chain += [
                    ("push", network.push_time(push, hosts)),
                    ("aggregate", cost.aggregate(shard) * slow / cost.phases),
                    ("pull", network.pull_time(pull, hosts)),
                ]
                wire += (push + pull) * (hosts - 1) / hosts
            chain.append(("decode", hosts * cost.decode(shard) * slow))
            for step, dur in chain:
                if step in _NETWORK_STEPS:
                    dur += lag  # waiting for the slowest host
                    done = min(profile.backward_s, done + dur)  # backward goes on beside it
                totals[step] += dur
                t += dur
    t += profile.backward_s - done + profile.step_s
    return Prediction(
        codec=cost.spec,
        iteration_s=t,
        compute_s=profile.compute_s,
        encode_s=totals["encode"] + totals["aggregate"] + totals["decode"],
        network_s=totals["push"] + totals["pull"],
        wire_bytes=wire,
        rel_error=cost.rel_error,
        steps=totals,
    )


def predict_all(
    profile: ModelProfile,
    calibration: Calibration,
    network: Network,
    hosts: int,
    *,
    specs: Sequence[str] | None = None,
    cpu_share: float = 1.0,
    jitter_s: float = 0.0,
    exit_skew_s: float = 0.0,
) -> list[Prediction]:
    """Predictions for every calibrated codec (or `specs`), fastest first."""
    chosen = list(specs) if specs is not None else list(calibration.codecs)
    preds = [
        predict(
            profile,
            calibration[s],
            network,
            hosts,
            cpu_share=cpu_share,
            jitter_s=jitter_s,
            exit_skew_s=exit_skew_s,
        )
        for s in chosen
    ]
    return sorted(preds, key=lambda p: p.iteration_s)


def choose_codec(
    profile: ModelProfile,
    link_bps: float | None,
    *,
    hosts: int = 2,
    calibration: Calibration | None = None,
    candidates: Sequence[str] | None = None,
    network: Network | None = None,
    min_gain: float = 0.05,
    max_rel_error: float | None = None,
    cpu_share: float = 1.0,
    jitter_s: float = 0.0,
    exit_skew_s: float = 0.0,
) -> str:
    """The codec `auto` stands for: the fastest predicted one, unless a more
    accurate codec (smaller calibrated error) is within `min_gain` of it.

    Call again when the link rate changes. `calibration` defaults to the
    cached one (`Calibration.load()`), calibrated now if there is none;
    `max_rel_error` drops codecs whose one-round error is larger.
    """
    if calibration is None:
        from dlcp.costmodel.calibrate import calibrate

        try:
            calibration = Calibration.load(hosts=max(hosts, 2))
        except LocalError:
            calibration = calibrate(hosts=max(hosts, 2))
            calibration.save()
    net = network if network is not None else Network.from_rate(link_bps)
    specs = [s for s in (candidates or list(calibration.codecs)) if s in calibration.codecs]
    if max_rel_error is not None:
        specs = [s for s in specs if calibration[s].rel_error <= max_rel_error]
    if not specs:
        raise LocalError("no calibrated codec to choose from")
    preds = predict_all(
        profile,
        calibration,
        net,
        hosts,
        specs=specs,
        cpu_share=cpu_share,
        jitter_s=jitter_s,
        exit_skew_s=exit_skew_s,
    )
    best = preds[0].iteration_s
    close = [p for p in preds if p.iteration_s <= best * (1 + min_gain)]
    return min(close, key=lambda p: (p.rel_error, p.iteration_s)).codec
