"""One Gloo rank for the benchmarks: all-reduce a buffer K times, print JSON timings."""

from __future__ import annotations

import argparse
import json
import resource
import time

import torch
import torch.distributed as dist


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--master", required=True)
    p.add_argument("--port", type=int, default=29555)
    p.add_argument("--iface", default=None)
    p.add_argument("--elements", type=int, required=True)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    a = p.parse_args()
    dist.init_process_group(
        "gloo", init_method=f"tcp://{a.master}:{a.port}", rank=a.rank, world_size=a.world
    )
    x = torch.randn(a.elements)
    for _ in range(a.warmup):
        dist.all_reduce(x)
    dist.barrier()
    times = []
    c0 = cpu_s()
    for _ in range(a.iters):
        t = time.perf_counter()
        dist.all_reduce(x)
        times.append(time.perf_counter() - t)
    cpu = cpu_s() - c0
    print(json.dumps({"rank": a.rank, "times_s": times, "cpu_s": cpu}))
    dist.destroy_process_group()


if __name__ == "__main__":
    from dlcp.shim.leave import exit_process

    main()
    exit_process(0)  # not a plain return: see dlcp.shim.leave
