"""The scenarios' disturbances while a backend runs: threads that change the
testbed during the run and put it back when it ends (bursts of loss on a
port, a port cut and restored). `dlcp.bench.cluster.Cluster.disturbed` runs
them.
"""

from __future__ import annotations

import threading
import time

from dlcp.bench.setup import Burst, PathDown
from dlcp.testbed import Testbed

__all__ = ["Burster", "Disturber", "PortCutter"]


class Disturber:
    """A thread that changes the testbed during a run (`_disturb`) and puts
    it back when the run ends (`_restore`); an error is kept in `.error`."""

    name = "dlcp-bench-disturb"

    def __init__(self, tb: Testbed) -> None:
        self.tb = tb
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self.error: BaseException | None = None

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self._restore()

    def _run(self) -> None:
        try:
            self._disturb()
        except BaseException as exc:  # reported by whoever reads .error
            self.error = exc

    def _disturb(self) -> None:
        raise NotImplementedError

    def _restore(self) -> None:
        raise NotImplementedError


class Burster(Disturber):
    """Toggles bursts of loss on one switch port."""

    name = "dlcp-bench-burst"

    def __init__(self, tb: Testbed, burst: Burst) -> None:
        super().__init__(tb)
        self.burst = burst
        self.bursts = 0

    def _disturb(self) -> None:
        b = self.burst
        while not self._stop.wait(max(0.0, b.period_s - b.length_s)):
            self.tb.set_loss(b.host, b.pct)
            self.bursts += 1
            self._stop.wait(b.length_s)
            self.tb.set_loss(b.host, 0.0)

    def _restore(self) -> None:
        self.tb.set_loss(self.burst.host, 0.0)


class PortCutter(Disturber):
    """Sets one switch port down `after_s` into a run and up again
    `length_s` later (or when the run ends first)."""

    name = "dlcp-bench-pathdown"

    def __init__(self, tb: Testbed, down: PathDown) -> None:
        super().__init__(tb)
        self.down = down
        self.down_at: float | None = None  # time.monotonic() when the port went down
        self.up_at: float | None = None  # ... and up again

    def _disturb(self) -> None:
        d = self.down
        if self._stop.wait(d.after_s):
            return
        self.tb.set_port(d.host, d.path, False)
        self.down_at = time.monotonic()
        if d.length_s > 0:  # else down until the run ends
            self._stop.wait(d.length_s)
            self.tb.set_port(d.host, d.path, True)
            self.up_at = time.monotonic()

    def _restore(self) -> None:
        if self.down_at is not None and self.up_at is None:
            self.tb.set_port(self.down.host, self.down.path, True)
