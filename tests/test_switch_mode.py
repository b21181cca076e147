"""Mode "switch": an aggregator in the switch owns every shard (no root needed).

The pieces of `dlcp testbed up --switch-aggregator` that need no namespaces
(addresses, MACs, the ifb names, the aggregator's config and the `ip`/`tc`
lines that wire it), the job's shape (`JobSpec.switch`), the shim's
rendezvous with a switch descriptor, the pacing cap toward an aggregator in
the switch (no fan-in cut), the batched receive that takes an interleaved
drain source by source, and the mode end to end over loopback daemons, the
third of which plays the switch's aggregator. The namespace variant is
test_switch_netns.py.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dlcp.core.engine import Engine, RoundComplete, RoundFailed
from dlcp.core.rate import RateConfig
from dlcp.core.receiver import Receiver
from dlcp.core.records import SWITCH_SHARDS, JobSpec
from dlcp.daemon.flow import WINDOW_MIN, size_windows
from dlcp.errors import LocalError
from dlcp.shim.client import DaemonClient, DaemonError
from dlcp.shim.rendezvous import plan_membership
from dlcp.testbed.plan import (
    MAX_HOSTS,
    MAX_PATHS,
    TestbedError,
    TestbedSpec,
    host_address,
    host_mac,
    switch_address,
    switch_mac,
    uplink_ifb,
)
from dlcp.testbed.switchagg import (
    host_neigh_commands,
    switch_config,
    switch_link_commands,
    uplink_commands,
)
from dlcp.wire import Codec, PacketType
from dlcp.wire.header import header_of_valid
from tests.daemons import Rank, hosts_of, loopback_daemons, submit

KEY = bytes(range(32))


# --- the job ---


def test_switch_job_has_the_last_host_own_every_shard() -> None:
    for me in range(4):
        spec = JobSpec.switch(7, KEY, me, 4)
        assert spec.contributors == (0, 1, 2)
        assert spec.owners == (3,) * SWITCH_SHARDS
        assert spec.members == frozenset(range(4))
    spec = JobSpec.switch(7, KEY, 0, 4)
    # the aggregator hears from every contributor, each contributor from the aggregator
    assert spec.senders_to(3) == frozenset({0, 1, 2})
    for node in (0, 1, 2):
        assert spec.senders_to(node) == frozenset({3})
    assert SWITCH_SHARDS == 8
    assert JobSpec.switch(7, KEY, 2, 3, shards=3).owners == (2, 2, 2)
    # two hosts: one contributor and the aggregator
    two = JobSpec.switch(7, KEY, 1, 2)
    assert two.contributors == (0,) and set(two.owners) == {1}
    assert JobSpec.switch(7, KEY, 0, 3, payload=1000).payload == 1000


def test_switch_job_needs_a_contributor_and_a_member_me() -> None:
    with pytest.raises(LocalError, match="no contributors"):
        JobSpec.switch(7, KEY, 0, 1)  # the aggregator alone
    with pytest.raises(LocalError, match="not a member"):
        JobSpec.switch(7, KEY, 4, 4)


# --- the testbed's plan ---


def test_switch_address_mac_and_uplink_names() -> None:
    assert switch_address(0) == "10.77.0.254"
    assert switch_address(3) == "10.77.3.254"
    assert switch_address(MAX_PATHS - 1) == f"10.77.{MAX_PATHS - 1}.254"
    # no host has the aggregator's address or its bridge's MAC
    hosts = {host_address(i, p) for i in range(MAX_HOSTS) for p in range(2)}
    assert switch_address(0) not in hosts and switch_address(1) not in hosts
    macs = {host_mac(i, p) for i in range(MAX_HOSTS) for p in range(2)}
    assert switch_mac(0) == "02:77:00:ff:ff:fe"
    assert switch_mac(1) == "02:77:01:ff:ff:fe"
    assert switch_mac(0) not in macs and switch_mac(1) not in macs
    assert uplink_ifb(0, 0) == "up0p0"
    assert uplink_ifb(12, 3) == "up12p3"
    assert len(uplink_ifb(MAX_HOSTS - 1, MAX_PATHS - 1)) <= 15  # IFNAMSIZ - 1


@pytest.mark.parametrize("path", [-1, MAX_PATHS, 100])
def test_switch_address_rejects_paths_out_of_range(path: int) -> None:
    with pytest.raises(TestbedError, match=f"path {path}"):
        switch_address(path)


def test_switch_config_lists_the_bridges_addresses_and_the_hosts_as_peers() -> None:
    spec = TestbedSpec(hosts=3, paths=2, name="swc", switch_aggregator=True)
    cfg = switch_config(spec, Path("/tmp/x/switch/dlcpd.sock"), {})
    assert cfg["daemon"] == {
        "socket": "/tmp/x/switch/dlcpd.sock",
        "metrics_port": spec.metrics_port,
        "host_index": 3,  # after the hosts: the job's last host
    }
    net = cfg["network"]
    assert net["addresses"] == ["10.77.0.254", "10.77.1.254"]
    assert net["udp_port"] == spec.udp_port
    assert "payload" not in net  # the default at MTU 1500
    assert net["peers"] == [
        {"index": i, "addresses": [f"10.77.0.{i + 1}", f"10.77.1.{i + 1}"]} for i in range(3)
    ]
    # jumbo frames: the payload follows the MTU; `extra` merges in, as for the hosts
    jumbo = TestbedSpec(hosts=2, name="swc", switch_aggregator=True, mtu=9000)
    extra = {"timing": {"timeout": 5.0}, "daemon": {"metrics_port": 0}}
    cfg = switch_config(jumbo, "/s.sock", extra)
    assert cfg["network"]["payload"] == 9000 - 92
    assert cfg["timing"] == {"timeout": 5.0}
    assert cfg["daemon"] == {"socket": "/s.sock", "metrics_port": 0, "host_index": 2}


def test_switch_link_and_host_neighbour_commands() -> None:
    spec = TestbedSpec(hosts=2, paths=2, name="swc", switch_aggregator=True)
    assert switch_link_commands(spec) == [
        "link set br0 address 02:77:00:ff:ff:fe",
        "addr add 10.77.0.254/24 dev br0",
        "neigh replace 10.77.0.1 lladdr 02:77:00:00:00:00 dev br0 nud permanent",
        "neigh replace 10.77.0.2 lladdr 02:77:00:00:00:01 dev br0 nud permanent",
        "link set br1 address 02:77:01:ff:ff:fe",
        "addr add 10.77.1.254/24 dev br1",
        "neigh replace 10.77.1.1 lladdr 02:77:01:00:00:00 dev br1 nud permanent",
        "neigh replace 10.77.1.2 lladdr 02:77:01:00:00:01 dev br1 nud permanent",
    ]
    assert host_neigh_commands(spec, lambda p: f"eth{p}") == [
        "neigh replace 10.77.0.254 lladdr 02:77:00:ff:ff:fe dev eth0 nud permanent",
        "neigh replace 10.77.1.254 lladdr 02:77:01:ff:ff:fe dev eth1 nud permanent",
    ]


def test_uplink_commands_redirect_the_aggregators_traffic_into_the_ifb() -> None:
    spec = TestbedSpec(hosts=2, paths=2, name="swc", switch_aggregator=True, mtu=9000)
    ip, tc = uplink_commands(spec, 1, 1, "h1p1")
    assert ip == ["link add up1p1 mtu 9000 type ifb", "link set up1p1 up"]
    assert tc == [
        "qdisc add dev h1p1 handle ffff: ingress",
        "filter add dev h1p1 parent ffff: protocol ip prio 1 u32 "
        "match ip dst 10.77.1.254/32 action mirred egress redirect dev up1p1",
    ]
    ip, tc = uplink_commands(TestbedSpec(hosts=1, name="swc"), 0, 0, "h0p0")
    assert ip[0] == "link add up0p0 mtu 1500 type ifb"
    assert "match ip dst 10.77.0.254/32 " in tc[1] and tc[1].endswith("dev up0p0")


# --- the shim's rendezvous ---


def _descriptor(i: int, payload: int = 1408) -> dict[str, Any]:
    return {"id": f"d{i}", "addresses": [f"10.77.0.{i + 1}"], "udp_port": 7400, "payload": payload}


def test_plan_membership_with_a_switch_puts_it_last_and_cuts_eight_shards() -> None:
    # ranks 0 and 2 share host 0; rank 1 is host 1
    daemons = [_descriptor(0), _descriptor(1, payload=1200), _descriptor(0)]
    secret = {"job": 99, "key": "ab" * 32}
    switch = {"addresses": ["10.77.0.254"], "udp_port": 7400, "payload": 1000, "id": "sw"}
    plain = plan_membership(daemons, 2, secret)
    m = plan_membership(daemons, 2, secret, switch)
    assert (
        m.hosts
        == plain.hosts
        == [
            {"addresses": ["10.77.0.1"], "udp_port": 7400},
            {"addresses": ["10.77.0.2"], "udp_port": 7400},
        ]
    )
    assert m.me == plain.me == 0 and m.local_ranks == 2
    assert m.host_of_rank == plain.host_of_rank == [0, 1, 0]
    assert m.switch == {"addresses": ["10.77.0.254"], "udp_port": 7400}
    assert plain.switch is None
    assert plain.shards == 2
    assert m.shards == SWITCH_SHARDS
    assert plain.payload == 1200
    assert m.payload == 1000  # the smallest, the switch's included

    rank = m.join_fields("switch")
    assert rank["hosts"] == [*m.hosts, m.switch]
    assert rank["me"] == 0 and rank["local_ranks"] == 2
    assert rank["mode"] == "switch" and rank["payload"] == 1000
    assert rank["job"] == 99 and rank["key"] == "ab" * 32
    at = m.join_fields("switch", at_switch=True)
    assert at["hosts"] == rank["hosts"]
    assert at["me"] == len(m.hosts) == 2  # the aggregator is the job's last host
    assert at["local_ranks"] == 1
    assert at["payload"] == 1000
    # without a switch nothing changes
    assert plain.join_fields("transpose")["hosts"] == plain.hosts
    # a switch payload above the hosts' leaves the hosts' minimum
    big = plan_membership(daemons, 1, secret, {**switch, "payload": 9000})
    assert big.payload == 1200 and big.me == 1 and big.local_ranks == 1


# --- pacing toward the switch ---


class _FakeRate:
    def __init__(self) -> None:
        self.max_rate: float | None = None

    def set_max_rate(self, rate: float) -> None:
        self.max_rate = rate


class _FakePeer:
    """What `size_windows` touches of an outbox `Peer` (hashed by identity)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.rate = _FakeRate()
        self.window = 0


@dataclass
class _FakeJob:
    spec: JobSpec
    hosts: tuple[str, ...]
    mode: str
    peers: dict[int, _FakePeer] = field(default_factory=dict)


def _job_at_contributor(mode: str, hosts: int = 4) -> _FakeJob:
    """Host 0's view of a job whose last host is the one aggregator."""
    spec = JobSpec.switch(5, KEY, 0, hosts)
    names = tuple(f"h{i}" for i in range(hosts))
    return _FakeJob(spec, names, mode, {i: _FakePeer(names[i]) for i in range(1, hosts)})


def test_a_switch_aggregator_is_paced_at_the_whole_link_a_ps_one_at_a_share() -> None:
    rate = RateConfig(link_rate_bps=1e9)
    window = 64 << 20
    switch, ps = _job_at_contributor("switch"), _job_at_contributor("ps")
    size_windows([switch], window, rate)
    size_windows([ps], window, rate)
    # 3 contributors send to the aggregator: "ps" shares its port among them,
    # a switch's aggregator takes each on its own port
    assert switch.peers[3].rate.max_rate == rate.fan_in_rate(1) == 1e9 * rate.utilization
    assert ps.peers[3].rate.max_rate == rate.fan_in_rate(3) == 1e9 * rate.utilization / 3
    # the other contributors hear only from the aggregator: the whole link either way
    for job in (switch, ps):
        for node in (1, 2):
            assert job.peers[node].rate.max_rate == rate.fan_in_rate(1)
    # the flow-control window is still shared among the aggregator's senders
    assert switch.peers[3].window == max(WINDOW_MIN, window // 3) == ps.peers[3].window


def test_no_link_rate_sets_no_cap_toward_the_switch() -> None:
    job = _job_at_contributor("switch", hosts=3)
    assert size_windows([job], 0, RateConfig()) == 0
    assert all(p.rate.max_rate is None for p in job.peers.values())


# --- the aggregator's drains ---


def _switch_engines() -> list[Engine]:
    out = []
    for me in range(3):
        e = Engine()
        e.add_job(JobSpec.switch(9, KEY, me, 3))
        out.append(e)
    return out


def test_an_interleaved_drain_is_taken_source_by_source(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two contributors' data packets for one shard, alternating in one drain
    at the aggregator: one run a source, and the sums of `receive` per packet
    with the drain sorted by source (stable)."""
    runs: list[tuple[int | None, int]] = []
    real = Receiver._receive_run

    def counting(self: Receiver, h: Any, heads: Any, payloads: Any, now: float, src: Any) -> Any:
        runs.append((src, len(payloads)))
        return real(self, h, heads, payloads, now, src)

    monkeypatch.setattr(Receiver, "_receive_run", counting)
    rng = np.random.default_rng(4)
    per_lanes = 352  # fp32 lanes in a 1408-byte payload
    total = SWITCH_SHARDS * 4 * per_lanes  # 4 packets a shard
    xs = [rng.standard_normal(total).astype("<f4") for _ in range(2)]
    clusters = [_switch_engines(), _switch_engines()]  # per packet, batched
    for engines in clusters:
        for me in (0, 1):
            engines[me].submit(
                job=9,
                round=0,
                bucket=0,
                codec=Codec.FP32,
                total=total,
                lanes=xs[me].tobytes(),
                now=0,
            )
    sent = [[(me, s) for me in (0, 1) for s in eng[me].datagrams_to_send()] for eng in clusters]
    assert [(m, s.node, s.datagram) for m, s in sent[0]] == [
        (m, s.node, s.datagram) for m, s in sent[1]
    ]
    drain = sent[0]
    assert {s.node for _, s in drain} == {2}  # everything goes to the aggregator

    def shard0(dg: bytes) -> bool:
        h = header_of_valid(dg)
        return h.type == PacketType.DATA and h.shard == 0

    by_src: dict[int, list[bytes]] = {0: [], 1: []}
    for src, s in drain:
        if shard0(s.datagram):
            by_src[src].append(s.datagram)
    assert len(by_src[0]) == len(by_src[1]) == 4
    interleaved = [(src, by_src[src][k]) for k in range(4) for src in (0, 1)]
    runs.clear()
    accepted = clusters[1][2].receive_many(
        [d for _, d in interleaved], 0.0, [s for s, _ in interleaved]
    )
    assert accepted.tolist() == list(range(len(interleaved)))  # positions, in order
    assert runs == [(0, 4), (1, 4)]  # one run a source, not eight runs of one
    for src, dg in sorted(interleaved, key=lambda item: item[0]):
        assert clusters[0][2].receive(dg, 0.0, src=src) is not None
    # the rest of the bucket, then the results back, the same way on both
    rest = [(src, s.datagram) for src, s in drain if not shard0(s.datagram)]
    for src, dg in rest:
        clusters[0][2].receive(dg, 0.0, src=src)
    clusters[1][2].receive_many([d for _, d in rest], 0.0, [s for s, _ in rest])
    assert clusters[0][2].stats["shards_aggregated"] == SWITCH_SHARDS
    assert clusters[0][2].stats == clusters[1][2].stats
    assert clusters[0][2].rejects == clusters[1][2].rejects
    results = []
    for engines in clusters:
        back = engines[2].datagrams_to_send()
        assert back and {s.node for s in back} == {0, 1}
        for s in back:
            engines[s.node].receive(s.datagram, 0.0, src=2)
        got: dict[int, RoundComplete] = {}
        for me in (0, 1):
            while (ev := engines[me].next_event()) is not None:
                assert not isinstance(ev, RoundFailed), ev
                got[me] = ev
        assert sorted(got) == [0, 1]
        results.append(got)
    want = (xs[0] + xs[1]).tobytes()  # two addends: exact in either order
    for got in results:
        for ev in got.values():
            assert ev.sums.tobytes() == want
            assert (ev.contributors == 2).all()


def test_a_drain_of_one_source_is_not_reordered(monkeypatch: pytest.MonkeyPatch) -> None:
    engines = _switch_engines()
    total = SWITCH_SHARDS * 2 * 352
    engines[0].submit(
        job=9, round=0, bucket=0, codec=Codec.FP32, total=total, lanes=bytes(total * 4), now=0
    )
    dgs = [s.datagram for s in engines[0].datagrams_to_send()]
    runs: list[int] = []
    real = Receiver._receive_run

    def counting(self: Receiver, h: Any, heads: Any, payloads: Any, now: float, src: Any) -> Any:
        runs.append(h.shard)
        return real(self, h, heads, payloads, now, src)

    monkeypatch.setattr(Receiver, "_receive_run", counting)
    accepted = engines[2].receive_many(dgs, 0.0, [0] * len(dgs))
    assert accepted.tolist() == list(range(len(dgs)))
    assert runs == sorted(runs) and len(runs) == SWITCH_SHARDS  # one run a shard, in order


# --- daemons on loopback ---

JOB = 606


def test_switch_jobs_of_bad_shapes_are_refused(tmp_path: Path) -> None:
    with loopback_daemons(tmp_path, 1) as ds, DaemonClient(ds[0].socket) as c:
        c.hello()

        def err(**kw: Any) -> str:
            with pytest.raises(DaemonError) as e:
                c.join(job=JOB, key=KEY, **kw)
            return e.value.code

        # the aggregator alone, no host to contribute
        assert err(hosts=hosts_of(ds), me=0, mode="switch") == "bad_request"
        assert err(hosts=hosts_of(ds), me=0, mode="crossbar") == "bad_request"
        assert all(j["job"] != JOB for j in c.status()["jobs"])  # nothing was made


def test_switch_mode_over_loopback_daemons(tmp_path: Path) -> None:
    """Daemons 0 and 1 contribute; daemon 2 is the switch's aggregator, whose
    only client puts the job there (me=2, as the shim's rank 0 does)."""
    with loopback_daemons(tmp_path, 3, {"timing": {"timeout": 5.0}}) as ds:
        hosts = hosts_of(ds)
        pid = os.getpid()
        agg = DaemonClient(ds[2].socket)
        ranks: list[Rank] = []
        try:
            agg.hello()
            agg.join(job=JOB, key=KEY, hosts=hosts, me=2, local_ranks=1, mode="switch")
            for i in (0, 1):
                ranks.append(Rank(ds[i], f"dlcp-sw{pid}-{i}", 1 << 20))
                ranks[-1].join(JOB, KEY, hosts, i, mode="switch")
            (job,) = [j for j in agg.status()["jobs"] if j["job"] == JOB]
            assert job["mode"] == "switch" and job["me"] == 2
            assert job["contributors"] == [0, 1] and job["owners"] == [2] * SWITCH_SHARDS
            # a join at the aggregator with another shape is a conflict
            with pytest.raises(DaemonError) as e:
                agg.join(job=JOB, key=KEY, hosts=hosts, me=2, mode="ps", aggregators=[2])
            assert e.value.code == "conflict"

            def counters() -> dict[str, int]:
                got: dict[str, int] = agg.status()["counters"]
                return got

            before = counters()
            rng = np.random.default_rng(6)
            xs = [rng.standard_normal(30_000).astype(np.float32) for _ in ranks]
            waits = [
                submit(r, job=JOB, round=0, bucket=0, lanes=x, shards=SWITCH_SHARDS)
                for r, x in zip(ranks, xs, strict=True)
            ]
            for w in waits:
                res = w()
                np.testing.assert_array_equal(res.sums, xs[0] + xs[1])
                assert (res.contributors == 2).all()
                assert res.reply["lost_lanes"] == 0
            after = counters()
            aggregated = after.get("shards_aggregated", 0) - before.get("shards_aggregated", 0)
            assert aggregated == SWITCH_SHARDS

            q = [rng.integers(0, 256, 16_384, dtype=np.uint8) for _ in ranks]
            waits = [
                submit(r, job=JOB, round=1, bucket=0, lanes=x, codec="thc8", shards=SWITCH_SHARDS)
                for r, x in zip(ranks, q, strict=True)
            ]
            for w in waits:
                res = w()
                np.testing.assert_array_equal(res.sums, q[0].astype(np.uint16) + q[1])
            final = counters()
            aggregated = final.get("shards_aggregated", 0) - after.get("shards_aggregated", 0)
            assert aggregated == SWITCH_SHARDS
            assert final.get("data_packets_sent", 0) == 0  # the aggregator contributes nothing
            assert final.get("result_packets_sent", 0) > 0
            for r in ranks:  # the contributors aggregate nothing
                assert r.client.status()["counters"].get("shards_aggregated", 0) == 0
        finally:
            for r in ranks:
                r.close()
            agg.close()
