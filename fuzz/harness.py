"""The fuzz targets' registry, their input reader and the sanitized build's loader.

A target is one function of the input bytes, registered with `@target`:
it reads what it needs with `Input` (every read succeeds: past the end it
gets zeros), calls the C entry points and their Python twins and asserts
they agree. Adding a C entry point is one such function and its seeds.
"""

from __future__ import annotations

import glob
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

# the extensions setup.py builds; the sanitized build replaces all of them
NATIVE = (
    "dlcp.wire._bulk",
    "dlcp.wire._ghash",
    "dlcp.daemon._udp",
    "dlcp.daemon._keys",
    "dlcp.daemon._arenas",
)
CORPUS = Path(__file__).resolve().parent / "corpus"


class Input:
    """Reads a fuzz input front to back; past its end every read is zeros.

    Every execution reads dozens of fields, so the reads are written to make
    no object they need not (a byte is an index, not a slice): under ASan with
    PYTHONMALLOC=malloc each allocation is a sanitizer malloc."""

    __slots__ = ("at", "data", "size")

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.at = 0
        self.size = len(data)

    def left(self) -> int:
        return self.size - self.at

    def take(self, n: int) -> bytes:
        at = self.at
        out = self.data[at : at + n]
        self.at = at + len(out)
        return out

    def uint(self, nbytes: int) -> int:
        at = self.at
        end = at + nbytes
        if end <= self.size and nbytes <= 2:
            self.at = end
            d = self.data
            return d[at] if nbytes == 1 else d[at] | d[at + 1] << 8
        return int.from_bytes(self.take(nbytes), "little")

    def below(self, n: int) -> int:
        """An int in 0 .. n - 1 (two bytes' worth)."""
        if n <= 0:
            return 0  # (nothing read)
        at = self.at
        if at + 2 <= self.size:
            self.at = at + 2
            d = self.data
            return (d[at] | d[at + 1] << 8) % n
        return self.uint(2) % n

    def chance(self, k: int) -> bool:
        """True for one byte value in k."""
        at = self.at
        if at < self.size:
            self.at = at + 1
            return self.data[at] % k == 0
        return True  # a zero byte

    def rest(self) -> bytes:
        return self.take(self.left())

    def datagrams(self, limit: int = 64, longest: int = 4096) -> list[bytes]:
        """Up to `limit` byte strings, each a 2-byte length then its bytes (as
        `pack_datagrams` writes them)."""
        out: list[bytes] = []
        append, data, at, mod = out.append, self.data, self.at, longest + 1
        last = self.size - 2  # where the last length can start
        for _ in range(limit):
            if at > last:
                break
            start = at + 2
            at = start + (data[at] | data[at + 1] << 8) % mod
            append(data[start:at])  # (a slice past the end stops at it)
        self.at = min(at, self.size)
        return out


def pack_datagrams(datagrams: Sequence[bytes], prefix: bytes = b"") -> bytes:
    """A seed that `Input.datagrams` reads back as `datagrams` (after `prefix`)."""
    return prefix + b"".join(len(d).to_bytes(2, "little") + d for d in datagrams)


@dataclass(frozen=True)
class Target:
    name: str
    run: Callable[[bytes], None]
    covers: tuple[str, ...]  # the C entry points it calls, as docs/native.md names them
    seeds: Callable[[], list[bytes]]


TARGETS: dict[str, Target] = {}


def target(
    name: str, covers: Sequence[str], seeds: Callable[[], list[bytes]]
) -> Callable[[Callable[[Input], None]], Callable[[Input], None]]:
    """Register `fn(Input)` as fuzz target `name`."""

    def register(fn: Callable[[Input], None]) -> Callable[[Input], None]:
        if name in TARGETS:
            raise ValueError(f"fuzz target {name} registered twice")
        TARGETS[name] = Target(name, lambda data: fn(Input(data)), tuple(covers), seeds)
        return fn

    return register


def load_targets() -> dict[str, Target]:
    """Every target (the modules that register them imported)."""
    from fuzz import targets_core, targets_daemon, targets_lanes, targets_wire  # noqa: F401

    return TARGETS


def seed_files(name: str) -> list[Path]:
    return sorted((CORPUS / name).glob("*"))


class _SanitizedFinder(importlib.abc.MetaPathFinder):
    """Finds the extensions of NATIVE in `lib` (a `setup.py build_ext
    --build-lib` tree) before the in-place ones of the source tree."""

    def __init__(self, lib: Path) -> None:
        self.lib = lib

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in NATIVE:
            return None
        found = glob.glob(str(self.lib / fullname.replace(".", "/")) + ".*.so")
        if not found:
            raise ImportError(f"{fullname} is not in the sanitized build {self.lib}")
        loader = importlib.machinery.ExtensionFileLoader(fullname, found[0])
        return importlib.util.spec_from_file_location(fullname, found[0], loader=loader)


def use_build(lib: Path) -> None:
    """Import the C extensions from `lib` instead of the source tree, and
    check that every one came from there (nothing imported them before)."""
    if any(name in sys.modules for name in NATIVE):
        raise RuntimeError("a C extension was imported before the sanitized build was set")
    sys.meta_path.insert(0, _SanitizedFinder(lib))
    for name in NATIVE:
        mod = importlib.import_module(name)
        where = Path(mod.__file__ or "").resolve()
        if lib.resolve() not in where.parents:
            raise RuntimeError(f"{name} came from {where}, not {lib}")


def sanitized_lib() -> Path | None:
    lib = os.environ.get("DLCP_FUZZ_LIB")
    return Path(lib) if lib else None
