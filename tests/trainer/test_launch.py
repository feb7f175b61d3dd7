"""kembed_trainer.launch: torchrun that exits with what happened to the failed rank, and a node of one process
started without torchrun under the same policy."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kembed_contract import lifecycle, runtime
from kembed_trainer import lone_rank


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


def _launch(*args: str) -> list[str]:
    return [sys.executable, "-m", runtime.LAUNCHER_MODULE, *args]


@pytest.mark.parametrize(("argv", "alone"), [
    pytest.param(["--nnodes=1", "--node-rank=0", "--nproc-per-node=1", "--master-addr=127.0.0.1",
                  "--master-port=29511", "--max-restarts=0", "--rdzv-id=job-1", "-m", "kembed_trainer", "--config",
                  "c.yaml"], ["-m", "kembed_trainer", "--config", "c.yaml"], id="the-platforms-node-command"),
    pytest.param(["--standalone", "--nnodes", "1", "--nproc-per-node", "1", "w.py", "--nnodes=4"],
                 ["w.py", "--nnodes=4"], id="a-script-whose-own-arguments-look-like-torchruns"),
    pytest.param(["--nnodes=1", "--nproc-per-node=2", "w.py"], None, id="two-ranks"),
    pytest.param(["--nnodes=2", "--node-rank=0", "--nproc-per-node=1", "w.py"], None, id="two-nodes"),
    pytest.param(["--nnodes=1:2", "--nproc-per-node=1", "w.py"], None, id="an-elastic-range"),
    pytest.param(["--nnodes=1", "--nproc-per-node=1", "--max-restarts=3", "w.py"], None, id="restarts"),
    pytest.param(["--nnodes=1", "--nproc-per-node=1", "--tee=3", "w.py"], None, id="an-option-it-does-not-know"),
    pytest.param(["--nproc-per-node=1", "w.py"], None, id="nodes-left-to-torchrun"),
])
def test_only_one_node_of_one_process_skips_torchrun(argv, alone):
    parsed = lone_rank.parse(argv)
    assert (parsed and parsed.command) == alone


def test_a_lone_rank_gets_torchruns_environment(tmp_path):
    worker = tmp_path / "worker.py"
    worker.write_text("import json, os\nprint(json.dumps({k: os.environ.get(k) for k in "
                      "('RANK', 'LOCAL_RANK', 'WORLD_SIZE', 'LOCAL_WORLD_SIZE', 'MASTER_ADDR', 'MASTER_PORT')}))\n")
    done = subprocess.run(_launch("--nnodes=1", "--nproc-per-node=1", "--master-port=29517", str(worker)),
                          capture_output=True, text=True, timeout=60, check=True)
    assert json.loads(done.stdout) == {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29517"}


@pytest.mark.parametrize("nproc", [pytest.param("1", id="lone-rank"), pytest.param("2", id="torchrun")])
def test_a_bad_config_exits_2_whoever_starts_the_ranks(tmp_path, nproc):
    """The lifecycle tells a permanent bad input (2) from a crash (1) by the launcher's code, on either path."""
    worker = tmp_path / "worker.py"
    worker.write_text("import sys\nsys.exit(2)\n")
    done = subprocess.run(_launch("--standalone", "--nnodes=1", f"--nproc-per-node={nproc}", str(worker)),
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == runtime.EXIT_BAD_CONFIG, done.stderr[-2000:]
    assert "exit code 2" in done.stderr


def test_sigterm_to_a_lone_ranks_launcher_reaches_the_rank_which_saves_before_the_launcher_exits_143(tmp_path):
    """As in a pod, where the kubelet signals the launcher alone: the rank (in a session of its own) is asked to
    stop, finishes what it does on SIGTERM, and the launcher says it was stopped (retryable)."""
    saved = tmp_path / "saved"
    worker = tmp_path / "worker.py"
    worker.write_text(
        "import signal, sys, time, pathlib\n"
        f"def stop(*_):\n    time.sleep(0.5)\n    pathlib.Path({str(saved)!r}).write_text('yes')\n    sys.exit(143)\n"
        "signal.signal(signal.SIGTERM, stop)\nprint('ready', flush=True)\ntime.sleep(60)\n")
    launcher = subprocess.Popen(_launch("--nnodes=1", "--nproc-per-node=1", str(worker)), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
    assert launcher.stdout.readline() == "ready\n"
    launcher.send_signal(signal.SIGTERM)
    assert launcher.wait(timeout=30) == runtime.EXIT_STOPPED, launcher.stderr.read()
    assert saved.read_text() == "yes"
    assert "stopped by SIGTERM" in launcher.stderr.read()
    assert lifecycle.is_retryable_exit_code(launcher.returncode)


def test_a_lone_rank_does_not_outlive_a_launcher_killed_outright(tmp_path):
    """SIGKILL leaves the launcher no chance to pass anything on; the rank, in a session of its own, must end too."""
    worker = tmp_path / "worker.py"
    worker.write_text("import os, time\nprint(os.getpid(), flush=True)\ntime.sleep(60)\n")
    launcher = subprocess.Popen(_launch("--nnodes=1", "--nproc-per-node=1", str(worker)), stdout=subprocess.PIPE,
                                text=True, start_new_session=True)
    rank = int(launcher.stdout.readline())
    launcher.kill()
    launcher.wait(timeout=30)
    deadline = time.monotonic() + 10
    while _alive(rank):
        assert time.monotonic() < deadline, "the rank outlived its launcher"
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie has ended; only its parent's wait is missing
