"""The C ghash-aes MAC (dlcp/wire/_ghash.c: its own AVX-512 GHASH, and
OpenSSL's GCM) against the Python one (the `cryptography` package): the same
tags, datagrams and verdicts, bit for bit, for every payload length around the
16-byte block edges, the 8-block groups and the 128-block chunks, and for views into larger buffers;
bad input is refused with an error, not a crash.

The project's install builds the extension (setup.py), so its absence fails
here; set DLCP_ALLOW_NO_NATIVE=1 to run the suite where it cannot be built.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from dlcp.wire import mac
from dlcp.wire.batch import HEADER_DTYPE, decode_batch, encode_batch
from dlcp.wire.mac import GhashAesKey
from dlcp.wire.slices import Slices

KEY = bytes(range(32))
LENGTHS = [
    *range(0, 40),
    *range(240, 275),  # 15 to 17 blocks: the AVX-512 loop's 8-block groups and rest
    *range(500, 530),
    *range(760, 790),
    *range(1960, 2010),  # 127 to 130 blocks with the header's: one chunk of key powers, two
    *range(4020, 4045),  # the edge of two chunks and three
    4095,
    4096,
    4097,
    8908,
    8909,
    65000,
]

if mac._ghash is None and os.environ.get("DLCP_ALLOW_NO_NATIVE") == "1":
    pytest.skip("dlcp.wire._ghash is not built (DLCP_ALLOW_NO_NATIVE=1)", allow_module_level=True)


def _c(key: bytes, avx512: bool) -> GhashAesKey:
    assert mac._ghash is not None, "dlcp.wire._ghash was not built: pip install -e . builds it"
    return GhashAesKey(key, native=True, avx512=avx512)


@pytest.fixture(scope="module", params=["C, AVX-512", "C, OpenSSL"])
def keys(request: pytest.FixtureRequest) -> tuple[GhashAesKey, GhashAesKey]:
    """A C key of one backend and the Python key."""
    c = _c(KEY, avx512=request.param == "C, AVX-512")
    if c.backend != request.param:
        pytest.skip(f"this CPU has no AVX-512 VPCLMULQDQ: {c.backend} only")
    return c, GhashAesKey(KEY, native=False)


def _inputs(seed: int) -> tuple[list[bytes], list[memoryview]]:
    rng = np.random.default_rng(seed)
    heads = [rng.bytes(48) for _ in LENGTHS]
    big = rng.bytes(sum(LENGTHS) + 3 * len(LENGTHS))
    payloads, at = [], 0
    for n in LENGTHS:  # views at odd offsets into one buffer, as the daemon's are
        at += 3
        payloads.append(memoryview(big)[at : at + n])
        at += n
    return heads, payloads


def test_tags_are_the_python_ones(keys: tuple[GhashAesKey, GhashAesKey]) -> None:
    c, py = keys
    assert c.native and not py.native
    for seed in range(4):
        heads, payloads = _inputs(seed)
        assert c.tags(heads, payloads) == py.tags(heads, payloads)
    # another key gives other tags
    other = GhashAesKey(bytes(32), native=True)
    assert other.tags(heads, payloads) != c.tags(heads, payloads)
    assert other.tags(heads, payloads) == GhashAesKey(bytes(32), native=False).tags(heads, payloads)


def test_the_avx512_backend_makes_the_tags_aes_with_aes_ni() -> None:
    """With the AVX-512 backend the tag's AES-256 block is made by AES-NI
    (its own key expansion, checked against OpenSSL at set-up) where the CPU
    has it, so that the comparisons with Python above are of that path; the
    OpenSSL backend leaves it to OpenSSL."""
    c = _c(KEY, avx512=True)
    if c.backend != "C, AVX-512":
        pytest.skip(f"this CPU has no AVX-512 VPCLMULQDQ: {c.backend} only")
    flags = Path("/proc/cpuinfo").read_text().split()
    native = c._native
    assert native.aesni == ("aes" in flags)
    assert not _c(KEY, avx512=False)._native.aesni
    for key in (bytes(32), bytes(range(32, 64)), b"\xff" * 32):  # expansions of other keys
        a, b = GhashAesKey(key, native=True), GhashAesKey(key, native=False)
        dg = a.encode(b"\x5a" * 48 + bytes(16), [b"payload" * 41])[0]
        assert dg == b.encode(b"\x5a" * 48 + bytes(16), [b"payload" * 41])[0]


def test_encode_and_verify_agree_with_python(keys: tuple[GhashAesKey, GhashAesKey]) -> None:
    c, py = keys
    heads, payloads = _inputs(7)
    raw = b"".join(h + b"\xee" * 16 for h in heads)  # tag bytes in the records are ignored
    dgs = c.encode(raw, payloads)
    assert dgs == py.encode(raw, payloads)
    assert [d[64:] for d in dgs] == [bytes(p) for p in payloads]
    assert c.verify(dgs).all() and py.verify(dgs).all()
    # one flipped bit anywhere (header, tag, payload) fails that datagram only
    rng = np.random.default_rng(1)
    for i in range(0, len(dgs), 7):  # a sample of the lengths: every one costs a verify per bit
        d = dgs[i]
        for pos in {0, 47, 48, 63, len(d) - 1, int(rng.integers(0, len(d)))}:
            bad = bytearray(d)
            bad[pos] ^= 1 << int(rng.integers(0, 8))
            trial = [*dgs[:i], bytes(bad), *dgs[i + 1 :]]
            want = np.ones(len(dgs), dtype=bool)
            want[i] = False
            assert c.verify(trial).tolist() == want.tolist()
            assert py.verify(trial).tolist() == want.tolist()


def test_encode_batch_is_the_same_either_way(keys: tuple[GhashAesKey, GhashAesKey]) -> None:
    c, py = keys
    n = 150  # more than mac.ENCODE_CHUNK, so the Python path takes several chunks
    assert n > mac.ENCODE_CHUNK
    heads = np.zeros(n, dtype=HEADER_DTYPE)
    heads["type"] = 1
    heads["job"] = 4
    heads["count"] = 100
    heads["total"] = 100 * n
    heads["offset"] = np.arange(n) * 100
    heads["contributors"] = 1
    lanes = np.random.default_rng(3).standard_normal(100 * n).astype(">f4").tobytes()
    payloads = [memoryview(lanes)[i * 400 : (i + 1) * 400] for i in range(n)]
    a = encode_batch(heads.copy(), payloads, c)
    assert a == encode_batch(heads.copy(), payloads, py)
    for k in keys:
        got = decode_batch(a, {4: k})
        assert len(got) == n and not got.rejects


def test_encode_from_slices_is_encode_of_the_views(keys: tuple[GhashAesKey, GhashAesKey]) -> None:
    """Payloads named by (buffer, starts, lengths), as the engine sends a shard:
    the C copy straight from the buffer gives the datagrams that encoding the
    views one by one gives, on both backends and in Python."""
    c, py = keys
    heads, views = _inputs(11)
    big = views[0].obj  # the buffer every view lies in
    lengths = np.array(LENGTHS, dtype=np.int64)
    starts = 3 * np.arange(1, len(LENGTHS) + 1) + np.cumsum(lengths) - lengths  # as `_inputs`
    raw = b"".join(h + bytes(16) for h in heads)
    sl = Slices(big, starts, lengths)
    assert [bytes(v) for v in sl] == [bytes(v) for v in views]
    assert bytes(sl[5]) == bytes(views[5]) and len(sl[3:9]) == 6
    want = py.encode(raw, views)
    assert c.encode(raw, sl) == want
    assert py.encode(raw, sl) == want
    assert c.encode(raw[: 10 * 64], sl[:10]) == want[:10]
    # the C checks under the wrapper's: each slice inside the buffer, one length
    native = c._native
    with pytest.raises(ValueError, match="outside the buffer"):
        native.encode_from(raw[:64], big, np.array([len(big) - 3]), np.array([4]))
    with pytest.raises(ValueError, match="outside the buffer"):
        native.encode_from(raw[:64], big, np.array([-1]), np.array([4]))
    with pytest.raises(ValueError, match="one length"):
        native.encode_from(raw[:64], big, np.array([0]), np.array([1, 2]))
    with pytest.raises(ValueError, match="header bytes"):
        native.encode_from(raw[:64], big, np.array([0, 1]), np.array([1, 2]))
    with pytest.raises(ValueError, match="outside the buffer"):  # and the Python type's
        Slices(big, np.array([len(big) - 3]), np.array([4]))
    with pytest.raises(ValueError, match="one length"):
        Slices(big, np.array([0]), np.array([1, 2]))


def test_encode_gather_makes_the_same_datagrams_in_place(
    keys: tuple[GhashAesKey, GhashAesKey],
) -> None:
    """`encode_gather` (payloads left where they lie) makes the datagrams
    `encode` makes: joined, compared, indexed and sliced they are those bytes;
    the header (`head`: a copy) is held in the datagram and the payload is a
    view of the caller's buffer. Bad slices are refused as by `encode_from`."""
    c, py = keys
    heads, views = _inputs(12)
    big = bytearray(views[0].obj)  # writable: the payloads are read from it in place
    lengths = np.array(LENGTHS, dtype=np.int64)
    starts = 3 * np.arange(1, len(LENGTHS) + 1) + np.cumsum(lengths) - lengths
    raw = b"".join(h + bytes(16) for h in heads)
    want = py.encode(raw, views)
    got = c.encode_gather(raw, Slices(memoryview(big), starts, lengths))
    assert py.encode_gather(raw, Slices(memoryview(big), starts, lengths)) == want  # no C: bytes
    assert [type(g).__name__ for g in got] == ["Gathered"] * len(want)
    assert [bytes(g) for g in got] == want and got == want
    assert c.verify([bytes(g) for g in got]).all()
    g, w = got[-1], want[-1]  # the longest payload
    assert len(g) == len(w) and g.head == w[:64] and bytes(g.payload) == w[64:]
    for i in (0, 3, 47, 48, 63, 64, 65, len(w) - 1, -1, -len(w)):
        assert g[i] == w[i], i
    for sl in (slice(3, 4), slice(8, 36), slice(0, 64), slice(60, 70), slice(64, None),
               slice(100, 200), slice(None, None, 7), slice(-5, None), slice(50, 10)):  # fmt: skip
        assert g[sl] == w[sl], sl
    with pytest.raises(IndexError):
        g[len(w)]
    with pytest.raises(TypeError):
        hash(g)
    assert f"{len(w)} bytes" in repr(g)
    native = c._native
    with pytest.raises(ValueError, match="outside the buffer"):
        native.encode_gather(raw[:64], big, np.array([len(big) - 3]), np.array([4]))
    with pytest.raises(ValueError, match="one length"):
        native.encode_gather(raw[:64], big, np.array([0]), np.array([1, 2]))
    with pytest.raises(ValueError, match="header bytes"):
        native.encode_gather(raw[:64], big, np.array([0, 1]), np.array([1, 2]))


def test_gathered_payloads_are_read_in_place_until_detached() -> None:
    """A Gathered datagram reads its payload from the caller's buffer, which it
    keeps alive; `detach_gathered` gives it a copy (all of a list, or those
    something else still holds), after which the buffer is the caller's again."""
    c = _c(KEY, avx512=True)
    arr = np.arange(4000, dtype=np.uint8)
    sl = Slices(memoryview(arr), np.array([0, 1000, 2000, 3000]), np.array([1000] * 4))
    dgs = c.encode_gather(bytes(4 * 64), sl)
    before = [bytes(d) for d in dgs]
    arr[:10] = 0xEE  # in place: the first datagram's payload changes with it
    assert bytes(dgs[0])[64:74] == b"\xee" * 10 and bytes(dgs[1]) == before[1]
    with pytest.raises(ValueError):  # the datagrams hold the array's memory
        arr.resize(10)
    queue = [dgs[2]]  # something else holds the third one
    assert mac.detach_gathered(dgs, shared_only=True) == 1000
    arr[:] = 0
    assert bytes(queue[0]) == before[2]
    assert bytes(dgs[3])[64:] == bytes(1000)  # not detached: still reads the array
    assert mac.detach_gathered(dgs) == 3000  # the other three
    assert mac.detach_gathered(dgs) == 0  # each has its own copy now
    arr[:] = 7
    assert bytes(dgs[3])[64:] == bytes(1000) and bytes(dgs[1])[64:] == bytes(1000)
    assert mac.detach_gathered([b"plain bytes", bytearray(3)]) == 0
    del arr, sl  # the datagrams' copies outlive the buffer
    assert bytes(dgs[2]) == before[2]


def test_the_datagrams_of_a_call_share_one_export_of_the_buffer() -> None:
    """The datagrams of one `encode_gather` call hold one export of the
    caller's buffer between them: it is released when the last of them is
    freed or detached, not before, and a payload view keeps it too."""
    c = _c(KEY, avx512=True)
    buf = bytearray(range(256)) * 12
    sl = Slices(memoryview(buf), np.array([0, 1000, 2000]), np.array([1000] * 3))
    dgs = c.encode_gather(bytes(3 * 64), sl)
    del sl
    want = [bytes(d) for d in dgs]
    assert [w[64:] for w in want] == [bytes(buf[i : i + 1000]) for i in (0, 1000, 2000)]
    last = dgs[2]
    del dgs
    with pytest.raises(BufferError):  # one datagram left: the export with it
        buf.append(0)
    view = last.payload  # read-only, of the shared buffer
    assert view.readonly and bytes(view) == want[2][64:]
    assert mac.detach_gathered([last]) == 1000
    assert bytes(last) == want[2]
    with pytest.raises(BufferError):  # the payload view still holds it
        buf.append(0)
    view.release()
    buf.append(0)  # nothing holds the buffer now
    buf[2000:3000] = bytes(1000)
    assert bytes(last) == want[2]  # its own copy


def test_a_gathered_datagram_is_tagged_when_first_read_whole() -> None:
    """The tag is computed when the datagram is first sent, joined, copied or
    its tag bytes read (not when made, nor when header bytes before the tag
    are read): it covers the payload as it is then, and stays that tag."""
    c = _c(KEY, avx512=True)
    arr = np.arange(3000, dtype=np.uint8)
    sl = Slices(memoryview(arr), np.array([0, 1000, 2000]), np.array([1000] * 3))
    heads = b"".join(bytes([k]) * 48 + bytes(16) for k in (1, 2, 3))
    dgs = c.encode_gather(heads, sl)
    assert dgs[0][3] == 1 and dgs[0][8:36] == bytes([1]) * 28  # header reads: no tag yet
    arr[:] = 9  # changed before any whole read: the tags cover the new bytes
    assert dgs[0][48:64] == c.tags([heads[:48]], [bytes([9]) * 1000])
    assert c.verify([bytes(d) for d in dgs]).all()
    arr[:] = 4  # after: the tags are those of the payloads when first read
    assert not c.verify([bytes(d) for d in dgs]).any()
    assert [d.head[48:] for d in dgs] == [
        c.tags([heads[i * 64 : i * 64 + 48]], [bytes([9]) * 1000]) for i in range(3)
    ]


def test_bad_input_is_refused(keys: tuple[GhashAesKey, GhashAesKey]) -> None:
    c, _ = keys
    native = c._native
    with pytest.raises(ValueError, match="48 bytes"):
        c.tags([b"h" * 47], [b"p"])
    with pytest.raises(ValueError, match="payloads"):
        c.tags([b"h" * 48], [])
    with pytest.raises(ValueError, match="header bytes"):
        c.encode(b"h" * 63, [b"p"])
    with pytest.raises(ValueError, match="64 bytes"):
        c.verify([b"d" * 63])
    with pytest.raises(ValueError, match="48 bytes"):  # the C checks, under the wrapper's
        native.tags([b"h" * 49], [b"p"])
    with pytest.raises(ValueError, match="header bytes"):
        native.encode(b"h" * 65, [b"p"])
    with pytest.raises(ValueError, match="fewer than 64"):
        native.verify([b"d" * 64, b"d" * 10])
    with pytest.raises(TypeError):
        native.tags([b"h" * 48], [12])
    with pytest.raises(BufferError):  # not contiguous: refused, never read past
        native.tags([b"h" * 48], [memoryview(bytes(100))[::2]])
    with pytest.raises(BufferError):  # verify reads views in place, but not these
        native.verify([memoryview(bytes(200))[::2]])
    released = memoryview(bytes(100))
    released.release()
    with pytest.raises(ValueError):
        native.verify([released])
    with pytest.raises(ValueError, match="32 bytes"):
        mac._ghash.GhashAes(b"k" * 31, b"k" * 32)
    unset = mac._ghash.GhashAes.__new__(mac._ghash.GhashAes)  # never initialised
    with pytest.raises(RuntimeError):
        unset.tags([b"h" * 48], [b""])
    assert c.tags([], []) == b"" and c.encode(b"", []) == [] and len(c.verify([])) == 0


def test_the_switch_to_python(monkeypatch: pytest.MonkeyPatch) -> None:
    """native=None follows mac.NATIVE (DLCP_NATIVE_MAC=0 turns it off), and
    avx512=None mac.AVX512 (DLCP_GHASH_AVX512=0); native=True without the
    extension is an error, not a silent fallback."""
    monkeypatch.setattr(mac, "NATIVE", False)
    assert not GhashAesKey(KEY).native
    monkeypatch.setattr(mac, "NATIVE", True)
    assert GhashAesKey(KEY).native == (mac._ghash is not None)
    monkeypatch.setattr(mac, "AVX512", False)
    assert GhashAesKey(KEY).backend in ("C, OpenSSL", "cryptography")
    monkeypatch.setattr(mac, "_ghash", None)
    with pytest.raises(ValueError, match="not built"):
        GhashAesKey(KEY, native=True)
