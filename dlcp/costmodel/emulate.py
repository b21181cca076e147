"""Measured iterations for the cost model: one rank of data-parallel training of the
digits MLP whose buckets go through a codec over Gloo (torch.distributed).

An emulation of dlcp's data path, not dlcp itself: buckets are formed as DDP
forms them (`assign_buckets`, post-accumulate-grad hooks), one communication
thread takes them in order, and each bucket is exchanged as dlcp's transpose
all-reduce exchanges it: every worker encodes the shard of each owner with the
codec's `Pipeline`, an all-to-all pushes shards to their owners, owners
aggregate, an all-gather pulls the results, workers decode. Bytes on the wire
are the codec's; TCP (Gloo) carries them instead of dlcp's UDP.

    python -m dlcp.costmodel.emulate --rank R --world H --master ADDR --port P \
        --codecs fp32,fft --iters 20

prints one JSON line per measurement: {"kind": "netcal"|"compute"|"compute_in_step"|
"calibration"|"codec", ...}; "compute_in_step" times the slowest rank of
iterations that every rank starts at once (`_Trainer.run_in_step`).
With --calibrate every rank times the next codec's steps on sample gradients just
before running it, all ranks at once and in step: each step starts on every rank
together (a barrier) and counts until the slowest rank is done (an all-reduce MAX),
so the costs carry the load of that moment and the ranks' contention for the
cores, as the exchange after the step waits for the slowest rank.
"""

from __future__ import annotations

import argparse
import json
import queue
import statistics
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from dlcp.costmodel.calibrate import calibrate, make_codec
from dlcp.costmodel.digits import DIGITS_HIDDEN, build_mlp, load_digits_data, sample_gradients
from dlcp.costmodel.pipeline import Pipeline, ShardContext, pipeline_for
from dlcp.costmodel.profile import assign_buckets

__all__ = ["BucketExchanger", "main"]


def _emit(kind: str, **fields: Any) -> None:
    sys.stdout.write(json.dumps({"kind": kind, **fields}) + "\n")
    sys.stdout.flush()


def _u8(data: bytes | bytearray) -> torch.Tensor:
    """uint8 tensor of `data` (no copy for a bytearray)."""
    if not data:
        return torch.zeros(0, dtype=torch.uint8)
    return torch.frombuffer(
        data if isinstance(data, bytearray) else bytearray(data), dtype=torch.uint8
    )


def _all_gather(out: torch.Tensor, inp: torch.Tensor) -> None:
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, inp)


_STEPS = ("encode", "push", "aggregate", "pull", "decode")


class BucketExchanger:
    """Transpose all-reduce of whole buckets through a codec pipeline over Gloo."""

    def __init__(self, pipe: Pipeline, rank: int, world: int) -> None:
        self.pipe = pipe
        self.rank = rank
        self.world = world
        self.ctx: dict[int, list[ShardContext]] = {}
        self.rounds = 0
        self.steps: dict[str, float] = dict.fromkeys(_STEPS, 0.0)  # seconds, cumulative

    def _tick(self, step: str, since: float) -> float:
        now = time.perf_counter()
        self.steps[step] += now - since
        return now

    def _bounds(self, n: int) -> list[tuple[int, int]]:
        w = self.world
        return [(n * s // w, n * (s + 1) // w) for s in range(w)]

    def exchange(self, bucket: int, x: torch.Tensor, seed: int) -> torch.Tensor:
        pipe, w, me = self.pipe, self.world, self.rank
        t = time.perf_counter()
        bounds = self._bounds(x.numel())
        ctxs = self.ctx.setdefault(bucket, [ShardContext(hi - lo) for lo, hi in bounds])
        for ctx, (lo, hi) in zip(ctxs, bounds, strict=True):
            pipe.begin(ctx, x[lo:hi], seed)
        maxima = [pipe.local_max(c) for c in ctxs]
        if all(m is not None for m in maxima):  # THC's first round: agree on the scale
            agreed = torch.tensor(maxima, dtype=torch.float32)
            dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
            for c, m in zip(ctxs, agreed.tolist(), strict=True):
                c.scale = m
        results: list[memoryview] = []
        for phase in range(pipe.phases):
            payloads = [pipe.encode(c, phase) for c in ctxs]
            send = _u8(bytearray().join(payloads))
            in_splits = [len(p) for p in payloads]
            step = len(payloads[me])
            recv = torch.empty(step * w, dtype=torch.uint8)
            t = self._tick("encode", t)
            dist.all_to_all_single(recv, send, [step] * w, in_splits)
            t = self._tick("push", t)
            raw = recv.numpy().data
            mine = pipe.aggregate(
                phase, [raw[i * step : (i + 1) * step] for i in range(w)], ctxs[me].numel
            )
            sizes = [pipe.result_bytes(c, phase, w) for c in ctxs]
            width = max(sizes)
            padded = torch.zeros(width, dtype=torch.uint8)
            padded[: len(mine)] = _u8(mine)
            gathered = torch.empty(w * width, dtype=torch.uint8)
            t = self._tick("aggregate", t)
            _all_gather(gathered, padded)
            t = self._tick("pull", t)
            allb = gathered.numpy().data
            results = [allb[s * width : s * width + sizes[s]] for s in range(w)]
            if phase < pipe.phases - 1:
                for c, r in zip(ctxs, results, strict=True):
                    pipe.absorb(c, phase, r)
        out = torch.cat([pipe.decode(c, r, w) for c, r in zip(ctxs, results, strict=True)])
        self._tick("decode", t)
        self.rounds += 1
        return out


class _Trainer:
    """Digits MLP, DDP-style buckets handed to one communication thread."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.rank, self.world = args.rank, args.world
        self.model = build_mlp(args.hidden, seed=0)
        self.params = [p for p in self.model.parameters()]
        self.groups = assign_buckets([p.numel() for p in self.params], args.bucket_mb)
        self.owner = {i: b for b, g in enumerate(self.groups) for i in g}
        self.xtr, self.ytr, _, _ = load_digits_data(0)
        self.batch = args.batch
        self.gen = torch.Generator().manual_seed(1000 + self.rank)
        self.opt = torch.optim.SGD(self.params, lr=0.01, momentum=0.9)
        self.loss_fn = torch.nn.CrossEntropyLoss()
        self.pending: list[int] = []
        self.ready_at: list[float] = []
        self.jobs: queue.Queue[tuple[int, torch.Tensor] | None] = queue.Queue()
        self.done: list[threading.Event] = []
        self.means: list[torch.Tensor | None] = []
        self.exchanger: BucketExchanger | None = None
        self.exchangers: dict[str, BucketExchanger] = {}
        self.round = 0
        for i, p in enumerate(self.params):
            p.register_post_accumulate_grad_hook(self._hook(i))
        self.thread = threading.Thread(target=self._comm, daemon=True)
        self.thread.start()

    def _hook(self, i: int) -> Any:
        def hook(_: torch.Tensor) -> None:
            b = self.owner[i]
            self.pending[b] -= 1
            if self.pending[b] == 0:
                self.ready_at[b] = time.perf_counter()
                grads = [self.params[j].grad for j in self.groups[b]]
                flat = torch.cat([g.reshape(-1) for g in grads if g is not None])
                if self.exchanger is None:
                    self.means[b] = flat
                    self.done[b].set()
                else:
                    self.jobs.put((b, flat))

        return hook

    def _comm(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            b, flat = job
            assert self.exchanger is not None
            self.means[b] = self.exchanger.exchange(b, flat, seed=self.round * 1009 + b)
            self.done[b].set()

    def iteration(self) -> dict[str, Any]:
        nb = len(self.groups)
        self.pending = [len(g) for g in self.groups]
        self.ready_at = [0.0] * nb
        self.done = [threading.Event() for _ in range(nb)]
        self.means = [None] * nb
        idx = torch.randint(0, self.xtr.shape[0], (self.batch,), generator=self.gen)
        t0 = time.perf_counter()
        self.opt.zero_grad(set_to_none=True)
        loss = self.loss_fn(self.model(self.xtr[idx]), self.ytr[idx])
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        for e in self.done:
            e.wait()
        t3 = time.perf_counter()
        for b, g in enumerate(self.groups):
            mean = self.means[b]
            assert mean is not None
            at = 0
            for j in g:
                p = self.params[j]
                p.grad = mean[at : at + p.numel()].view_as(p)
                at += p.numel()
        self.opt.step()
        t4 = time.perf_counter()
        self.round += 1
        return {
            "iteration_s": t4 - t0,
            "forward_s": t1 - t0,
            "backward_s": t2 - t1,
            "wait_s": t3 - t2,
            "step_s": t4 - t3,
            "ready_s": [r - t1 for r in self.ready_at],
        }

    def run(self, codec: str | None, iters: int, warmup: int) -> list[dict[str, Any]]:
        if codec is None:
            self.exchanger = None
        else:  # one exchanger per codec for the whole run: error feedback, THC scales
            if codec not in self.exchangers:
                pipe = pipeline_for(make_codec(codec))
                self.exchangers[codec] = BucketExchanger(pipe, self.rank, self.world)
            self.exchanger = self.exchangers[codec]
        dist.barrier()
        out = []
        for i in range(warmup + iters):
            before = dict(self.exchanger.steps) if self.exchanger else {}
            r = self.iteration()
            if self.exchanger is not None:
                r["steps"] = {k: v - before[k] for k, v in self.exchanger.steps.items()}
            if i >= warmup:
                out.append(r)
        dist.barrier()
        return out

    def run_in_step(self, iters: int, warmup: int) -> list[dict[str, Any]]:
        """Iterations without communication, every rank starting each one at once
        (a barrier), timed as the slowest rank's: forward, each bucket's ready time
        and backward as the last rank reaches them, the optimizer step. An exchange
        cannot start before the last rank's bucket is ready, and the ranks compute
        at once on shared cores as they do between exchanges."""
        self.exchanger = None
        out = []
        for i in range(warmup + iters):
            dist.barrier()
            r = self.iteration()
            f = r["forward_s"]
            ends = [f, f + r["backward_s"], r["step_s"], r["iteration_s"]]
            ends += [f + t for t in r["ready_s"]]
            slowest = torch.tensor(ends, dtype=torch.float64)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            m = slowest.tolist()
            if i >= warmup:
                out.append(
                    {
                        "iteration_s": m[3],
                        "forward_s": m[0],
                        "backward_s": m[1] - m[0],
                        "wait_s": 0.0,
                        "step_s": m[2],
                        "ready_s": [max(0.0, t - m[0]) for t in m[4:]],
                    }
                )
        dist.barrier()
        return out

    def close(self) -> None:
        self.jobs.put(None)


_EXIT_SKEWS: list[float] = []  # of the barriers `_together` ran, since the last emit


def _together(step: Any) -> float:
    """`calibrate`'s sync: `step` on every rank at once; the slowest rank's seconds.

    Also notes how much later than the median rank the last one left the
    barrier (`_EXIT_SKEWS`): ranks leave a collective out of step, and the
    next one waits for the last. The times are on the clock the emulated hosts
    share (CLOCK_MONOTONIC: one machine and its network namespaces).
    """
    dist.barrier()
    t = time.monotonic()
    step()
    mine = torch.tensor([t, time.monotonic() - t], dtype=torch.float64)
    every = [torch.empty(2, dtype=torch.float64) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    exits = [float(e[0].item()) for e in every]
    _EXIT_SKEWS.append(max(exits) - statistics.median(exits))
    return max(float(e[1].item()) for e in every)


def _netcal(sizes: Sequence[int], reps: int, world: int) -> dict[str, Any]:
    """Times of a bare push (all-to-all) and pull (all-gather) of `sizes` bytes."""
    rows = []
    for size in sizes:
        per = size // world
        send = torch.zeros(per * world, dtype=torch.uint8)
        recv = torch.empty(per * world, dtype=torch.uint8)
        inp = torch.zeros(per, dtype=torch.uint8)
        push, pull = [], []
        for _ in range(reps + 1):
            dist.barrier()
            t = time.perf_counter()
            dist.all_to_all_single(recv, send)
            push.append(time.perf_counter() - t)
            dist.barrier()
            t = time.perf_counter()
            _all_gather(recv, inp)
            pull.append(time.perf_counter() - t)
        rows.append(
            {
                "bytes": per * world,
                "push_s": statistics.median(push[1:]),
                "pull_s": statistics.median(pull[1:]),
            }
        )
    return {"rows": rows}


def _summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    keys = ("iteration_s", "forward_s", "backward_s", "wait_s", "step_s")
    out: dict[str, Any] = {k: statistics.median(r[k] for r in runs) for k in keys}
    for k in keys:
        out[k + "_all"] = [r[k] for r in runs]
    out["iterations"] = out["iteration_s_all"]
    out["ready_s"] = [r["ready_s"] for r in runs]
    if runs and "steps" in runs[0]:
        out["steps"] = {k: statistics.median(r["steps"][k] for r in runs) for k in _STEPS}
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--master", required=True)
    p.add_argument("--port", type=int, default=29570)
    p.add_argument("--codecs", default="fp32", help="codec specs separated by ';'")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument(
        "--hidden", type=lambda s: tuple(int(h) for h in s.split(",")), default=DIGITS_HIDDEN
    )
    p.add_argument("--bucket-mb", type=float, default=1.0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument(
        "--netcal", default="65536,1048576,4194304,16777216", help="bytes to time push/pull at"
    )
    p.add_argument("--rounds", type=int, default=1, help="cycles through all runs (interleaved)")
    p.add_argument(
        "--calibrate",
        action="store_true",
        help="before each codec run, time its steps here (dlcp.costmodel.calibrate)",
    )
    p.add_argument("--cal-repeats", type=int, default=5, help="calibration rounds per size")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    dist.init_process_group(
        "gloo", init_method=f"tcp://{a.master}:{a.port}", rank=a.rank, world_size=a.world
    )
    try:
        trainer = _Trainer(a)
        buckets = [sum(trainer.params[i].numel() for i in g) for g in trainer.groups]
        specs = [s.strip() for s in a.codecs.split(";") if s.strip()]
        # calibrated between the smallest and the largest shard the exchanges carry,
        # so the fitted line interpolates the sizes it predicts (codec costs are not
        # linear over decades of sizes: caches, sketch's sorting)
        shards = [b // a.world for b in buckets]
        sample = (
            [g[: max(shards)].clone() for g in sample_gradients(a.world, hidden=a.hidden)]
            if a.calibrate
            else []
        )
        for rnd in range(a.rounds):  # interleaved, so that load changes hit every run alike
            if a.netcal:
                sizes = [int(s) for s in a.netcal.split(",")]
                _emit("netcal", rank=a.rank, round=rnd, **_netcal(sizes, 5, a.world))
            runs = trainer.run(None, a.iters, a.warmup)
            _emit("compute", rank=a.rank, round=rnd, buckets=buckets, **_summary(runs))
            runs = trainer.run_in_step(a.iters, a.warmup)
            _emit("compute_in_step", rank=a.rank, round=rnd, buckets=buckets, **_summary(runs))
            for spec in specs:
                if a.calibrate:
                    cost = calibrate(  # every rank at once, in step, as they encode at once
                        [spec],
                        sample,
                        hosts=a.world,
                        small=min(shards),
                        repeats=a.cal_repeats,
                        sync=_together,
                        together=a.world,
                    ).codecs[spec]
                    skew = statistics.median(_EXIT_SKEWS) if _EXIT_SKEWS else 0.0
                    _EXIT_SKEWS.clear()
                    _emit(
                        "calibration",
                        rank=a.rank,
                        round=rnd,
                        codec=spec,
                        cost=cost.to_json(),
                        exit_skew_s=skew,
                    )
                runs = trainer.run(spec, a.iters, a.warmup)
                _emit("codec", rank=a.rank, round=rnd, codec=spec, **_summary(runs))
        trainer.close()
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    from dlcp.shim.leave import exit_process

    exit_process(main())  # not sys.exit: see dlcp.shim.leave
