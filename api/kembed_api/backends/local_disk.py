"""The embedded backend's local disk: what is free under the data dir, and what a running gang's trainers have
written into their local folder so far (runtime.ENV_LOCAL_DIR: their tiered tables' rows).

A tier's files are unlinked as soon as they are opened (kembed_trainer.tiered.store), so no listing of the folder
shows them: their open descriptors do. /proc/<pid>/fd/<n> of a trainer names the file it holds (`<folder>/...
(deleted)`), and a stat through it gives the blocks it takes.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterable
from pathlib import Path

__all__ = ["free_bytes", "written_bytes"]


def free_bytes(path: Path) -> int:
    """Bytes an unprivileged process may still write on the file system of `path` (statvfs' f_bavail)."""
    return shutil.disk_usage(path).free


def written_bytes(pids: Iterable[int], folder: Path) -> int:
    """Bytes of disk the files under `folder` held open by `pids` take (each file once, however many hold it)."""
    prefix = f"{folder}/"
    seen: dict[tuple[int, int], int] = {}
    for pid in pids:
        fds = Path(f"/proc/{pid}/fd")
        with contextlib.suppress(OSError):  # the process ended meanwhile, or is not ours to look at
            for fd in os.listdir(fds):
                with contextlib.suppress(OSError):
                    if os.readlink(fds / fd).startswith(prefix):
                        info = os.stat(fds / fd)
                        seen[(info.st_dev, info.st_ino)] = info.st_blocks * 512
    return sum(seen.values())
