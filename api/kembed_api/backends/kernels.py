"""The local backend's side of the trainer's kernel cache (kembed_trainer.kernel_cache): the platform compiles the
trainer's numba kernels once per installation, in a process of its own, and every job gets the folder to read.

The build starts with the backend, in the background. A job started meanwhile waits for it (at most
BUILD_TIMEOUT_S): the build compiles what the job would otherwise compile itself, and jobs compiling side by side
would only slow each other down. A build that fails is logged, and jobs then compile their kernels themselves.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
from pathlib import Path

from kembed_api.platform import confinement
from kembed_contract import runtime

__all__ = ["BUILD_TIMEOUT_S", "PlatformKernels"]

log = logging.getLogger(__name__)

# A build compiles a few kernels (seconds each on a busy machine); past this it is stuck, and jobs go on without it.
BUILD_TIMEOUT_S = 300.0


class PlatformKernels:
    def __init__(self, root: Path) -> None:
        self.root = root
        self._folder: Path | None = None
        self._thread = threading.Thread(target=self._build, name="kembed-kernel-cache", daemon=True)
        self._thread.start()

    def _build(self) -> None:
        # The platform's own code, compiled by the platform: no job's input goes into it. The trainers' allowlisted
        # environment, not the server's (its settings and credentials stay out of a process that needs none).
        environ = confinement.trainer_environ(os.environ, scratch=self.root, server_s3_credentials=False)
        self.root.mkdir(parents=True, exist_ok=True)
        try:
            done = subprocess.run([sys.executable, "-m", runtime.KERNEL_CACHE_MODULE, "ensure", str(self.root)],
                                  env=environ, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            log.warning("the trainer's kernels were not compiled (%s): each job compiles its own", exc)
            return
        if done.returncode != 0:
            log.warning("the trainer's kernels were not compiled (exit %d): each job compiles its own; %s",
                        done.returncode, done.stderr.strip().splitlines()[-1:] or "")
            return
        self._folder = Path(done.stdout.strip().splitlines()[-1])
        log.info("the trainer's compiled kernels are in %s (read-only to jobs)", self._folder)

    def folder(self) -> Path | None:
        """The folder of this installation's compiled kernels, once built (waiting for the build); None when it
        could not be built."""
        self._thread.join(BUILD_TIMEOUT_S)
        return self._folder
