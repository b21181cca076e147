"""The structure's bars (issue "Structure: objects that own their state"):
objects composed, not assembled from mixins; modules of a readable size;
tests that build what they test through its constructor."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_LINES = 500


def _modules(under: str) -> list[Path]:
    return sorted((ROOT / under).rglob("*.py"))


def test_no_class_inherits_from_two_dlcp_classes() -> None:
    trees = {p: ast.parse(p.read_text()) for p in _modules("dlcp")}
    ours = {n.name for t in trees.values() for n in ast.walk(t) if isinstance(n, ast.ClassDef)}
    found = []
    for path, tree in trees.items():
        for node in ast.walk(tree):
            if not isinstance(node, ast.ClassDef):
                continue
            bases = [
                b.id if isinstance(b, ast.Name) else b.attr if isinstance(b, ast.Attribute) else ""
                for b in node.bases
            ]
            if len([b for b in bases if b in ours]) >= 2:
                found.append(f"{path.relative_to(ROOT)}: {node.name}({', '.join(bases)})")
    assert not found, found


def test_no_module_is_over_500_lines() -> None:
    long = [
        f"{p.relative_to(ROOT)}: {n}"
        for p in _modules("dlcp")
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    ]
    assert not long, long


def test_no_test_makes_half_initialised_objects() -> None:
    bad = []
    for path in _modules("tests"):
        if path.name == Path(__file__).name:
            continue
        text = path.read_text()
        for needle in ("object.__new__(", "__dict__.update(", ".__dict__ ="):
            if needle in text:
                bad.append(f"{path.relative_to(ROOT)}: {needle}")
    assert not bad, bad
