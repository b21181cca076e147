"""python -m fuzz list | seeds | replay [NAME...] | run NAME [libFuzzer args...]

- list: the targets, one a line, and the C entry points each covers.
- seeds: (re)write fuzz/corpus/NAME/ from each target's seeds (regress-* files,
  the inputs of findings, are kept).
- replay [NAME...] [--files FILE...]: every seed (or each file given) through
  its target (of NAME; one, with --files) once.
- run: coverage-guided fuzzing of one target under atheris (libFuzzer's
  arguments follow: corpus directories, -max_total_time=S, ...). With
  $DLCP_FUZZ_LIB set, the C extensions come from that sanitized build.
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

from fuzz import harness


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__)
        return 2
    cmd, rest = argv[0], argv[1:]
    lib = harness.sanitized_lib()
    if lib is not None:
        harness.use_build(lib)
    targets = harness.load_targets()
    if cmd == "list":
        for t in targets.values():
            print(t.name, " ".join(t.covers))
        return 0
    if cmd == "seeds":
        for t in targets.values():
            d = harness.CORPUS / t.name
            d.mkdir(parents=True, exist_ok=True)
            for old in d.glob("*"):
                if not old.name.startswith("regress-"):  # findings' inputs stay
                    old.unlink()
            for s in t.seeds():
                (d / hashlib.sha1(s).hexdigest()[:16]).write_bytes(s)
        return 0
    if cmd == "replay":
        given = rest.index("--files") if "--files" in rest else len(rest)
        names, paths = rest[:given] or list(targets), rest[given + 1 :]
        for name in names:
            t = targets[name]
            files = [Path(f) for f in paths] if paths else harness.seed_files(name)
            for f in files:
                t.run(f.read_bytes())
            print(f"{name}: {len(files)} {'files' if paths else 'seeds'} replayed")
        return 0
    if cmd == "run":
        import atheris  # only here: the other commands need no fuzzer

        t = targets[rest[0]]
        atheris.Setup([f"fuzz-{t.name}", *rest[1:]], t.run)
        atheris.Fuzz()
        return 0
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
