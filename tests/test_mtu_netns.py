"""Jumbo frames end to end: two daemons on an MTU-9000 testbed find the MTU
themselves (no payload in their configs), send datagrams larger than a
1500-byte link could carry, and sum a bucket exactly. Runs as root (CI);
skipped with a reason otherwise."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import pytest

from dlcp.daemon.mtu import payload_for
from dlcp.shim.client import DaemonClient, Segment
from dlcp.testbed import Testbed, TestbedSpec
from tests.daemons import submit

pytestmark = pytest.mark.netns

HOSTS = 2
JOB = 91


def _tx(tb: Testbed, host: int) -> tuple[int, int]:
    """(bytes, packets) the host's interface has sent."""
    h = tb.hosts[host]
    out = subprocess.run(
        ["ip", "-n", h.netns, "-s", "-j", "link", "show", "dev", h.interfaces[0]],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    tx = json.loads(out)[0]["stats64"]["tx"]
    return int(tx["bytes"]), int(tx["packets"])


def test_daemons_on_a_jumbo_link_send_jumbo_datagrams_and_sum_exactly() -> None:
    root = Path(tempfile.mkdtemp(prefix="dlcp-mtu-", dir="/tmp"))
    spec = TestbedSpec(hosts=HOSTS, mtu=9000, name="dlcp-mtu")
    tb = Testbed.up(spec, state_root=root)
    ranks: list[tuple[DaemonClient, Segment]] = []
    try:
        # no GSO: each datagram is one packet on the link, so its size shows there
        tb.start_daemons({"network": {"gso": False}, "daemon": {"metrics_port": 0}})
        hosts = [{"addresses": [tb.address(i)], "udp_port": spec.udp_port} for i in range(HOSTS)]
        for i in range(HOSTS):
            client = DaemonClient(str(tb.hosts[i].socket))
            seg = Segment(f"dlcp-mtu{os.getpid()}-{i}", 16 << 20)
            ranks.append((client, seg))
            client.segment(seg)
        infos = [c.hello() for c, _ in ranks]
        assert [info["payload"] for info in infos] == [payload_for(9000)] * HOSTS
        for i, (client, _) in enumerate(ranks):
            client.join(job=JOB, key=bytes(32).hex(), hosts=hosts, me=i, local_ranks=1)
        before = [_tx(tb, i) for i in range(HOSTS)]
        rng = np.random.default_rng(3)
        xs = [rng.standard_normal(1 << 20).astype(np.float32) for _ in range(HOSTS)]

        class _Rank:  # what tests.daemons.submit reads
            def __init__(self, client: DaemonClient, seg: Segment, info: dict) -> None:
                self.client, self.seg, self.info = client, seg, info

        waits = [
            submit(_Rank(c, s, info), job=JOB, round=0, bucket=0, lanes=x, shards=HOSTS, timeout=60)  # type: ignore[arg-type]
            for (c, s), info, x in zip(ranks, infos, xs, strict=True)
        ]
        for res in (w() for w in waits):
            np.testing.assert_array_equal(res.sums, xs[0] + xs[1])
        for i in range(HOSTS):
            sent, packets = (a - b for a, b in zip(_tx(tb, i), before[i], strict=True))
            # half of 4 MiB each way, in datagrams of up to 9000 bytes
            assert sent > 2 << 20
            assert sent / packets > 1500, f"host {i}: {sent} bytes in {packets} packets"
    finally:
        for client, seg in ranks:
            client.close()
            seg.close()
        tb.down()
        shutil.rmtree(root, ignore_errors=True)
