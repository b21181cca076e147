"""Fuzzing the packet decoders, the protocol engine and running daemons.

- In process: a million mutated datagrams (tests/fuzz_daemon.py's corpus)
  through `decode` and `decode_batch`: both agree on every reject reason and
  nothing authenticates. Property tests on top.
- The engine under authenticated garbage (a member with the key sending
  nonsense): nothing escapes `receive`, every datagram is accepted or counted
  once under a reason, and rounds it did not touch still sum exactly.
- Running daemons: datagrams to their UDP ports from loopback while a job
  all-reduces: every one counted under the reason the decoder predicts, no
  daemon dies or stalls, every round of the job exact. 200k by default,
  a million with --run-slow.
"""

from __future__ import annotations

import json
import os
import random
import struct
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dlcp.core.engine import Engine, JobSpec, RoundComplete
from dlcp.core.timing import Timing
from dlcp.errors import Reason, WireError
from dlcp.wire import decode, decode_batch, split_segments
from dlcp.wire.header import (
    _STRUCT,
    ALL_FLAGS,
    MAGIC,
    VERSION,
    Codec,
    compute_mac,
    expected_payload,
)
from tests.fuzz_daemon import Mutator, expected_reason, run_daemon_fuzz, templates
from tests.netsim import Network

JOB = 0xABC
KEY = bytes(range(7, 39))
KEYS = {JOB: KEY, JOB + 1: bytes(range(32))}
TEMPLATES = templates(JOB, KEY) + templates(JOB + 1, KEYS[JOB + 1])


def _reason(dg: bytes | memoryview) -> Reason | None:
    try:
        decode(dg, KEYS)
    except WireError as exc:
        return exc.reason
    return None


def _report(name: str, figures: dict[str, object]) -> None:
    """Print the figures (pytest -s) and keep them in $DLCP_RELIABILITY_OUT if set."""
    print(f"\n{name}: {json.dumps(figures, sort_keys=True)}")
    out = os.environ.get("DLCP_RELIABILITY_OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / f"{name}.json").write_text(json.dumps(figures, indent=2, sort_keys=True))


# --- the decoders, in process ------------------------------------------------------


def test_templates_are_valid_and_mutations_never_are() -> None:
    for t in TEMPLATES:
        assert _reason(t) is None
    m = Mutator(TEMPLATES, seed=0)
    assert all(_reason(dg) is not None for dg in m.many(5000))


@pytest.mark.parametrize("count", [1_000_000])
def test_a_million_mutated_datagrams_decode_and_decode_batch_agree(count: int) -> None:
    """Both decoders on the same million datagrams: the same reject reason for
    each (compared as per-batch counts), none accepted, no other exception."""
    m = Mutator(TEMPLATES, seed=20)
    total: Counter[str] = Counter()
    batch_size = 1024
    done = 0
    while done < count:
        n = min(batch_size, count - done)
        dgs = m.many(n)
        single: Counter[Reason] = Counter()
        for dg in dgs:
            r = _reason(dg)
            assert r is not None, dg.hex()
            single[r] += 1
        b = decode_batch(dgs, KEYS)
        assert len(b) == 0
        assert b.rejects == single
        total.update({r.label: k for r, k in single.items()})
        done += n
    assert sum(total.values()) == count
    # the corpus reaches every decoder check, the MAC included
    for r in Reason:
        if r in (Reason.BAD_SENDER, Reason.STALE_ROUND, Reason.MISMATCH, Reason.BAD_ADDRESS):
            continue  # engine and daemon checks, after authentication
        assert total[r.label] > 0, r
    _report("fuzz_decoders", {"datagrams": count, "by_reason": dict(total), "kinds": m.kinds})


def test_gso_trains_split_and_decode_like_single_datagrams() -> None:
    m = Mutator(TEMPLATES, seed=21)
    for _ in range(300):
        train = m.gso_train()
        size = len(train[0])
        parts = split_segments(b"".join(train), size)
        assert [bytes(p) for p in parts] == train
        b = decode_batch(parts, KEYS)
        assert len(b) == 0
        assert b.rejects == Counter(_reason(dg) for dg in train)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 2**64), st.integers(1, 64))
def test_mutated_datagrams_rejected_alike_one_by_one(seed: int, n: int) -> None:
    dgs = Mutator(TEMPLATES, seed=seed).many(n)
    reasons = [_reason(dg) for dg in dgs]
    assert None not in reasons
    for dg, r in zip(dgs, reasons, strict=True):
        assert decode_batch([dg], KEYS).rejects == Counter([r])


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=2000), st.sampled_from(["127.0.0.2", "127.0.0.9"]))
def test_oracle_matches_the_daemon_rule_for_arbitrary_bytes(blob: bytes, src: str) -> None:
    """expected_reason never raises and names a real reject label."""
    label = expected_reason(blob, KEYS, {JOB: frozenset({"127.0.0.2"})}, src)
    assert label in {r.label for r in Reason}


# --- the engine under authenticated garbage ------------------------------------------


def _keyed_garbage(rng: random.Random, rounds: list[int]) -> tuple[bytes, int | None]:
    """A datagram that authenticates (a member's key) with hostile field values:
    misaligned or overlapping lanes, wrong totals and codecs, foreign shards and
    senders, NACKs for packets that do not exist, manifests of the wrong size."""
    t = rng.choice((1, 1, 1, 2, 2, 3, 3, 4, 4, 5, 6))
    codec = rng.randrange(4)
    per = {0: 352, 1: 704, 2: 1024, 3: 2048}[codec]
    r = rng.random()
    if r < 0.001:
        total = rng.choice(((1 << 32) - 1, 1 << 31))  # a member announcing a giant bucket
    elif r < 0.6:
        total = per * rng.randrange(1, 12)
    else:
        total = rng.choice((1, per - 1, per + 1, 3000, 20_000, rng.randrange(1, 1 << 16)))
    flags = rng.randrange(64) & ALL_FLAGS
    if t in (1, 2):
        i = rng.randrange(-(-total // per))
        off = i * per if rng.random() < 0.7 else rng.randrange(total)
        count = min(per, total - off) if rng.random() < 0.7 else rng.randrange(1, per + 1)
        count = max(1, min(count, total - off))
    else:
        off = rng.randrange(4)
        count = rng.choice((0, 1, 2, 5, 30, rng.randrange(100)))
        if t == 5:
            count = rng.randrange(3)
    sender = rng.choice((1, 2, 1, 2, 1, 2, 0, 3, 400))
    src = sender if rng.random() < 0.85 else rng.choice((None, 1, 2))
    head = _STRUCT.pack(
        MAGIC,
        VERSION,
        t,
        flags,
        rng.randrange(8),
        codec,
        0,
        JOB,
        rng.choice(rounds),
        rng.randrange(3),
        rng.choice((0, 0, 0, 1, 2, 3, 65535)),
        rng.randrange(70000) & 0xFFFF,
        sender,
        rng.choice((0, 1, 1, 2, 3, 65535)),
        off,
        count,
        total,
        rng.choice((0.0, 0.0, 0.05, 0.5, 1.0, -1.0, 3.0, 1e38)),
        rng.getrandbits(32),
    )
    n = expected_payload(t, codec, flags, count, 0)
    if t == 3:
        payload = b"".join(
            struct.pack("!I", rng.choice((0, 1, 2, 3, 7, 40, 0xFFFFFFFF))) for _ in range(count)
        )
    else:
        payload = rng.randbytes(n)
    return head + compute_mac(KEY, head, payload) + payload, (None if src is None else int(src))


def _engines(timing: Timing) -> dict[int, Engine]:
    engines = {n: Engine(timing=timing) for n in range(3)}
    for n, e in engines.items():
        e.add_job(JobSpec.transpose(JOB, KEY, n, 3))
    return engines


@pytest.mark.parametrize(
    "count", [pytest.param(20_000), pytest.param(300_000, marks=pytest.mark.slow)]
)
def test_authenticated_garbage_never_escapes_the_engine(count: int) -> None:
    """Three engines run real rounds (every 10th round number); between them,
    node 0 gets keyed garbage for the round numbers in between. Nothing
    raises, every datagram is accepted or counted once, real rounds stay exact."""
    timing = Timing(timeout=1.0, retain=0.5)
    engines = _engines(timing)
    net = Network(engines, seed=3, loss=0.01, duplicate=0.01)
    rng = random.Random(4)
    data_rng = np.random.default_rng(5)
    per_round = 2000
    rounds = max(1, count // per_round)
    accepted = 0
    for k in range(rounds):
        real = 10 * k
        xs = [data_rng.standard_normal(5000).astype(np.float32) for _ in range(3)]
        for n, e in engines.items():
            e.submit(
                job=JOB,
                round=real,
                bucket=0,
                codec=Codec.FP32,
                total=5000,
                lanes=xs[n],
                now=net.now,
            )
        start = {n: len(net.events[n]) for n in engines}
        net.flush_all()
        # rounds between the real ones, and the previous real (closed) round
        garbage_rounds = [real + j for j in range(-10, 10) if real + j >= 0 and j % 10]
        garbage_rounds += [real - 10] if real else []
        for _ in range(per_round):
            dg, src = _keyed_garbage(rng, garbage_rounds)
            before = sum(engines[0].rejects.values())
            got = engines[0].receive(dg, net.now, src=src)
            grew = sum(engines[0].rejects.values()) - before
            assert grew == (0 if got is not None else 1)
            accepted += got is not None
            net.flush(0)
            net.now += 0.0002

        def finished(real: int = real, start: dict[int, int] = start) -> bool:
            return all(any(ev.round == real for ev in net.events[n][start[n] :]) for n in engines)

        net.run(until=net.now + 30, done=finished)
        expected = xs[0] + xs[1] + xs[2]
        for n in engines:
            ends = [ev for ev in net.events[n][start[n] :] if ev.round == real]
            assert ends, f"round {real} did not end at node {n}"
            ev = ends[0]
            assert isinstance(ev, RoundComplete), ev
            np.testing.assert_array_equal(ev.sums, expected)
    rejects = {r.label: c for r, c in engines[0].rejects.items()}
    _report(
        "fuzz_engine_keyed" + ("_slow" if count > 20_000 else ""),
        {
            "datagrams": rounds * per_round,
            "accepted": accepted,
            "rejects": rejects,
            "real_rounds": rounds,
            "stats": dict(engines[0].stats),
        },
    )


# --- running daemons ----------------------------------------------------------------


def _daemon_fuzz(tmp: Path, count: int, name: str) -> None:
    report = run_daemon_fuzz(tmp, count, seed=7)
    _report(name, report)
    assert report["sent"] == count
    assert report["predicted"].get("accepted", 0) == 0
    assert report["daemons_alive"], report
    assert not report["stalls"], report["stalls"]
    assert not report["mismatch"], report["mismatch"]  # each counted under its reason
    assert sum(report["by_reason"].values()) == count
    assert report["metrics_by_reason"] == report["by_reason"]  # /metrics agrees with status
    assert report["kernel_drops"] == 0
    assert not report["job_failures"], report["job_failures"]
    assert report["rounds"] >= 3


def test_daemons_count_every_fuzzed_datagram_while_a_job_runs(tmp_path: Path) -> None:
    _daemon_fuzz(tmp_path, 200_000, "fuzz_daemon")


@pytest.mark.slow
def test_daemons_count_a_million_fuzzed_datagrams_while_a_job_runs(tmp_path: Path) -> None:
    _daemon_fuzz(tmp_path, 1_000_000, "fuzz_daemon_slow")
