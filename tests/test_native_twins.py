"""docs/native.md, the list of the C extensions' functions and their Python
twins, against the code: every twin it names imports, every test it names is
defined in its file, every switch is read by dlcp, and every function in the
C files' method tables (PyMethodDef) has a row. Needs no built extension."""

from __future__ import annotations

import ast
import importlib
import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "native.md"
C_FILES = {
    "_arenas": ROOT / "dlcp/daemon/_arenas.c",
    "_keys": ROOT / "dlcp/daemon/_keys.c",
    "_udp": ROOT / "dlcp/daemon/_udp.c",
    "_bulk": ROOT / "dlcp/wire/_bulk.c",
    "_ghash": ROOT / "dlcp/wire/_ghash.c",
    "_thc": ROOT / "dlcp/codecs/_thc.c",
    "_fp16": ROOT / "dlcp/codecs/_fp16.c",
}
_CODE = re.compile(r"`([^`]+)`")
_TWIN = re.compile(r"^[a-z_][\w.]*:[A-Za-z_][\w.]*$")  # module:qualified.name
_TEST = re.compile(r"^(tests/\w+\.py)::(test_\w+)$")
_C_NAME = re.compile(r"^(_[a-z][a-z0-9]*)\.([A-Za-z_][\w.]*)$")
_SWITCH = re.compile(r"^(DLCP_[A-Z0-9_]+)=0$")
_TABLE = re.compile(r"static\s+PyMethodDef\s+\w+\[\]\s*=\s*\{(.*?)\n\};", re.S)
_ENTRY = re.compile(r'\{\s*"(\w+)"\s*,')


def _rows() -> list[list[str]]:
    """The table's body rows, as cells."""
    rows = []
    for line in DOC.read_text().splitlines():
        if not line.startswith("| `_"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        assert len(cells) == 4, f"a row of docs/native.md needs 4 cells: {line}"
        rows.append(cells)
    return rows


def _codes(cell: str) -> list[str]:
    return _CODE.findall(cell)


def _method_tables() -> dict[str, set[str]]:
    """Per extension, the names in its C file's PyMethodDef tables."""
    out = {}
    for ext, path in C_FILES.items():
        names = set()
        for body in _TABLE.findall(path.read_text()):
            names.update(_ENTRY.findall(body))
        assert names, f"no PyMethodDef table found in {path}"
        out[ext] = names
    return out


@cache
def _test_names(path: str) -> frozenset[str]:
    tree = ast.parse((ROOT / path).read_text())
    return frozenset(
        n.name for n in tree.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
    )


def test_the_table_has_a_row_for_each_extension() -> None:
    named = {_C_NAME.match(c).group(1) for r in _rows() for c in _codes(r[0]) if _C_NAME.match(c)}
    assert named == set(C_FILES)


def test_every_c_method_has_a_row_and_every_row_names_c_methods() -> None:
    """Each name in a PyMethodDef table is listed (a module's function as
    `_ext.name`, a type's method as `_ext.Type.name`); each name listed is
    such a function, a type's method or a type the C file defines."""
    tables = _method_tables()
    listed: dict[str, set[str]] = {ext: set() for ext in C_FILES}
    for row in _rows():
        for code in _codes(row[0]):
            m = _C_NAME.match(code)
            assert m, f"not an extension's name in the first column: {code}"
            ext, name = m.groups()
            assert ext in C_FILES, f"{code}: no such extension"
            text = C_FILES[ext].read_text()
            prefix = f"dlcp.{C_FILES[ext].parent.name}.{ext}"
            *owner, last = name.split(".")
            if owner:
                assert f'"{prefix}.{".".join(owner)}"' in text, f"{code}: no such type"
            if owner or last in tables[ext]:
                assert last in tables[ext], f"{code}: not in a method table"
                listed[ext].add(last)
            else:
                assert f'"{prefix}.{last}"' in text, f"{code}: no such function or type"
    for ext, names in tables.items():
        missing = names - listed[ext]
        assert not missing, f"{C_FILES[ext].name}: {sorted(missing)} not in docs/native.md"


def _twins() -> list[str]:
    return sorted({c for r in _rows() for c in _codes(r[1]) if _TWIN.match(c)})


@pytest.mark.parametrize("twin", _twins())
def test_every_twin_exists(twin: str) -> None:
    module, qualname = twin.split(":")
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        assert hasattr(obj, part), f"{twin}: {part} not found"
        obj = getattr(obj, part)
    assert callable(obj), f"{twin} is not callable"


def test_every_row_names_a_twin_or_says_why_none() -> None:
    """A twin, or "none:", why, and what stands in for it (named as a twin)."""
    for row in _rows():
        assert any(_TWIN.match(c) for c in _codes(row[1])), f"{row[0]}: no twin named"
        assert _TWIN.match(_codes(row[1])[0]) or row[1].startswith("none:"), row[0]


def test_every_row_names_tests_that_exist() -> None:
    seen = 0
    for row in _rows():
        tests = [m.groups() for c in _codes(row[3]) if (m := _TEST.match(c))]
        assert tests, f"{row[0]}: no test named"
        for path, name in tests:
            assert name in _test_names(path), f"{path}::{name} not defined"
            seen += 1
    assert seen >= len(_rows())


def test_every_switch_is_read_by_dlcp() -> None:
    sources = "\n".join(p.read_text() for p in (ROOT / "dlcp").rglob("*.py"))
    switches = {m.group(1) for r in _rows() for c in _codes(r[2]) if (m := _SWITCH.match(c))}
    assert switches >= {"DLCP_NATIVE_MAC", "DLCP_NATIVE_KEYS", "DLCP_NATIVE_BULK"}
    for row in _rows():
        assert any(_SWITCH.match(c) for c in _codes(row[2])), f"{row[0]}: no switch"
    for s in switches:
        assert f'"{s}"' in sources, f"{s} is not read anywhere in dlcp/"
