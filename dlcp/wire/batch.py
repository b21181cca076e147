"""Decode many datagrams at once into numpy arrays of header fields.

The receive path gets datagrams in batches (one GRO buffer of equal-sized
segments, or a list from a drain of the socket). Field checks run vectorised
over the whole batch; only the MAC is verified per packet. The result holds the
accepted packets' header fields as arrays plus their payload views, and a
count of rejects per reason, so nothing escapes as an exception.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar, overload

import numpy as np

from dlcp.errors import Reason
from dlcp.wire.header import (
    _CODECS,
    _TYPES,
    ALL_FLAGS,
    HEADER_SIZE,
    LANE_BITS,
    MAGIC,
    MAX_PAYLOAD,
    MAX_PRIORITY,
    VERSION,
    Codec,
    Flags,
    Header,
    PacketType,
)
from dlcp.wire.mac import MacKey, encode_blake2b, verify_blake2b
from dlcp.wire.slices import Slices

try:  # the header gather (and the lane copies of dlcp.codecs.lanes) in C; setup.py
    from dlcp.wire import _bulk  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - exercised where the extension is not built
    _bulk = None
if os.environ.get("DLCP_NATIVE_BULK", "1") == "0":  # Python loops instead (comparisons)
    _bulk = None

__all__ = ["HEADER_DTYPE", "Batch", "decode_batch", "encode_batch", "picked", "split_segments"]

HEADER_DTYPE = np.dtype(
    [
        ("magic", ">u2"),
        ("version", "u1"),
        ("type", "u1"),
        ("flags", "u1"),
        ("priority", "u1"),
        ("codec", "u1"),
        ("reserved", "u1"),
        ("job", ">u4"),
        ("round", ">u4"),
        ("bucket", ">u4"),
        ("shard", ">u2"),
        ("layer", ">u2"),
        ("sender", ">u2"),
        ("contributors", ">u2"),
        ("offset", ">u4"),
        ("count", ">u4"),
        ("total", ">u4"),
        ("param", ">f4"),
        ("aux", ">u4"),
        ("mac", "V16"),
    ]
)
assert HEADER_DTYPE.itemsize == HEADER_SIZE

_MAX_CODEC = 256
_DATA_BITS = np.zeros(_MAX_CODEC, dtype=np.int64)
_SUM_BITS = np.zeros(_MAX_CODEC, dtype=np.int64)
for _c, (_d, _s) in LANE_BITS.items():
    _DATA_BITS[_c] = _d
    _SUM_BITS[_c] = _s
_VALID_TYPE = np.zeros(256, dtype=bool)
_VALID_TYPE[list(_TYPES)] = True
_VALID_CODEC = np.zeros(256, dtype=bool)
_VALID_CODEC[list(_CODECS)] = True
_LANE_TYPE = np.zeros(256, dtype=bool)  # types whose payload is lanes
_LANE_TYPE[[PacketType.DATA, PacketType.RESULT]] = True
_LANE_BITS = np.stack([_DATA_BITS, _SUM_BITS])  # [summed, codec]: bits per lane
# payload bits per `count` and the round-up of the other types: NACK u32
# indices, DONE a bitmap, ACK empty, any other type `count` bytes
_TYPE_BITS = np.full(256, 8, dtype=np.int64)
_TYPE_BITS[[PacketType.NACK, PacketType.DONE, PacketType.ACK]] = [32, 1, 0]
_TYPE_ROUND = np.zeros(256, dtype=np.int64)
_TYPE_ROUND[[PacketType.DATA, PacketType.RESULT, PacketType.DONE]] = 7
_BAD_FLAG_BITS = np.uint8(~ALL_FLAGS & 0xFF)
# the reason of each row of `_field_reasons`' masks
_CHECK_REASONS = np.array(
    [
        Reason.TRUNCATED,
        Reason.BAD_MAGIC,
        Reason.BAD_VERSION,
        Reason.BAD_TYPE,
        Reason.BAD_FLAGS,
        Reason.BAD_CODEC,
        Reason.RESERVED,
        Reason.BAD_PRIORITY,
        Reason.BAD_RANGE,
        Reason.BAD_RANGE,
        Reason.BAD_RANGE,
        Reason.BAD_LENGTH,
        Reason.BAD_LENGTH,
        Reason.BAD_RANGE,
    ],
    dtype=np.int64,
)

assert max(_TYPE_BITS.max(), _TYPE_ROUND.max(), _DATA_BITS.max(), _SUM_BITS.max()) < 256
# the same checks' tables for the C pass (`_bulk.field_checks`), 256 bytes each in
# its order: valid type, valid codec, lane type, DATA, RESULT (by type byte),
# payload bits and round-up of the other types (by type), bits per data lane
# and per summed lane (by codec)
_CHECK_TABLES = np.stack(
    [
        _VALID_TYPE,
        _VALID_CODEC,
        _LANE_TYPE,
        np.arange(256) == PacketType.DATA,
        np.arange(256) == PacketType.RESULT,
        _TYPE_BITS,
        _TYPE_ROUND,
        _DATA_BITS,
        _SUM_BITS,
    ]
).astype(np.uint8)
_NO_CHECK = 255
# the constants the C checks take after the tables
_CHECK_ARGS = (
    MAGIC,
    VERSION,
    int(_BAD_FLAG_BITS),
    int(Flags.SUMMED),
    MAX_PRIORITY,
    MAX_PAYLOAD,
)


class Payloads(Sequence[memoryview]):
    """The payloads of datagrams (what follows their first `skip` bytes), each
    made into a view only when it is asked for. A slice is another `Payloads`;
    `dlcp.codecs.lanes.store_runs` copies from `datagrams` directly, so a run
    of data or result packets never has a view made per payload."""

    __slots__ = ("datagrams", "skip")

    def __init__(self, datagrams: Sequence[bytes | memoryview], skip: int = HEADER_SIZE) -> None:
        self.datagrams = datagrams
        self.skip = skip

    def __len__(self) -> int:
        return len(self.datagrams)

    @overload
    def __getitem__(self, i: int) -> memoryview: ...
    @overload
    def __getitem__(self, i: slice) -> Payloads: ...
    def __getitem__(self, i: int | slice) -> memoryview | Payloads:
        if isinstance(i, slice):
            return Payloads(self.datagrams[i], self.skip)
        return memoryview(self.datagrams[i]).cast("B")[self.skip :]

    def __iter__(self) -> Iterator[memoryview]:
        skip = self.skip
        return (memoryview(d).cast("B")[skip:] for d in self.datagrams)


@dataclass
class Batch:
    """Accepted packets of a batch: header fields as arrays, payloads as views."""

    fields: np.ndarray  # HEADER_DTYPE records of the accepted packets
    payloads: Sequence[memoryview]  # `Payloads` (views made when asked for), or a list
    index: np.ndarray  # position of each accepted packet in the input batch
    rejects: Counter[Reason] = field(default_factory=Counter)

    def __len__(self) -> int:
        return len(self.payloads)

    def header(self, i: int) -> Header:
        r = self.fields[i]
        return Header(
            type=PacketType(int(r["type"])),
            job=int(r["job"]),
            round=int(r["round"]),
            bucket=int(r["bucket"]),
            flags=Flags(int(r["flags"])),
            priority=int(r["priority"]),
            codec=Codec(int(r["codec"])),
            shard=int(r["shard"]),
            layer=int(r["layer"]),
            sender=int(r["sender"]),
            contributors=int(r["contributors"]),
            offset=int(r["offset"]),
            count=int(r["count"]),
            total=int(r["total"]),
            param=float(r["param"]),
            aux=int(r["aux"]),
        )


T = TypeVar("T")


def picked(items: Sequence[T], order: np.ndarray) -> Sequence[T]:
    """`[items[i] for i in order]`: one C call (`_bulk.pick`) for a list, a
    tuple or a receive drain's `Datagrams` (then another `Datagrams`, no
    object a datagram). `order` holds positions 0..len-1: anything else (a
    negative index included) is an IndexError."""
    if _bulk is not None and isinstance(items, list | tuple | _bulk.Datagrams):
        return _bulk.pick(items, np.ascontiguousarray(order, dtype=np.int64))
    positions = np.asarray(order).tolist()
    for i in positions:  # positions, not Python's negative indices (as the C)
        if not 0 <= i < len(items):
            raise IndexError(f"index {i} of {len(items)} datagrams")
    return [items[i] for i in positions]


def split_segments(buf: bytes | memoryview, segment: int) -> list[memoryview]:
    """Split a GRO-coalesced buffer into its datagrams (the last may be shorter)."""
    view = memoryview(buf).cast("B")
    if segment <= 0 or segment >= len(view):
        return [view]
    return [view[i : i + segment] for i in range(0, len(view), segment)]


def _field_reasons(heads: np.ndarray, lengths: np.ndarray, full: np.ndarray) -> np.ndarray | None:
    """Per datagram the first header check it fails (a `Reason`, 0: none), in
    the order `header.decode` checks; None when every datagram passes them all.

    In C where `_bulk` is built: one pass over the records, a few microseconds
    a batch (the numpy masks below cost about 80 us a call whatever its size,
    1.3 us a datagram in a batch of 64). `_py_field_reasons` is the reference.
    """
    if _bulk is None:
        return _py_field_reasons(heads, lengths, full)
    return _reasons_of(_bulk.field_checks(heads, lengths, _CHECK_TABLES, *_CHECK_ARGS))


def _reasons_of(first: bytes | None) -> np.ndarray | None:
    """`_field_reasons` of the C pass's result (a byte a record: the index of
    the first check it fails, _NO_CHECK: none; None: every record passed)."""
    if first is None:
        return None
    idx = np.frombuffer(first, dtype=np.uint8)
    return np.where(idx == _NO_CHECK, 0, _CHECK_REASONS[np.minimum(idx, len(_CHECK_REASONS) - 1)])


def _py_field_reasons(
    heads: np.ndarray, lengths: np.ndarray, full: np.ndarray
) -> np.ndarray | None:
    """`_field_reasons` in numpy. Each check is one mask; they are stacked and
    the first failing row of each column is its reason (a few numpy calls a
    check, none per datagram)."""
    ptype = heads["type"]
    flags = heads["flags"]
    codec = heads["codec"]
    count = heads["count"].astype(np.int64)
    offset = heads["offset"].astype(np.int64)
    total = heads["total"].astype(np.int64)
    lanes = _LANE_TYPE[ptype]
    data = ptype == PacketType.DATA
    plen = lengths - HEADER_SIZE
    summed = (ptype == PacketType.RESULT) | ((flags & Flags.SUMMED) != 0)
    # payload bytes a header announces: (count * per-lane bits + round-up) // 8
    bits = np.where(lanes, _LANE_BITS[summed.view(np.uint8), codec], _TYPE_BITS[ptype])
    want = (count * bits + _TYPE_ROUND[ptype]) // 8
    masks = np.stack(
        [
            ~full,
            heads["magic"] != MAGIC,
            heads["version"] != VERSION,
            ~_VALID_TYPE[ptype],
            (flags & _BAD_FLAG_BITS) != 0,
            ~_VALID_CODEC[codec],
            heads["reserved"] != 0,
            heads["priority"] > MAX_PRIORITY,
            lanes & (count == 0),
            lanes & (offset + count > total),
            data & (heads["contributors"] == 0),
            plen > MAX_PAYLOAD,  # same order as header._check: cap, length, then param
            want != plen,
            ~np.isfinite(heads["param"]),  # no cast: sNaN would warn
        ]
    )
    failed = masks.any(axis=0)
    if not failed.any():
        return None
    return np.where(failed, _CHECK_REASONS[masks.argmax(axis=0)], 0)


def _verify(key: MacKey, datagrams: Sequence[bytes | memoryview]) -> np.ndarray:
    """Per datagram whether its MAC under `key` (a BLAKE2b secret, or a MAC
    state with `verify`) is right: a bool array."""
    return verify_blake2b(key, datagrams) if isinstance(key, bytes) else key.verify(datagrams)


def decode_batch(datagrams: Sequence[bytes | memoryview], keys: Mapping[int, MacKey]) -> Batch:
    """Validate and authenticate a batch of datagrams; never raises for bad input.

    With the C pass (`_bulk.checked_heads`) over a list of datagrams or a
    `Datagrams` (a receive drain's, dlcp/wire/datagrams.h), no Python object
    is made per datagram: the header records, their field checks and the one
    job they name come from one call, and when all pass and name a job with a
    key, the MAC check of all of them is the only step left (its result is
    reused if some fail it). Either way the payloads are a `Payloads` of the
    accepted ones.
    """
    n = len(datagrams)
    items: Sequence[bytes | memoryview]
    checked: np.ndarray | None = None  # the MAC check of all of them, made already
    if _bulk is not None and isinstance(datagrams, list | _bulk.Datagrams):
        # the header records and checks in one pass, and the one job they name
        raw_heads, first_failed, one_job = _bulk.checked_heads(
            datagrams, _CHECK_TABLES, *_CHECK_ARGS
        )
        heads = np.frombuffer(raw_heads, dtype=HEADER_DTYPE)  # writable, zeros if short
        items = datagrams
        if one_job >= 0 and (key := keys.get(one_job)) is not None:
            # every record passed its checks and names one job with a key: the
            # usual drain, whose only remaining check is the MAC
            checked = _verify(key, items)
            if checked.all():
                return Batch(
                    fields=heads, payloads=Payloads(items), index=np.arange(n), rejects=Counter()
                )
        found = _reasons_of(first_failed)
    else:
        views = [memoryview(d).cast("B") for d in datagrams]
        items = views
        lengths = np.fromiter(map(len, views), dtype=np.int64, count=n)
        full = lengths >= HEADER_SIZE
        if full.all():  # the usual case: one join of the header views, no per-packet copies
            heads = np.frombuffer(
                bytearray().join([v[:HEADER_SIZE] for v in views]), dtype=HEADER_DTYPE
            )  # writable, like the zeroed array below
        else:
            heads = np.zeros(n, dtype=HEADER_DTYPE)
            if full.any():
                raw = b"".join([views[i][:HEADER_SIZE] for i in np.flatnonzero(full).tolist()])
                heads[full] = np.frombuffer(raw, dtype=HEADER_DTYPE)
        found = _field_reasons(heads, lengths, full)
    reasons = np.zeros(n, dtype=np.int64) if found is None else found

    # MAC of the candidates (those that passed every check), per job
    if found is None:
        candidates = np.arange(n)
        cand = items
        cand_jobs = heads["job"]
    else:
        candidates = np.flatnonzero(reasons == 0)
        cand = picked(items, candidates)
        cand_jobs = heads["job"][candidates]
    m = len(cand)
    verified = np.zeros(m, dtype=bool)
    if m:
        first = cand_jobs[0]
        if (cand_jobs == first).all():
            groups: list[tuple[int, np.ndarray | None]] = [(int(first), None)]
        else:
            groups = [(j, np.flatnonzero(cand_jobs == j)) for j in np.unique(cand_jobs).tolist()]
        for job, sel in groups:  # sel: positions among the candidates; None: all
            key = keys.get(job)
            if key is None:
                reasons[candidates if sel is None else candidates[sel]] = Reason.UNKNOWN_JOB
                continue
            if checked is not None:  # the fast path's check (all of them: one group)
                ok = checked
            else:
                mine = cand if sel is None else picked(cand, sel)
                ok = _verify(key, mine)
            if sel is None:
                verified = ok
            else:
                verified[sel] = ok
    if found is None and verified.all():  # the usual batch: every datagram accepted
        return Batch(fields=heads, payloads=Payloads(items), index=candidates, rejects=Counter())
    reasons[candidates[~verified & (reasons[candidates] == 0)]] = Reason.BAD_MAC
    kept = np.flatnonzero(verified)
    idx = candidates[kept]
    fields = heads[idx]
    kept_items = picked(cand, kept)
    payloads = Payloads(kept_items)

    rejects: Counter[Reason] = Counter()
    bad = reasons[reasons != 0]
    if bad.size:
        for code, k in zip(*np.unique(bad, return_counts=True), strict=True):
            rejects[Reason(int(code))] = int(k)
    return Batch(fields=fields, payloads=payloads, index=idx, rejects=rejects)


def encode_batch(
    heads: np.ndarray,
    payloads: Sequence[bytes | memoryview],
    key: MacKey,
    *,
    gather: bool = False,
) -> list[bytes]:
    """Serialise packets whose header fields were filled in a HEADER_DTYPE array.

    The sender's fast path: fields are set with vector operations; only the MAC
    is computed per packet. `magic` and `version` are filled in here. The caller
    guarantees the fields agree with the payloads (the receiver checks anyway).

    With `gather`, payloads given as `Slices` stay in their buffer where the C
    MAC is built: each datagram is then a `Gathered` (its header bytes and the
    payload in place; `len`, indexing and `bytes()` as for the joined bytes),
    which the daemon's C send path hands the kernel as two iovecs. The caller
    must leave those payload bytes alone while the datagrams may still be sent.
    """
    heads["magic"] = MAGIC
    heads["version"] = VERSION
    raw = heads.tobytes()
    if isinstance(key, bytes):
        return encode_blake2b(key, raw, payloads)
    if gather and isinstance(payloads, Slices):
        return key.encode_gather(raw, payloads)
    return key.encode(raw, payloads)
