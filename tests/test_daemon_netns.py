"""Three real daemons in network namespaces: veth links, HTB rate limits, nftables loss.

The client speaks the shim protocol from the root namespace (Unix sockets and
/dev/shm are shared across network namespaces); datagrams cross the emulated
switch. Runs as root (CI); skipped with a reason otherwise.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dlcp.shim.client import DaemonClient, Segment
from dlcp.testbed import Testbed, TestbedSpec
from tests.daemons import packet_norms, submit

pytestmark = pytest.mark.netns

KEY = os.urandom(32)
JOB = 77
HOSTS = 3


class _Rank:
    def __init__(self, socket: str, name: str, size: int) -> None:
        self.client = DaemonClient(socket)
        self.info = self.client.hello()
        self.seg = Segment(name, size)
        self.client.segment(self.seg)

    def close(self) -> None:
        self.client.close()
        self.seg.close()


@pytest.fixture(scope="module")
def cluster() -> Iterator[tuple[Testbed, list[_Rank]]]:
    root = Path(tempfile.mkdtemp(prefix="dlcp-tb-", dir="/tmp"))
    spec = TestbedSpec(hosts=HOSTS, rate_bps=500_000_000, name="dlcpd-it")
    tb = Testbed.up(spec, state_root=root)
    ranks: list[_Rank] = []
    try:
        tb.start_daemons({"timing": {"timeout": 20.0}, "daemon": {"metrics_port": 0}})
        hosts = [{"addresses": [tb.address(i)], "udp_port": spec.udp_port} for i in range(HOSTS)]
        for i in range(HOSTS):
            r = _Rank(str(tb.hosts[i].socket), f"dlcp-it{os.getpid()}-{i}", 16 << 20)
            ranks.append(r)
            r.client.join(job=JOB, key=KEY, hosts=hosts, me=i, local_ranks=1)
        yield tb, ranks
    finally:
        for r in ranks:
            r.close()
        tb.down()
        shutil.rmtree(root, ignore_errors=True)
        assert (
            not [n for n in os.listdir("/run/netns") if n.startswith("dlcpd-it")]
            if (os.path.isdir("/run/netns"))
            else True
        )


_rounds = iter(range(1_000_000))


def _allreduce(ranks: list[_Rank], xs: list[np.ndarray], **kw: Any) -> list[Any]:
    rnd = next(_rounds)
    waits = [
        submit(r, job=JOB, round=rnd, bucket=0, lanes=x, shards=HOSTS, timeout=120, **kw)  # type: ignore[arg-type]
        for r, x in zip(ranks, xs, strict=True)
    ]
    return [w() for w in waits]


def test_exact_fp32_sums_without_loss(cluster: tuple[Testbed, list[_Rank]]) -> None:
    _, ranks = cluster
    rng = np.random.default_rng(10)
    for n in (1000, 1 << 20):
        xs = [rng.standard_normal(n).astype(np.float32) for _ in ranks]
        for res in _allreduce(ranks, xs):
            np.testing.assert_array_equal(res.sums, xs[0] + xs[1] + xs[2])
            assert (res.contributors == HOSTS).all()


def test_five_percent_loss_on_one_link_stays_within_bound_and_replicas_agree(
    cluster: tuple[Testbed, list[_Rank]],
) -> None:
    tb, ranks = cluster
    bound = 0.05
    tb.set_loss(1, 5.0)  # everything host 1 sends
    try:
        rng = np.random.default_rng(11)
        total_lost = 0
        for _ in range(4):
            n = 1 << 19
            scale = rng.uniform(0.01, 2.0, n).astype(np.float32)
            xs = [(rng.standard_normal(n) * scale).astype(np.float32) for _ in ranks]
            norms = [packet_norms(x, HOSTS) for x in xs]
            rnd = next(_rounds)
            waits = [
                submit(
                    r,
                    job=JOB,
                    round=rnd,
                    bucket=0,
                    lanes=x,
                    shards=HOSTS,
                    bound=bound,
                    norms=nm,
                    layers=np.zeros(len(nm)),
                    timeout=120,
                )
                for r, x, nm in zip(ranks, xs, norms, strict=True)
            ]
            results = [w() for w in waits]
            first = results[0]
            for res in results:
                assert res.sums.tobytes() == first.sums.tobytes(), "replicas differ"
                np.testing.assert_array_equal(res.contributors, first.contributors)
            lost = first.reply["lost_lanes"]
            assert lost <= bound * first.reply["total_lanes"]
            total_lost += lost
            # packets with every contribution hold the exact sum
            full = np.repeat(first.contributors == HOSTS, 352)[:n]
            exact = xs[0] + xs[1] + xs[2]
            np.testing.assert_array_equal(first.sums[full], exact[full])
        stats = ranks[0].client.status()["counters"]
        assert (
            stats.get("data_retransmits", 0)
            + stats.get("result_retransmits", 0)
            + sum(r.client.status()["counters"].get("data_retransmits", 0) for r in ranks[1:])
            > 0
        ), "5 % loss must have caused NACK recovery"
    finally:
        tb.set_loss(1, 0.0)
