"""The fuzz targets' jobs and keys, and seed datagrams made with dlcp's own
encoder (tests/fuzz_daemon.py's templates: valid packets of every type, codec
and flag set, MAC'd with BLAKE2b for one job and ghash-aes for another)."""

from __future__ import annotations

import importlib
import random
from collections.abc import Sequence
from functools import cache

from dlcp.wire.header import HEADER_SIZE
from dlcp.wire.mac import GhashAesKey, MacKey

JOB = 0xABC  # BLAKE2b
JOB_GHASH = 0xABD  # ghash-aes
_SECRET = bytes(range(7, 39))
KEYS: dict[int, MacKey] = {JOB: _SECRET, JOB_GHASH: GhashAesKey(_SECRET, native=None)}
# what the Python definitions decode with: the same keys, the MAC in Python
REF_KEYS: dict[int, MacKey] = {JOB: _SECRET, JOB_GHASH: GhashAesKey(_SECRET, native=False)}


@cache
def templates() -> tuple[bytes, ...]:
    # tests/ is no package mypy checks: its helper is imported by name
    make = importlib.import_module("tests.fuzz_daemon").templates
    return tuple(make(JOB, REF_KEYS[JOB]) + make(JOB_GHASH, REF_KEYS[JOB_GHASH]))


def datagram_seeds() -> list[list[bytes]]:
    """Batches of valid datagrams: one alone, runs of one job's, mixed jobs."""
    t = list(templates())
    rng = random.Random(64)
    out: list[list[bytes]] = [[t[k]] for k in range(0, len(t), 23)]
    for size in (2, 3, 5, 8, 16):
        out.append(rng.sample(t, size))
    one_job = [d for d in t if d[8:12] == JOB.to_bytes(4, "big")]
    out.append(one_job[:12])
    out.append([one_job[3]] * 6)  # repeats
    out.append([t[0][: HEADER_SIZE - 1], t[1][:12], b"", t[2]])  # short ones
    return out


def heads_of(dgs: Sequence[bytes]) -> bytes:
    """The 64-byte header records of `dgs`, back to back."""
    return b"".join(d[:HEADER_SIZE].ljust(HEADER_SIZE, b"\0") for d in dgs)
