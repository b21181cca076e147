"""The receive path in C against its Python definition, on the same traffic.

Two identical clusters run the same rounds of every codec; each datagram
either sends goes to both, in the same batches. One cluster takes them with
every C pass of the receive path (`dlcp.wire._bulk`: header checks, runs,
lane stores and sums, marks, picks; a drain given as one `Datagrams` as
dlcpd's is), the other with `_bulk` turned off in every module that uses it
(what DLCP_NATIVE_BULK=0 runs). The traffic is the network's worst: lost
datagrams (so NACKs and retransmissions), duplicates, replays of earlier
rounds, forged and near-miss MACs, spoofed senders, packets outside the
layout, truncated datagrams, every sender's interleaved in one drain, and
drains that hold a shard's last packet and more after it (the shard closes
mid-drain). After every drain the rejects by reason, the counters, each
aggregator's arrays (the lanes of every packet received, bit for bit) and
each collector's marks must be equal; so must every datagram either
cluster sends and every round's sums.
"""

from __future__ import annotations

import contextlib
import re
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from dlcp.codecs import lanes as lanes_mod
from dlcp.codecs import lanes_native as lanes_native_mod
from dlcp.core import aggregate as aggregate_mod
from dlcp.core import collector as collector_mod
from dlcp.core import runs as runs_mod
from dlcp.core.engine import Engine, JobSpec, RoundComplete
from dlcp.errors import Reason
from dlcp.wire import Codec, Flags, PacketType
from dlcp.wire import batch as batch_mod
from dlcp.wire.header import compute_mac, encode, header_of_valid, lane_bytes
from dlcp.wire.mac import mac_state

try:
    from dlcp.daemon import _udp  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover
    _udp = None

KEY = b"d" * 32
JOB = 5
MAC = "ghash-aes"
_MODULES = (batch_mod, lanes_mod, lanes_native_mod, runs_mod, aggregate_mod, collector_mod)
NATIVE = batch_mod._bulk


@contextlib.contextmanager
def _python() -> Iterator[None]:
    """The receive path with every module's `_bulk` off (the definition)."""
    saved = [m._bulk for m in _MODULES]
    for m in _MODULES:
        m._bulk = None  # type: ignore[attr-defined]
    try:
        yield
    finally:
        for m, v in zip(_MODULES, saved, strict=True):
            m._bulk = v  # type: ignore[attr-defined]


def _cluster(hosts: int, switch: bool, payload: int) -> list[Engine]:
    out = []
    for me in range(hosts):
        e = Engine()
        make = JobSpec.switch if switch else JobSpec.transpose
        e.add_job(make(JOB, KEY, me, hosts, payload=payload, mac=MAC))
        out.append(e)
    return out


def _lanes(codec: Codec, total: int, summed: bool, rng: np.random.Generator) -> bytes:
    if summed:  # two local ranks' sums (THC only here)
        return rng.integers(0, 160, total, dtype="<u2").tobytes()
    if codec in (Codec.FP32, Codec.SKETCH):
        return rng.standard_normal(total).astype("<f4").tobytes()
    if codec == Codec.FP16:
        x = rng.standard_normal(total).astype("<f2")
        x[::97] = np.inf  # and a NaN sum or two
        return x.tobytes()
    raw = rng.integers(0, 256, lane_bytes(codec, total, False), dtype=np.uint8)
    if codec == Codec.THC8:
        raw %= 80  # three hosts' sums fit THC8_SUM10
    return raw.tobytes()


def _bad(dg: bytes, rng: np.random.Generator, me: int) -> list[bytes]:
    """Hostile variants of a valid datagram addressed to node `me`."""
    key = mac_state(KEY, MAC)
    h = header_of_valid(dg)
    payload = dg[64:]
    out = []
    flip = bytearray(dg)
    flip[int(rng.integers(64, len(dg))) if len(dg) > 64 else 63] ^= 0x10  # MAC fails
    out.append(bytes(flip))
    out.append(encode(h.with_(sender=me), payload, key))  # "from" the receiver
    out.append(dg[: int(rng.integers(0, 64))])  # truncated: in the header
    out.append(dg[: int(rng.integers(64, max(65, len(dg))))])  # ... or the payload
    near = bytearray(dg)
    near[63] ^= 1  # the tag's last bit
    out.append(bytes(near))
    if h.type in (PacketType.DATA, PacketType.RESULT) and h.count > 8:
        summed = h.type == PacketType.RESULT or bool(h.flags & Flags.SUMMED)
        cut = lane_bytes(h.codec, 8, summed)
        # authenticated, but not a packet of the layout: BAD_RANGE inside a run
        out.append(encode(h.with_(offset=h.offset + 8, count=h.count - 8), payload[cut:], key))
        # authenticated with a length its count does not have
        head = h.pack()
        out.append(b"".join((head, compute_mac(key, head, payload[:-1]), payload[:-1])))
    return [out[i] for i in rng.permutation(len(out)).tolist()]


def _as_drain(dgs: list[bytes], rng: np.random.Generator) -> object:
    """What dlcpd hands the engine: one `Datagrams` over the buffers (as its
    C receive makes), or a list where that is not built."""
    if NATIVE is None or _udp is None or rng.random() < 0.2:
        return list(dgs)
    return NATIVE.join([_udp.split_gro(d, 0)[0] for d in dgs])


def _state(e: Engine) -> dict[str, object]:
    """What the receive path changes, as comparable values."""
    aggs = {}
    for op, shard, a in e.rounds.aggregators():
        key = (op, shard)
        rows = []
        # two senders, this node's lanes held: C sums the other's packets with
        # them as they come (`_summing_row`: into `out`), Python stores them
        # and sums at the end; either's row is compared as those sums
        own = None
        if len(a.senders) == 2 and len(a.acc.held) == 1 and a.slots.dtype == np.float32:
            own = next(iter(a.acc.held.values()))
        for r in range(len(a.senders)):
            mask = np.repeat(a.received[r], a.counts)
            if r in a.acc.held:
                rows.append(None)
            elif r == a.acc.summed_row:
                assert a.out is not None
                rows.append(a.out[mask].tobytes())
            elif own is not None:
                rows.append(np.add(own, a.slots[r])[mask].tobytes())
            else:
                rows.append(a.slots[r][mask].tobytes())
        aggs[key] = (
            rows,
            a.received.tobytes(),
            a.block_max.tobytes(),
            a.droppable.tobytes(),
            a.classes.tobytes(),
            a.layers.tobytes(),
            a.weight.tolist(),
            a.n_received,
            a.duplicates,
            a.scale,
        )
    cols = {
        r.op: (
            {s: w.received.tobytes() for s, w in c.waiting.items()},
            c.contributors.tobytes(),
            c.block_max.tobytes(),
            c.duplicates,
        )
        for r, c in e.rounds.collectors()
    }
    return {
        "rejects": dict(e.rejects),
        "stats": dict(e.stats),
        "aggs": aggs,
        "cols": cols,
        "last_error": e.last_error,
    }


def _run(
    codec: Codec, hosts: int, seed: int, *, switch: bool = False, summed: bool = False
) -> Counter[Reason]:
    rng = np.random.default_rng(seed)
    payload = 1000 if codec != Codec.UNION else 200
    native, python = _cluster(hosts, switch, payload), _cluster(hosts, switch, payload)
    total = 12_288  # whole THC blocks
    contributors = range(hosts - 1) if switch else range(hosts)
    xs = {me: _lanes(codec, total, summed, rng) for me in contributors}
    scale = 1.0 if codec in (Codec.THC8, Codec.THC4, Codec.FFT8) else 0.0
    now = 0.0
    for rnd in range(2):
        for eng in (native, python):
            for me in contributors:
                eng[me].submit(
                    job=JOB, round=rnd, bucket=0, codec=codec, total=total, lanes=xs[me],
                    now=now, summed=summed, weight=2 if summed else 1, scale=scale,
                )  # fmt: skip
    seen: list[bytes] = []
    for _step in range(400):
        outs = []
        for eng, off in ((native, False), (python, True)):
            with _python() if off else contextlib.nullcontext():
                outs.append([(me, s.node, s.datagram) for me, e in enumerate(eng)
                             for s in e.datagrams_to_send()])  # fmt: skip
        assert outs[0] == outs[1]
        if not outs[0]:
            now += 0.05
            for eng, off in ((native, False), (python, True)):
                with _python() if off else contextlib.nullcontext():
                    for e in eng:
                        e.handle_timer(now)
            if all(not e.pending_rounds() for e in native + python):
                break
            continue
        by_dst: dict[int, list[tuple[int, bytes]]] = {}
        for src, dst, dg in outs[0]:
            by_dst.setdefault(dst, []).append((src, bytes(dg)))
        for dst, items in by_dst.items():
            stream: list[tuple[int, bytes]] = []
            # every sender's datagrams interleaved, each sender's mostly in order
            keys = np.arange(len(items)) + rng.integers(0, 40, len(items))
            for i in np.argsort(keys, kind="stable").tolist():
                src, dg = items[i]
                r = rng.random()
                if r < 0.03:
                    continue  # lost: a NACK asks for it again
                stream.append((src, dg))
                if r < 0.08:
                    stream.append((src, dg))  # a duplicate right behind
                elif r < 0.10 and seen:
                    stream.append((src, seen[int(rng.integers(len(seen)))]))  # a replay
                elif r < 0.13:
                    stream.extend((src, f) for f in _bad(dg, rng, dst))
                elif r < 0.14:
                    stream.append(((src + 1) % hosts, dg))  # from another's address
                if dg[3] in (PacketType.DATA, PacketType.RESULT) and rng.random() < 0.02:
                    seen.append(dg)
            cut = 0
            while cut < len(stream):
                part = stream[cut : cut + int(rng.integers(1, 300))]
                dgs = [d for _, d in part]
                srcs = np.array([s for s, _ in part], np.int64)
                got = native[dst].receive_many(_as_drain(dgs, rng), now, srcs)  # type: ignore[arg-type]
                with _python():
                    want = python[dst].receive_many(dgs, now, srcs)
                assert got.tolist() == want.tolist()
                assert _state(native[dst]) == _state(python[dst])
                cut += len(part)
            now += 0.001
    done = []
    for eng in (native, python):
        events = {}
        for me, e in enumerate(eng):
            while (ev := e.next_event()) is not None:
                assert isinstance(ev, RoundComplete), ev
                events[(me, ev.round)] = (
                    ev.sums.dtype.str,
                    ev.sums.tobytes(),
                    ev.contributors.tobytes(),
                    ev.block_max.tobytes(),
                )
        done.append(events)
    assert done[0] == done[1]
    assert sorted(done[0]) == [(m, r) for m in contributors for r in range(2)]
    bad: Counter[Reason] = Counter()
    for e in native:
        bad.update(e.rejects)
    return bad


CASES = [
    (Codec.FP32, 2, False, False),
    (Codec.FP16, 3, False, False),
    (Codec.THC8, 3, False, False),
    (Codec.THC4, 3, False, False),
    (Codec.FFT8, 2, False, False),
    (Codec.UNION, 3, False, False),
    (Codec.SKETCH, 3, False, False),
    (Codec.THC8, 3, False, True),
    (Codec.FP16, 4, True, False),
    (Codec.THC4, 3, True, False),
]


@pytest.mark.parametrize(("codec", "hosts", "switch", "summed"), CASES)
@pytest.mark.parametrize("seed", [1, 2])
def test_native_receive_is_the_python_receive(
    codec: Codec, hosts: int, switch: bool, summed: bool, seed: int
) -> None:
    if NATIVE is None:
        pytest.skip("dlcp.wire._bulk is not built")
    bad = _run(codec, hosts, seed * 100 + int(codec), switch=switch, summed=summed)
    # the traffic held what it is meant to: forged, spoofed, truncated, bad ranges
    for reason in (Reason.BAD_MAC, Reason.BAD_SENDER, Reason.TRUNCATED, Reason.BAD_RANGE):
        assert bad[reason] > 0, reason


def test_the_python_side_turns_off_every_c_pass_of_the_receive_path() -> None:
    """Every module of the core that reads `_bulk` is among those `_python`
    turns off (a module added later and missed would make the comparison C
    against C), and with them off the lane stores are Python's."""
    root = Path(lanes_mod.__file__).resolve().parents[1]
    readers = {
        ".".join(p.relative_to(root.parent).with_suffix("").parts)
        for p in root.rglob("*.py")
        if re.search(r"^from dlcp\.wire(\.batch)? import .*\b_bulk\b", p.read_text(), re.M)
    }
    # join or pick drains' datagrams; the engine is the same either way
    daemon_only = {"dlcp.daemon.netin", "dlcp.daemon.poll"}
    assert readers - daemon_only <= {m.__name__ for m in _MODULES}, readers
    with _python():
        assert lanes_native_mod.native_kind(np.zeros(4, np.float32), Codec.FP16, False) is None
        assert lanes_native_mod.to_halves(np.ones(9, np.float32)).dtype == np.dtype("<f2")
    if NATIVE is not None:
        assert lanes_native_mod.native_kind(np.zeros(4, np.float32), Codec.FP16, False)
