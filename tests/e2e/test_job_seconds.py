"""Where a job's seconds go and where its trainers run, on a real `kembed serve` with real trainers: the split of
its wall time by phase (kembed_contract.job_seconds) in the API and the CLI, and two jobs side by side on
disjoint cores (kembed_api.backends.cores) with their threads held to the CPU they were admitted with."""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import pytest

from kembed_contract import job_seconds, threads
from tests.builders import make_spec
from tests.e2e.conftest import alive, trainer_pids

pytestmark = pytest.mark.slow

# The split is rounded to milliseconds phase by phase: nine phases sum to the wall time within this.
_ROUNDING_S = 0.01


def test_a_finished_job_says_where_its_wall_time_went(server):
    job = server.client.submit(make_spec("seconds").with_steps(200).build())
    done = server.wait_terminal(job["id"])
    assert done["state"] == "SUCCEEDED", done["message"]

    seconds = done["seconds"]
    assert set(seconds) == {"wall", *job_seconds.PHASES}
    assert all(seconds[phase] >= 0 for phase in job_seconds.PHASES), seconds
    wall = (datetime.fromisoformat(done["finished_at"]) - datetime.fromisoformat(done["created_at"])).total_seconds()
    assert seconds["wall"] == pytest.approx(wall, abs=_ROUNDING_S)
    assert sum(seconds[phase] for phase in job_seconds.PHASES) == pytest.approx(wall, abs=_ROUNDING_S)
    # What a job does is measured, not left in the remainder: it started processes, imported torch, read its
    # data, trained, evaluated, saved its final checkpoint and exited.
    for phase in ("process_start", "imports", "data", "training", "evaluation", "saving", "exit"):
        assert seconds[phase] > 0, (phase, seconds)
    assert seconds["other"] < 0.5 * wall, seconds


def test_the_cli_shows_the_split(server):
    job = server.client.submit(make_spec("split-cli").build())
    done = server.wait_terminal(job["id"])
    shown = subprocess.run([sys.executable, "-m", "kembed_api.cli", "status", job["id"], "--server", server.url],
                           capture_output=True, text=True, timeout=120, env={**os.environ, "KEMBED_TOKEN": server.token})
    assert shown.returncode == 0, shown.stdout + shown.stderr
    line = next(line for line in shown.stdout.splitlines() if line.startswith("seconds "))
    assert f"{done['seconds']['wall']:.1f} s" in line
    for phase, label in job_seconds.PHASE_LABELS.items():
        assert f"{label} {done['seconds'][phase]:.1f}" in line, (label, line)


def _cores_of(pid: int) -> set[int]:
    """The cores a process may run on, as the kernel says (/proc/<pid>/status, Cpus_allowed_list: `0-1,3`)."""
    listed = next(line for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                  if line.startswith("Cpus_allowed_list:")).split(":", 1)[1].strip()
    cores = set()
    for part in listed.split(","):
        first, _, last = part.partition("-")
        cores.update(range(int(first), int(last or first) + 1))
    return cores


def _ranks(job_id: str) -> list[int]:
    """The job's training processes (torchrun's workers: `-m kembed_trainer --config`), alive."""
    return [pid for pid in trainer_pids(job_id) if alive(pid)
            and b"kembed_trainer\x00--config" in Path(f"/proc/{pid}/cmdline").read_bytes()]


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="two jobs on disjoint cores need two cores")
def test_two_jobs_side_by_side_run_on_disjoint_cores_with_their_share_of_threads(server):
    """Fails when two jobs oversubscribe the cores: each job's processes (launcher and ranks) may run only on
    cores of its own, and each rank sizes its thread pools to the one core its job was admitted with."""
    jobs = [server.client.submit(make_spec(f"side-{i}").with_cpu_only(cpu=1.0).with_steps(20000).build())["id"]
            for i in range(2)]
    try:
        for job_id in jobs:
            server.wait_for(job_id, lambda j: j["state"] == "RUNNING" and j["progress"]["step"] > 0, timeout=240)
        placed = {}
        for job_id in jobs:
            ranks = _ranks(job_id)
            assert ranks, f"{job_id}: no trainer process found"
            placed[job_id] = set().union(*(_cores_of(pid) for pid in trainer_pids(job_id) if alive(pid)))
            assert len(placed[job_id]) == 1, placed  # cpu_per_node 1: one core, whatever the machine has
            for pid in ranks:
                environ = dict(item.split(b"=", 1) for item in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                               if b"=" in item)
                assert environ[b"OMP_NUM_THREADS"] == b"1"
                assert all(environ[name.encode()] == value.encode() for name, value in threads.WAIT_POLICY.items())
        first, second = placed.values()
        assert not first & second, f"two jobs share cores: {placed}"
    finally:
        for job_id in jobs:
            server.client.cancel(job_id)
        for job_id in jobs:
            server.wait_terminal(job_id)
