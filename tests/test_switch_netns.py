"""The switch aggregator in network namespaces: `Testbed.up(switch_aggregator=True)`
with daemons (root only; skipped with a reason otherwise).

Three hosts and the aggregator daemon in the switch namespace (10.77.0.254 on
the bridge). The clients speak the shim protocol from the root namespace (the
daemons' Unix sockets and /dev/shm are shared across network namespaces): one
puts the job on the aggregator as the shim's rank 0 does (me=3, mode
"switch"), one rank per host submits. What must hold: the sums are exact
(fp32, bound 0), the aggregator did the summing, and each host's traffic into
it went through its uplink's ifb (its qdisc counted packets). No test asserts
a speed.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import pytest

from dlcp.core.records import SWITCH_SHARDS
from dlcp.shim.client import DaemonClient, Segment
from dlcp.testbed import Testbed, TestbedSpec, down, system
from dlcp.testbed.plan import owned_netns, switch_address, uplink_ifb
from tests.daemons import submit

pytestmark = pytest.mark.netns

KEY = os.urandom(32)
JOB = 808
HOSTS = 3


class _Rank:
    """One host's rank, in the root namespace, at that host's daemon socket."""

    def __init__(self, socket: str, name: str, size: int) -> None:
        self.client = DaemonClient(socket)
        self.seg: Segment | None = None
        try:
            self.info = self.client.hello()
            self.seg = Segment(name, size)
            self.client.segment(self.seg)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.client.close()
        if self.seg is not None:
            self.seg.close()


def _sent_packets(netns: str, dev: str) -> int:
    """Packets the root qdisc of `dev` in `netns` sent (`tc -s qdisc`)."""
    out = subprocess.run(
        ["ip", "netns", "exec", netns, "tc", "-s", "qdisc", "show", "dev", dev],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout
    sent = re.search(r"Sent \d+ bytes (\d+) pkt", out)
    assert sent is not None, out
    return int(sent.group(1))


def test_a_round_sums_through_the_switch_aggregator() -> None:
    name = f"swn{os.getpid() % 100000}"
    root = Path(tempfile.mkdtemp(prefix="dlcp-sw-", dir="/tmp"))
    tb: Testbed | None = None
    at_switch: DaemonClient | None = None
    ranks: list[_Rank] = []
    try:
        spec = TestbedSpec(
            hosts=HOSTS,
            rate_bps=200_000_000,
            switch_aggregator=True,
            daemons=True,
            name=name,
        )
        tb = Testbed.up(spec, state_root=root)
        (switch,) = tb.show()["switches"]
        agg = switch["aggregator"]
        assert agg is not None and agg["daemon_alive"], agg
        assert agg["addresses"] == [switch_address(0)]
        assert tb.switch_socket is not None and agg["socket"] == str(tb.switch_socket)
        assert tb.env(0)["DLCP_SWITCH_SOCKET"] == str(tb.switch_socket)
        ifbs = [uplink_ifb(i, 0) for i in range(HOSTS)]
        before = [_sent_packets(tb.switch_netns, dev) for dev in ifbs]

        hosts = [{"addresses": list(h.addresses), "udp_port": h.udp_port} for h in tb.hosts]
        hosts.append({"addresses": list(tb.switch_addresses), "udp_port": spec.udp_port})
        # the job at the aggregator, as the shim's rank 0 puts it there
        at_switch = DaemonClient(str(tb.switch_socket))
        at_switch.hello()
        at_switch.join(job=JOB, key=KEY, hosts=hosts, me=HOSTS, local_ranks=1, mode="switch")
        for i in range(HOSTS):
            r = _Rank(str(tb.hosts[i].socket), f"dlcp-swn{os.getpid()}-{i}", 4 << 20)
            ranks.append(r)
            r.client.join(job=JOB, key=KEY, hosts=hosts, me=i, local_ranks=1, mode="switch")

        rng = np.random.default_rng(12)
        # each bucket at least a packet a shard: all 8 are summed
        for rnd, n in enumerate((10_000, 100_000)):
            xs = [rng.standard_normal(n).astype(np.float32) for _ in range(HOSTS)]
            waits = [
                submit(
                    r,  # type: ignore[arg-type]
                    job=JOB,
                    round=rnd,
                    bucket=0,
                    lanes=x,
                    shards=SWITCH_SHARDS,
                    timeout=120,
                )
                for r, x in zip(ranks, xs, strict=True)
            ]
            # the aggregator sums in sender order
            expected = (xs[0] + xs[1]) + xs[2]
            for w in waits:
                res = w()
                np.testing.assert_array_equal(res.sums, expected)
                assert (res.contributors == HOSTS).all()
                assert res.reply["lost_lanes"] == 0
        counters = at_switch.status()["counters"]
        assert counters.get("shards_aggregated", 0) == 2 * SWITCH_SHARDS
        assert counters.get("data_packets_sent", 0) == 0
        for r in ranks:
            assert r.client.status()["counters"].get("shards_aggregated", 0) == 0
        # each host's traffic into the aggregator went through its shaped uplink
        after = [_sent_packets(tb.switch_netns, dev) for dev in ifbs]
        assert all(a > b for a, b in zip(after, before, strict=True)), (before, after)
    finally:
        for r in ranks:
            r.close()
        if at_switch is not None:
            with contextlib.suppress(Exception):
                at_switch.close()
        try:
            if tb is not None:
                tb.down()
            else:  # `up` failed: it cleans up after itself, and this makes sure
                down(name, state_root=root)
        finally:
            shutil.rmtree(root, ignore_errors=True)
        assert owned_netns(name, system.list_netns()) == []
