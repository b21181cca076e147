"""Property tests of the wire format: single and batch decoders, MAC keys."""

from __future__ import annotations

import random
import struct
import warnings
from collections import Counter

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from dlcp.errors import Reason, WireError
from dlcp.wire import (
    HEADER_DTYPE,
    HEADER_SIZE,
    MAX_PAYLOAD,
    Codec,
    Flags,
    Header,
    PacketType,
    decode,
    decode_batch,
    encode,
    encode_batch,
    lane_bytes,
    mac_key,
    split_segments,
)
from dlcp.wire.header import (
    ALL_FLAGS,
    LANE_BITS,
    MAC_OFFSET,
    MAC_SIZE,
    MAGIC,
    MAX_PRIORITY,
    VERSION,
    expected_payload,
)
from dlcp.wire.mac import mac_state

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

U16 = 0xFFFF
U32 = 0xFFFFFFFF
SECRET = b"test-secret"
JOB = 7
KEY = mac_key(SECRET, JOB)
KEYS = {JOB: KEY}
# Lanes a data/result packet may carry in these tests (keeps payloads small);
# the full payload budget is exercised separately.
MAX_LANES = 3000

u16 = st.integers(0, U16)
u32 = st.integers(0, U32)
f32 = st.floats(width=32, allow_nan=False, allow_infinity=False)
flags_st = st.integers(0, ALL_FLAGS).map(Flags)
priority_st = st.integers(0, MAX_PRIORITY)
codec_st = st.sampled_from(list(Codec))


def _payload(rnd: int, n: int) -> bytes:
    return random.Random(rnd).randbytes(n)


def _payload_len(h: Header) -> int:
    summed = h.type == PacketType.RESULT or bool(h.flags & Flags.SUMMED)
    if h.type in (PacketType.DATA, PacketType.RESULT):
        return lane_bytes(h.codec, h.count, summed)
    return {
        PacketType.NACK: 4 * h.count,
        PacketType.DONE: (h.count + 7) // 8,
        PacketType.ACK: 0,
        PacketType.CONTROL: h.count,
    }[h.type]


@st.composite
def headers(draw: st.DrawFn, ptype: PacketType | None = None, job: int | None = None) -> Header:
    """A valid header of any type, every field over its whole legal range."""
    t = draw(st.sampled_from(list(PacketType))) if ptype is None else ptype
    if t in (PacketType.DATA, PacketType.RESULT):
        count = draw(st.integers(1, MAX_LANES))
        offset = draw(st.integers(0, U32 - count))
        total = draw(st.integers(offset + count, U32))
        lo = 1 if t == PacketType.DATA else 0
        contributors = draw(st.integers(lo, U16))
    else:
        count = {
            PacketType.NACK: st.integers(0, 500),
            PacketType.DONE: st.integers(0, 5000),
            PacketType.ACK: u32,  # no payload: count is free
            PacketType.CONTROL: st.integers(0, 1500),
        }[t]
        count = draw(count)
        offset, total, contributors = draw(u32), draw(u32), draw(u16)
    return Header(
        type=t,
        job=draw(u32) if job is None else job,
        round=draw(u32),
        bucket=draw(u32),
        flags=draw(flags_st),
        priority=draw(priority_st),
        codec=draw(codec_st),
        shard=draw(u16),
        layer=draw(u16),
        sender=draw(u16),
        contributors=contributors,
        offset=offset,
        count=count,
        total=total,
        param=draw(f32),
        aux=draw(u32),
    )


@st.composite
def packets(draw: st.DrawFn, job: int | None = JOB) -> tuple[Header, bytes]:
    h = draw(headers(job=job))
    return h, _payload(draw(st.integers(0, 2**32)), _payload_len(h))


def _reason(datagram: bytes | memoryview, keys: dict[int, bytes] = KEYS) -> Reason | None:
    try:
        decode(datagram, keys)
    except WireError as exc:
        assert isinstance(exc.reason, Reason)
        return exc.reason
    return None


def _rejected(datagram: bytes | memoryview, keys: dict[int, bytes] = KEYS) -> Reason:
    with pytest.raises(WireError) as info:
        decode(datagram, keys)
    assert isinstance(info.value.reason, Reason)
    return info.value.reason


# --- round trip ---------------------------------------------------------------


@SETTINGS
@given(st.data())
def test_round_trip_every_type(data: st.DataObject) -> None:
    for t in PacketType:
        h = data.draw(headers(ptype=t))
        payload = _payload(data.draw(st.integers(0, 2**32)), _payload_len(h))
        key = mac_key(SECRET, h.job)
        wire = encode(h, payload, key)
        assert len(wire) == HEADER_SIZE + len(payload)
        got, view = decode(wire, {h.job: key})
        assert got == h
        assert bytes(view) == payload
        assert isinstance(got.type, PacketType)
        assert isinstance(got.flags, Flags)
        assert isinstance(got.codec, Codec)


def _extreme(t: PacketType, hi: bool) -> Header:
    count = {PacketType.DATA: 1, PacketType.RESULT: 1, PacketType.ACK: U32}.get(t, 8)
    return Header(
        type=t,
        job=U32 if hi else 0,
        round=U32 if hi else 0,
        bucket=U32 if hi else 0,
        flags=Flags(ALL_FLAGS) if hi else Flags.NONE,
        priority=MAX_PRIORITY if hi else 0,
        codec=Codec.THC4 if hi else Codec.FP32,
        shard=U16 if hi else 0,
        layer=U16 if hi else 0,
        sender=U16 if hi else 0,
        contributors=U16 if hi else 1,
        offset=U32 - 1 if hi else 0,
        count=count,
        total=U32,
        param=float(np.finfo(np.float32).max) * (-1 if hi else 1),
        aux=U32 if hi else 0,
    )


@pytest.mark.parametrize("hi", [False, True])
@pytest.mark.parametrize("t", list(PacketType))
def test_round_trip_extremes(t: PacketType, hi: bool) -> None:
    h = _extreme(t, hi)
    payload = b"\x5a" * _payload_len(h)
    key = mac_key(SECRET, h.job)
    got, view = decode(encode(h, payload, key), {h.job: key})
    assert got == h
    assert bytes(view) == payload


@pytest.mark.parametrize("codec", list(Codec))
def test_full_payload_budget(codec: Codec) -> None:
    # the largest data packet that fits, and CONTROL at exactly MAX_PAYLOAD
    bits = LANE_BITS[codec][0]  # fp32 32, fp16 16, thc8 8, thc4 4, fft 8, union 1, sketch 32
    count = MAX_PAYLOAD * 8 // bits
    h = Header(PacketType.DATA, JOB, 1, 2, codec=codec, count=count, total=count)
    payload = b"\x01" * lane_bytes(codec, count, False)
    assert decode(encode(h, payload, KEY), KEYS)[0] == h
    c = Header(PacketType.CONTROL, JOB, 1, 2, count=MAX_PAYLOAD)
    assert decode(encode(c, b"\x02" * MAX_PAYLOAD, KEY), KEYS)[0] == c


def test_oversized_payload_rejected() -> None:
    n = MAX_PAYLOAD + 1
    h = Header(PacketType.CONTROL, JOB, 1, 2, count=n)
    with pytest.raises(ValueError):
        encode(h, bytes(n), KEY)
    head = h.pack()
    forged = head + _mac(head, bytes(n)) + bytes(n)
    assert _rejected(forged) == Reason.BAD_LENGTH
    assert decode_batch([forged], KEYS).rejects == Counter({Reason.BAD_LENGTH: 1})


def test_payload_length_ok_matches_encoder() -> None:
    from dlcp.wire.header import payload_length_ok

    for t in PacketType:
        for codec in Codec:
            for flags in (Flags.NONE, Flags.SUMMED):
                for count in (1, 2, 7, 8, 9, 100):
                    h = Header(t, JOB, 0, 0, flags=flags, codec=codec, count=count, total=count)
                    n = _payload_len(h)
                    assert payload_length_ok(t, codec, flags, count, n)
                    assert not payload_length_ok(t, codec, flags, count, n + 1)
                    if n:
                        assert not payload_length_ok(t, codec, flags, count, n - 1)


def test_encode_rejects_invalid_headers() -> None:
    base = Header(PacketType.DATA, JOB, 0, 0, count=4, total=4)
    good = bytes(16)
    encode(base, good, KEY)
    bad = [
        (base.with_(priority=MAX_PRIORITY + 1), good),
        (base.with_(count=0), b""),
        (base.with_(offset=1), good),
        (base.with_(contributors=0), good),
        (base.with_(param=float("nan")), good),
        (base.with_(param=float("inf")), good),
        (base, good + b"\x00"),
        (base, good[:-1]),
        (base.with_(job=U32 + 1), good),
        (base.with_(shard=U16 + 1), good),
        (base.with_(round=-1), good),
    ]
    for h, payload in bad:
        with pytest.raises(ValueError):
            encode(h, payload, KEY)


# --- corruption, truncation, foreign keys --------------------------------------


@settings(max_examples=12, deadline=None)
@given(packets(), st.integers(1, 254))
def test_every_single_byte_corruption_rejected(pkt: tuple[Header, bytes], rmask: int) -> None:
    h, payload = pkt
    wire = encode(h, payload, KEY)
    assert decode(wire, KEYS)[0] == h
    buf = bytearray(wire)
    for pos in range(len(wire)):
        for mask in (0x01, 0x80, 0xFF, rmask):
            buf[pos] ^= mask
            _rejected(bytes(buf))
            buf[pos] ^= mask
    assert bytes(buf) == wire


@settings(max_examples=25, deadline=None)
@given(packets())
def test_every_truncation_and_extension_rejected(pkt: tuple[Header, bytes]) -> None:
    h, payload = pkt
    wire = encode(h, payload, KEY)
    for n in range(len(wire)):
        reason = _rejected(wire[:n])
        assert reason == (Reason.TRUNCATED if n < HEADER_SIZE else Reason.BAD_LENGTH)
    for extra in (b"\x00", b"\xff" * 3, bytes(64)):
        assert _rejected(wire + extra) == Reason.BAD_LENGTH


def test_corruption_specific_reasons() -> None:
    h = Header(PacketType.DATA, JOB, 3, 4, codec=Codec.FP16, count=10, total=20, param=0.5)
    wire = bytearray(encode(h, bytes(20), KEY))

    def hit(pos: int, value: int) -> Reason:
        buf = bytearray(wire)
        buf[pos] = value
        return _rejected(bytes(buf))

    assert hit(0, 0x00) == Reason.BAD_MAGIC
    assert hit(1, 0x00) == Reason.BAD_MAGIC
    assert hit(2, VERSION + 1) == Reason.BAD_VERSION
    assert hit(2, 0) == Reason.BAD_VERSION
    assert hit(3, 0) == Reason.BAD_TYPE
    assert hit(3, max(PacketType) + 1) == Reason.BAD_TYPE
    assert hit(4, 0x80) == Reason.BAD_FLAGS
    assert hit(5, MAX_PRIORITY + 1) == Reason.BAD_PRIORITY
    assert hit(6, max(Codec) + 1) == Reason.BAD_CODEC
    assert hit(7, 1) == Reason.RESERVED
    assert hit(8, 0xEE) == Reason.UNKNOWN_JOB  # job byte
    assert hit(12, 0xEE) == Reason.BAD_MAC  # round byte
    assert hit(35, 0) == Reason.BAD_RANGE  # count 0
    assert hit(35, 21) == Reason.BAD_RANGE  # offset + count > total
    assert hit(35, 9) == Reason.BAD_LENGTH  # count 9 needs 18 bytes
    assert hit(40, 0x7F) == Reason.BAD_MAC  # param 0x7f000000: finite
    for bits in (0x7FC00000, 0x7F800000, 0xFF800000):  # NaN, +inf, -inf
        buf = bytearray(wire)
        struct.pack_into("!I", buf, 40, bits)
        assert _rejected(bytes(buf)) == Reason.BAD_RANGE
    assert hit(MAC_OFFSET, wire[MAC_OFFSET] ^ 1) == Reason.BAD_MAC
    assert hit(HEADER_SIZE, 1) == Reason.BAD_MAC  # payload
    # magic is checked before everything else
    both = bytearray(wire)
    both[0], both[2] = 0, 9
    assert _rejected(bytes(both)) == Reason.BAD_MAGIC


@SETTINGS
@given(packets(), st.binary(min_size=1, max_size=40))
def test_wrong_key_and_unknown_job(pkt: tuple[Header, bytes], other: bytes) -> None:
    h, payload = pkt
    wire = encode(h, payload, KEY)
    assert _rejected(wire, {}) == Reason.UNKNOWN_JOB
    assert _rejected(wire, {JOB + 1: KEY}) == Reason.UNKNOWN_JOB
    assert _rejected(wire, {JOB: mac_key(SECRET + other, JOB)}) == Reason.BAD_MAC
    assert _rejected(wire, {JOB: mac_key(SECRET, JOB + 1)}) == Reason.BAD_MAC
    # the right key among others still verifies
    assert decode(wire, {JOB + 1: b"x", JOB: KEY})[0] == h
    # signed with another job's key, claiming this job
    assert _rejected(encode(h, payload, mac_key(SECRET, JOB + 1))) == Reason.BAD_MAC


@SETTINGS
@given(packets(), st.integers(0, U16), st.integers(0, 255))
def test_magic_and_version_mismatch(pkt: tuple[Header, bytes], magic: int, version: int) -> None:
    h, payload = pkt
    wire = bytearray(encode(h, payload, KEY))
    if magic != MAGIC:
        forged = bytearray(wire)
        struct.pack_into("!H", forged, 0, magic)
        # re-MAC so that only the magic is wrong
        forged[MAC_OFFSET:HEADER_SIZE] = _mac(bytes(forged[:MAC_OFFSET]), payload)
        assert _rejected(bytes(forged)) == Reason.BAD_MAGIC
    if version != VERSION:
        forged = bytearray(wire)
        forged[2] = version
        forged[MAC_OFFSET:HEADER_SIZE] = _mac(bytes(forged[:MAC_OFFSET]), payload)
        assert _rejected(bytes(forged)) == Reason.BAD_VERSION


def _mac(head: bytes, payload: bytes, key: bytes = KEY) -> bytes:
    import hashlib

    h = hashlib.blake2b(key=key, digest_size=MAC_SIZE)
    h.update(head)
    h.update(payload)
    return h.digest()


# --- fuzz: arbitrary bytes never escape as anything but WireError ----------------

_valid_prefix = struct.pack("!HB", MAGIC, VERSION)


@settings(max_examples=400, deadline=None)
@given(
    st.one_of(
        st.binary(max_size=200),
        st.binary(min_size=HEADER_SIZE - 3, max_size=300).map(lambda b: _valid_prefix + b),
    )
)
def test_random_bytes_only_wire_errors(blob: bytes) -> None:
    # an accepted random packet would need a forged MAC
    keys = {struct.unpack_from("!I", blob, 8)[0]: KEY} if len(blob) >= 12 else KEYS
    assert _reason(blob, keys) is not None
    assert _reason(bytearray(blob), keys) is not None
    assert _reason(memoryview(blob), keys) is not None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the receive loop must not warn either
        batch = decode_batch([blob], keys)
    assert len(batch) == 0
    assert sum(batch.rejects.values()) == 1


# --- batch decoder agrees with the single decoder ----------------------------------


def _sign(head48: bytes, payload: bytes) -> bytes:
    return head48 + _mac(head48, payload) + payload


@st.composite
def raw_fields(draw: st.DrawFn) -> bytes:
    """A signed datagram whose header fields are arbitrary, valid or not."""
    small = st.integers(0, 12)
    head = struct.pack(
        "!HBBBBBBIIIHHHHIIIfI",
        draw(st.sampled_from([MAGIC, MAGIC, MAGIC, 0xCFD1, 0])),
        draw(st.sampled_from([VERSION, VERSION, VERSION, 0, 2])),
        draw(st.integers(0, 8)),
        draw(st.integers(0, 255)),
        draw(st.integers(0, 9)),
        draw(st.integers(0, 5)),
        draw(st.sampled_from([0, 0, 0, 1])),
        draw(st.sampled_from([JOB, JOB, JOB, JOB + 1])),
        draw(u32),
        draw(u32),
        draw(u16),
        draw(u16),
        draw(u16),
        draw(st.sampled_from([0, 1, 2])),
        draw(small),
        draw(small),
        draw(small),
        draw(st.floats(width=32) | st.sampled_from([float("nan"), float("inf")])),
        draw(u32),
    )
    t, flags, _, codec = struct.unpack_from("!3xBBBB", head)
    count = struct.unpack_from("!I", head, 32)[0]
    plen = draw(st.integers(0, 60))
    if t in set(PacketType) and codec in set(Codec) and draw(st.booleans()):
        plen = expected_payload(t, codec, flags, count, plen)
    payload = draw(st.binary(min_size=plen, max_size=plen))
    return _sign(head, payload)


@st.composite
def mixed_batches(draw: st.DrawFn) -> list[bytes]:
    out: list[bytes] = []
    for _ in range(draw(st.integers(0, 24))):
        kind = draw(st.sampled_from(["valid", "corrupt", "trunc", "extend", "foreign", "raw"]))
        if kind == "raw":
            out.append(draw(raw_fields()))
            continue
        h, payload = draw(packets())
        wire = encode(h, payload, KEY)
        if kind == "corrupt":
            pos = draw(st.integers(0, len(wire) - 1))
            buf = bytearray(wire)
            buf[pos] ^= draw(st.integers(1, 255))
            wire = bytes(buf)
        elif kind == "trunc":
            wire = wire[: draw(st.integers(0, len(wire) - 1))]
        elif kind == "extend":
            wire += draw(st.binary(min_size=1, max_size=8))
        elif kind == "foreign":
            wire = encode(h, payload, mac_key(b"other", JOB))
        out.append(wire)
    return out


def _assert_agree(datagrams: list[bytes], keys: dict[int, bytes] = KEYS) -> None:
    want_ok: list[tuple[int, Header, bytes]] = []
    want_rejects: Counter[Reason] = Counter()
    for i, d in enumerate(datagrams):
        try:
            h, p = decode(d, keys)
        except WireError as exc:
            want_rejects[exc.reason] += 1
        else:
            want_ok.append((i, h, bytes(p)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        batch = decode_batch(datagrams, keys)
    assert batch.rejects == want_rejects
    assert len(batch) == len(want_ok)
    assert batch.index.tolist() == [i for i, _, _ in want_ok]
    assert batch.fields.dtype == HEADER_DTYPE
    for j, (_, h, p) in enumerate(want_ok):
        assert batch.header(j) == h
        assert bytes(batch.payloads[j]) == p


@SETTINGS
@given(mixed_batches())
def test_decode_batch_agrees_on_mixed_batches(datagrams: list[bytes]) -> None:
    _assert_agree(datagrams)
    _assert_agree([memoryview(d) for d in datagrams])
    _assert_agree(datagrams, {})


@settings(max_examples=300, deadline=None)
@given(st.lists(raw_fields(), max_size=6))
def test_decode_batch_agrees_on_arbitrary_fields(datagrams: list[bytes]) -> None:
    _assert_agree(datagrams)


def test_decode_batch_agrees_on_every_corruption() -> None:
    h = Header(PacketType.DATA, JOB, 1, 2, codec=Codec.THC4, count=9, total=12, param=1.5)
    wire = encode(h, bytes(5), KEY)
    out = [wire]
    for pos in range(len(wire)):
        for mask in (0x01, 0x40, 0xFF):
            buf = bytearray(wire)
            buf[pos] ^= mask
            out.append(bytes(buf))
    out += [wire[:n] for n in range(len(wire))]
    _assert_agree(out)
    assert len(decode_batch(out, KEYS)) == 1


@pytest.mark.parametrize("bits", [0x7F800001, 0xFFC00000, 0x7F800000, 0xFF800000])
def test_non_finite_param_rejected_without_warning(bits: int) -> None:
    # signalling and quiet NaNs, infinities: BAD_RANGE, and no numpy warning
    h = Header(PacketType.DONE, JOB, 1, 2, count=8)
    head = bytearray(h.pack())
    struct.pack_into("!I", head, 40, bits)
    wire = _sign(bytes(head), b"\x01")
    assert _rejected(wire) == Reason.BAD_RANGE
    # a wrong payload length is reported before the param, by both decoders
    short = _sign(bytes(head), b"")
    assert _rejected(short) == Reason.BAD_LENGTH
    _assert_agree([wire, short, wire])


def test_decode_batch_empty() -> None:
    batch = decode_batch([], KEYS)
    assert len(batch) == 0
    assert batch.rejects == Counter()
    assert batch.index.tolist() == []


# --- encode_batch / split_segments ---------------------------------------------


def _to_record(h: Header, rec: np.ndarray) -> None:
    for name in HEADER_DTYPE.names:
        if name in ("magic", "version", "reserved", "mac"):
            continue
        rec[name] = getattr(h, name)


@SETTINGS
@given(st.lists(packets(), max_size=10))
def test_encode_batch_matches_encode(pkts: list[tuple[Header, bytes]]) -> None:
    heads = np.zeros(len(pkts), dtype=HEADER_DTYPE)
    for i, (h, _) in enumerate(pkts):
        _to_record(h, heads[i : i + 1])
    payloads = [p for _, p in pkts]
    wires = encode_batch(heads, payloads, KEY)
    assert wires == [encode(h, p, KEY) for h, p in pkts]
    batch = decode_batch(wires, KEYS)
    assert batch.rejects == Counter()
    assert [batch.header(i) for i in range(len(batch))] == [h for h, _ in pkts]
    assert [bytes(p) for p in batch.payloads] == payloads


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(packets(), min_size=1, max_size=3), st.integers(1, 200))
def test_encode_batch_with_ghash_aes_matches_encode_across_chunks(
    pkts: list[tuple[Header, bytes]], n: int
) -> None:
    """Batches of up to 200 packets span several ENCODE_CHUNKs: every datagram
    is still the one `encode` makes alone, and authenticates."""
    from dlcp.wire.mac import ENCODE_CHUNK

    assert ENCODE_CHUNK < 200
    key = mac_state(bytes(KEY), "ghash-aes")
    pkts = [pkts[i % len(pkts)] for i in range(n)]
    heads = np.zeros(n, dtype=HEADER_DTYPE)
    for i, (h, _) in enumerate(pkts):
        _to_record(h, heads[i : i + 1])
    wires = encode_batch(heads, [p for _, p in pkts], key)
    assert wires == [encode(h, p, key) for h, p in pkts]
    batch = decode_batch(wires, {JOB: key})
    assert batch.rejects == Counter() and len(batch) == n


@SETTINGS
@given(
    st.integers(0, 3).map(lambda c: Codec(c)),
    st.integers(1, 300),
    st.integers(1, 12),
    st.integers(0, 2**32),
    st.booleans(),
)
def test_split_segments_round_trip(
    codec: Codec, count: int, n: int, seed: int, short_last: bool
) -> None:
    # a GRO buffer: n equal-size segments, the last possibly shorter
    pkts = []
    for i in range(n):
        c = count if not (short_last and i == n - 1 and count > 1) else count - 1
        h = Header(
            PacketType.DATA, JOB, 5, 9, codec=codec, offset=i * count, count=c, total=n * count
        )
        pkts.append((h, _payload(seed + i, lane_bytes(codec, c, False))))
    wires = [encode(h, p, KEY) for h, p in pkts]
    seg = len(wires[0])
    buf = b"".join(wires)
    parts = split_segments(buf, seg)
    assert [bytes(p) for p in parts] == wires
    batch = decode_batch(parts, KEYS)
    assert [batch.header(i) for i in range(len(batch))] == [h for h, _ in pkts]
    # no or oversized segment size: the buffer is one datagram
    for s in (0, -1, len(buf), len(buf) + 1):
        assert [bytes(p) for p in split_segments(buf, s)] == [buf]
    # segments are views, not copies
    assert all(isinstance(p, memoryview) for p in parts)


# --- keys ------------------------------------------------------------------------


@SETTINGS
@given(st.binary(max_size=64), u32, st.binary(max_size=64), u32)
def test_mac_key_deterministic_and_distinct(s1: bytes, j1: int, s2: bytes, j2: int) -> None:
    k = mac_key(s1, j1)
    assert isinstance(k, bytes)
    assert len(k) == 32
    assert k == mac_key(s1, j1)
    assert k == mac_key(bytes(s1), j1)
    if (s1, j1) != (s2, j2):
        assert k != mac_key(s2, j2)
    assert k != mac_key(s1, (j1 + 1) % (U32 + 1))
    assert k != mac_key(s1 + b"\x00", j1)


@SETTINGS
@given(st.text(max_size=30), u32)
def test_mac_key_str_is_utf8(secret: str, job: int) -> None:
    assert mac_key(secret, job) == mac_key(secret.encode(), job)


def test_mac_key_known_values() -> None:
    assert mac_key(b"s", 1) != mac_key(b"s", 2)
    assert mac_key(b"s", 1) != mac_key(b"t", 1)
    assert mac_key("s", 1) == mac_key(b"s", 1)


@example(b"")
@given(st.binary(max_size=8))
@settings(max_examples=20, deadline=None)
def test_empty_and_tiny_are_truncated(blob: bytes) -> None:
    assert _reason(blob) == Reason.TRUNCATED
