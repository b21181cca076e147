"""Overlap mode on the emulated cluster: one rank per namespace host, one dlcpd
each (two hosts: fp32 sums of two contributions are exact in any order). The
parameters after N steps are bitwise equal to the same per-parameter optimizer
applied after each step without overlap, bitwise equal on both ranks, and
close to torch.optim on the default hook. Needs root (CI); skipped otherwise.

The ranks run this module: `python -m tests.test_overlap_netns --out DIR`.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.test_shim_netns import ROOT, _wait

HOSTS = 2
MASTER_PORT = 29527

pytestmark = pytest.mark.netns


def _rank_main(argv: Sequence[str]) -> int:
    import torch.distributed as dist

    from tests.test_overlap_loopback import overlap_worker

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--optimizer", default="sgd")
    args = ap.parse_args(argv)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    result = overlap_worker(rank, world, [None] * world, args.optimizer)  # type: ignore[list-item]
    torch.save(result, Path(args.out) / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()
    return 0


@pytest.fixture
def pair() -> Iterator[Any]:
    from dlcp.testbed import Testbed, TestbedSpec

    root = Path(tempfile.mkdtemp(prefix="dlcp-ovl-", dir="/tmp"))
    tb = Testbed.up(TestbedSpec(hosts=HOSTS, name="ovlnet"), state_root=root)
    try:
        tb.start_daemons({"timing": {"timeout": 10.0}, "daemon": {"metrics_port": 0}})
        yield tb
    finally:
        tb.down()
        shutil.rmtree(root, ignore_errors=True)


def _env(tb: Any, rank: int) -> dict[str, str]:
    return {
        "MASTER_ADDR": tb.address(0),
        "MASTER_PORT": str(MASTER_PORT),
        "RANK": str(rank),
        "WORLD_SIZE": str(HOSTS),
        "LOCAL_RANK": "0",
        "GLOO_SOCKET_IFNAME": tb.hosts[rank].interfaces[0],
        "PYTHONPATH": str(ROOT),
        "OMP_NUM_THREADS": "1",
    }


def test_overlap_is_bitwise_the_per_parameter_optimizer_across_namespaces(
    pair: Any, tmp_path: Path
) -> None:
    argv = [sys.executable, "-m", "tests.test_overlap_netns", "--out", str(tmp_path)]
    procs = []
    for i in range(HOSTS):
        with open(tmp_path / f"rank{i}.log", "wb") as log:
            procs.append(
                pair.popen(i, argv, env=_env(pair, i), cwd=str(ROOT), stdout=log, stderr=log)
            )
    _wait(procs, tmp_path, 400)
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(HOSTS)]
    for res in results:
        on, off = res["on"], res["off"]
        assert on["in_flight"] and not off["in_flight"]
        for a, b in zip(on["params"], off["params"], strict=True):
            assert torch.equal(a, b)
        for a, b in zip(on["params"], res["torch"]["params"], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        assert on["stats"]["fallbacks"] == 0 and on["stats"]["failures"] == 0
    for a, b in zip(results[0]["on"]["params"], results[1]["on"]["params"], strict=True):
        assert torch.equal(a, b)


if __name__ == "__main__":
    from dlcp.shim.leave import exit_process

    exit_process(_rank_main(sys.argv[1:]))
