"""Runs of a received batch: where the datagrams that the engine can store
in one call (`ShardAggregator.on_data_run`, `ResultCollector.on_result_run`)
begin, and each datagram's source node; then which of a run's packets
to store (`first_fresh`, `run_slots`).

A run is consecutive DATA or RESULT packets from one source that agree on
the fields of `_RUN_FIELDS` and the flags of `_RUN_FLAGS` (data packets also
on their contributors and param). One C pass where `_bulk` is built;
`py_run_starts` is its numpy reference.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TypeVar

import numpy as np

from dlcp.wire.batch import HEADER_DTYPE, Payloads, _bulk, picked
from dlcp.wire.header import Flags, PacketType

__all__ = [
    "LANE_TYPES",
    "first_fresh",
    "picked",
    "py_run_starts",
    "run_slots",
    "run_starts",
    "sources",
    "taken",
]

_RUN_FIELDS = ("type", "job", "round", "bucket", "shard", "sender", "codec", "total")
_RUN_FLAGS = int(Flags.SUMMED | Flags.RESULT_LEG)


def _field_mask(names: Iterable[str], flags: int = 0) -> bytes:
    """A HEADER_DTYPE record with every bit of the fields `names` set (and the
    bits `flags` of its flags byte): what `run_starts` compares."""
    raw = np.zeros(HEADER_DTYPE.itemsize, np.uint8)
    for name in names:
        off = _field_at(name)
        raw[off : off + HEADER_DTYPE[name].itemsize] = 0xFF
    raw[_field_at("flags")] |= flags
    return raw.tobytes()


def _field_at(name: str) -> int:
    """The byte offset of field `name` in a HEADER_DTYPE record."""
    fields = HEADER_DTYPE.fields
    assert fields is not None
    return int(fields[name][1])


# what the packets of one run (`Engine.receive_many`) share: the fields of
# _RUN_FIELDS and the flags bits _RUN_FLAGS; data packets also their
# contributors and param (compared as bytes: a -0.0 param beside 0.0 starts a
# run, as it would one packet at a time)
_RUN_MASK = _field_mask(_RUN_FIELDS, _RUN_FLAGS)
_RUN_DATA_MASK = _field_mask(("contributors", "param"))
LANE_TYPES = np.zeros(256, dtype=bool)  # by type byte: DATA and RESULT carry lanes
LANE_TYPES[[PacketType.DATA, PacketType.RESULT]] = True
_LANE_TYPE_BYTES = LANE_TYPES.view(np.uint8).tobytes()  # the same, as `_bulk` takes it
_TYPE_AT = _field_at("type")
_DATA_TYPE = int(PacketType.DATA)


def run_starts(f: np.ndarray, src: np.ndarray) -> list[int]:
    """Where the runs of a batch's accepted records `f` (sources `src`, -1:
    unknown) start: a record starts one unless it and the one before it are
    both DATA or RESULT packets from one source that agree on _RUN_MASK (and,
    data packets, on _RUN_DATA_MASK). One C pass where `_bulk` is built."""
    if _bulk is not None:
        raw = _bulk.run_starts(
            np.ascontiguousarray(f),
            np.ascontiguousarray(src, dtype=np.int64),
            _RUN_MASK,
            _RUN_DATA_MASK,
            _LANE_TYPE_BYTES,
            _TYPE_AT,
            _DATA_TYPE,
        )
        return np.frombuffer(raw, np.int64).tolist()
    return py_run_starts(f, src)


def py_run_starts(f: np.ndarray, src: np.ndarray) -> list[int]:
    """`run_starts` in numpy (the reference): the records as 64-bit words,
    each compared with the one before under the masks."""
    n = len(f)
    if n == 0:
        return []
    words = np.ascontiguousarray(f).view(np.uint64).reshape(n, -1)
    mask = np.frombuffer(_RUN_MASK, np.uint64)
    data_mask = np.frombuffer(_RUN_DATA_MASK, np.uint64)
    diff = words[1:] ^ words[:-1]
    lanes = LANE_TYPES[f["type"]]
    same = lanes[1:] & lanes[:-1] & (src[1:] == src[:-1]) & ~(diff & mask).any(axis=1)
    same &= (f["type"][1:] != PacketType.DATA) | ~(diff & data_mask).any(axis=1)
    change = np.ones(n, dtype=bool)
    change[1:] = ~same
    return np.flatnonzero(change).tolist()


def sources(srcs: Sequence[int | None] | np.ndarray | None, index: np.ndarray) -> np.ndarray:
    """The source node of each accepted datagram (`index`: its position), -1 if
    unknown; `srcs` is a sequence (None: unknown) or an int array (-1: unknown)."""
    if srcs is None:
        return np.full(index.size, -1, dtype=np.int64)
    if isinstance(srcs, np.ndarray):
        return srcs.astype(np.int64, copy=False)[index]
    try:  # the usual case, every source known: one conversion, no Python per datagram
        return np.fromiter(srcs, np.int64, len(srcs))[index]
    except TypeError:  # some None
        return np.fromiter(
            (-1 if (s := srcs[i]) is None else s for i in index.tolist()), np.int64, index.size
        )


T = TypeVar("T")


def first_fresh(local: np.ndarray, bad: np.ndarray, received: np.ndarray) -> tuple[np.ndarray, int]:
    """Of a run of packets at positions `local` (`received` indexed the same way),
    the indices of those to store: the first occurrence of each good one not
    received before. Also how many were good (the rest of them are duplicates)."""
    good = np.flatnonzero(~bad)
    loc = local[good]
    keep = ~received[loc]
    if loc.size > 1 and not (loc[1:] > loc[:-1]).all():  # else no position repeats (the usual run)
        _, first = np.unique(loc, return_index=True)
        once = np.zeros(good.size, dtype=bool)
        once[first] = True
        keep &= once
    return good[keep], good.size


def taken(items: Sequence[T], take: np.ndarray) -> Sequence[T]:
    """`items` at the positions `take` (increasing), without a copy when it is
    all of them; a `Payloads` stays one, its datagrams picked in C where
    `_bulk` is built (no object a datagram)."""
    if take.size == len(items):
        return items
    if isinstance(items, Payloads):
        return Payloads(picked(items.datagrams, take), items.skip)  # type: ignore[return-value]
    return [items[k] for k in take.tolist()]


def run_slots(
    heads: np.ndarray,
    per: int,
    split: int,
    total: int,
    base: int,
    slots: int,
    start_sub: int,
    received: np.ndarray,
) -> tuple[np.ndarray, int, np.ndarray | None]:
    """`_bulk.run_index` of a run's header records, as arrays: (take, local,
    starts, counts) of the packets to store (rows of one int64 array), how
    many were bad, and which (None: none)."""
    raw, n_bad, bad = _bulk.run_index(heads, per, split, total, base, slots, start_sub, received)
    index = np.frombuffer(raw, np.int64).reshape(4, -1)
    return index, n_bad, None if bad is None else np.frombuffer(bad, dtype=bool)
