"""Packet MACs: which keyed function makes a packet's 16-byte tag.

Every packet carries a 128-bit tag over its first 48 header bytes and its
payload, keyed with the job's key (`header.mac_key`). Two functions:

- ``blake2b``: keyed BLAKE2b-128 over header and payload. About 1 GB/s per
  core in CPython's hashlib, which was a quarter of the daemon's CPU at high
  rates; the core's default (`JobSpec.mac`, raw key bytes).
- ``ghash-aes`` (dlcpd's default, `[network] mac`): hash, then encrypt. GHASH
  (the polynomial hash of AES-GCM, run by OpenSSL with carry-less
  multiplication, several GB/s) of the payload and the header, under a subkey H
  derived from the job key, and then one AES-256 block encryption of that
  16-byte hash under a second derived key. It is the classic
  universal-hash-then-PRP MAC (Wegman-Carter-Shoup; the construction of
  AES-GCM-SIV's tag): deterministic, no nonce to manage, forgery chance about
  q^2 * l / 2^128 after q packets of l blocks. Needs the `cryptography`
  package. The GHASH is taken from AES-GCM run with a fixed nonce, the header
  as plaintext and the payload as associated data: its tag is then
  GHASH_H(payload, header XOR a fixed keystream) XOR a constant, an injective
  encoding of (payload, header), and that tag alone never leaves the host: only
  its AES encryption does (a fixed-nonce GCM tag sent as is would reveal H).

Both ends of a job must use the same function (a mismatch shows as bad_mac
rejects). Both give 128-bit tags and need the key to forge; ``ghash-aes`` is
only faster: about 6 GB/s against 1 GB/s for 9 KB payloads on the project's
machines, the same for 1.4 KB ones.

``ghash-aes`` runs in C where the extension ``dlcp.wire._ghash`` was built
(setup.py): the same tags, bit for bit, and `GhashAesKey.encode` builds each
datagram in one allocation, MACing the payload's copy while it is in cache.
Where the CPU has AVX-512 and VPCLMULQDQ the extension hashes sixteen blocks per
step itself (about 16 GB/s, 2.2x OpenSSL 3.0's GCM here); elsewhere, or with
DLCP_GHASH_AVX512=0, it runs OpenSSL's GCM with one EVP context per key.
Without the extension (or with DLCP_NATIVE_MAC=0) the same functions run
through the `cryptography` package. `GhashAesKey.backend` says which.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Sequence
from itertools import repeat
from typing import Any

import numpy as np

from dlcp.wire.slices import Slices

try:
    from dlcp.wire import _ghash  # type: ignore[attr-defined]
except ImportError:  # not built: the cryptography package computes the same tags
    _ghash = None

__all__ = [
    "AVX512",
    "MAC_ALGORITHMS",
    "NATIVE",
    "GhashAesKey",
    "MacKey",
    "blake2b_tag",
    "detach_gathered",
    "encode_blake2b",
    "mac_state",
    "verify_blake2b",
]

# whether ghash-aes tags are computed by the C extension (see the docstring)
NATIVE = _ghash is not None and os.environ.get("DLCP_NATIVE_MAC", "1") != "0"
# whether the C extension may hash with AVX-512 (where the CPU has it)
AVX512 = os.environ.get("DLCP_GHASH_AVX512", "1") != "0"

MAC_ALGORITHMS = ("blake2b", "ghash-aes")
_NONCE = bytes(12)
_TAG = 16
_HEAD = 48  # the header bytes a tag covers (those before the tag itself)
_HEADER = _HEAD + _TAG  # a datagram's header: those bytes, then the tag
# Packets per MAC call in the Python path's `encode`: about 570 KB of 9 KB
# payloads, which stay in a core's L2 cache between the MAC reading them and
# the copy into the datagrams (14 % less time per packet than MACing a whole
# shard first: bench/diag/encode_micro.py). The C path copies, then MACs the copy.
ENCODE_CHUNK = 64


class GhashAesKey:
    """A job's keys for the ``ghash-aes`` MAC (see the module docstring)."""

    __slots__ = ("_ecb", "_gcm", "_native")

    def __init__(self, key: bytes, native: bool | None = None, avx512: bool | None = None) -> None:
        """`native`: compute in C (None: where `NATIVE`; True: fail without it);
        `avx512`: let C hash with AVX-512 where the CPU has it (None: `AVX512`)."""
        k_hash = hashlib.blake2b(key, digest_size=32, person=b"dlcp-ghash-key").digest()
        k_prp = hashlib.blake2b(key, digest_size=32, person=b"dlcp-prp-key").digest()
        if native is None:
            native = NATIVE
        elif native and _ghash is None:
            raise ValueError("the C ghash-aes MAC (dlcp.wire._ghash) is not built")
        if avx512 is None:
            avx512 = AVX512
        self._native: Any = _ghash.GhashAes(k_hash, k_prp, avx512=avx512) if native else None
        self._gcm: Any = None
        self._ecb: Any = None
        if self._native is not None:
            return
        try:
            from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
            from cryptography.hazmat.primitives.ciphers.aead import AESGCM
        except ImportError as exc:  # pragma: no cover - depends on the installation
            raise ValueError("the ghash-aes MAC needs the 'cryptography' package") from exc
        self._gcm = AESGCM(k_hash)
        # ECB over whole 16-byte blocks only: each block is one PRP call
        self._ecb = Cipher(algorithms.AES(k_prp), modes.ECB()).encryptor()

    @property
    def native(self) -> bool:
        return self._native is not None

    @property
    def backend(self) -> str:
        """Who computes the tags: 'C, AVX-512', 'C, OpenSSL' or 'cryptography'."""
        if self._native is None:
            return "cryptography"
        return "C, AVX-512" if self._native.backend == "avx512" else "C, OpenSSL"

    def tags(
        self, heads: Sequence[bytes | memoryview], payloads: Sequence[bytes | memoryview]
    ) -> bytes:
        """The tags of packets (48 header bytes, payload), back to back."""
        n = len(heads)
        if len(payloads) != n:
            raise ValueError(f"{n} headers but {len(payloads)} payloads")
        if n == 0:
            return b""
        if self._native is not None:
            return self._native.tags(heads, payloads)
        if set(map(len, heads)) != {_HEAD}:
            raise ValueError(f"headers must be {_HEAD} bytes each")
        # map() calls AES-GCM per packet without a Python frame per packet; each
        # output is the encrypted header (48 bytes) and the GCM tag (16)
        out = b"".join(map(self._gcm.encrypt, repeat(_NONCE, n), heads, payloads))
        inner = np.frombuffer(out, np.uint8).reshape(n, _HEAD + _TAG)[:, _HEAD:]
        return bytes(self._ecb.update(inner.tobytes()))

    def tag(self, head: bytes | memoryview, payload: bytes | memoryview) -> bytes:
        return self.tags((head,), (payload,))

    def encode(self, heads: bytes, payloads: Sequence[bytes | memoryview]) -> list[bytes]:
        """Datagrams of packets whose 64-byte header records lie back to back in
        `heads` (tag bytes ignored): 48 header bytes, the tag, the payload."""
        n = len(payloads)
        if len(heads) != n * _HEADER:
            raise ValueError(f"{len(heads)} header bytes for {n} packets of {_HEADER}")
        if self._native is not None:
            if isinstance(payloads, Slices):  # copied from their buffer: no view apiece
                return self._native.encode_from(
                    heads, payloads.buffer, payloads.starts, payloads.lengths
                )
            return self._native.encode(heads, payloads)
        head_list = [heads[i * _HEADER : i * _HEADER + _HEAD] for i in range(n)]
        out: list[bytes] = []
        # ENCODE_CHUNK packets at a time: the payloads the MAC has just read are
        # still in the core's cache when they are copied into the datagrams
        for c in range(0, n, ENCODE_CHUNK):
            hs = head_list[c : c + ENCODE_CHUNK]
            ps = payloads[c : c + ENCODE_CHUNK]
            tags = self.tags(hs, ps)
            tag_list = [tags[i : i + _TAG] for i in range(0, len(tags), _TAG)]
            out += map(b"".join, zip(hs, tag_list, ps, strict=True))
        return out

    def encode_gather(self, heads: bytes, payloads: Slices) -> list[bytes]:
        """`encode`, each datagram keeping its payload in `payloads.buffer`: a
        `Gathered` (dlcp.wire._ghash) of the 64 header bytes and the payload in
        place, which reads as the joined datagram (`len`, indexing, `bytes()`).
        Its tag is computed when it is first sent or read whole, over the
        payload as it is then. Without the C MAC: `encode`."""
        if self._native is None:
            return self.encode(heads, payloads)
        # the C call checks the header bytes and each slice itself
        return self._native.encode_gather(heads, payloads.buffer, payloads.starts, payloads.lengths)

    def verify(self, datagrams: Sequence[bytes | memoryview]) -> np.ndarray:
        """Per datagram (64 bytes or more each) whether its tag is right: a bool
        array. Every byte of every tag is compared (no early exit), so the time
        taken says nothing about where a forged tag goes wrong."""
        n = len(datagrams)
        if self._native is not None:  # it checks the lengths itself
            return np.frombuffer(self._native.verify(datagrams), dtype=bool)
        if any(len(d) < _HEADER for d in datagrams):
            raise ValueError(f"datagrams must have {_HEADER} bytes or more")
        if n == 0:
            return np.zeros(0, dtype=bool)
        views = [memoryview(d).cast("B") for d in datagrams]
        tags = self.tags([v[:_HEAD] for v in views], [v[_HEADER:] for v in views])
        want = np.frombuffer(tags, np.uint8).reshape(n, _TAG)
        got = np.frombuffer(b"".join([v[_HEAD:_HEADER] for v in views]), np.uint8)
        return (want == got.reshape(n, _TAG)).all(axis=1)


def detach_gathered(datagrams: list[bytes], shared_only: bool = False) -> int:
    """Give each `Gathered` datagram of the list (`GhashAesKey.encode_gather`)
    its own copy of its payload, so that it no longer reads the buffer it was
    made from; with `shared_only`, only those something besides the list still
    holds (a send queue). Other datagrams are left alone. Returns the payload
    bytes copied."""
    if _ghash is None:  # no Gathered datagram was ever made
        return 0
    return int(_ghash.detach(datagrams, shared_only))


_KEYED: dict[bytes, Any] = {}  # keyed BLAKE2b states, by raw key


def blake2b_tag(key: bytes, head: bytes | memoryview, payload: bytes | memoryview) -> bytes:
    """The keyed BLAKE2b-128 tag of (48 header bytes, payload) under raw key bytes."""
    base = _KEYED.get(key)
    if base is None:  # keying BLAKE2b costs a compression; copy a keyed state instead
        if len(_KEYED) > 4096:
            _KEYED.clear()
        base = _KEYED[key] = hashlib.blake2b(key=key, digest_size=_TAG)
    h = base.copy()
    h.update(head)
    h.update(payload)
    return h.digest()


def encode_blake2b(key: bytes, heads: bytes, payloads: Sequence[bytes | memoryview]) -> list[bytes]:
    """`GhashAesKey.encode` for a BLAKE2b key (raw key bytes)."""
    out = []
    for i, payload in enumerate(payloads):
        head = heads[i * _HEADER : i * _HEADER + _HEAD]
        out.append(b"".join((head, blake2b_tag(key, head, payload), payload)))
    return out


def verify_blake2b(key: bytes, datagrams: Sequence[bytes | memoryview]) -> np.ndarray:
    """`GhashAesKey.verify` for a BLAKE2b key (raw key bytes)."""
    ok = np.zeros(len(datagrams), dtype=bool)
    for i, d in enumerate(datagrams):
        v = memoryview(d).cast("B")
        ok[i] = hmac.compare_digest(blake2b_tag(key, v[:_HEAD], v[_HEADER:]), v[_HEAD:_HEADER])
    return ok


MacKey = bytes | GhashAesKey  # what encode/decode take: raw key bytes mean BLAKE2b


def mac_state(key: bytes, algorithm: str = "blake2b") -> MacKey:
    """The MAC key object of a job key for `algorithm` (one of MAC_ALGORITHMS)."""
    if algorithm == "blake2b":
        return bytes(key)
    if algorithm == "ghash-aes":
        return GhashAesKey(bytes(key))
    raise ValueError(f"unknown MAC {algorithm!r}; one of {', '.join(MAC_ALGORITHMS)}")
