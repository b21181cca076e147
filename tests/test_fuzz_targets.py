"""The fuzz targets of fuzz/ (run coverage-guided and sanitized by
`bash scripts/fuzz`) with the normal build: every seed of the corpus, findings'
inputs among them, passes its target (the C result is its Python twin's), and
every C function that reads bytes from the network or from a rank has a
target, so that a new entry point is fuzzed or is said here why not."""

from __future__ import annotations

import os

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
