"""Fuzz targets of dlcp.wire._bulk and dlcp.wire._ghash: header gathers and
checks, the batch decoder, run splits, a run's packets found and noted, lane
copies and sums, and the packet MAC, each against its Python twin."""

from __future__ import annotations

import struct
from collections import Counter

import numpy as np

from dlcp.codecs import lanes
from dlcp.core import runs as runs_mod
from dlcp.errors import Reason, RemoteError, WireError
from dlcp.wire import batch as batch_mod
from dlcp.wire import decode, decode_batch
from dlcp.wire.batch import HEADER_DTYPE, Payloads
from dlcp.wire.header import HEADER_SIZE, Codec, Header
from dlcp.wire.mac import GhashAesKey
from fuzz.harness import Input, pack_datagrams, target
from fuzz.seeds import JOB, JOB_GHASH, KEYS, REF_KEYS, datagram_seeds, heads_of

_bulk = batch_mod._bulk


def _same_error(fast: BaseException | None, ref: BaseException | None, both: bool = False) -> None:
    """Both raised the same kind of error (a RemoteError: the same reason), or
    neither; `both`: the input has runs outside the lanes and payloads of the
    wrong length, and which is found first is the order of the checks."""
    if both and fast is not None and ref is not None:
        return
    assert type(fast) is type(ref), (fast, ref)
    if isinstance(fast, RemoteError) and isinstance(ref, RemoteError):
        assert fast.reason == ref.reason, (fast, ref)


def _variety(dgs: list[bytes], how: int) -> list:
    """The datagrams as bytes, bytearrays and memoryviews (the C reads any buffer)."""
    if how == 0:
        return dgs
    return [bytearray(d) if k % 3 == 0 else memoryview(d) if k % 3 == 1 else d
            for k, d in enumerate(dgs)]  # fmt: skip


# --- header gathers and checks -----------------------------------------------


def _heads_seeds() -> list[bytes]:
    return [pack_datagrams(dgs, bytes((64, k % 3))) for k, dgs in enumerate(datagram_seeds())]


@target(
    "bulk_heads",
    covers=("_bulk.heads", "_bulk.field_checks", "_bulk.checked_heads"),
    seeds=_heads_seeds,
)
def bulk_heads(inp: Input) -> None:
    size = inp.uint(1) % 97
    how = inp.uint(1) % 3
    dgs = inp.datagrams(limit=32)
    items: list | tuple = _variety(dgs, how)
    if how == 2:
        items = tuple(items)
    raw, lengths = _bulk.heads(items, size)
    # a record a datagram: its first size bytes, zeros where it is shorter
    assert bytes(raw) == b"".join(d[:size] if len(d) >= size else bytes(size) for d in dgs)
    assert lengths == np.array([len(d) for d in dgs], np.int64).tobytes()
    raw64, lengths64 = _bulk.heads(items, HEADER_SIZE)
    recs = np.frombuffer(raw64, HEADER_DTYPE)
    lens = np.frombuffer(lengths64, np.int64)
    tables, args = batch_mod._CHECK_TABLES, batch_mod._CHECK_ARGS
    first = _bulk.field_checks(recs, lens, tables, *args)
    want = batch_mod._py_field_reasons(recs, lens, lens >= HEADER_SIZE)
    got = batch_mod._reasons_of(first)
    assert (got is None) == (want is None), (got, want)
    if got is not None and want is not None:
        assert got.tolist() == want.tolist()
    ids = {struct.unpack_from("!I", d, 8)[0] if len(d) >= 12 else -1 for d in dgs}
    job = ids.pop() if first is None and len(ids) == 1 else -1
    assert _bulk.checked_heads(items, tables, *args) == (raw64, first, job)
    if dgs and inp.chance(4):  # lengths of any value beside the same records
        odd = np.array([inp.uint(4) - (1 << 31) if inp.chance(2) else n for n in lens], np.int64)
        first = _bulk.field_checks(recs, odd, tables, *args)
        want = batch_mod._py_field_reasons(recs, odd, odd >= HEADER_SIZE)
        got = batch_mod._reasons_of(first)
        assert (got is None) == (want is None)
        if got is not None and want is not None:
            assert got.tolist() == want.tolist()


# --- the batch decoder -------------------------------------------------------


def _reason(dg: bytes) -> tuple[Reason | None, tuple[Header, bytes] | None]:
    try:
        h, payload = decode(dg, REF_KEYS)
    except WireError as exc:
        return exc.reason, None
    return None, (h, bytes(payload))


@target(
    "decode_batch",
    covers=("_bulk.checked_heads", "_ghash.GhashAes.verify"),
    seeds=lambda: [pack_datagrams(dgs, b"\0") for dgs in datagram_seeds()],
)
def decode_batch_target(inp: Input) -> None:
    how = inp.uint(1) % 2
    dgs = inp.datagrams(limit=24)
    b = decode_batch(_variety(dgs, how), KEYS)
    want = [_reason(d) for d in dgs]
    assert b.rejects == Counter(r for r, _ in want if r is not None), (b.rejects, want)
    accepted = [k for k, (r, _) in enumerate(want) if r is None]
    assert b.index.tolist() == accepted
    for i, k in enumerate(accepted):
        decoded = want[k][1]
        assert decoded is not None
        assert b.header(i) == decoded[0]
        assert bytes(b.payloads[i]) == decoded[1]


# --- run splits ---------------------------------------------------------------


def _run_seeds() -> list[bytes]:
    out = []
    for dgs in datagram_seeds():
        n = min(len(dgs), 64)
        src = bytes(k // 7 % 3 for k in range(n))
        out.append(bytes((n,)) + src + heads_of(dgs[:n]))
    return out


@target("bulk_run_starts", covers=("_bulk.run_starts",), seeds=_run_seeds)
def bulk_run_starts(inp: Input) -> None:
    n = inp.uint(1) % 65
    src = np.array([b % 4 - 1 for b in inp.take(n).ljust(n, b"\0")], np.int64)
    raw = inp.take(n * HEADER_SIZE).ljust(n * HEADER_SIZE, b"\0")
    f = np.frombuffer(raw, HEADER_DTYPE)
    assert runs_mod.run_starts(f, src) == runs_mod.py_run_starts(f, src)


# --- lane copies and sums ------------------------------------------------------

# (codec, summed) whose wire lanes `_bulk.copy_runs` writes as they are
_IN_PLACE = [(c, s) for c in Codec for s in (False, True)
             if (lanes._WIRE_SUMMED if s else lanes._WIRE_DATA).get(c) is not None]  # fmt: skip


def _runs(inp: Input, size: int, itemsize: int) -> tuple[np.ndarray, np.ndarray, list]:
    """Up to 16 runs into `size` lanes (some outside it, some with a payload
    of the wrong length), their payloads as bytes or datagrams (`Payloads`).

    Each run reads, as `Input` would: start `below(size + 3)`, count
    `below(min(size, 600) + 2)`; `chance(16)`: start `-uint(1)`; `chance(8)`:
    the payload `uint(1) % 5 - 2` bytes off its length; then the payload
    (`take`). The reads are written out here, on locals: this loop is most of
    what the lane targets do in Python besides the calls they compare."""
    d, at, end = inp.data, inp.at, inp.size
    k = 0
    if at < end:
        k, at = d[at] % 17, at + 1
    span, most = size + 3, min(size, 600) + 2
    starts, counts, payloads = [], [], []
    for _ in range(k):
        if at + 4 <= end:  # the two two-byte reads
            start = (d[at] | d[at + 1] << 8) % span
            count = (d[at + 2] | d[at + 3] << 8) % most
            at += 4
        elif at >= end:  # past the end: zeros
            start = count = 0
        else:  # 1-3 bytes left: as Input reads them
            inp.at = at
            start, count = inp.below(span), inp.below(most)
            at = inp.at
        if at >= end or d[at] % 16 == 0:  # chance(16); past the end: True
            at += at < end
            if at < end:
                start, at = -d[at], at + 1
            else:
                start = 0
        else:
            at += 1
        nbytes = count * itemsize
        if at >= end or d[at] % 8 == 0:  # chance(8)
            at += at < end
            if at < end:
                nbytes, at = nbytes + d[at] % 5 - 2, at + 1
            else:
                nbytes -= 2
        else:
            at += 1
        nbytes = max(nbytes, 0)
        payload = d[at : at + nbytes]
        at += len(payload)
        starts.append(start)
        counts.append(count)
        payloads.append(payload.ljust(nbytes, b"\x3f"))
    inp.at = at
    return np.array(starts, np.int64), np.array(counts, np.int64), payloads


def _outside(s: np.ndarray, c: np.ndarray, size: int) -> bool:
    """Whether a run lies outside `size` lanes (in Python: at most 16 runs,
    fewer objects than numpy's masks)."""
    return any(a < 0 or a + k > size for a, k in zip(s.tolist(), c.tolist(), strict=True))


def _both_errors(c: np.ndarray, payloads: list[bytes], item: int, outside: bool) -> bool:
    """Whether the runs have both a run outside the lanes (`outside`) and a
    payload of the wrong length (either error may then come first)."""
    return outside and any(len(p) != k * item for p, k in zip(payloads, c.tolist(), strict=True))


def _as_datagrams(inp: Input, payloads: list[bytes]) -> list[bytes] | Payloads:
    if inp.chance(2):
        return payloads
    return Payloads([bytes(HEADER_SIZE) + p for p in payloads], HEADER_SIZE)


def _lane_seeds(codec_pick: int) -> list[bytes]:
    rng = np.random.default_rng(codec_pick)
    out = []
    for k in range(12):
        size = int(rng.integers(1, 3000))
        head = bytes((codec_pick + k,)) + size.to_bytes(2, "little")
        body = rng.integers(0, 256, 1024, dtype=np.uint8).tobytes()
        out.append(head + body)
    return out


def _store(
    dest: np.ndarray,
    codec: int,
    summed: bool,
    s: np.ndarray,
    c: np.ndarray,
    p: list[bytes] | Payloads,
    native: bool,
) -> BaseException | None:
    try:
        lanes.store_runs(dest, codec, summed, s, c, p, native=native)
    except (RemoteError, IndexError) as exc:
        return exc
    return None


@target("bulk_copy_runs", covers=("_bulk.copy_runs",), seeds=lambda: _lane_seeds(0))
def bulk_copy_runs(inp: Input) -> None:
    codec, summed = _IN_PLACE[inp.uint(1) % len(_IN_PLACE)]
    size = inp.uint(2) % 3000 + 1
    dtype = (lanes._WIRE_SUMMED if summed else lanes._WIRE_DATA)[codec]
    s, c, payloads = _runs(inp, size, dtype.itemsize)
    p = _as_datagrams(inp, payloads)
    fast = np.zeros(size, dtype)
    ref = np.zeros(size, dtype)
    outside = _outside(s, c, size)
    both = _both_errors(c, payloads, dtype.itemsize, outside)
    e_fast = _store(fast, codec, summed, s, c, p, True)
    _same_error(e_fast, _store(ref, codec, summed, s, c, p, False), both)
    if not outside:
        assert fast.tobytes() == ref.tobytes()


def _add(
    dest: np.ndarray,
    own: np.ndarray,
    codec: int,
    summed: bool,
    s: np.ndarray,
    c: np.ndarray,
    p: list[bytes] | Payloads,
    native: bool,
) -> BaseException | None:
    try:
        lanes.add_runs(dest, own, codec, summed, s, c, p, native=native)
    except (RemoteError, IndexError) as exc:
        return exc
    return None


@target("bulk_add_runs", covers=("_bulk.add_runs",), seeds=lambda: _lane_seeds(1))
def bulk_add_runs(inp: Input) -> None:
    summed = inp.chance(2)
    size = inp.uint(2) % 3000 + 1
    own = np.frombuffer(inp.take(4 * size).ljust(4 * size, b"\x01"), "<f4").copy()
    s, c, payloads = _runs(inp, size, 4)
    p = _as_datagrams(inp, payloads)
    fast = np.full(size, 7.0, np.float32)
    ref = fast.copy()
    with np.errstate(all="ignore"):
        e_ref = _add(ref, own, Codec.FP32, summed, s, c, p, False)
    both = _both_errors(c, payloads, 4, _outside(s, c, size))
    _same_error(_add(fast, own, Codec.FP32, summed, s, c, p, True), e_ref, both)
    if e_ref is None and fast.tobytes() != ref.tobytes():  # NaN payloads' bits aside, the same sums
        a, b = fast.view(np.uint32), ref.view(np.uint32)
        same = (a == b) | (np.isnan(fast) & np.isnan(ref))
        assert same.all(), np.flatnonzero(~same)[:5]


# --- the packet MAC -----------------------------------------------------------


def _mac_seeds() -> list[bytes]:
    out = []
    for dgs in datagram_seeds():
        body = [d for d in dgs if len(d) >= HEADER_SIZE][:8]
        out.append(bytes(range(32)) + bytes((len(body),)) + heads_of(body)
                   + pack_datagrams([d[HEADER_SIZE:] for d in body]))  # fmt: skip
    return out


_MAC_KEYS: dict[bytes, tuple[GhashAesKey, ...]] = {}


def _mac_keys(key: bytes) -> tuple[GhashAesKey, ...]:
    """The Python form and each C backend for `key` (a few keys kept: making
    one costs key expansion, not what is fuzzed)."""
    if key not in _MAC_KEYS:
        if len(_MAC_KEYS) > 64:
            _MAC_KEYS.clear()
        _MAC_KEYS[key] = (
            GhashAesKey(key, native=False),
            GhashAesKey(key, native=True, avx512=False),
            GhashAesKey(key, native=True, avx512=True),
        )
    return _MAC_KEYS[key]


@target(
    "ghash_mac",
    covers=("_ghash.GhashAes.tags", "_ghash.GhashAes.encode", "_ghash.GhashAes.verify"),
    seeds=_mac_seeds,
)
def ghash_mac(inp: Input) -> None:
    py, *natives = _mac_keys(inp.take(32).ljust(32, b"\0") if inp.chance(4) else bytes(range(32)))
    n = inp.uint(1) % 9
    raw = inp.take(n * HEADER_SIZE).ljust(n * HEADER_SIZE, b"\0")
    payloads = inp.datagrams(limit=n, longest=2048)
    payloads += [b""] * (n - len(payloads))
    want = py.encode(raw, payloads)
    heads48 = [raw[k * HEADER_SIZE : k * HEADER_SIZE + 48] for k in range(n)]
    tags = py.tags(heads48, payloads)
    # datagrams to verify: the encoded ones, one byte of one of them changed,
    # and the input's own (any length: shorter than a header is refused)
    trial = list(want)
    if trial and inp.chance(2):
        k = inp.below(len(trial))
        d = bytearray(trial[k])
        d[inp.below(len(d))] ^= inp.uint(1) | 1
        trial[k] = bytes(d)
    trial += inp.datagrams(limit=4)
    ref = _verify(py, trial)
    for c in natives:
        assert c.encode(raw, payloads) == want
        assert c.tags(heads48, payloads) == tags
        got = _verify(c, trial)
        assert type(got) is type(ref), (got, ref)
        if not isinstance(ref, BaseException):
            assert got.tolist() == ref.tolist()  # type: ignore[union-attr]


def _verify(key: GhashAesKey, dgs: list[bytes]) -> np.ndarray | BaseException:
    try:
        return key.verify(dgs)
    except ValueError as exc:
        return exc


assert JOB in KEYS and JOB_GHASH in KEYS
