"""The outbox's packet identities in C (dlcp/daemon/_keys.c) against their
Python definitions in dlcp.daemon.outbox: the same bytes for every datagram,
errors (not reads past the end) for bad input.

The project's install builds the extension (setup.py), so its absence fails
here; set DLCP_ALLOW_NO_NATIVE=1 to run the suite where it cannot be built.
"""

from __future__ import annotations

import os
import random
from types import ModuleType

import pytest

from dlcp.daemon import outbox

if outbox._keys is None and os.environ.get("DLCP_ALLOW_NO_NATIVE") == "1":
    pytest.skip("dlcp.daemon._keys is not built (DLCP_ALLOW_NO_NATIVE=1)", allow_module_level=True)


@pytest.fixture(scope="module")
def keys() -> ModuleType:
    assert outbox._keys is not None, "dlcp.daemon._keys was not built: pip install -e . builds it"
    return outbox._keys


def _datagrams(n: int, seed: int) -> list[bytes]:
    rng = random.Random(seed)
    return [rng.randbytes(rng.choice((36, 37, 64, 100, 8908, 9000))) for _ in range(n)]


@pytest.mark.parametrize("n", [0, 1, 2, 63, 64, 500])
def test_identities_and_heads_equal_the_python_definitions(keys: ModuleType, n: int) -> None:
    dgs = _datagrams(n, n)
    ids = [outbox._identity(dg) for dg in dgs]
    assert keys.identities(dgs) == ids
    assert keys.identities(tuple(dgs)) == ids
    assert keys.identities_heads(dgs) == (ids, [i[: outbox._BKEY] for i in ids])
    assert all(len(i) == 29 for i in ids)


def test_other_buffers_give_the_same_identities(keys: ModuleType) -> None:
    dgs = _datagrams(8, 7)
    others = [bytearray(dgs[0]), memoryview(dgs[1]), memoryview(b"xx" + dgs[2])[2:], *dgs[3:]]
    assert keys.identities(others) == [outbox._identity(dg) for dg in dgs]


def test_every_identity_byte_comes_from_its_header_byte(keys: ModuleType) -> None:
    base = bytes(64)
    positions = [3, *range(8, 36)]
    for k, pos in enumerate(positions):
        dg = bytearray(base)
        dg[pos] = 0xA5
        ident = keys.identities([bytes(dg)])[0]
        assert ident[k] == 0xA5 and ident.count(0xA5) == 1, pos
    for pos in [0, 1, 2, 4, 5, 6, 7, 36, 63]:  # flags, class, MAC, payload: not identity
        dg = bytearray(base)
        dg[pos] = 0xA5
        assert keys.identities([bytes(dg)])[0] == bytes(29), pos


def test_bad_input_raises_instead_of_reading_past_the_datagram(keys: ModuleType) -> None:
    with pytest.raises(ValueError, match="datagram 1 is 35 bytes"):
        keys.identities([bytes(36), bytes(35)])
    with pytest.raises(ValueError, match="datagram 0 is 0 bytes"):
        keys.identities_heads([b""])
    with pytest.raises(TypeError):
        keys.identities([bytes(40), 7])
    with pytest.raises(TypeError):
        keys.identities(5)
    with pytest.raises(BufferError):
        keys.identities([memoryview(bytes(80))[::2]])  # not contiguous


def test_the_outbox_uses_the_extension_where_it_is_built(keys: ModuleType) -> None:
    if os.environ.get("DLCP_NATIVE_KEYS") == "0":
        pytest.skip("DLCP_NATIVE_KEYS=0 turns the extension off")
    assert outbox._identities is keys.identities
    assert outbox._identities_heads is keys.identities_heads
