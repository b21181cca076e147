"""Leave a process that used Gloo without Python's interpreter finalization.

PyTorch's Gloo backend runs each collective on a worker thread. That thread
marks the collective done, which wakes the rank, and only then drops its own
references to the collective's tensors (a barrier also holds the collectives
that were in flight when it was queued). A tensor that Python already let go of
needs the GIL for that last release. If the rank has meanwhile returned from
`main()` and the interpreter is finalizing, the worker thread that asks for
the GIL is ended by `pthread_exit` inside a C++ destructor, and the process
aborts: SIGABRT, "terminate called without an active exception". It happens
even after `dist.barrier()` and `destroy_process_group()`, which do not join
Gloo's threads; under load it hit about one run in ten of three ranks
(a core dump shows `~AsyncBarrierWork -> ~AsyncAllgatherWork ->
decref_pyobject -> take_gil -> PyThread_exit_thread`).

`exit_process(code)` flushes the standard streams and logging and ends the
process with `os._exit`, so no finalization can race those threads. Call it
as a script's last act, after everything it promised has been written:

    if __name__ == "__main__":
        exit_process(main())

It skips `atexit` handlers and object finalizers: close what needs closing
(the shim's `state.close()`, files) before.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from typing import NoReturn

__all__ = ["exit_process"]


def exit_process(code: int | None = 0) -> NoReturn:
    """End the process now with `code` (None counts as 0), after flushing
    stdout, stderr and logging; no interpreter finalization runs."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError, AttributeError):  # closed, replaced
            stream.flush()
    os._exit(0 if code is None else int(code))
