"""Policies and tc on the wire: real daemons in network namespaces (root only).

What the tests show:
- the DSCP of every dlcp packet a host sends is the one its priority and drop
  policies give that packet for the layers and norms the rank submitted
  (captured with a packet socket on the switch ports): gradient packets in
  classes 1..5, droppable ones in class 7, control packets in class 0, with
  the configured class -> DSCP table;
- on a congested HTB-limited switch port with background traffic, the switch
  drops only droppable (class 7) and background (class 6) packets, never a
  gradient or control class (tc class counters);
- `spray` puts traffic on both paths, `flow` on one, and `adaptive` charges
  NACKed losses to the path that lost them: a path with 10 % random loss
  (within rate.loss_tolerance) keeps its goodput share, and when its loss
  rises to 50 % the traffic moves off it within a few rounds.

No test asserts a speed; bench/diag/multipath.py measures the throughput ratios.
The clients speak the shim protocol from the root namespace (Unix sockets
and /dev/shm are shared across network namespaces).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import socket
import struct
import tempfile
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dlcp.core.layout import Layout
from dlcp.policies import (
    CONTROL_CLASS,
    DEFAULT_DSCP,
    DROPPABLE_CLASS,
    apply_droppable,
    from_config,
)
from dlcp.shim.client import DaemonClient, Segment
from dlcp.testbed import Testbed, TestbedSpec
from dlcp.wire import Flags, Header, PacketType, decode
from dlcp.wire.header import Codec
from tests.daemons import submit, wire_key

pytestmark = pytest.mark.netns

KEY = os.urandom(32)
PER_PACKET = 352  # fp32 lanes in a 1408-byte payload
ETH_P_ALL = 0x0003
ETH_P_IP = 0x0800
PACKET_OUTGOING = 4
SO_RCVBUFFORCE = getattr(socket, "SO_RCVBUFFORCE", 33)
RETRANSMIT_CLASS = 1  # dlcp.core.engine: retransmitted data travels in the top gradient class
LOWEST_RELIABLE_CLASS = 5  # result packets are never in a class below this
# A class -> DSCP table unlike the default, so the test sees the configured one.
TABLE = (46, 38, 30, 22, 14, 6, 0, 1)

_jobs = itertools.count(300)


# --------------------------------------------------------------------------- helpers


@contextlib.contextmanager
def make_testbed(name: str, **spec: Any) -> Iterator[Testbed]:
    """A testbed with its own name and state directory, removed in any case."""
    root = Path(tempfile.mkdtemp(prefix="dlcp-pol-", dir="/tmp"))
    tb = None
    try:
        tb = Testbed.up(TestbedSpec(name=name, **spec), state_root=root)
        yield tb
    finally:
        try:
            if tb is not None:
                tb.down()
        finally:
            shutil.rmtree(root, ignore_errors=True)


class Rank:
    """One rank in the root namespace talking to a host's daemon."""

    def __init__(self, tb: Testbed, host: int, job: int) -> None:
        self.client = DaemonClient(str(tb.hosts[host].socket))
        self.info = self.client.hello()
        self.seg = Segment(f"dlcp-pol{os.getpid()}-{job}-{host}", 16 << 20)
        self.client.segment(self.seg)
        hosts = [{"addresses": list(h.addresses), "udp_port": h.udp_port} for h in tb.hosts]
        self.client.join(job=job, key=KEY, hosts=hosts, me=host, local_ranks=1)

    def status(self) -> dict[str, Any]:
        return self.client.status()

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.client.close()
        self.seg.close()


@contextlib.contextmanager
def ranks(tb: Testbed, job: int) -> Iterator[list[Rank]]:
    made: list[Rank] = []
    try:
        for i in range(len(tb.hosts)):
            made.append(Rank(tb, i, job))
        yield made
    finally:
        for r in made:
            r.close()


def bucket_meta(packets: int, n_layers: int, seed: int) -> tuple[np.ndarray, list[np.ndarray]]:
    """Layers (shared) and per-host norms for a bucket of `packets` packets."""
    rng = np.random.default_rng(seed)
    layers = (np.arange(packets) * n_layers // packets).astype(np.uint16)
    norms = [rng.uniform(0.01, 10.0, packets).astype(np.float32) for _ in range(2)]
    return layers, norms


def allreduce(
    rs: Sequence[Rank],
    *,
    job: int,
    rnd: int,
    total: int,
    bound: float = 0.0,
    layers: np.ndarray | None = None,
    norms: Sequence[np.ndarray] | None = None,
    seed: int = 0,
) -> list[Any]:
    """One bucket on every rank; returns the results (replicas checked equal)."""
    rng = np.random.default_rng(seed)
    xs = [rng.standard_normal(total).astype(np.float32) for _ in rs]
    waits = [
        submit(
            r,  # type: ignore[arg-type]
            job=job,
            round=rnd,
            bucket=0,
            lanes=x,
            shards=len(rs),
            bound=bound,
            layers=layers,
            norms=None if norms is None else norms[i],
            timeout=120,
        )
        for i, (r, x) in enumerate(zip(rs, xs, strict=True))
    ]
    results = [w() for w in waits]
    for res in results:
        assert res.sums.tobytes() == results[0].sums.tobytes(), "replicas differ"
        assert res.reply["lost_lanes"] <= bound * res.reply["total_lanes"]
    if bound == 0.0:
        np.testing.assert_array_equal(results[0].sums, np.sum(xs, axis=0, dtype=np.float32))
    return results


def expected_classes(
    layers: np.ndarray,
    norms: np.ndarray,
    layout: Layout,
    bound: float,
    dscp: Sequence[int] = DEFAULT_DSCP,
) -> np.ndarray:
    """The class of each packet of one sender's bucket, by the same policy objects
    and the same steps as the daemon (priority over the bucket, drop per shard)."""
    priority = from_config("priority", {"name": "layer_magnitude", "dscp": list(dscp)})
    drop = from_config("drop", {"name": "smallest_norm"})
    counts = layout.packet_counts()
    lay = layers.astype(np.int64)
    nrm = norms.astype(np.float64)
    classes = priority.classify(layers=lay, n_layers=int(lay.max()) + 1, norms=nrm, counts=counts)
    droppable = np.zeros(layout.packets, dtype=bool)
    for s in range(layout.shards):
        r = layout.shard_packets(s)
        droppable[r.start : r.stop] = drop.droppable(
            norms=nrm[r.start : r.stop], counts=counts[r.start : r.stop], bound=bound
        )
    return apply_droppable(classes, droppable)


@dataclass(frozen=True)
class Captured:
    port: str
    dscp: int
    header: Header


class Capture:
    """Frames arriving at switch ports (from their hosts), via packet sockets
    opened inside the switch namespace; read once the traffic is over."""

    def __init__(self, tb: Testbed, ports: Sequence[str], job: int) -> None:
        from pyroute2 import netns as pr_netns

        self.job = job
        self.socks: list[tuple[str, socket.socket]] = []
        try:
            for port in ports:
                s = pr_netns.create_socket(
                    tb.switch_netns,
                    socket.AF_PACKET,
                    socket.SOCK_RAW,
                    socket.htons(ETH_P_ALL),
                    flags=0,
                )
                self.socks.append((port, s))
                s.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, 64 << 20)
                s.bind((port, ETH_P_ALL))
        except BaseException:
            self.close()
            raise
        self.frames = 0
        self.other = 0

    def read(self) -> list[Captured]:
        out: list[Captured] = []
        keys = {self.job: wire_key(KEY)}
        for port, s in self.socks:
            s.setblocking(False)
            while True:
                try:
                    data, addr = s.recvfrom(1 << 16)
                except BlockingIOError:
                    break
                if addr[2] == PACKET_OUTGOING or data[12:14] != struct.pack("!H", ETH_P_IP):
                    continue
                self.frames += 1
                ip = data[14:]
                ihl = (ip[0] & 0x0F) * 4
                if ip[9] != socket.IPPROTO_UDP:
                    self.other += 1
                    continue
                (ip_len,) = struct.unpack_from("!H", ip, 2)
                payload = ip[ihl + 8 : ip_len]
                try:
                    h, _ = decode(payload, keys)
                except Exception:
                    self.other += 1
                    continue
                out.append(Captured(port, ip[1] >> 2, h))
        return out

    def close(self) -> None:
        for _, s in self.socks:
            s.close()


def class_stats(tb: Testbed, host: int, path: int = 0) -> dict[int, Any]:
    return {s.cls: s for s in tb.tc_stats(host, path)}


def delta(after: dict[int, Any], before: dict[int, Any], field: str) -> dict[int, int]:
    return {c: getattr(after[c], field) - getattr(before[c], field) for c in after}


# --------------------------------------------------------------------------- 1: DSCP


def test_dscp_on_the_wire_follows_layer_and_magnitude() -> None:
    bound = 0.1
    shards = 2
    packets = 2 * 120
    total = packets * PER_PACKET
    layout = Layout(total, Codec.FP32, shards)
    layers, norms = bucket_meta(packets, n_layers=12, seed=1)
    expect = [expected_classes(layers, n, layout, bound, TABLE) for n in norms]
    # what crosses the wire: each host's data for the other host's shard
    want_sent = {(s, i) for s in range(2) for i in layout.shard_packets(1 - s)}
    want_classes = {int(expect[s][i]) for s, i in want_sent}
    # the chosen inputs exercise every gradient class and the droppable class
    assert want_classes == {1, 2, 3, 4, 5, DROPPABLE_CLASS}

    job = next(_jobs)
    policies = {
        "priority": {"name": "layer_magnitude"},
        "drop": {"name": "smallest_norm"},
        "dscp": list(TABLE),
    }
    rounds: list[tuple[list[Captured], Capture]] = []
    # MTU frames on the wire: unshaped, the host veths would segment by default
    # and 64 KB super-packets would cross the switch whole
    with make_testbed("pol-dscp", hosts=2, segmentation=False) as tb:
        ports = [h.switch_ports[0] for h in tb.hosts]
        tb.start_daemons(
            {"policies": policies, "timing": {"timeout": 30.0}, "daemon": {"metrics_port": 0}}
        )
        with ranks(tb, job) as rs:
            # round 0 without loss; round 1 with 10 % loss on what host 0 sends,
            # so that NACKs and retransmissions show up too
            for rnd, loss in enumerate((0.0, 10.0)):
                tb.set_loss(0, loss)
                cap = Capture(tb, ports, job)
                try:
                    allreduce(rs, job=job, rnd=rnd, total=total, bound=bound, layers=layers,
                              norms=norms, seed=rnd)  # fmt: skip
                    time.sleep(0.3)  # trailing ACKs and repeated DONEs
                    rounds.append((cap.read(), cap))
                finally:
                    cap.close()

    types: Counter[PacketType] = Counter()
    for seen, cap in rounds:
        assert seen, f"nothing captured ({cap.frames} IPv4 frames, {cap.other} not dlcp)"
        assert cap.other == 0, "only dlcp traffic crosses the switch"
        types.update(c.header.type for c in seen)
        check_round(seen, ports, expect, want_sent, layout)
    # every kind of packet was seen and checked
    assert types[PacketType.DATA] and types[PacketType.RESULT]
    assert types[PacketType.DONE] and types[PacketType.ACK] and types[PacketType.NACK]


def check_round(
    seen: list[Captured],
    ports: list[str],
    expect: list[np.ndarray],
    want_sent: set[tuple[int, int]],
    layout: Layout,
) -> None:
    first_sent: Counter[tuple[int, int]] = Counter()
    retransmitted: set[tuple[int, int]] = set()
    for c in seen:
        h = c.header
        # the wire's DSCP is the table entry of the class in the dlcp header, but a
        # DONE trails its shard's packets in their class (never the droppable one),
        # so that no queue lets it overtake them
        if h.type == PacketType.DONE:
            assert c.dscp in {TABLE[k] for k in range(DROPPABLE_CLASS - 1)}, (h, c.dscp)
        else:
            assert c.dscp == TABLE[h.priority], (h, c.dscp)
        # a host's packets enter the switch on that host's port
        assert c.port == ports[h.sender]
        if h.type == PacketType.DATA:
            i = h.offset // layout.per_packet
            if h.flags & Flags.RETRANSMIT:
                retransmitted.add((h.sender, i))
                assert h.priority == min(int(expect[h.sender][i]), RETRANSMIT_CLASS)
                assert not h.flags & Flags.DROPPABLE
            else:
                first_sent[(h.sender, i)] += 1
                want = int(expect[h.sender][i])
                assert h.priority == want, (h.sender, i, h.priority, want)
                assert bool(h.flags & Flags.DROPPABLE) == (want == DROPPABLE_CLASS)
        elif h.type != PacketType.RESULT:  # NACK, DONE, ACK: control
            assert h.priority == CONTROL_CLASS, h
            if h.type != PacketType.DONE:
                assert c.dscp == TABLE[CONTROL_CLASS]
    # every data packet of the other host's shard went out once, in its class
    assert set(first_sent) == want_sent
    assert max(first_sent.values()) == 1
    # results: the most important class any contribution of the packet had, at
    # most 5; retransmitted ones, as data's, in RETRANSMIT_CLASS
    for c in seen:
        h = c.header
        if h.type != PacketType.RESULT:
            continue
        i = h.offset // layout.per_packet
        want = min(int(expect[0][i]), int(expect[1][i]), LOWEST_RELIABLE_CLASS)
        if any((s, i) in retransmitted for s in range(2)) or h.flags & Flags.RETRANSMIT:
            want = min(want, RETRANSMIT_CLASS)
        assert h.priority == want, (i, h.priority, want)


# --------------------------------------------------------------------------- 2: congestion


def test_congested_port_drops_only_droppable_and_background() -> None:
    """Two hosts on 20 Mbit/s switch ports with unmarked UDP background at
    150 % of the link toward each host: the port is overloaded all along, and
    dlcp's buckets arrive in bursts far above the link rate. The switch's
    strict priority must drop in the background class (6) and the short
    droppable queue (7) only; no gradient or control class loses a packet."""
    rate = 20_000_000
    bound = 0.1
    packets = 2 * 300
    total = packets * PER_PACKET
    layout = Layout(total, Codec.FP32, 2)
    layers, norms = bucket_meta(packets, n_layers=12, seed=2)
    expect = [expected_classes(layers, n, layout, bound) for n in norms]
    droppable_per_shard = [
        int((expect[s][layout.shard_packets(1 - s)] == DROPPABLE_CLASS).sum()) for s in range(2)
    ]
    # more droppable packets per burst than the droppable queue holds (16)
    assert min(droppable_per_shard) > 16

    job = next(_jobs)
    with make_testbed("pol-cong", hosts=2, rate_bps=rate) as tb:
        tb.start_daemons({"timing": {"timeout": 60.0}, "daemon": {"metrics_port": 0}})
        tb.start_background("udp", udp_rate_bps=rate * 3 // 2)
        with ranks(tb, job) as rs:
            # background alone already overflows its class
            before = [class_stats(tb, h) for h in range(2)]
            deadline = time.monotonic() + 30.0
            while sum(class_stats(tb, h)[6].drops for h in range(2)) == 0:
                assert time.monotonic() < deadline, "background traffic never filled its queue"
                time.sleep(0.1)
            lost = 0
            for rnd in range(4):
                res = allreduce(rs, job=job, rnd=rnd, total=total, bound=bound, layers=layers,
                                norms=norms, seed=rnd)  # fmt: skip
                lost += res[0].reply["lost_lanes"]
            after = [class_stats(tb, h) for h in range(2)]
            status = [r.status() for r in rs]

    sent: Counter[int] = Counter()
    drops: Counter[int] = Counter()
    for b, a in zip(before, after, strict=True):
        sent.update(delta(a, b, "packets"))
        drops.update(delta(a, b, "drops"))
    # dlcp used every gradient class and the droppable one, and control packets
    for cls in (0, 1, 2, 3, 4, 5, DROPPABLE_CLASS):
        assert sent[cls] > 0, (cls, dict(sent))
    # the highest classes lost nothing; drops fell on droppable and background traffic
    assert all(drops[cls] == 0 for cls in range(6)), dict(drops)
    assert drops[6] > 0 and drops[DROPPABLE_CLASS] > 0, dict(drops)
    # droppable losses stayed within the bound (checked per round by allreduce)
    # and nothing non-droppable had to be recovered for a switch drop
    assert lost > 0
    for st in status:
        assert st["counters"].get("rounds_failed", 0) == 0


# --------------------------------------------------------------------------- 3: multipath


def path_sent(status: dict[str, Any]) -> list[int]:
    """Packets the daemon sent on each path (its only peer in a 2-host testbed)."""
    (peer,) = status["peers"]
    return [p["sent"] for p in peer["paths"]]


def dlcp_packets(tb: Testbed, path: int, *, control: bool = True) -> int:
    """Packets of dlcp's classes (all but best effort) through both hosts' ports
    on `path`; without class 0 (`control` False: path probes and their echoes
    go on every path, the one a flow does not use too)."""
    skip = {6} if control else {6, CONTROL_CLASS}
    return sum(
        s.packets for h in range(len(tb.hosts)) for s in tb.tc_stats(h, path) if s.cls not in skip
    )


def run_rounds(rs: list[Rank], job: int, rounds: range, total: int) -> None:
    for rnd in rounds:
        allreduce(rs, job=job, rnd=rnd, total=total, seed=rnd)


def test_spray_uses_both_paths_flow_one_adaptive_weighs_loss() -> None:
    """Two paths at 50 Mbit/s. Functional facts only (speeds: bench/diag/multipath.py):
    spray sends on both paths about equally, flow on exactly one; adaptive,
    with 10 % loss on one path, charges the NACKed losses to that path and
    gives it about its goodput share (random loss within rate.loss_tolerance);
    when that path's loss rises to 50 %, it gives it a small share."""
    total = 1 << 18  # 1 MB of fp32
    with make_testbed("pol-mp", hosts=2, paths=2, rate_bps=50_000_000) as tb:
        base = {"timing": {"timeout": 60.0}, "daemon": {"metrics_port": 0}}

        # spray: round robin per packet over both paths
        tb.start_daemons({**base, "policies": {"balance": "spray"}})
        job = next(_jobs)
        wire0 = [dlcp_packets(tb, p) for p in range(2)]
        with ranks(tb, job) as rs:
            run_rounds(rs, job, range(2), total)
            sent = [path_sent(r.status()) for r in rs]
        wire = [dlcp_packets(tb, p) - wire0[p] for p in range(2)]
        for s in sent:
            assert min(s) > 0 and min(s) >= 0.45 * sum(s), sent
        assert min(wire) >= 0.45 * sum(wire), wire

        # flow: every packet to a peer on one path (but the other path's probes)
        tb.start_daemons({**base, "policies": {"balance": "flow"}})
        job = next(_jobs)
        wire0 = [dlcp_packets(tb, p, control=False) for p in range(2)]
        with ranks(tb, job) as rs:
            run_rounds(rs, job, range(2), total)
            sent = [path_sent(r.status()) for r in rs]
        wire = [dlcp_packets(tb, p, control=False) - wire0[p] for p in range(2)]
        for s in sent:
            assert sorted(s)[0] == 0 and max(s) > 0, sent
        used = {s.index(max(s)) for s in sent}
        assert len(used) == 1, sent  # both directions hash to the same path here
        assert wire[1 - used.pop()] == 0, wire

        # adaptive: 10 % random loss on path 1 in both directions. Buckets small
        # enough that no switch queue overflows, and NACKs late enough that no
        # packet merely queued behind higher classes is NACKed: the only losses
        # are the random ones, and the NACKs must charge them to path 1.
        # Unpaced, so that the shares follow the loss alone: paced, they also
        # weigh each path's rate estimate, and on this 50 Mbit/s link those say
        # nothing (a lossy path's cut rate, far above the link, against the
        # clean path's slow-start rate; see BENCHMARKS.md "Multipath").
        # Without path probes: at 50 % loss each way three probes in a row
        # often go unanswered and the daemons take the path out of use for a
        # while, whatever the balancer (tests/test_pathdown_*.py); here the
        # balancer's own weighing of the NACKed losses is under test.
        tb.start_daemons(
            {
                "timing": {
                    "timeout": 60.0,
                    "nack_delay": 0.2,
                    "nack_interval": 0.3,
                    "reorder": 0.2,  # packets found lost by later ones, asked late too
                },
                "rate": {"pacing": False},
                "daemon": {"metrics_port": 0},
                "network": {"probe_interval_s": 0},
                "policies": {"balance": "adaptive"},
            }
        )
        for h in range(2):
            tb.set_loss(h, 10.0, path=1)
        job = next(_jobs)
        small = 1 << 17  # 512 KB: 186 data + 186 result packets per host and round
        with ranks(tb, job) as rs:
            run_rounds(rs, job, range(3), small)
            random_loss = [r.status() for r in rs]
            # the loss rises beyond rate.loss_tolerance: no longer random loss
            for h in range(2):
                tb.set_loss(h, 50.0, path=1)
            run_rounds(rs, job, range(3, 6), small)
            early = [path_sent(r.status()) for r in rs]
            run_rounds(rs, job, range(6, 9), small)
            status = [r.status() for r in rs]
    for st in random_loss:
        (peer,) = st["peers"]
        healthy, lossy = peer["paths"]
        # the NACKed losses were charged to the lossy path, none to the healthy one
        assert lossy["loss_rate"] > 0.02 and healthy["loss_rate"] == 0.0, peer["paths"]
        # random loss: the path keeps about its goodput share (1 - loss of a clean one's)
        assert 0.25 < lossy["weight"] < 0.5 < healthy["weight"], peer["paths"]
    for st, r, e in zip(status, random_loss, early, strict=True):
        (peer,) = st["peers"]
        healthy, lossy = peer["paths"]
        assert lossy["loss_rate"] > 0.15 and healthy["loss_rate"] == 0.0, peer["paths"]
        assert lossy["weight"] < 0.2 < 0.8 < healthy["weight"], peer["paths"]
        # the last rounds gave the lossy path a small share of the packets, far
        # smaller than under random loss
        late = [now - then for now, then in zip(path_sent(st), e, strict=True)]
        assert late[1] < 0.2 * sum(late), late
        before = path_sent(r)
        assert late[1] / sum(late) < 0.5 * before[1] / sum(before), (before, late)
