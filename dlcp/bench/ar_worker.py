"""One host's all-reduce loop for `dlcp bench allreduce` (run inside the host's
namespace by the orchestrator; speaks JSON lines, see `dlcp.bench.procs`).

    python -m dlcp.bench.ar_worker --backend gloo --rank 0 --world 3 --master 10.77.0.1 ...
    python -m dlcp.bench.ar_worker --backend dlcp --rank 0 --world 3 --hosts JSON ...

Protocol: "joined" -> (go) -> warm-up rounds -> "warm" -> per timed round:
(go) -> the round -> "iter" {i, t} -> ... -> "result" {times_s, cpu_s,
lost_lanes, ...} -> (go) -> exit.

Every rank waits for the orchestrator's go before each timed round, so the
rounds of all ranks start together for every backend, and rank 0's check of a
dlcp result (a subtraction and a norm over the buffer) runs between rounds:
without the go, the other ranks started their next round while rank 0 was
still checking, and that wait counted in their round (the bench's time is the
slowest rank's) for dlcp alone (0.24 against 0.17 s a 100 MB round unshaped).

Gloo: `torch.distributed.all_reduce` of a float32 buffer, or (`--cast fp16|bf16`)
of the buffer cast to that dtype and divided by the world, cast back after, as
DDP's fp16/bf16_compress_hook do (the casts are timed: a hook pays them); with
`--check`, one more untimed round of the original data gives its error. dlcp: the shim's own
round functions (`dlcp.shim.exchange`: encode, write to shared memory, submit
to the local daemon, decode) without a process group, so the measurement is
the transport alone. fft keeps a state per bucket: a dense first (warm-up)
round, then the coefficient set agreed from each result, with error feedback.
THC scales come from the previous round's maxima, which
the result carries back (the shim's "packet" scale mode); the first warm-up
round uses a bound every host can compute from the data's known range.

The buffer is the same every round: values are integers times per-position
powers of two, so fp32 sums are exact in any order and rank 0 can check the
result against the exact mean (`error`: relative L2 error of the decoded
mean; 0 for lossless fp32).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import resource
import sys
import time
from typing import Any

import numpy as np
import torch

__all__ = ["bucket_spans", "main", "make_data", "position_scales"]

N_LAYERS = 16


def emit(event: str, **fields: Any) -> None:
    sys.stdout.write(json.dumps({"event": event, **fields}) + "\n")
    sys.stdout.flush()


def wait_go() -> None:
    line = sys.stdin.readline()
    if not line:
        raise SystemExit("orchestrator went away")


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def position_scales(elements: int, seed: int, block: int = 352) -> np.ndarray:
    """Per-element magnitudes shared by every host: powers of two, constant per
    `block` elements, larger toward the front (like gradients of early layers
    and of a few hot slices)."""
    rng = np.random.default_rng(seed)
    blocks = -(-elements // block)
    exp = rng.integers(-8, 1, blocks)  # 2^-8 .. 1
    front = (np.arange(blocks) < max(1, blocks // 8)).astype(np.int64)
    scale = np.ldexp(1.0, np.minimum(exp + 2 * front, 1)).astype(np.float32)
    return np.repeat(scale, block)[:elements]


def make_data(elements: int, seed: int, host: int, scales: np.ndarray) -> np.ndarray:
    """Host `host`'s buffer: integers in [-2^15, 2^15) / 2^15 times the scales."""
    rng = np.random.default_rng([seed, host])
    ints = rng.integers(-(2**15), 2**15, elements, dtype=np.int32).astype(np.float32)
    return ints * np.float32(2.0**-15) * scales


CASTS = {"none": None, "fp16": torch.float16, "bf16": torch.bfloat16}


def reference_mean(a: argparse.Namespace, scales: np.ndarray) -> torch.Tensor:
    """The exact mean of every host's buffer (the data sum exactly in fp32)."""
    total = np.zeros(a.elements, np.float32)
    for h in range(a.world):
        total += make_data(a.elements, a.seed, h, scales)
    return torch.from_numpy(total / np.float32(a.world))


def relative_error(mean: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative L2 error of `mean` against `ref`."""
    return float(torch.linalg.vector_norm(mean - ref)) / float(torch.linalg.vector_norm(ref))


def gloo_round(x: torch.Tensor, out: torch.Tensor, dtype: torch.dtype | None, world: int) -> None:
    """One Gloo all-reduce of `x`: in place in fp32 (the sum, as before), or as
    DDP's fp16/bf16 compress hooks do it: cast, divide by the world,
    all-reduce, cast back into `out` (the casts count in the round)."""
    import torch.distributed as dist

    if dtype is None:
        dist.all_reduce(x)
        return
    y = x.to(dtype).div_(world)
    dist.all_reduce(y)
    out.copy_(y)


def run_gloo(a: argparse.Namespace) -> None:
    import datetime

    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{a.master}:{a.port}",
        rank=a.rank,
        world_size=a.world,
        timeout=datetime.timedelta(seconds=a.timeout),
    )
    dtype = CASTS[a.cast]
    scales = position_scales(a.elements, a.seed)
    data = make_data(a.elements, a.seed, a.rank, scales)
    x = torch.from_numpy(data.copy())
    out = torch.empty_like(x)
    emit("joined")
    wait_go()
    for _ in range(a.warmup):
        gloo_round(x, out, dtype, a.world)
    emit("warm")
    times: list[float] = []
    c0 = cpu_s()
    for i in range(a.iters):
        wait_go()  # every rank starts each round together (see the module docstring)
        t = time.perf_counter()
        gloo_round(x, out, dtype, a.world)
        times.append(time.perf_counter() - t)
        emit("iter", i=i, t=times[-1])
    cpu = cpu_s() - c0
    error = None
    if a.check:  # one more round of the original data, untimed: its mean against the exact one
        x = torch.from_numpy(data)
        gloo_round(x, out, dtype, a.world)
        if a.rank == 0:
            error = relative_error(x / a.world if dtype is None else out, reference_mean(a, scales))
    emit("result", times_s=times, cpu_s=cpu, lost_lanes=0, total_lanes=0, error=error)
    wait_go()
    dist.destroy_process_group()


def bucket_spans(elements: int, bucket_elements: int) -> list[tuple[int, int]]:
    """(offset, count) of each bucket: the buffer cut into `bucket_elements` pieces."""
    step = max(1, bucket_elements)
    return [(o, min(step, elements - o)) for o in range(0, elements, step)]


def run_dlcp(a: argparse.Namespace) -> None:
    from dlcp.codecs import CodecState, get_codec, next_scale
    from dlcp.core.records import SWITCH_SHARDS
    from dlcp.shim.arena import Arena
    from dlcp.shim.client import DaemonClient, default_socket
    from dlcp.shim.exchange import RoundPlan, decode_round, submit_round
    from dlcp.shim.regions import region_sizes
    from dlcp.shim.sketch_round import submit_sketch, union_plan
    from dlcp.shim.staging import Staging

    hosts = json.loads(a.hosts)
    client = DaemonClient(a.socket or default_socket(), timeout=10.0)
    info = client.hello()
    shape = json.loads(a.shape)  # mode "ps": aggregators, contributors, shards
    key = bytes.fromhex(a.key)
    client.join(job=a.job, key=key, hosts=hosts, me=a.rank, local_ranks=1, mode=a.mode, **shape)
    codec = get_codec(a.codec)
    payload = int(info["payload"])
    shards = SWITCH_SHARDS if a.mode == "switch" else len(hosts)  # JobSpec's: the layout's
    shards = int(shape.get("shards", shards))
    scales = position_scales(a.elements, a.seed)
    x = torch.from_numpy(make_data(a.elements, a.seed, a.rank, scales))
    ref = reference_mean(a, scales) if a.rank == 0 and a.check else None
    spans = bucket_spans(a.elements, a.bucket_elements or a.elements)
    # fft: each bucket's rounds follow from its results (a dense first round,
    # then the agreed coefficients, with error feedback): a state per bucket
    states = [CodecState() if codec.agreed else None for _ in spans]
    plans0 = [
        RoundPlan.make(codec.for_round(st), n, shards=shards, payload=payload, round_=0, bucket=b)
        for b, ((_, n), st) in enumerate(zip(spans, states, strict=True))
    ]
    sizes = [region_sizes(p.layout) for p in plans0]
    # sketch: its union's regions too (the cells' are sized for a union of all)
    sketch = codec.name == "sketch"
    extra = sum(region_sizes(union_plan(p).layout).total for p in plans0) if sketch else 0
    arena = Arena(client, f"dlcp-bench-{a.job:x}-{a.rank}", sum(z.total for z in sizes) + extra)
    staging = Staging()
    gen = torch.Generator()
    gen.manual_seed(a.seed * 1009 + a.rank)

    # synthetic layers: the whole buffer cut into N_LAYERS equal layers

    def layers_of(o: int, p: RoundPlan) -> np.ndarray:
        span = p.codec.packet_span(p.per_packet)
        at = o + np.arange(p.packets, dtype=np.int64) * span
        return (at * N_LAYERS // a.elements).clip(0, N_LAYERS - 1).astype(np.uint16)

    layers = [layers_of(o, p) for (o, _), p in zip(spans, plans0, strict=True)]
    out = torch.empty(a.elements, dtype=torch.float32)
    scale: list[torch.Tensor | None] = [None] * len(spans)
    if plans0[0].scaled:
        # A bound on every block's rotated max that all hosts know without
        # talking: |rotated value| <= the block's L2 norm <= sqrt(n) * max scale.
        for b, ((o, n), p) in enumerate(zip(spans, plans0, strict=True)):
            pp = p.per_packet
            per = np.zeros(p.packets * pp, np.float32)
            per[:n] = scales[o : o + n]
            bound = per.reshape(p.packets, pp).max(axis=1) * math.sqrt(pp)
            scale[b] = torch.from_numpy(bound.astype(np.float32))

    state: dict[str, Any] = {"lost": 0, "total": 0, "saturated": 0}

    def one_round(r: int) -> torch.Tensor:
        arena.reset()
        subs = []
        for b, (o, n) in enumerate(spans):
            rc = codec.for_round(states[b])
            plan = RoundPlan.make(
                rc, n, shards=shards, payload=payload, round_=r, bucket=b, scale=scale[b]
            )
            if sketch:  # the union round (waited for), then the cells
                sub = submit_sketch(
                    client,
                    arena.take,
                    plan,
                    x[o : o + n],
                    job=a.job,
                    bound=a.bound,
                    layers=functools.partial(layers_of, o),
                    state=None,
                    staging=staging,
                    timeout=a.timeout,
                )
                subs.append(sub)
                continue
            same = rc is codec
            region = arena.take(sizes[b] if same else region_sizes(plan.layout))
            sub = submit_round(
                client,
                region,
                plan,
                x[o : o + n],
                job=a.job,
                bound=a.bound,
                layers=layers[b] if same else layers_of(o, plan),
                state=states[b],
                generator=gen,
                staging=staging,
            )
            subs.append(sub)
        for b, ((o, n), sub) in enumerate(zip(spans, subs, strict=True)):
            reply = sub.reply.result(a.timeout)
            # into the result buffer, as the DDP hook decodes into its bucket:
            # one division, no new tensor (its page faults) and no copy after
            dest = out[o : o + n]
            dec = decode_round(sub.plan, sub.region, torch.device("cpu"), staging, dest)
            if dec.mean.data_ptr() != dest.data_ptr():  # packets with other counts
                dest.copy_(dec.mean)
            state["lost"] += int(reply.get("lost_lanes", 0))
            state["total"] += int(reply.get("total_lanes", 0))
            state["saturated"] += int(sub.saturated)
            if sub.plan.scaled:
                scale[b] = next_scale(torch.from_numpy(dec.maxima), a.scale_margin)
            st = states[b]
            if st is not None and dec.sums is not None:
                pp = sub.plan.per_packet
                sub.plan.codec.learn(st, dec.sums, dec.counts, per_packet=pp, maxima=dec.maxima)
        return out

    emit("joined", buckets=len(spans))
    wait_go()
    for r in range(a.warmup):
        one_round(r)
    state.update(lost=0, total=0, saturated=0)
    emit("warm")
    times: list[float] = []
    errors: list[float] = []
    check_cpu = 0.0  # the check is not the transport's work: not counted
    c0 = cpu_s()
    diff = torch.empty_like(ref) if ref is not None else None
    ref_norm = float(torch.linalg.vector_norm(ref)) if ref is not None else 0.0
    for i in range(a.iters):
        wait_go()  # every rank starts each round together (see the module docstring)
        t = time.perf_counter()
        mean = one_round(a.warmup + i)
        times.append(time.perf_counter() - t)
        if ref is not None and diff is not None:  # before "iter": outside every rank's round
            e0 = cpu_s()
            torch.sub(mean, ref, out=diff)
            errors.append(float(torch.linalg.vector_norm(diff)) / ref_norm)
            check_cpu += cpu_s() - e0
        emit("iter", i=i, t=times[-1])
    cpu = cpu_s() - c0 - check_cpu
    emit(
        "result",
        times_s=times,
        cpu_s=cpu,
        lost_lanes=state["lost"],
        total_lanes=state["total"],
        saturated=state["saturated"],
        error=max(errors) if errors else None,
    )
    # Stay in the job until every host has its results: a daemon whose last
    # client leaves drops the job, and with it the results that peers may
    # still be NACKing for.
    wait_go()
    client.close()
    arena.close()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--backend", choices=("gloo", "dlcp"), required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--elements", type=int, required=True)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--timeout", type=float, default=120.0)
    p.add_argument("--threads", type=int, default=1)
    # gloo
    p.add_argument("--master", default="127.0.0.1")
    p.add_argument("--port", type=int, default=29555)
    p.add_argument(
        "--cast",
        choices=tuple(CASTS),
        default="none",
        help="all-reduce cast to this dtype (as fp16_compress_hook)",
    )
    # dlcp
    p.add_argument("--socket", default=None)
    p.add_argument("--hosts", default="[]", help="JSON list of the job's hosts")
    p.add_argument("--job", type=int, default=1)
    p.add_argument("--key", default="00" * 32)
    p.add_argument("--codec", default="fp32")
    p.add_argument("--mode", choices=("transpose", "switch", "ps"), default="transpose")
    p.add_argument("--shape", default="{}", help="mode ps: the join's aggregators, ... (JSON)")
    p.add_argument("--bound", type=float, default=0.0)
    p.add_argument("--scale-margin", type=float, default=1.25)
    p.add_argument(
        "--bucket-elements", type=int, default=0, help="split into buckets (0: one bucket)"
    )
    p.add_argument("--check", action="store_true", help="rank 0 checks results")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    try:
        if a.backend == "gloo":
            run_gloo(a)
        else:
            run_dlcp(a)
    except Exception as exc:
        emit("error", error=f"{type(exc).__name__}: {exc}")
        raise SystemExit(1) from None


if __name__ == "__main__":
    from dlcp.shim.leave import exit_process

    main()
    exit_process(0)  # not a plain return: see dlcp.shim.leave
