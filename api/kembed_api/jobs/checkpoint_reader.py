"""Running a read of a tenant-written checkpoint in a short-lived, confined process, never in the API's own.

A checkpoint is whatever its tenant's trainer (or anyone who can write its folder) put there, and torch's format
carries pickles: read in the API process, a crafted file would run code with the server's rights (its database,
its tokens, its cloud credentials). So the API runs `python -m kembed_trainer.export_worker` through `run`:

- Landlock (`kembed_platform.sandbox`, as the local backend's trainers): readable only the system, this
  interpreter and its packages, and the checkpoint folders given; writable only a fresh scratch folder; the
  places in `denied` (the data dir, the checkpoint root) never, even where a granted folder contains them.
  Landlock judges a symlink by its target, so a shard linked to the server's database is refused by the kernel.
- a minimal environment written here, not the server's: no `KEMBED_*`, no cloud keys, no database URL;
- resource limits (`Limits`): data memory, CPU seconds, open files, processes, file size, no core dumps, and a
  wall-clock deadline after which its whole process group is killed; its output is read up to a bound.

Where the kernel has no Landlock (or `KEMBED_TRAINER_SANDBOX=off`) the process still gets the clean environment and
the limits, and the worker reads DCP's metadata through an allow-listing unpickler (`kembed_trainer.dcp_read`),
so a crafted file is refused unread; what the unpickler does not cover is then not contained (docs/security.md).

This module is the only place that starts such a process; it knows nothing of exports.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import resource
import selectors
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from kembed_platform import sandbox as landlock

__all__ = ["MAX_READERS", "Limits", "Output", "ReaderBusy", "ReaderFailed", "ReaderUnavailable", "run"]

_HEADER_BYTES = 1 << 20  # the first line of the output: a small JSON answer
_CHUNK = 1 << 16
# Readers at once in one server process: each is bounded, and so is their number (callers size each one's memory
# by it). A request finding them all busy waits this long, then is told to come back.
MAX_READERS = 2
_WAIT_FOR_SLOT_S = 30.0
_slots = threading.BoundedSemaphore(MAX_READERS)


class ReaderFailed(RuntimeError):
    """The confined process broke a limit, or ended without an answer. Never carries what it printed."""


class ReaderBusy(RuntimeError):
    """Every reader slot stayed taken: try again shortly."""


class ReaderUnavailable(RuntimeError):
    """The sandbox was required (`landlock`) but this kernel has none."""


@dataclass(frozen=True)
class Limits:
    """What one read may take. The worker imports torch first (~0.9 GiB of data on its own, measured), so memory
    starts above that; callers add what the checkpoint itself needs."""

    memory_bytes: int = 2 << 30  # RLIMIT_DATA: heap and private mappings (not AS: torch maps GBs of libraries)
    cpu_seconds: int = 600  # RLIMIT_CPU: then SIGXCPU, SIGKILL 5 s later
    wall_seconds: float = 600.0  # then the process group is killed
    open_files: int = 256  # RLIMIT_NOFILE
    processes: int = 64  # RLIMIT_NPROC, above what this user runs already (the limit counts all of them)
    output_bytes: int = 1 << 30  # RLIMIT_FSIZE for files it writes, and what is read of its stdout


@dataclass(frozen=True)
class Output:
    returncode: int
    header: bytes  # the first line of stdout (without its newline)
    num_bytes: int  # what followed it, written to the sink


def _pythonpath() -> str:
    """Where this server finds the trainer, the contract it stands on and the sandbox, so the worker runs the same
    code (not the server's env). Found, not imported: the API runs no trainer code in its own process."""
    roots = []
    for package in ("kembed_trainer", "kembed_contract", "kembed_platform"):
        spec = importlib.util.find_spec(package)
        if spec and spec.submodule_search_locations:
            roots.append(str(Path(next(iter(spec.submodule_search_locations))).resolve().parent))
    return os.pathsep.join(dict.fromkeys(roots))


def _environ(scratch: Path) -> dict[str, str]:
    return {
        "PATH": os.defpath, "HOME": str(scratch), "TMPDIR": str(scratch), "NUMBA_CACHE_DIR": str(scratch),
        "PYTHONDONTWRITEBYTECODE": "1", "PYTHONPATH": _pythonpath(), "OMP_NUM_THREADS": "1",
        "LANG": "C.UTF-8",
    }


def _user_processes() -> int:
    """Tasks (threads count) this user runs now: RLIMIT_NPROC counts them all, not only the worker's."""
    uid, count = os.getuid(), 0
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                if entry.stat().st_uid == uid:
                    count += len(os.listdir(f"/proc/{entry.name}/task"))
            except OSError:
                continue  # it ended meanwhile
    return count


def _within_hard(which: int, soft: int, hard: int) -> tuple[int, int, int]:
    """(which, soft, hard) lowered to this process's own hard limit: a process may not raise it."""
    current = resource.getrlimit(which)[1]
    if current != resource.RLIM_INFINITY:
        soft, hard = min(soft, current), min(hard, current)
    return which, soft, hard


def _is_under(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip("/") + "/")


def _sandbox_prefix(read: Sequence[str], scratch: Path, denied: Sequence[str]) -> list[str]:
    denied = [os.path.realpath(d) for d in denied]
    system_read, system_write = landlock.rules(
        read=[*landlock.SYSTEM_READ, *landlock.python_paths(), *_pythonpath().split(os.pathsep)],
        write=landlock.SYSTEM_WRITE, denied=denied)
    folders = [os.path.realpath(p) for p in read]
    # Granted whole, so none may hold a denied place (a step folder never does; a crafted one could be a link).
    if any(_is_under(d, f) for f in folders for d in denied):
        raise ReaderFailed("a checkpoint folder contains a place the reader may not open")
    return [sys.executable, "-m", "kembed_platform.sandbox", *(f"--read={p}" for p in [*system_read, *folders]),
            *(f"--write={p}" for p in [*system_write, str(scratch.resolve())]), "--"]


def run(command: Sequence[str], *, read: Sequence[str], scratch: Path, denied: Sequence[str], sandbox: str,
        limits: Limits, sink: IO[bytes]) -> Output:
    """Run `command` (argv) confined: read only beneath `read` (and the system's and Python's paths), write only
    beneath `scratch` (a fresh folder the caller owns and removes), never anything beneath `denied`.

    Its stdout is a first line (at most 1 MiB, returned) and then bytes written to `sink` (at most
    `limits.output_bytes`). `sandbox`: auto, landlock or off, as `KEMBED_TRAINER_SANDBOX`. Raises ReaderFailed
    past a limit or the deadline, ReaderBusy when `MAX_READERS` run already and none ends within 30 s,
    ReaderUnavailable when Landlock is required and missing."""
    if sandbox == "landlock" and landlock.abi_version() < 1:
        raise ReaderUnavailable("KEMBED_TRAINER_SANDBOX=landlock, but this kernel has no Landlock")
    if not _slots.acquire(timeout=_WAIT_FOR_SLOT_S):
        raise ReaderBusy(f"{MAX_READERS} checkpoints are being read already; try again shortly")
    try:
        return _run(command, read=read, scratch=scratch, denied=denied, sandbox=sandbox, limits=limits, sink=sink)
    finally:
        _slots.release()


def _run(command: Sequence[str], *, read: Sequence[str], scratch: Path, denied: Sequence[str], sandbox: str,
         limits: Limits, sink: IO[bytes]) -> Output:
    confined = sandbox != "off" and landlock.abi_version() >= 1
    prefix = _sandbox_prefix(read, scratch, denied) if confined else []
    processes = _user_processes() + limits.processes
    rlimits = [_within_hard(which, soft, hard) for which, soft, hard in (
        (resource.RLIMIT_DATA, limits.memory_bytes, limits.memory_bytes),
        (resource.RLIMIT_CPU, limits.cpu_seconds, limits.cpu_seconds + 5),
        (resource.RLIMIT_NOFILE, limits.open_files, limits.open_files),
        (resource.RLIMIT_NPROC, processes, processes),
        (resource.RLIMIT_FSIZE, limits.output_bytes, limits.output_bytes),
        (resource.RLIMIT_CORE, 0, 0),
    )]

    def limit() -> None:  # in the child before exec: only setrlimit calls, on values computed above
        for which, soft, hard in rlimits:
            resource.setrlimit(which, (soft, hard))

    process = subprocess.Popen(  # noqa: S603 - our own interpreter and module, no shell
        [*prefix, *command], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
        env=_environ(scratch), cwd=scratch, start_new_session=True, preexec_fn=limit, close_fds=True,
    )
    deadline = time.monotonic() + limits.wall_seconds
    try:
        header, num_bytes = _collect(process, sink, limits, deadline)
        returncode = process.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        raise ReaderFailed("the checkpoint reader did not finish in time") from None
    finally:
        _kill_group(process)
    if returncode < 0:
        raise ReaderFailed(f"the checkpoint reader was stopped by {signal.Signals(-returncode).name} "
                           "(a limit of memory, time or size)")
    return Output(returncode=returncode, header=header, num_bytes=num_bytes)


def _collect(process: subprocess.Popen, sink: IO[bytes], limits: Limits, deadline: float) -> tuple[bytes, int]:
    """(first line, bytes after it) of the process's stdout, read until it closes, within the bounds."""
    assert process.stdout is not None
    fd = process.stdout.fileno()
    os.set_blocking(fd, False)
    header, first, num_bytes = bytearray(), True, 0
    with selectors.DefaultSelector() as selector:
        selector.register(fd, selectors.EVENT_READ)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ReaderFailed("the checkpoint reader did not finish in time")
            if not selector.select(min(left, 1.0)):
                continue
            chunk = os.read(fd, _CHUNK)
            if not chunk:
                break
            if first:
                line, newline, rest = chunk.partition(b"\n")
                header += line
                if len(header) > _HEADER_BYTES:
                    raise ReaderFailed("the checkpoint reader's answer is too large")
                if not newline:
                    continue
                first, chunk = False, rest
            num_bytes += len(chunk)
            if num_bytes > limits.output_bytes:
                raise ReaderFailed("the checkpoint reader's output is over its limit")
            sink.write(chunk)
    return bytes(header), num_bytes


def _kill_group(process: subprocess.Popen) -> None:
    """SIGKILL what is left of the process group (its children too), and reap the process."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
    if process.stdout is not None:
        process.stdout.close()
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=10)
