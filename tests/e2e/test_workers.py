"""`kembed serve --workers 2`: worker processes share one port, one of them dispatches, losing it loses no job."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from tests.builders import make_spec
from tests.e2e.conftest import alive, trainer_pids

pytestmark = pytest.mark.slow


def _dispatching_worker(server) -> int | None:
    """The pid holding the dispatcher's lock (from /proc/locks: "... FLOCK ADVISORY WRITE <pid> <dev>:<inode> ...")."""
    inode = os.stat(server.data_dir / "dispatcher.lock").st_ino
    with open("/proc/locks") as locks:
        for line in locks:
            fields = line.split()
            if fields[1] == "FLOCK" and fields[5].endswith(f":{inode}"):
                return int(fields[4])
    return None


def _admissions_counted(server) -> float:
    # A connection of its own, so that the kernel may hand it to either worker.
    text = httpx.get(f"{server.url}/metrics").text
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("kembed_admission_wait_seconds_count"))


def test_jobs_submitted_through_any_worker_run_once_and_every_worker_reports_them(start_server):
    server = start_server(slots=2, workers=2)
    headers = {"Authorization": f"Bearer {server.token}"}
    ids = [httpx.post(f"{server.url}/v1/jobs", json=make_spec(f"w{i}").with_nodes(1, 1).build(),
                      headers=headers).json()["id"] for i in range(3)]
    for job_id in ids:
        done = server.wait_terminal(job_id)
        assert done["state"] == "SUCCEEDED", done["message"]
        assert [e["reason"] for e in done["events"]] == ["Submitted", "Admitted", "Started", "Completed"]
    # Only the dispatching worker observed the admissions; a scrape of either worker shows all three.
    assert [_admissions_counted(server) for _ in range(8)] == [3.0] * 8


def test_when_the_dispatching_worker_dies_another_takes_over_and_the_job_resumes(start_server):
    server = start_server(slots=2, workers=2)
    job = server.client.submit(make_spec("long").with_nodes(1, 2).with_steps(400, checkpoint_every=20).build())
    server.wait_for(job["id"], lambda j: (j["checkpoint_step"] or 0) >= 40)
    leader, trainers = _dispatching_worker(server), trainer_pids(job["id"])
    assert leader is not None and trainers

    os.kill(leader, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while _dispatching_worker(server) in (None, leader):
        assert time.monotonic() < deadline, "no other worker took over dispatching"
        time.sleep(0.2)
    done = server.wait_terminal(job["id"], timeout=240)
    assert done["state"] == "SUCCEEDED", done["message"]
    reasons = [e["reason"] for e in done["events"]]
    assert reasons == ["Submitted", "Admitted", "Started", "ServerRestarted", "Resumed", "Completed"]
    assert not any(alive(pid) for pid in trainers)  # the dead worker's trainers were reclaimed, not left running
    assert server.process.poll() is None  # the server as a whole never went away


def test_workers_that_cannot_start_stop_the_server_saying_why(tmp_path):
    """A port another program holds: every worker fails to bind it, and the server gives up instead of
    starting them over and over."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        result = subprocess.run(
            [sys.executable, "-m", "kembed_api.cli", "serve", "--port", str(taken.getsockname()[1]),
             "--data-dir", str(tmp_path / "kembed"), "--workers", "2"],
            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert "workers ended within" in result.stdout and "Address already in use" in result.stderr
