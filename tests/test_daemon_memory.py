"""dlcpd's allocator and collector settings (dlcp/daemon/memory.py) take effect."""

from __future__ import annotations

import json
import platform
import subprocess
import sys

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
