"""The fuzz targets of fuzz/ (run coverage-guided and sanitized by
`bash scripts/fuzz`) with the normal build: every seed of the corpus, findings'
inputs among them, passes its target (the C result is its Python twin's), and
every C function that reads bytes from the network or from a rank has a
target, so that a new entry point is fuzzed or is said here why not."""

from __future__ import annotations

import os

import numpy as np
import pytest

from fuzz import harness
from tests.test_native_twins import _method_tables

TARGETS = harness.load_targets()

# C functions no target calls, and why: no bytes from the network or a rank
# reach them, or they are reached through another one's target
NOT_FUZZED = {
    ("_arenas", "keep"): "object arenas of the process: no input bytes",
    ("_arenas", "stats"): "object arenas of the process: no input bytes",
    ("_udp", "send_gso"): "sends the outbox's own datagrams (no bytes from the network)",
    ("_ghash", "encode_from"): "encode of slices of a rank's buffer: encode is fuzzed (ghash_mac)",
    ("_ghash", "encode_gather"): "encode, the payload left in place: encode is fuzzed (ghash_mac)",
    ("_ghash", "detach"): "copies a Gathered datagram's payload (made by encode_gather)",
    ("_ghash", "__bytes__"): "a Gathered datagram's bytes (made by encode_gather)",
    ("_keys", "clear"): "Fifo.clear: empties the queue, reads no bytes",
    ("_keys", "by_path"): "cuts the outbox's own datagrams by path (no bytes from the network)",
    ("_bulk", "to_halves"): "casts an owner's own float sums to fp16 result lanes",
    ("_bulk", "pack_u10"): "packs an owner's own thc8 sums into 10-bit result lanes",
    ("_thc", "rotate"): "the rank's own float32 gradients, in its own process: no input bytes",
    ("_thc", "encode"): "the rank's own float32 gradients, in its own process: no input bytes",
    ("_thc", "quantize"): "the rank's own float32 gradients, in its own process: no input bytes",
    ("_thc", "unrotate"): "the rank's own float32 gradients, in its own process: no input bytes",
    ("_thc", "dequantize"): "the rank's own decode of its daemon's sums, sizes checked in Python",
    ("_thc", "uniforms"): "fills a float32 buffer from a key: no input bytes",
    ("_fp16", "encode"): "the rank's own float32 gradients, in its own process: no input bytes",
    ("_fp16", "available"): "reads the CPU's features: no input bytes",
}


def _natives() -> None:
    from dlcp.wire import batch

    if batch._bulk is None:
        assert os.environ.get("DLCP_ALLOW_NO_NATIVE") == "1", "the C extensions were not built"
        pytest.skip("the C extensions are not built (DLCP_ALLOW_NO_NATIVE=1)")


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_every_seed_passes_its_target(name: str) -> None:
    _natives()
    seeds = harness.seed_files(name)
    assert seeds, f"fuzz/corpus/{name} has no seeds: python -m fuzz seeds"
    for path in seeds:
        TARGETS[name].run(path.read_bytes())


def test_every_c_function_with_input_bytes_has_a_target() -> None:
    tables = _method_tables()
    covered = {(c.split(".")[0], c.split(".")[-1]) for t in TARGETS.values() for c in t.covers}
    for ext, names in tables.items():
        for fn in sorted(names):
            if (ext, fn) in NOT_FUZZED:
                assert (ext, fn) not in covered, f"{ext}.{fn} is fuzzed: drop it from NOT_FUZZED"
                continue
            assert (ext, fn) in covered, f"{ext}.{fn}: add a fuzz target (fuzz/) or say why not"
    every = {(e, n) for e, ns in tables.items() for n in ns}
    assert set(NOT_FUZZED) <= every, set(NOT_FUZZED) - every
    assert covered <= every | {("_bulk", "Datagrams"), ("_bulk", "Segment")}, covered - every


def test_a_divergence_is_a_finding() -> None:
    """A target fails when the C result and the twin's differ (here the
    twin is made to count one lane more)."""
    _natives()
    from dlcp.core import runs as runs_mod

    seed = harness.seed_files("bulk_run_starts")[-1].read_bytes()
    real = runs_mod.py_run_starts
    try:
        runs_mod.py_run_starts = lambda f, src: [*real(f, src), len(f)]  # type: ignore[assignment]
        with pytest.raises(AssertionError):
            TARGETS["bulk_run_starts"].run(seed)
    finally:
        runs_mod.py_run_starts = real


# --- the readers written out on locals read what Input's methods read --------


def _runs_wire_by_methods(inp: harness.Input, size: int, itemsize: int) -> tuple:
    """targets_wire._runs as Input's methods read it (the definition)."""
    starts, counts, payloads = [], [], []
    for _ in range(inp.uint(1) % 17):
        start = inp.below(size + 3)
        count = inp.below(min(size, 600) + 2)
        if inp.chance(16):
            start = -inp.uint(1)
        nbytes = max(count * itemsize + (inp.uint(1) % 5 - 2 if inp.chance(8) else 0), 0)
        starts.append(start)
        counts.append(count)
        payloads.append(inp.take(nbytes).ljust(nbytes, b"\x3f"))
    return starts, counts, payloads


def _runs_lanes_by_methods(inp: harness.Input, size: int, codec: int, summed: bool) -> tuple:
    """targets_lanes._runs as Input's methods read it (the definition)."""
    from dlcp.wire.header import lane_bytes

    starts, counts, payloads = [], [], []
    for _ in range(inp.uint(1) % 17):
        start = -inp.uint(1) if inp.chance(16) else inp.below(size + 3)
        count = inp.below(min(size, 600) + 2)
        n = lane_bytes(codec, count, summed) + (inp.uint(1) % 5 - 2 if inp.chance(8) else 0)
        starts.append(start)
        counts.append(count)
        payloads.append(inp.take(max(n, 0)).ljust(max(n, 0), b"\x5a"))
    return starts, counts, payloads


def _random_inputs(seed: int, n: int) -> list[bytes]:
    """Inputs of every length up to 2,000 bytes that end at every point of a
    run, rich in the byte values the readers branch on (0, 8, 16: a chance)."""
    import random

    rng = random.Random(seed)
    out = []
    for _ in range(n):
        size = rng.choice((0, 1, 2, 3, 4, 5, 8, 20, 60, 200, 2000))
        out.append(bytes(rng.choice((0, 0, 1, 8, 16, 255, rng.randrange(256)))
                         for _ in range(rng.randrange(size + 1))))  # fmt: skip
    return out


def test_the_run_readers_read_what_input_reads() -> None:
    """The lane targets' `_runs` read their input on locals, not with Input's
    methods (the reads were most of those targets' Python): the same runs,
    payloads and position, so the corpora and regress-* inputs mean what
    they meant."""
    import random

    from fuzz import targets_lanes, targets_wire

    rng = random.Random(7)
    for k, data in enumerate(_random_inputs(64, 20_000)):
        size, skip = rng.randrange(1, 3001), k % 3
        a, b = harness.Input(data), harness.Input(data)
        a.take(skip), b.take(skip)
        if k % 2:
            item = rng.choice((1, 2, 4))
            s, c, p = targets_wire._runs(a, size, item)
            want = _runs_wire_by_methods(b, size, item)
        else:
            codec, summed, _ = rng.choice(targets_lanes._UNPACKED)
            s, c, p = targets_lanes._runs(a, size, codec, summed)
            want = _runs_lanes_by_methods(b, size, codec, summed)
        assert (s.tolist(), c.tolist(), p) == want, (data, size)
        assert s.dtype == c.dtype == np.int64
        assert a.at == b.at
