"""One-leg rounds of the sans-IO engine: reduce-scatter (the DATA leg only)
and all-gather (the RESULT leg only), against the full all-reduce."""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable

import numpy as np
import pytest

from dlcp.core.engine import Engine, JobSpec, RoundComplete, RoundFailed, Send
from dlcp.core.layout import Layout
from dlcp.errors import LocalError
from dlcp.wire import Codec, Flags, Header, PacketType, decode
from tests.netsim import Network

KEY = b"k" * 32
JOB = 7


def cluster(hosts: int, gather: bool = False) -> dict[int, Engine]:
    """`gather`: datagrams read the callers' buffers in place (the daemon's way)."""
    engines = {}
    for me in range(hosts):
        e = Engine(gather=gather)
        mac = "ghash-aes" if gather else "blake2b"
        e.add_job(JobSpec.transpose(JOB, KEY, me, hosts, mac=mac))
        engines[me] = e
    return engines


class ReusingNetwork(Network):
    """A network whose nodes reuse their `out` buffers (NaNs) as soon as
    their round completes, as a rank does once its submit is answered."""

    outs: dict[int, np.ndarray]
    got: dict[int, np.ndarray]  # each node's sums as its round completed
    results_by_then: dict[int, int]  # result packets it had made by then

    def flush(self, src: int) -> None:
        before = len(self.events[src])
        super().flush(src)
        for ev in self.events[src][before:]:
            if isinstance(ev, RoundComplete):
                self.got[src] = np.array(ev.sums, copy=True)
                self.results_by_then[src] = self.engines[src].stats["result_packets_sent"]
                if src in self.outs:
                    self.outs[src][:] = np.nan


def run(
    xs: list[np.ndarray],
    kind: str,
    *,
    seed: int = 0,
    drop: Callable[[int, Send, Header], bool] | None = None,
    late: dict[int, float] | None = None,
    gather: bool = False,
) -> tuple[Network, dict[int, RoundComplete], Counter[str]]:
    """Every node submits its row of `xs` as a round of `kind` (node n at
    `late[n]` seconds, else at once); the completions and the packets sent by type."""
    sent: Counter[str] = Counter()

    def count(src: int, s: Send) -> bool:
        h, _ = decode(bytes(s.datagram), {JOB: net.engines[src].keys[JOB]})
        leg = "result_leg" if h.flags & Flags.RESULT_LEG else ""
        sent[f"{PacketType(h.type).name} {leg}".strip()] += 1
        return drop is not None and drop(src, s, h)

    net = ReusingNetwork(cluster(len(xs), gather), seed=seed, drop=count)
    net.outs = {me: np.zeros(x.size, np.float32) for me, x in enumerate(xs)} if gather else {}
    net.got, net.results_by_then = {}, {}
    late = late or {}

    def submit(me: int) -> None:
        x = xs[me]
        net.engines[me].submit(
            job=JOB,
            round=0,
            bucket=0,
            codec=Codec.FP32,
            total=x.size,
            lanes=x.astype("<f4").tobytes(),
            now=net.now,
            kind=kind,
            out=net.outs.get(me),
        )
        net.flush(me)

    for me in range(len(xs)):
        if me not in late:
            submit(me)
    for me, at in sorted(late.items(), key=lambda kv: kv[1]):
        net.run(until=at)
        net.now = max(net.now, at)
        submit(me)
    net.run()
    done: dict[int, RoundComplete] = {}
    for n, evs in net.events.items():
        for ev in evs:
            assert not isinstance(ev, RoundFailed), ev
            done[n] = dataclasses.replace(ev, sums=net.got[n])
    return net, done, sent


def shard_of(lay: Layout, s: int) -> slice:
    off, count = lay.shard_range(s)
    return slice(off, off + count)


def rows(hosts: int, n: int, seed: int = 1) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(n).astype(np.float32) for _ in range(hosts)]


@pytest.mark.parametrize("hosts", [2, 3, 4])
def test_reduce_scatter_gives_each_owner_its_shards_sum(hosts: int) -> None:
    xs = rows(hosts, 352 * 7 * hosts)
    _, done, sent = run(xs, "reduce_scatter")
    assert sorted(done) == list(range(hosts))
    lay = done[0].layout
    expected = np.sum(np.stack(xs), axis=0)
    for me, ev in done.items():
        part = shard_of(lay, me)
        np.testing.assert_array_equal(ev.sums[part], expected[part])
        # its shard's lanes of every sender, none lost (the others' sums are not here)
        assert (ev.lost_lanes, ev.total_lanes) == (0, (part.stop - part.start) * hosts)
    assert sent["RESULT"] == 0  # no RESULT leg
    assert sent["DATA"] == lay.packets * (hosts - 1)


@pytest.mark.parametrize("hosts", [2, 3, 4])
def test_all_gather_gives_everyone_each_owners_shard_bit_for_bit(hosts: int) -> None:
    xs = rows(hosts, 352 * 5 * hosts + 17)
    lay = Layout(total=xs[0].size, codec=Codec.FP32, shards=hosts)
    for me, x in enumerate(xs):  # bits a sum with zeros would change
        x[shard_of(lay, me)][:3] = [-0.0, np.float32(1e-45), np.float32(-3.4e38)]
    _, done, sent = run(xs, "all_gather")
    assert sorted(done) == list(range(hosts))
    gathered = np.concatenate([xs[s][shard_of(lay, s)] for s in range(hosts)])
    for ev in done.values():
        assert ev.sums.view(np.uint32).tobytes() == gathered.view(np.uint32).tobytes()
    assert sent["DATA"] == 0  # no DATA leg
    assert sent["RESULT"] == lay.packets * (hosts - 1)


def test_one_leg_rounds_move_half_an_all_reduces_bytes() -> None:
    xs = rows(3, 352 * 30)
    legs = {kind: run(xs, kind)[2] for kind in ("allreduce", "reduce_scatter", "all_gather")}

    def lanes(c: Counter[str]) -> int:
        return c["DATA"] + c["RESULT"]

    full = lanes(legs["allreduce"])
    assert lanes(legs["reduce_scatter"]) * 2 == full
    assert lanes(legs["all_gather"]) * 2 == full


def test_reduce_scatter_retransmits_lost_data_and_lost_dones() -> None:
    xs = rows(3, 352 * 12)
    lost: Counter[str] = Counter()

    def drop(src: int, s: Send, hd: Header) -> bool:
        kind = PacketType(hd.type).name
        first = not hd.flags & Flags.RETRANSMIT
        # every first copy of one data packet and both DONEs of node 0's shard to node 1
        if kind == "DATA" and first and hd.offset == 352 * 5 and lost["data"] < 2:
            lost["data"] += 1
            return True
        done_to_1 = kind == "DONE" and hd.flags & Flags.RESULT_LEG and (src, s.node) == (0, 1)
        if done_to_1 and lost["done"] < 2:
            lost["done"] += 1
            return True
        return False

    _, done, sent = run(xs, "reduce_scatter", drop=drop)
    assert lost == {"data": 2, "done": 2}
    assert sorted(done) == [0, 1, 2]
    lay = done[0].layout
    expected = np.sum(np.stack(xs), axis=0)
    for me, ev in done.items():
        part = shard_of(lay, me)
        np.testing.assert_array_equal(ev.sums[part], expected[part])
    assert sent["RESULT"] == 0


@pytest.mark.parametrize("gather", [False, True])
def test_all_gather_waits_for_a_late_receiver_and_survives_loss(gather: bool) -> None:
    if gather and not _gathered_supported():
        pytest.skip("dlcp.wire._ghash (the C MAC) is not built")
    xs = rows(3, 352 * 9)
    dropped = Counter[str]()

    def drop(src: int, s: Send, hd: Header) -> bool:
        # node 2's "ready" manifests to node 0 are lost: node 0 learns it is
        # there from its NACK; and one result packet's first copy is lost
        t = PacketType(hd.type).name
        if t == "DONE" and src == 2 and s.node == 0 and not hd.flags & Flags.RESULT_LEG:
            dropped["ready"] += 1
            return True
        if t == "RESULT" and src == 1 and not dropped["result"]:
            dropped["result"] += 1
            return True
        return False

    net, done, sent = run(xs, "all_gather", drop=drop, late={2: 0.2}, gather=gather)
    assert dropped["ready"] == 2 and dropped["result"] == 1
    assert sorted(done) == [0, 1, 2]
    lay = done[0].layout
    gathered = np.concatenate([xs[s][shard_of(lay, s)] for s in range(3)])
    for ev in done.values():
        np.testing.assert_array_equal(ev.sums, gathered)
    # nothing was sent to node 2 before it submitted (at 0.2 s): no result
    # of node 0's or 1's shard was lost on a round not open there
    assert net.engines[2].stats["late_packets"] == 0
    assert sent["DATA"] == 0


def test_one_leg_rounds_need_a_transpose_job() -> None:
    e = Engine()
    e.add_job(JobSpec.switch(JOB, KEY, 0, 3))
    with pytest.raises(LocalError, match="transpose"):
        e.submit(
            job=JOB,
            round=0,
            bucket=0,
            codec=Codec.FP32,
            total=10,
            lanes=np.zeros(10, "<f4").tobytes(),
            now=0.0,
            kind="reduce_scatter",
        )
    with pytest.raises(LocalError, match="round kind"):
        e.submit(
            job=JOB,
            round=0,
            bucket=0,
            codec=Codec.FP32,
            total=10,
            lanes=np.zeros(10, "<f4").tobytes(),
            now=0.0,
            kind="broadcast",
        )


@pytest.mark.parametrize("gather", [False, True])
def test_an_all_gather_shard_sent_to_no_one_survives_its_owners_reuse_of_out(
    gather: bool,
) -> None:
    """Node 1 submits late and its "ready" manifests are lost: node 0's shard
    has gone to no one when node 0 completes (node 1's shard came) and reuses
    its `out`; node 1's NACK then gets node 0's shard as it was."""
    if gather and not _gathered_supported():
        pytest.skip("dlcp.wire._ghash (the C MAC) is not built")
    xs = rows(2, 352 * 6)

    def drop(src: int, s: Send, hd: Header) -> bool:
        return src == 1 and hd.type == PacketType.DONE and not hd.flags & Flags.RESULT_LEG

    net, done, _ = run(xs, "all_gather", drop=drop, late={1: 0.2}, gather=gather)
    assert sorted(done) == [0, 1]
    lay = done[0].layout
    gathered = np.concatenate([xs[s][shard_of(lay, s)] for s in range(2)])
    for ev in done.values():
        np.testing.assert_array_equal(ev.sums, gathered)
    assert net.results_by_then[0] == 0  # node 0 completed with its shard sent to no one
    assert net.engines[0].stats["result_packets_sent"] == lay.shard_result_count(0)


def _gathered_supported() -> bool:
    from dlcp.wire import mac

    return mac._ghash is not None


def test_the_daemon_refuses_one_leg_rounds_it_cannot_run() -> None:
    """A submit's kind: one leg needs one local rank and a transpose job; an
    all-gather is exact (bound 0); an unknown kind is refused."""
    from types import SimpleNamespace

    from dlcp.daemon.requests import RequestError
    from dlcp.daemon.shimservice import ShimService

    def job(local: int = 1, spec: JobSpec | None = None) -> object:
        return SimpleNamespace(local_ranks=local, spec=spec or JobSpec.transpose(JOB, KEY, 0, 3))

    kind = ShimService._round_kind
    assert kind({}, job(), 0.0) == "allreduce"
    assert kind({"kind": "reduce_scatter"}, job(), 0.01) == "reduce_scatter"
    assert kind({"kind": "all_gather"}, job(), 0.0) == "all_gather"
    for req, j, bound in (
        ({"kind": "broadcast"}, job(), 0.0),
        ({"kind": "reduce_scatter"}, job(local=2), 0.0),
        ({"kind": "all_gather"}, job(spec=JobSpec.switch(JOB, KEY, 0, 3)), 0.0),
        ({"kind": "all_gather"}, job(), 0.01),
    ):
        with pytest.raises(RequestError) as err:
            kind(req, j, bound)
        assert err.value.code == "bad_request"
