"""dlcpd's allocator and collector settings (dlcp/daemon/memory.py) take effect."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

from tests.daemons import ROOT

SCRIPT = """
import gc, json
from dlcp.daemon.memory import GC_THRESHOLDS, tune_process
before = gc.get_freeze_count()
applied = tune_process()
print(json.dumps({"applied": applied, "threshold": list(gc.get_threshold()),
                  "want": list(GC_THRESHOLDS), "frozen": gc.get_freeze_count() - before}))
"""


def test_tune_process_sets_malloc_and_gc() -> None:
    # in a child: the settings are process-wide and would stay in the test run
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, check=True
    )
    got = json.loads(out.stdout)
    assert got["threshold"] == got["want"]
    assert got["applied"]["gc"] is True
    assert got["frozen"] > 1000  # the imported modules' objects left the collector
    if platform.libc_ver()[0] == "glibc":
        assert all(got["applied"].values()), got["applied"]


ARENAS = """
import json, resource, sys
from dlcp.daemon import _arenas
_arenas.keep(int(sys.argv[1]))
def make():  # about 30 MB of small objects: 30 arenas
    return [i.to_bytes(8, "little") * 5 for i in range(400_000)]
xs = make()
del xs  # every arena empty: kept, or unmapped
freed = _arenas.stats()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
xs = make()
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
again = _arenas.stats()
del xs
_arenas.keep(2)  # the ones kept past the new limit go back at once
print(json.dumps({"freed": freed, "again": again, "faults": faults, "cut": _arenas.stats()}))
"""


def _arenas_run(keep: int) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", ARENAS, str(keep)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout)


def _need_arenas() -> None:
    from dlcp.daemon import memory

    if memory._arenas is None and os.environ.get("DLCP_ALLOW_NO_NATIVE") == "1":
        pytest.skip("dlcp.daemon._arenas is not built (DLCP_ALLOW_NO_NATIVE=1)")
    assert memory._arenas is not None, (
        "dlcp.daemon._arenas was not built: pip install -e . builds it"
    )


def test_freed_arenas_are_kept_and_reused() -> None:
    _need_arenas()
    kept, none = _arenas_run(64), _arenas_run(0)
    # freed arenas stay mapped up to the limit, and the next objects take them
    assert kept["freed"]["kept"] >= 20 and kept["freed"]["returned"] == 0
    assert kept["again"]["reused"] >= 20
    assert none["freed"]["kept"] == 0 and none["freed"]["returned"] >= 20
    # the pages of a reused arena are mapped already: far fewer page faults
    assert kept["faults"] * 4 < none["faults"]
    assert kept["cut"]["kept"] <= 2 and kept["cut"]["limit"] == 2


def test_keep_checks_its_limit() -> None:
    _need_arenas()
    for bad in (-1, 1 << 21):
        out = subprocess.run(
            [sys.executable, "-c", f"from dlcp.daemon import _arenas; _arenas.keep({bad})"],
            cwd=ROOT,
            capture_output=True,
            text=True,
        )
        assert out.returncode != 0 and "ValueError" in out.stderr


def test_arenas_can_be_turned_off() -> None:
    _need_arenas()
    script = (
        "import json; from dlcp.daemon import _arenas; from dlcp.daemon.memory import tune_process;"
        "a = tune_process(); print(json.dumps([a['arenas'], _arenas.stats()['limit']]))"
    )
    from dlcp.daemon.memory import ARENAS_KEPT

    for env, want in (({"DLCP_NATIVE_ARENAS": "0"}, [False, 0]), ({}, [True, ARENAS_KEPT])):
        out = subprocess.run(
            [sys.executable, "-c", script],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "DLCP_NATIVE_ARENAS": "1", **env},
        )
        assert json.loads(out.stdout) == want
