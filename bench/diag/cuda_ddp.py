"""DDP training steps on a GPU: Gloo's all-reduce hook against dlcp's hook.

    python bench/diag/cuda_ddp.py [--ranks 2] [--params-m 25] [--steps 10] [--rounds 2]
        [--json out.json]

`--ranks` processes (one Gloo group on loopback) share the machine's GPUs
(all on GPU 0 where there is one), each talking to its own dlcpd on
127.0.0.x (tests/daemons.py; no root). The model is a stack of 1024 x 1024
linear layers, `--params-m` million parameters, in DDP buckets of 25 MB. Per
backend the median time of a step (forward, backward and the gradients'
all-reduce, to the last synchronize):

- `gloo`: PyTorch's default all-reduce hook over the Gloo group;
- `dlcp`: dlcp's fp32 hook, its segment page-locked (one DMA each way);
- `dlcp-staged`: the same with the page-locking refused, so that buckets go
  through the pinned staging buffer as before 9075951.

The backends run in turn, `--rounds` times, in one invocation. A loopback
figure on one machine: it shows what the shim's copies cost beside Gloo's,
not what a network would. `--ceiling` is the daemons' pacing ceiling, 100
Gbit/s by default as in bench/diag/veth_busbw.py (loopback has no link rate;
dlcpd's default of 10 Gbit/s, a real link's, caps dlcp here).
`--device cpu` runs the same steps on the CPU (a smoke test; the two dlcp
backends are then one).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import dlcp.shim as dlcp  # noqa: E402
from dlcp.shim import client  # noqa: E402
from tests.daemons import free_tcp_port, loopback_daemons  # noqa: E402

BACKENDS = ("gloo", "dlcp-staged", "dlcp")
WIDTH = 1024
WARM = 3


def _model(params_m: int) -> nn.Module:
    torch.manual_seed(0)
    layers = max(1, round(params_m * 1e6 / (WIDTH * WIDTH + WIDTH)))
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(layers)])


def _steps(
    backend: str,
    rank: int,
    socket: str,
    device: torch.device,
    params_m: int,
    steps: int,
    batch: int,
) -> dict[str, Any]:
    ddp = nn.parallel.DistributedDataParallel(
        _model(params_m).to(device),
        device_ids=None if device.type == "cpu" else [device.index],
        bucket_cap_mb=25,
    )
    state = None
    refuse = backend == "dlcp-staged"
    pin = client._Mapped.pin_for_cuda
    if backend == "gloo":
        ddp.register_comm_hook(None, allreduce_hook)
    else:
        state = dlcp.init(codec="fp32", socket=socket, round_timeout_s=30.0, strict=True)
        ddp.register_comm_hook(state, dlcp.hook)
        if refuse:
            client._Mapped.pin_for_cuda = lambda self: False  # type: ignore[method-assign]
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(batch, WIDTH, generator=gen).to(device)
    times = []
    try:
        for step in range(WARM + steps):
            dist.barrier()
            t0 = time.perf_counter()
            ddp(x).pow(2).mean().backward()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if step >= WARM:
                times.append(time.perf_counter() - t0)
            for p in ddp.parameters():
                p.grad = None
    finally:
        client._Mapped.pin_for_cuda = pin  # type: ignore[method-assign]
    out: dict[str, Any] = {"backend": backend, "rank": rank, "times_s": times}
    if state is not None:
        stats = state.stats()
        out["pinned"] = stats["segment_pinned"]
        out["fallbacks"] = stats["fallbacks"]
        state.close()
        if stats["fallbacks"]:
            raise RuntimeError(f"{backend}: fell back to Gloo ({stats['last_error']})")
    return out


def _counters(status: dict[str, Any]) -> dict[str, Any]:
    """What of a daemon's status says where its time went: losses, resends, stalls."""
    c = status["counters"]
    keys = ("rounds_completed", "data_nacks_sent", "result_nacks_sent", "data_retransmits",
            "result_retransmits", "late_packets", "rx_packets")  # fmt: skip
    peers = status["peers"]
    return {
        **{k: c.get(k, 0) for k in keys},
        "lost_packets": sum(p["lost_packets"] for p in peers),
        "window_stalls": sum(p["window_stalls"] for p in peers),
        "window_resets": sum(p["window_resets"] for p in peers),
        "mac": status["mac"],
    }


def _worker(
    rank: int, world: int, port: int, sockets: list[str], a: dict[str, Any], out_dir: str
) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    if a["device"] == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    runs = []
    try:
        for r in range(a["rounds"]):
            for backend in a["backends"].split(","):
                run = _steps(
                    backend, rank, sockets[rank], device, a["params_m"], a["steps"], a["batch"]
                )
                runs.append({**run, "round": r})
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(runs))
        dist.barrier()
    finally:
        dist.destroy_process_group()
    dlcp.exit_process(0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--params-m", type=int, default=25)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--batch", type=int, default=64, help="samples a step and rank")
    p.add_argument("--backends", default=",".join(BACKENDS), help="of " + ", ".join(BACKENDS))
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument(
        "--ceiling",
        type=float,
        default=100e9,
        help="the daemons' pacing ceiling, bit/s ([rate] ceiling_bps; dlcpd's default: 10e9)",
    )
    p.add_argument("--json", type=Path)
    a = p.parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device (--device cpu for a smoke test)", file=sys.stderr)
        return 2
    extra = {"rate": {"ceiling_bps": a.ceiling}}
    with tempfile.TemporaryDirectory() as td, loopback_daemons(Path(td), a.ranks, extra) as ds:
        sockets = [d.socket for d in ds]
        mp.spawn(
            _worker,
            args=(a.ranks, free_tcp_port(), sockets, vars(a), td),
            nprocs=a.ranks,
            join=True,
        )
        ranks = [json.loads(Path(td, f"rank{i}.json").read_text()) for i in range(a.ranks)]
        daemons = []
        for d in ds:
            c = d.client()
            try:
                daemons.append(_counters(c.status()))
            finally:
                c.close()
    runs = [r for rank in ranks for r in rank]
    rows = []
    for backend in a.backends.split(","):
        mine = [r for r in runs if r["backend"] == backend]
        # a step ends for the job when its slowest rank ends it
        slowest = [
            max(r["times_s"][i] for r in mine if r["round"] == rd)
            for rd in range(a.rounds)
            for i in range(a.steps)
        ]
        rows.append(
            {
                "backend": backend,
                "median_step_s": statistics.median(slowest),
                "pinned": sorted({r.get("pinned") for r in mine}, key=str),
                "runs": mine,
            }
        )
    name = torch.cuda.get_device_name(0) if a.device == "cuda" else "cpu"
    print(
        f"{a.ranks} ranks on {name}, {a.params_m}M parameters, {a.steps} steps x {a.rounds}, "
        f"pacing ceiling {a.ceiling / 1e9:g} Gbit/s"
    )
    for r in rows:
        step_ms = r["median_step_s"] * 1e3
        print(f"{r['backend']:>12}  median step {step_ms:8.1f} ms  pinned {r['pinned']}")
    for i, d in enumerate(daemons):
        print(f"daemon {i}: " + ", ".join(f"{k} {v}" for k, v in d.items()))
    if a.json:
        meta = {"device": name, "args": vars(a) | {"json": str(a.json)}}
        a.json.write_text(json.dumps({**meta, "rows": rows, "daemons": daemons}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
