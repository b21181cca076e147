"""mode="ps" in network namespaces, both placements (root only; skipped with a
reason otherwise).

One testbed of four hosts with daemons. Dedicated: hosts 0..2 train and host
3 is a parameter server (its own namespace and shaped switch port, no
ranks); a client puts the job on it as the shim's rank 0 does. Co-located:
hosts 0..2 alone, each aggregating its shards. One rank per training host
submits from the root namespace (the daemons' Unix sockets and /dev/shm are
shared across namespaces). What must hold: the sums are exact (fp32, bound
0; integer-valued data, so any order of summing gives the same bits), the
aggregators named did the summing and no other daemon did, and the server's
sums went down through the switch. No test asserts a speed.
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

from dlcp.shim.client import DaemonClient
from dlcp.shim.placement import ps_fields
from dlcp.testbed import Testbed, TestbedSpec, down, system
from dlcp.testbed.plan import owned_netns
from tests.test_switch_netns import _Rank, _sent_packets

pytestmark = pytest.mark.netns

KEY = os.urandom(32)
TRAIN = 3


@pytest.fixture(scope="module")
def testbed() -> Iterator[Testbed]:
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    name = f"psn{os.getpid() % 100000}"
    root = Path(tempfile.mkdtemp(prefix="dlcp-ps-", dir="/tmp"))
    tb: Testbed | None = None
    try:
        spec = TestbedSpec(hosts=TRAIN + 1, rate_bps=200_000_000, daemons=True, name=name)
        tb = Testbed.up(spec, state_root=root)
        yield tb
    finally:
        try:
            if tb is not None:
                tb.down()
            else:
                down(name, state_root=root)
        finally:
            shutil.rmtree(root, ignore_errors=True)
        assert owned_netns(name, system.list_netns()) == []


def _aggregated(tb: Testbed) -> list[int]:
    out = []
    for h in tb.hosts:
        with DaemonClient(str(h.socket)) as c:
            out.append(int(c.status()["counters"].get("shards_aggregated", 0)))
    return out


def _rounds(
    tb: Testbed, job: int, hosts: list[dict[str, Any]], shape: dict[str, Any]
) -> list[list[Any]]:
    """Two rounds of one rank per training host; each rank's results."""
    from tests.daemons import submit

    ranks: list[_Rank] = []
    got: list[list[Any]] = []
    try:
        for i in range(TRAIN):
            r = _Rank(str(tb.hosts[i].socket), f"dlcp-psn{os.getpid()}-{job}-{i}", 4 << 20)
            ranks.append(r)
            r.client.join(job=job, key=KEY, hosts=hosts, me=i, mode="ps", **shape)
        rng = np.random.default_rng(job)
        for rnd, n in enumerate((10_000, 200_000)):
            xs = [rng.integers(-999, 1000, n).astype(np.float32) for _ in range(TRAIN)]
            waits = [
                submit(
                    r,  # type: ignore[arg-type]
                    job=job,
                    round=rnd,
                    bucket=0,
                    lanes=x,
                    shards=shape["shards"],
                    timeout=120,
                )
                for r, x in zip(ranks, xs, strict=True)
            ]
            results = [w() for w in waits]
            for res in results:
                np.testing.assert_array_equal(res.sums, xs[0] + xs[1] + xs[2])
                assert (res.contributors == TRAIN).all()
                assert res.reply["lost_lanes"] == 0
            got.append(results)
    finally:
        for r in ranks:
            r.close()
    return got


def _hosts(tb: Testbed, n: int) -> list[dict[str, Any]]:
    return [{"addresses": list(h.addresses), "udp_port": h.udp_port} for h in tb.hosts[:n]]


def test_a_dedicated_parameter_server_sums_every_shard(testbed: Testbed) -> None:
    tb = testbed
    shape = ps_fields(TRAIN, 1, False)
    assert shape["aggregators"] == [TRAIN] and shape["shards"] == 8
    server_port = tb.hosts[TRAIN].switch_ports[0]
    before, sent = _aggregated(tb), _sent_packets(tb.switch_netns, server_port)
    with DaemonClient(str(tb.hosts[TRAIN].socket)) as server:  # as the shim's rank 0
        server.hello()
        server.join(job=41, key=KEY, hosts=_hosts(tb, TRAIN + 1), me=TRAIN, mode="ps", **shape)
        _rounds(tb, 41, _hosts(tb, TRAIN + 1), shape)
        counters = server.status()["counters"]
    after = _aggregated(tb)
    assert after[TRAIN] - before[TRAIN] == 2 * 8  # two rounds of eight shards
    assert after[:TRAIN] == before[:TRAIN]  # the training hosts summed nothing
    assert counters.get("data_packets_sent", 0) == 0  # and the server contributed nothing
    # the training hosts' data reached the server through its own shaped
    # switch port, as to any host of the testbed
    assert _sent_packets(tb.switch_netns, server_port) > sent


def test_co_located_aggregators_sum_on_every_training_host(testbed: Testbed) -> None:
    tb = testbed
    shape = ps_fields(TRAIN, 0, True)
    assert shape["aggregators"] == [0, 1, 2] and shape["shards"] == 9
    before = _aggregated(tb)
    _rounds(tb, 42, _hosts(tb, TRAIN), shape)
    after = _aggregated(tb)
    assert [a - b for a, b in zip(after, before, strict=True)] == [6, 6, 6, 0]


def test_a_join_that_cannot_work_is_refused_in_the_namespaces(testbed: Testbed) -> None:
    from dlcp.shim.client import DaemonError

    tb = testbed
    with DaemonClient(str(tb.hosts[0].socket)) as c:
        c.hello()
        with pytest.raises(DaemonError, match="aggregator 4 is not a host of the job"):
            c.join(job=43, key=KEY, hosts=_hosts(tb, TRAIN + 1), me=0, mode="ps", aggregators=[4])
        with pytest.raises(DaemonError, match="at least one aggregator"):
            c.join(job=43, key=KEY, hosts=_hosts(tb, TRAIN + 1), me=0, mode="ps")
