"""Ending a trainer once its work is done, without the interpreter's teardown.

A trainer that has reported its result, waited for its writers and left its process group has nothing left to
do, yet Python's own teardown (freeing every module of torch, numba and their objects one by one) took seconds
after the `done` record: seconds in every job's `exit` phase (docs/benchmarks.md). This ends the process there,
as the interpreter would and without the freeing: the exit handlers run (logging's flush among them), the
standard streams are flushed, then the process exits with its code.

A thread that is not a daemon may still be writing something (the interpreter would wait for it): then the
process takes the interpreter's way out after all.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading

__all__ = ["exit_now"]


def _writers_left() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon and t.is_alive()]


def exit_now(code: int) -> None:
    """End the process with `code`: at once when nothing is left running, else through the interpreter's exit."""
    if _writers_left():
        sys.exit(code)
    atexit._run_exitfuncs()  # what the interpreter would run before its teardown, in its order
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError, AttributeError):  # closed or replaced: nothing to write
            stream.flush()
    os._exit(code)
