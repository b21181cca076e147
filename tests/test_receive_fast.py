"""The receive path's batched forms against frozen copies of the per-datagram
code they replaced (tests/receive_reference.py), datagram for datagram:

- `decode_batch` (header checks as one stack of masks, one job's MAC without
  per-packet indexing) on batches of real traffic with forged, truncated,
  extended, duplicated and foreign packets, for both MACs;
- `NetworkIn._receive` (per GRO buffer: the job ids as one strided view, the
  control packets from the type bytes) on buffers of one or several jobs,
  sources outside the job, truncated last segments and single datagrams:
  the same datagrams and nodes reach the engine, the same rejects are
  counted, the same NACKs and acknowledged bytes reach the outbox and rates;
- `Engine.receive_many`'s sources with and without unknown ones.
"""

from __future__ import annotations

import os
import struct
from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest

from dlcp.core import runs as runs_mod
from dlcp.core.engine import Engine, JobSpec, RoundComplete
from dlcp.core.runs import sources as _sources
from dlcp.daemon import netin, server, transport
from dlcp.daemon.netin import NetworkIn
from dlcp.daemon.transport import Split, UdpPath, split_gro
from dlcp.wire import Codec, Flags, PacketType
from dlcp.wire import batch as batch_mod
from dlcp.wire.batch import HEADER_DTYPE, decode_batch
from dlcp.wire.header import HEADER_SIZE, MAGIC, VERSION, Header
from dlcp.wire.mac import mac_state
from tests import receive_reference
from tests.receive_reference import reference_decode_batch, reference_receive

JOB_A, JOB_B, JOB_UNKNOWN = 11, 12, 13
SECRET = b"r" * 32


def _traffic(job: int, mac: str, seed: int, payload: int = 1000) -> list[bytes]:
    """Every datagram of two rounds between two engines, with some lost (so
    that NACKs, DONEs and ACKs are among them)."""
    rng = np.random.default_rng(seed)
    engines = []
    for me in range(2):
        e = Engine()
        e.add_job(JobSpec.transpose(job, SECRET, me, 2, payload=payload, mac=mac))
        engines.append(e)
    total = 5000
    seen: list[bytes] = []
    now = 0.0
    for rnd in range(2):
        for e in engines:
            lanes = rng.standard_normal(total).astype("<f4").view(np.uint8)
            e.submit(
                job=job, round=rnd, bucket=0, codec=Codec.FP32, total=total, lanes=lanes, now=now
            )
        done = 0
        for _ in range(400):
            moved = False
            for src, e in enumerate(engines):
                for s in e.datagrams_to_send():
                    seen.append(s.datagram)
                    moved = True
                    if rng.random() < 0.1:
                        continue  # lost
                    engines[s.node].receive(s.datagram, now, src)
            for e in engines:
                while (ev := e.next_event()) is not None:
                    assert isinstance(ev, RoundComplete), ev
                    done += 1
            if done == 2:
                break
            if not moved:
                now += 0.05
                for e in engines:
                    e.handle_timer(now)
        assert done == 2
    return seen


def _variants(dg: bytes, rng: np.random.Generator, mac: str) -> list[bytes]:
    """Bad and odd variants of a valid datagram."""
    out = [dg]
    buf = bytearray(dg)
    pos = int(rng.integers(0, len(dg)))
    buf[pos] ^= int(rng.integers(1, 256))
    out.append(bytes(buf))  # any one byte changed: a field check or the MAC
    head = bytearray(dg[:HEADER_SIZE])
    field = int(rng.integers(0, 8))  # one of the first header bytes: magic .. reserved
    head[field] = int(rng.integers(0, 256))
    out.append(bytes(head) + dg[HEADER_SIZE:])
    out.append(dg[: int(rng.integers(0, len(dg)))])  # truncated
    out.append(dg + bytes(int(rng.integers(1, 9))))  # extended
    # other counts, offsets, totals and contributors (BAD_RANGE, BAD_LENGTH)
    b = bytearray(dg)  # a non-finite param (BAD_RANGE)
    struct.pack_into("!I", b, 40, int(rng.choice([0x7F800001, 0xFFC00000, 0x7F800000])))
    out.append(bytes(b))
    for off, fmt in ((32, "!I"), (28, "!I"), (36, "!I"), (26, "!H")):
        b = bytearray(dg)
        struct.pack_into(fmt, b, off, int(rng.integers(0, 3)) * int(rng.integers(0, 1 << 12)))
        out.append(bytes(b))
    return out


def _foreign(dg: bytes, job: int) -> bytes:
    """`dg` claiming another job (its MAC then fails, or the job is unknown)."""
    b = bytearray(dg)
    struct.pack_into("!I", b, 8, job)
    return bytes(b)


def _assert_same(batch: list[bytes | memoryview], keys: dict[int, Any]) -> int:
    """decode_batch of a list (the C header gather where it is built) and of a
    tuple (the Python path) against the reference."""
    want = reference_decode_batch(batch, keys)
    for got in (decode_batch(batch, keys), decode_batch(tuple(batch), keys)):
        assert got.rejects == want.rejects
        assert got.index.tolist() == want.index.tolist()
        assert got.fields.dtype == want.fields.dtype
        assert got.fields.tobytes() == want.fields.tobytes()
        assert len(got.payloads) == len(want.payloads)
        assert [bytes(p) for p in got.payloads] == [bytes(p) for p in want.payloads]
        assert [bytes(got.payloads[i]) for i in range(len(got))] == [
            bytes(p) for p in want.payloads
        ]
        got.fields["aux"] = 1  # writable, as it was
    return len(want.payloads)


@pytest.mark.parametrize("mac", ["ghash-aes", "blake2b"])
def test_decode_batch_matches_the_reference(mac: str) -> None:
    rng = np.random.default_rng(5 if mac == "blake2b" else 6)
    a = _traffic(JOB_A, mac, 1)
    b = _traffic(JOB_B, mac, 2, payload=700)
    kinds = Counter(d[3] for d in a)
    assert {1, 2, 3, 4, 5} <= set(kinds), kinds  # data, result, NACK, DONE, ACK
    keys = {JOB_A: mac_state(SECRET, mac), JOB_B: mac_state(SECRET, mac)}
    wrong = {JOB_A: mac_state(b"w" * 32, mac), JOB_B: mac_state(SECRET, mac)}
    pool = [*a, *b]
    accepted = 0
    for trial in range(60):
        k = int(rng.integers(0, 120))
        picks = [pool[int(i)] for i in rng.integers(0, len(pool), k)]
        if trial % 3 == 0:  # all valid, one job: the fast path
            batch: list[bytes | memoryview] = [a[int(i)] for i in rng.integers(0, len(a), k)]
        else:
            batch = []
            for dg in picks:
                r = rng.random()
                if r < 0.5:
                    batch.append(dg)
                elif r < 0.6:
                    batch += [dg, dg]  # duplicate
                elif r < 0.7:
                    batch.append(_foreign(dg, JOB_UNKNOWN if rng.random() < 0.5 else JOB_B))
                else:
                    vs = _variants(dg, rng, mac)
                    batch.append(vs[int(rng.integers(0, len(vs)))])
        if trial % 2:
            batch = [memoryview(d) for d in batch]
        accepted += _assert_same(batch, keys)
        _assert_same(batch, wrong)
        _assert_same(batch, {})
    assert accepted > 1000


def test_decode_batch_matches_on_every_header_byte() -> None:
    dg = _traffic(JOB_A, "ghash-aes", 3)[0]
    keys = {JOB_A: mac_state(SECRET, "ghash-aes")}
    batch = [dg]
    for pos in range(HEADER_SIZE):
        for mask in (0x01, 0x10, 0x80, 0xFF):
            b = bytearray(dg)
            b[pos] ^= mask
            batch.append(bytes(b))
    batch += [dg[:n] for n in range(0, HEADER_SIZE + 8)]
    _assert_same(batch, keys)
    for i in range(0, len(batch), 7):  # and in small batches, some all good
        _assert_same(batch[i : i + 7], keys)


@pytest.mark.parametrize("mac", ["ghash-aes", "blake2b"])
def test_decode_batch_of_one_job_with_forged_payloads(mac: str) -> None:
    """Batches of one job whose every header passes its checks but some
    payloads were changed (only the MAC fails them): the C pass's batch-wide
    MAC check is reused for the rejects, as the reference finds them."""
    rng = np.random.default_rng(15)
    a = _traffic(JOB_A, mac, 3)
    keys = {JOB_A: mac_state(SECRET, mac)}
    for trial in range(30):
        batch: list[bytes | memoryview] = [a[int(i)] for i in rng.integers(0, len(a), 40)]
        for i in rng.integers(0, len(batch), 1 + trial % 4):
            b = bytearray(batch[i])
            b[int(rng.integers(HEADER_SIZE - 16, len(b)))] ^= 0x20  # the tag or the payload
            batch[i] = bytes(b)
        assert _assert_same(batch, keys) < len(batch)


def test_checked_heads_is_heads_and_field_checks() -> None:
    """`_bulk.checked_heads` (the drain's header gather and checks in one pass)
    gives `heads` and `field_checks` of the same datagrams, and the job only
    when every record passes and all name it."""
    if batch_mod._bulk is None:
        assert os.environ.get("DLCP_ALLOW_NO_NATIVE") == "1", "dlcp.wire._bulk was not built"
        pytest.skip("dlcp.wire._bulk is not built (DLCP_ALLOW_NO_NATIVE=1)")
    c = batch_mod._bulk
    rng = np.random.default_rng(19)
    a = _traffic(JOB_A, "ghash-aes", 4)
    b = _traffic(JOB_B, "ghash-aes", 5, payload=700)
    tables, args = batch_mod._CHECK_TABLES, batch_mod._CHECK_ARGS
    jobs_seen = set()
    for trial in range(300):
        r = trial % 4
        pool = a if r < 2 else [*a, *b]
        batch = [pool[int(i)] for i in rng.integers(0, len(pool), int(rng.integers(0, 60)))]
        if r in (1, 3) and batch:  # some changed, truncated or extended
            for i in rng.integers(0, len(batch), 1 + trial % 3):
                vs = _variants(batch[i], rng, "ghash-aes")
                batch[i] = vs[int(rng.integers(0, len(vs)))]
        heads, lengths = c.heads(batch, HEADER_SIZE)
        first = c.field_checks(heads, np.frombuffer(lengths, np.int64), tables, *args)
        got = c.checked_heads(batch, tables, *args)
        assert got[:2] == (heads, first)
        ids = {struct.unpack_from("!I", d, 8)[0] if len(d) >= 12 else -1 for d in batch}
        want = ids.pop() if first is None and len(ids) == 1 else -1
        assert got[2] == want
        jobs_seen.add(want)
    assert {-1, JOB_A} <= jobs_seen
    with pytest.raises(ValueError, match="tables"):
        c.checked_heads([bytes(64)], bytes(10), *args)
    with pytest.raises(TypeError, match="list, tuple or Datagrams"):
        c.checked_heads(5, tables, *args)
    assert c.checked_heads([], tables, *args) == (bytearray(), None, -1)


def test_field_checks_in_c_are_the_numpy_ones() -> None:
    """The C pass over the header records (`_bulk.field_checks`) gives the
    reasons of the numpy masks (`_py_field_reasons`) on every header: random
    bytes, valid headers with one to three fields changed (to edge values
    too), every length around the header and payload sizes."""
    if batch_mod._bulk is None:
        assert os.environ.get("DLCP_ALLOW_NO_NATIVE") == "1", "dlcp.wire._bulk was not built"
        pytest.skip("dlcp.wire._bulk is not built (DLCP_ALLOW_NO_NATIVE=1)")
    rng = np.random.default_rng(9)
    base = np.frombuffer(
        b"".join(d[:HEADER_SIZE] for d in _traffic(JOB_A, "ghash-aes", 4)), dtype=HEADER_DTYPE
    )
    real_lengths = np.array([len(d) for d in _traffic(JOB_A, "ghash-aes", 4)], dtype=np.int64)
    n = 20_000
    pick = rng.integers(0, base.size, n)
    heads = base[pick].copy()
    lengths = real_lengths[pick].copy()
    raw = heads.view(np.uint8).reshape(n, HEADER_SIZE)
    edges = np.array([0, 1, 2, 7, 8, 0x7F, 0x80, 0xFE, 0xFF], dtype=np.uint8)
    for k in range(n):
        r = k % 5
        if r == 0:
            raw[k] = rng.integers(0, 256, HEADER_SIZE, dtype=np.uint8)
        elif r < 4:  # one to three header bytes changed
            for pos in rng.integers(0, 48, r):
                raw[k, pos] = (
                    edges[rng.integers(0, edges.size)]
                    if rng.random() < 0.5
                    else (rng.integers(0, 256))
                )
        if rng.random() < 0.2:  # a length that may not fit
            lengths[k] = int(rng.choice([0, 1, 63, 64, 65, lengths[k] - 1, lengths[k] + 1, 9001]))
    full = lengths >= HEADER_SIZE
    heads[~full] = np.zeros(1, dtype=HEADER_DTYPE)  # as the gathers leave a short one
    want = batch_mod._py_field_reasons(heads, lengths, full)
    got = batch_mod._field_reasons(heads, lengths, full)
    assert want is not None and got is not None
    assert got.tolist() == want.tolist()
    assert len(set(want.tolist())) >= 10  # most reasons came up, and none
    for i in range(0, n, 997):  # batches that pass: None from both
        ok = np.flatnonzero(want == 0)[i : i + 50]
        assert batch_mod._field_reasons(heads[ok], lengths[ok], full[ok]) is None
        assert batch_mod._py_field_reasons(heads[ok], lengths[ok], full[ok]) is None
    c = batch_mod._bulk
    args = (MAGIC, VERSION, 0, 8, 7, 9000)
    with pytest.raises(ValueError, match="header bytes"):
        c.field_checks(bytes(65), np.zeros(1, np.int64), batch_mod._CHECK_TABLES, *args)
    with pytest.raises(ValueError, match="tables"):
        c.field_checks(bytes(64), np.zeros(1, np.int64), bytes(10), *args)
    with pytest.raises(TypeError, match="int64"):
        c.field_checks(bytes(64), np.zeros(1, np.int32), batch_mod._CHECK_TABLES, *args)
    assert c.field_checks(b"", np.zeros(0, np.int64), batch_mod._CHECK_TABLES, *args) is None


# --- NetworkIn._receive ----------------------------------------------------------


class _Rate:
    def __init__(self, log: list[Any], name: str) -> None:
        self.log, self.name = log, name

    def on_ack(self, nbytes: int, rtt: float | None, now: float) -> None:
        self.log.append(("ack", self.name, nbytes, rtt, now))


class _Peer:
    def __init__(self, log: list[Any], name: str) -> None:
        self.name = name
        self.rate = _Rate(log, name)
        self.rx_bytes = 0  # flow control: bytes taken from the sockets, credited
        self.rx_credited = 0
        self.health = None  # one path: not probed


class _Spec:
    job = 1
    owners = (0, 1, 2)
    payload = 1000
    ranks = 0


class _Job:
    def __init__(self, log: list[Any], name: str, node_of: dict[str, int]) -> None:
        self.spec = _Spec()
        self.node_of = node_of
        self.peers = {n: _Peer(log, f"{name}/{n}") for n in node_of.values() if n != 2}


class _Outbox:
    def __init__(self, log: list[Any]) -> None:
        self.log = log
        self.backlog: set[_Peer] = set()  # nothing to send: the full receive budget

    def on_loss(self, peer: _Peer, count: int, now: float) -> None:
        self.log.append(("loss", peer.name, count, now))

    def on_nack(self, peer: _Peer, h: Header, dg: memoryview, **kw: Any) -> None:
        self.log.append(("nack", peer.name, h, bytes(dg), sorted(kw.items())))


class _Engine:
    """Records what it is given; accepts a fixed pseudo-random choice of the
    well-formed datagrams (a function of their bytes, so both sides agree)."""

    def __init__(self, log: list[Any]) -> None:
        self.log = log

    def receive_many(
        self, dgs: list[memoryview], now: float, nodes: Sequence[int | None] | np.ndarray
    ) -> Any:
        # the source node of each (the daemon's array says -1 for the reference's None)
        srcs = [-1 if x is None else int(x) for x in nodes]
        self.log.append(("engine", [bytes(d) for d in dgs], srcs, now))
        ok = [
            i
            for i, d in enumerate(dgs)
            if len(d) >= HEADER_SIZE and d[3] in (1, 2, 3, 4, 5) and sum(bytes(d[-3:])) % 5
        ]
        return np.asarray(ok, dtype=np.int64)


class _Path:
    """Buffers as recvmsg returned them; `receive_split` splits them in Python
    (`transport.split_gro`) or, with `native`, in C (`_udp.split_gro`), and
    with `runs` joins each drain's runs as `_udp.recv_runs` does
    (`transport.merge_splits`)."""

    def __init__(
        self,
        buffers: list[tuple[bytes, int, str]],
        native: bool = False,
        runs: bool = False,
        poll: bool = False,
    ) -> None:
        self.buffers = buffers
        self.native = native
        self.runs = runs
        self.poll = poll  # drains as `_udp.recv_drain` makes them (dlcp.daemon.poll)
        self.recvmsg_calls = 0

    def receive_drain(self, chunk: int, max_bytes: int) -> Any:
        """`_udp.recv_drain`'s drain (`_udp.drain_buffers` of the buffers its
        budgets take), or None (taking nothing) unless `poll`."""
        if not self.poll:
            return None
        taken: list[tuple[bytes, int, str]] = []
        nbytes, more = 0, 0
        while True:
            got = self.receive_buffers(chunk)
            taken += got
            nbytes += sum(len(b[0]) for b in got)
            if len(got) < chunk:
                break
            if max_bytes <= 0 or nbytes >= max_bytes:
                more = 1
                break
        drain = transport._udp.drain_buffers(taken)
        return (*drain[:8], more, *drain[9:])

    def receive_buffers(self, budget: int = 64) -> list[tuple[bytes, int, str]]:
        out, self.buffers = self.buffers[:budget], self.buffers[budget:]
        self.recvmsg_calls += len(out)
        return out

    def receive_split(self, budget: int = 64) -> list[Split]:
        split = transport._udp.split_gro if self.native else split_gro
        out = [(*split(data, seg), src) for data, seg, src in self.receive_buffers(budget)]
        return transport.merge_splits(out) if self.runs else out

    def receive(self, budget: int = 64) -> Any:
        return UdpPath.receive(self, budget)  # type: ignore[arg-type]


def _daemon(log: list[Any]) -> Any:
    def credit(peer: _Peer, job: _Job) -> None:
        log.append(("credit", peer.name, peer.rx_bytes))
        peer.rx_credited = peer.rx_bytes

    return NetworkIn(
        engine=_Engine(log),  # type: ignore[arg-type]
        paths=[],
        jobs={
            JOB_A: _Job(log, "a", {"10.0.0.1": 0, "10.0.0.2": 1}),
            JOB_B: _Job(log, "b", {"10.0.0.2": 1, "10.0.0.3": 2}),  # node 2: no peer
        },  # type: ignore[dict-item]
        outbox=_Outbox(log),  # type: ignore[arg-type]
        prober=None,  # type: ignore[arg-type]
        counters=Counter(),
        daemon_rejects=Counter(),
        moderation_s=0.0,
        clock=lambda: 1.5,
        pump=lambda: None,
        credit=credit,  # type: ignore[arg-type]
        watch=lambda on: None,
    )


def _packet(rng: np.random.Generator, job: int, size: int) -> bytes:
    ptype = int(rng.choice([1, 1, 2, 2, 3, 4, 5, 0, 9]))
    h = Header(
        PacketType.DATA,
        job,
        int(rng.integers(0, 4)),
        0,
        flags=Flags.NONE,
        count=int(rng.integers(0, 50)),
        total=100,
        contributors=1,
    )
    head = bytearray(h.pack() + bytes(16))
    head[3] = ptype
    body = rng.integers(0, 256, max(0, size - HEADER_SIZE), dtype=np.uint8).tobytes()
    return (bytes(head) + body)[:size]


def _buffers(rng: np.random.Generator, n: int, repeat: float = 0.0) -> list[tuple[bytes, int, str]]:
    """`n` buffers of random shapes; each takes the source, segment size and
    job of the one before with probability `repeat` (runs to join)."""
    srcs = ["10.0.0.1", "10.0.0.2", "10.0.0.3", "10.9.9.9"]
    out = []
    for i in range(n):
        if i == 0 or rng.random() >= repeat:
            src = srcs[int(rng.integers(0, len(srcs)))]
            seg = int(rng.choice([5, 20, HEADER_SIZE, 100, 300, 1500, 1500]))
            mixed = rng.random() < 0.2
            job0 = int(rng.choice([JOB_A, JOB_B, JOB_UNKNOWN]))
        k = int(rng.integers(1, 9))
        dgs = []
        for i in range(k):
            job = int(rng.choice([JOB_A, JOB_B, JOB_UNKNOWN])) if mixed else job0
            size = seg if i < k - 1 else int(rng.choice([seg, seg, 1, 3, 11, HEADER_SIZE - 1, 70]))
            dgs.append(_packet(rng, job, min(size, seg)))
        data = b"".join(dgs)
        r = rng.random()
        # a GRO buffer, a single datagram (no segment size), or a segment size
        # that is the whole buffer
        gro = seg if k > 1 else (0 if r < 0.5 else len(data))
        if k == 1 and r < 0.5:
            gro = 0
        out.append((data, gro, src))
    return out


def _field_run_starts(f: np.ndarray, src: np.ndarray) -> list[int]:
    """Where runs start, field by field as `Engine.receive_many` first defined
    them (an independent statement of what the masks compare)."""
    starts = []
    for i in range(len(f)):
        a, b = f[i - 1], f[i]
        same = (
            i > 0
            and int(a["type"]) in (PacketType.DATA, PacketType.RESULT)
            and int(b["type"]) in (PacketType.DATA, PacketType.RESULT)
            and src[i] == src[i - 1]
            and all(a[k] == b[k] for k in runs_mod._RUN_FIELDS)
            and (int(a["flags"]) ^ int(b["flags"])) & runs_mod._RUN_FLAGS == 0
            and (
                int(b["type"]) != PacketType.DATA
                or (
                    a["contributors"] == b["contributors"]
                    and a["param"].tobytes() == b["param"].tobytes()
                )
            )
        )
        if not same:
            starts.append(i)
    return starts


@pytest.mark.parametrize("seed", range(4))
def test_run_starts_in_c_and_numpy_are_the_fields_compared(seed: int) -> None:
    """`run_starts` (C where built) and `py_run_starts` split a batch into runs
    where a field-by-field comparison does: real data and result headers with
    one byte changed here and there (each field, the flags bits in and out of
    _RUN_FLAGS), other types, changing sources, -0.0 beside 0.0."""
    rng = np.random.default_rng(seed)
    base = np.frombuffer(
        b"".join(d[:HEADER_SIZE] for d in _traffic(JOB_A, "ghash-aes", 4)), dtype=HEADER_DTYPE
    )
    n = 3000
    pick = np.sort(rng.integers(0, base.size, n))
    heads = base[pick].copy()
    raw = heads.view(np.uint8).reshape(n, HEADER_SIZE)
    for k in rng.integers(0, n, n // 10):  # a byte of the first 48 changed
        raw[k, rng.integers(0, 48)] ^= np.uint8(1 << int(rng.integers(0, 8)))
    heads["type"][rng.integers(0, n, n // 20)] = rng.choice([1, 2, 3, 4, 5], n // 20)
    heads["param"][rng.integers(0, n, n // 20)] = rng.choice([0.0, -0.0], n // 20)
    src = np.repeat(rng.integers(-1, 3, n // 100 + 1), 100)[:n].astype(np.int64)
    want = _field_run_starts(heads, src)
    assert 50 < len(want) < n  # runs, and breaks of many kinds
    assert runs_mod.py_run_starts(heads, src) == want
    assert runs_mod.run_starts(heads, src) == want
    assert runs_mod.run_starts(heads[:0], src[:0]) == []
    assert runs_mod.py_run_starts(heads[:1], src[:1]) == [0]
    if runs_mod._bulk is None:
        assert os.environ.get("DLCP_ALLOW_NO_NATIVE") == "1", "dlcp.wire._bulk was not built"
        return
    with pytest.raises(ValueError, match="header bytes"):
        runs_mod._bulk.run_starts(bytes(65), src[:1], bytes(64), bytes(64), bytes(256), 3, 1)
    with pytest.raises(ValueError, match="masks"):
        runs_mod._bulk.run_starts(bytes(64), src[:1], bytes(63), bytes(64), bytes(256), 3, 1)


@pytest.mark.parametrize("drain", [40, 1])
@pytest.mark.parametrize("runs", [False, True])
@pytest.mark.parametrize("native", [False, True])
@pytest.mark.parametrize("seed", range(8))
def test_daemon_receive_matches_the_reference(
    seed: int, native: bool, runs: bool, drain: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With runs of buffers joined (as dlcpd takes them from `_udp.recv_runs`)
    or not, the same as the per-datagram reference; in drains of 40 buffers
    (groups of several peers and jobs) or of one (mostly one group: the
    usual drain's shortcuts)."""
    if native and transport._udp is None:
        assert os.environ.get("DLCP_ALLOW_NO_NATIVE") == "1", "dlcp.daemon._udp was not built"
        pytest.skip("dlcp.daemon._udp is not built (DLCP_ALLOW_NO_NATIVE=1)")
    for module in (netin, receive_reference):  # credits within this little traffic
        monkeypatch.setattr(module, "CREDIT_STEP", 4096)
    rng = np.random.default_rng(seed)
    buffers = _buffers(rng, 300, 0.7 if runs else 0.0)
    logs: list[list[Any]] = [[], []]
    daemons = [_daemon(logs[0]), _daemon(logs[1])]
    joined = 0
    for cut in range(0, len(buffers), drain):
        part = buffers[cut : cut + drain]
        reference_receive(daemons[0], _Path(part))
        path = _Path(part, native, runs)
        joined += len(part) - len(path.receive_split(len(part)))
        NetworkIn._receive(daemons[1], _Path(part, native, runs))  # type: ignore[arg-type]
    assert (joined > 0) == (runs and drain > 1)
    assert logs[1] == logs[0]
    assert daemons[1].daemon_rejects == daemons[0].daemon_rejects
    assert daemons[1].counters == daemons[0].counters
    got = {(j, n): p.rx_bytes for j, job in daemons[1].jobs.items() for n, p in job.peers.items()}
    want = {(j, n): p.rx_bytes for j, job in daemons[0].jobs.items() for n, p in job.peers.items()}
    assert got == want and all(want.values()), want
    kinds = Counter(entry[0] for entry in logs[0])
    assert kinds["engine"] and kinds["nack"] and kinds["ack"] and kinds["credit"], kinds
    assert daemons[0].daemon_rejects["bad_address"] > 0


@pytest.mark.parametrize("native", [False, True])
def test_datagrams_rejected_before_the_engine_are_still_counted_as_received(
    native: bool,
) -> None:
    """A drain of nothing but datagrams from an address outside their job
    reaches no engine, and its datagrams and bytes still count as received
    (they were not counted at all when nothing of the drain was left)."""
    if native and transport._udp is None:
        assert os.environ.get("DLCP_ALLOW_NO_NATIVE") == "1", "dlcp.daemon._udp was not built"
        pytest.skip("dlcp.daemon._udp is not built (DLCP_ALLOW_NO_NATIVE=1)")
    dgs = _traffic(JOB_A, "ghash-aes", 0)[:5]
    for d, receive in ((_daemon([]), reference_receive), (_daemon([]), NetworkIn._receive)):
        log = d.engine.log
        receive(d, _Path([(dg, 0, "10.9.9.9") for dg in dgs], native))  # not in job A
        assert d.daemon_rejects == {"bad_address": 5}
        assert d.counters == {"rx_packets": 5, "rx_bytes": sum(map(len, dgs))}
        assert log == []  # nothing reached the engine


def test_a_nack_that_asks_only_for_the_done_reports_no_loss() -> None:
    log: list[Any] = []
    d = _daemon(log)
    d.engine.receive_many = lambda dgs, now, nodes: np.arange(len(dgs))  # accept all
    dgs = []
    for count in (0, 3):
        h = Header(PacketType.NACK, JOB_A, 1, 0, shard=1, flags=Flags.NEED_MANIFEST, count=count)
        dgs.append(h.pack() + bytes(16) + bytes(4 * count))
    for dg in dgs:
        NetworkIn._receive(d, _Path([(dg, 0, "10.0.0.2")]))  # type: ignore[arg-type]
    assert [e[0] for e in log] == ["nack", "loss", "nack"]
    assert log[1][1:3] == ("a/1", 3)  # only the NACK that names packets counts them


def test_a_daemon_with_datagrams_to_send_takes_one_flush_of_buffers_at_a_time() -> None:
    """Idle, a drain takes _RX_BUDGET buffers; with datagrams to send, it
    takes _RX_SENDING buffers at a time until _RX_SENDING_BYTES: 16 GRO
    buffers of 64 KB, but more than 16 single datagrams (behind a shaped
    port, where 16 datagrams are 24 KB). Each says that more may wait."""
    rng = np.random.default_rng(0)
    d = _daemon([])
    path = _Path(_buffers(rng, 300))
    assert NetworkIn._receive(d, path)  # type: ignore[arg-type]
    assert len(path.buffers) == 300 - server._RX_BUDGET
    d.outbox.backlog.add(object())  # the outbox has datagrams queued: sending comes first
    gro = [(_packet(rng, JOB_A, 1500) * 43, 1500, "10.0.0.2")] * 40  # 64 KB each
    path = _Path(gro)
    assert NetworkIn._receive(d, path)  # type: ignore[arg-type]
    assert 40 - len(path.buffers) == server._RX_SENDING  # 16 x 64.5 KB: over the bytes
    single = [(_packet(rng, JOB_A, 1500), 0, "10.0.0.2")] * 1000
    path = _Path(single)
    assert NetworkIn._receive(d, path)  # type: ignore[arg-type]
    taken = 1000 - len(path.buffers)
    assert taken % server._RX_SENDING == 0
    assert (taken - server._RX_SENDING) * 1500 < server._RX_SENDING_BYTES <= taken * 1500
    path = _Path(single[:100])  # less than the budget: all of it, and nothing waits
    assert not NetworkIn._receive(d, path)  # type: ignore[arg-type]
    assert path.buffers == []
    assert 0 < server._RX_SENDING < server._RX_BUDGET


def test_sources_with_and_without_unknown_ones() -> None:
    index = np.array([0, 2, 3], dtype=np.int64)
    assert _sources([4, 5, 6, 7], index).tolist() == [4, 6, 7]
    assert _sources(np.array([4, 5, 6, 7]), index).tolist() == [4, 6, 7]
    # the daemon's form: an int array, -1 where the source is not known
    assert _sources(np.array([4, -1, -1, 7], np.int32), index).tolist() == [4, -1, 7]
    assert _sources([4, None, None, 7], index).tolist() == [4, -1, 7]
    assert _sources(None, index).tolist() == [-1, -1, -1]


def _first_fresh_by_unique(
    local: np.ndarray, bad: np.ndarray, received: np.ndarray
) -> tuple[np.ndarray, int]:
    """`runs.first_fresh` as it was: every run through np.unique."""
    good = np.flatnonzero(~bad)
    loc = local[good]
    _, first = np.unique(loc, return_index=True)
    keep = np.zeros(good.size, dtype=bool)
    keep[first] = True
    keep &= ~received[loc]
    return good[keep], good.size


@pytest.mark.parametrize("seed", range(8))
def test_first_fresh_skips_the_sort_only_where_no_position_repeats(seed: int) -> None:
    """A run of increasing positions (the usual one) takes no np.unique; the
    packets kept are those the sort keeps, for increasing runs, runs with
    repeats or out of order, bad packets and packets received before."""
    from dlcp.core.runs import first_fresh as _first_fresh

    rng = np.random.default_rng(seed)
    for _ in range(50):
        n = int(rng.integers(0, 40))
        start = int(rng.integers(0, 20))
        local = np.arange(start, start + n, dtype=np.int64)
        if seed % 2 and n:
            local = np.sort(rng.integers(0, 60, n))  # repeats, in order
        if seed % 4 == 3 and n:
            rng.shuffle(local)  # out of order
        bad = rng.random(n) < 0.1
        local = np.where(bad, -1, local)  # a bad packet's position is never read
        received = rng.random(100) < 0.2
        got = _first_fresh(local, bad, received)
        want = _first_fresh_by_unique(local, bad, received)
        assert got[1] == want[1] and got[0].tolist() == want[0].tolist()
