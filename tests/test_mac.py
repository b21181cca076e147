"""The packet MAC functions (dlcp/wire/mac.py): every byte the MAC covers is
covered, keys and functions do not verify each other's tags, and the batch
decoder agrees with the per-packet one, bad MACs counted per reason."""

from __future__ import annotations

import numpy as np
import pytest

from dlcp.core.engine import JobSpec
from dlcp.daemon.config import parse
from dlcp.errors import LocalError, Reason, WireError
from dlcp.wire import Codec, Flags, Header, PacketType, decode
from dlcp.wire.batch import decode_batch
from dlcp.wire.header import HEADER_SIZE, MAC_OFFSET, encode
from dlcp.wire.mac import MAC_ALGORITHMS, mac_state

KEY = bytes(range(32))


def _packet(mac: str, job: int = 5, count: int = 300, key: bytes = KEY) -> bytes:
    h = Header(
        type=PacketType.DATA,
        job=job,
        round=9,
        bucket=2,
        flags=Flags.DROPPABLE,
        shard=1,
        sender=1,
        count=count,
        total=10_000,
        offset=600,
        param=0.5,
    )
    payload = np.arange(count, dtype="<f4").tobytes()
    return encode(h, payload, mac_state(key, mac))


@pytest.mark.parametrize("mac", MAC_ALGORITHMS)
def test_round_trip_and_every_covered_byte_matters(mac: str) -> None:
    keys = {5: mac_state(KEY, mac)}
    dg = _packet(mac)
    h, payload = decode(dg, keys)
    assert h.count == 300 and bytes(payload) == dg[HEADER_SIZE:]
    positions = [*range(8, MAC_OFFSET), *range(MAC_OFFSET, HEADER_SIZE), HEADER_SIZE, len(dg) - 1]
    for pos in positions:
        bad = bytearray(dg)
        bad[pos] ^= 0x01
        with pytest.raises(WireError) as exc:
            decode(bytes(bad), keys)
        # header fields may fail their own checks first; never accepted
        assert exc.value.reason != Reason.UNKNOWN_JOB or pos in range(8, 12)


def test_keys_and_functions_do_not_verify_each_others_tags() -> None:
    other = bytes(32)
    for a in MAC_ALGORITHMS:
        for b in MAC_ALGORITHMS:
            for key in (KEY, other):
                dg = _packet(a, key=key)
                if a == b and key == KEY:
                    decode(dg, {5: mac_state(KEY, b)})
                    continue
                with pytest.raises(WireError) as exc:
                    decode(dg, {5: mac_state(KEY, b)})
                assert exc.value.reason == Reason.BAD_MAC


def test_ghash_aes_tags_are_deterministic_and_key_dependent() -> None:
    k = mac_state(KEY, "ghash-aes")
    assert not isinstance(k, bytes)
    t1 = k.tag(b"h" * 48, b"p" * 1000)
    assert t1 == k.tag(b"h" * 48, b"p" * 1000) and len(t1) == 16
    assert t1 != k.tag(b"h" * 48, b"p" * 999 + b"q")
    assert t1 != k.tag(b"h" * 47 + b"i", b"p" * 1000)
    # moving a byte between header and payload changes the tag (the split is covered)
    assert k.tag(b"h" * 48, b"") != k.tag(b"h" * 47 + b"\0", b"h")
    assert t1 != mac_state(bytes(32), "ghash-aes").tag(b"h" * 48, b"p" * 1000)  # type: ignore[union-attr]
    assert k.tags([b"h" * 48, b"x" * 48], [b"p" * 1000, b""]) == t1 + k.tag(b"x" * 48, b"")


def test_decode_batch_mixed_functions_and_bad_macs() -> None:
    keys = {5: mac_state(KEY, "ghash-aes"), 6: mac_state(KEY, "blake2b")}
    good = [_packet("ghash-aes", 5), _packet("blake2b", 6), _packet("ghash-aes", 5, 200)]
    forged = bytearray(good[0])
    forged[-3] ^= 0x80
    wrong_fn = _packet("blake2b", 5)  # job 5 uses ghash-aes
    stream = [good[0], bytes(forged), good[1], wrong_fn, good[2], _packet("blake2b", 7)]
    b = decode_batch(stream, keys)
    assert b.index.tolist() == [0, 2, 4]
    assert [bytes(p) for p in b.payloads] == [bytes(stream[i][HEADER_SIZE:]) for i in (0, 2, 4)]
    assert b.rejects == {Reason.BAD_MAC: 2, Reason.UNKNOWN_JOB: 1}
    for i, dg in enumerate(stream):
        try:
            decode(dg, keys)
            assert i in (0, 2, 4)
        except WireError as exc:
            assert i not in (0, 2, 4) and exc.reason in (Reason.BAD_MAC, Reason.UNKNOWN_JOB)


def test_unknown_mac_is_refused() -> None:
    with pytest.raises(ValueError):
        mac_state(KEY, "crc32")
    with pytest.raises(LocalError):
        JobSpec.transpose(1, KEY, 0, 2, mac="none")
    with pytest.raises(LocalError):
        parse({"network": {"mac": "none"}})
    assert parse({"network": {"mac": "blake2b"}}).mac == "blake2b"
    assert parse({}).mac == "ghash-aes"  # dlcpd's default
    assert Codec.FP32 == 0


def test_ghash_aes_tags_follow_the_construction() -> None:
    """Tags made in a batch are the module's construction, packet by packet:
    AES-256 (second derived key) of the tag of AES-GCM (first derived key, the
    zero nonce) over the header as plaintext and the payload as associated data."""
    import hashlib

    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    k_hash = hashlib.blake2b(KEY, digest_size=32, person=b"dlcp-ghash-key").digest()
    k_prp = hashlib.blake2b(KEY, digest_size=32, person=b"dlcp-prp-key").digest()

    def one(head: bytes, payload: bytes) -> bytes:
        inner = AESGCM(k_hash).encrypt(bytes(12), head, payload)[-16:]
        enc = Cipher(algorithms.AES(k_prp), modes.ECB()).encryptor()
        return enc.update(inner) + enc.finalize()

    k = mac_state(KEY, "ghash-aes")
    assert not isinstance(k, bytes)
    heads = [bytes([i]) * 48 for i in range(5)]
    payloads = [bytes([7 * i]) * (100 * i) for i in range(5)]  # the first one empty
    assert k.tags(heads, payloads) == b"".join(map(one, heads, payloads))
    assert k.tags([], []) == b""
    with pytest.raises(ValueError, match="payloads"):
        k.tags(heads, payloads[:-1])
    with pytest.raises(ValueError, match="48 bytes"):
        k.tags([b"h" * 47], [b"p"])
