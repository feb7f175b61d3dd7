"""Restarts of the embedded server lose no job: running jobs resume from their checkpoint, queued ones run."""

from __future__ import annotations

import signal

import pytest

from tests.builders import make_spec
from tests.e2e.conftest import alive, trainer_pids

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("stop_signal", [signal.SIGTERM, signal.SIGKILL], ids=["graceful-stop", "kill-9"])
def test_a_restart_resumes_the_running_job_and_runs_the_queued_one(start_server, tmp_path, stop_signal):
    server = start_server(slots=2)
    running = server.client.submit(make_spec("running").with_nodes(1, 2).with_steps(400, checkpoint_every=20).build())
    queued = server.client.submit(make_spec("queued").with_nodes(1, 2).build())
    server.wait_for(running["id"], lambda j: (j["checkpoint_step"] or 0) >= 40)
    assert server.client.job(queued["id"])["state"] == "QUEUED"

    trainers = trainer_pids(running["id"])
    assert trainers
    server.stop(stop_signal)
    if stop_signal == signal.SIGTERM:
        # a graceful stop ends the trainers too, after their SIGTERM checkpoint
        assert not any(alive(pid) for pid in trainers)

    restarted = start_server(server.data_dir, slots=2)
    # after kill -9 the orphaned trainers are reclaimed (SIGTERM, checkpoint, exit) before the server serves
    assert not any(alive(pid) for pid in trainers)
    resumed = restarted.wait_terminal(running["id"], timeout=240)
    assert resumed["state"] == "SUCCEEDED", resumed["message"]
    reasons = [e["reason"] for e in resumed["events"]]
    assert reasons[:3] == ["Submitted", "Admitted", "Started"]
    assert "ServerRestarted" in reasons and "Resumed" in reasons
    assert resumed["restart_count"] == 0

    starts = restarted.client._call("GET", f"/v1/jobs/{running['id']}/metrics", params={"event": "started"}).json()
    assert starts[0]["values"]["resumed_from"] is None
    assert starts[-1]["values"]["resumed_from"] is not None and starts[-1]["step"] >= 40

    other = restarted.wait_terminal(queued["id"], timeout=240)
    assert other["state"] == "SUCCEEDED", other["message"]
