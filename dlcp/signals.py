"""Signal handlers for a block of code, in the process that installed them only.

`interrupt_on(signals)` turns the signals into KeyboardInterrupt inside the
block (so cleanup in `finally` runs), `ignored(signals)` ignores them (so
cleanup runs to its end). Both restore the previous handlers afterwards, act
only in the main thread, and leave a forked child (pyroute2 forks to enter a
namespace; tests fork) to die of the signal as it expects instead of running
its parent's cleanup.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable, Iterator, Sequence
from types import FrameType

__all__ = ["handlers", "ignored", "interrupt_on"]

Handler = Callable[[int, FrameType | None], None]


@contextlib.contextmanager
def handlers(
    handler: Handler, signals: Sequence[int], *, only_default: bool = False
) -> Iterator[None]:
    """`handler` for `signals` inside the block; with `only_default`, only for
    signals that had the default action (a caller's own handler is kept)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    owner = os.getpid()

    def handle(signum: int, frame: FrameType | None) -> None:
        if os.getpid() != owner:  # a forked child: die as it would have
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        handler(signum, frame)

    chosen = [
        sig
        for sig in signals
        if not only_default or signal.getsignal(sig) in (signal.SIG_DFL, None)
    ]
    old = {sig: signal.signal(sig, handle) for sig in chosen}
    try:
        yield
    finally:
        for sig, previous in old.items():
            signal.signal(sig, previous)


def _interrupt(signum: int, _frame: FrameType | None) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def interrupt_on(
    signals: Sequence[int], *, only_default: bool = False
) -> contextlib.AbstractContextManager[None]:
    """`signals` raise KeyboardInterrupt inside the block."""
    return handlers(_interrupt, signals, only_default=only_default)


def ignored(signals: Sequence[int]) -> contextlib.AbstractContextManager[None]:
    """`signals` are ignored inside the block."""
    return handlers(lambda _signum, _frame: None, signals)
