"""kembed_trainer.launch: torchrun that exits with what happened to the failed rank."""

from __future__ import annotations

import signal
import subprocess
import sys

from kembed_contract import lifecycle, runtime


def test_a_rank_killed_by_a_signal_exits_the_launcher_with_128_plus_the_signal(tmp_path):
    """torchrun sees the worker's return code as -9; the launcher reports 137 like a shell or a kubelet would, so
    the one exit-code policy judges it retryable."""
    worker = tmp_path / "worker.py"
    worker.write_text("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n")
    done = subprocess.run(
        [sys.executable, "-m", runtime.LAUNCHER_MODULE, "--standalone", "--nnodes", "1", "--nproc-per-node", "1",
         str(worker)],
        capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 128 + signal.SIGKILL, done.stderr[-2000:]
    assert "exit code 137" in done.stderr
    assert lifecycle.is_retryable_exit_code(done.returncode)
