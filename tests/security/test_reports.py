"""Trainer reports against a real `kembed serve` and real trainers: none is lost when the API stops answering
while a trainer ends, and one replayed (by a retry, or by whoever holds the job's report token) changes nothing.
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from tests.builders import make_spec
from tests.e2e.conftest import alive, trainer_pids
from tests.security.hostile import World, start_world

pytestmark = pytest.mark.slow  # real trainers (tens of seconds on a loaded 2-core machine)


@pytest.fixture(scope="module")
def running_world(tmp_path_factory) -> Iterator[World]:
    """A server that admits and runs jobs (the hostile world of this module)."""
    instance = start_world(tmp_path_factory.mktemp("reports") / "kembed", env={"KEMBED_ADMISSION_PAUSED": "false"})
    yield instance
    if instance.server.process.poll() is None:
        instance.server.process.send_signal(signal.SIGCONT)
        instance.server.stop()


def _wait(what: str, check: Callable[[], object], timeout: float = 180) -> object:
    deadline = time.monotonic() + timeout
    while not (found := check()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)
    return found


def _job(client: httpx.Client, job_id: str) -> dict:
    return client.get(f"/v1/jobs/{job_id}").json()


def _log(world: World, job_id: str) -> str:
    path = Path(world.server.data_dir) / "logs" / job_id / "node-0.log"
    return path.read_text(errors="replace") if path.exists() else ""


def test_no_report_is_lost_when_the_api_stops_answering_as_the_trainer_ends(running_world: World):
    """The bug as it was seen under load: the API too busy to answer while a trainer wrote its last checkpoint and
    its result; the trainer gave up on its reports and exited, the API saw it exit 0 and recorded SUCCEEDED with no
    result and an older checkpoint. Here the API is frozen (SIGSTOP) from the trainer's start until well after
    its last record, so every report of the run has to wait for it."""
    world = running_world
    with world.as_("alpha", "member") as client:
        job = client.post("/v1/jobs", json=make_spec("unheard").with_steps(60, checkpoint_every=20).build()).json()
        _wait("the trainer to start", lambda: trainer_pids(job["id"]))
        world.server.process.send_signal(signal.SIGSTOP)
        try:
            _wait("the trainer's last record", lambda: '"event": "done"' in _log(world, job["id"]))
            # The old reporter gave up 5 s after its last record and let the trainer exit; this one holds it.
            deadline = time.monotonic() + 12
            while time.monotonic() < deadline and any(alive(pid) for pid in trainer_pids(job["id"])):
                time.sleep(0.2)
        finally:
            world.server.process.send_signal(signal.SIGCONT)
        ended = _wait("the job to end", lambda: (j := _job(client, job["id"]))["state"] in (
            "SUCCEEDED", "FAILED", "CANCELLED") and j)
        assert ended["state"] == "SUCCEEDED"
        assert ended["result"] is not None and "auc" in ended["result"]
        assert ended["checkpoint_step"] == 60 and ended["latest_checkpoint_uri"].endswith("step-60")
        assert ended["progress"]["step"] == 60
    # What makes a retry detectable: every record the trainer wrote carries its run and a growing number.
    records = [json.loads(line) for line in _log(world, job["id"]).splitlines() if line.startswith('{"event"')]
    assert len({r["run"] for r in records}) == 1
    assert [r["seq"] for r in records] == list(range(1, len(records) + 1))


def _report_token(job_id: str) -> str:
    for pid in trainer_pids(job_id):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        for entry in environ:
            if entry.startswith(b"KEMBED_REPORT_TOKEN="):
                return entry.split(b"=", 1)[1].decode()
    return ""


def test_a_replayed_report_changes_nothing(running_world: World):
    world = running_world
    spec = make_spec("replayed").with_steps(2**31 - 1, checkpoint_every=2**31 - 1).build()
    spec["trainer"]["training"]["log_every"] = 2**31 - 1  # the trainer itself reports nothing more while it runs
    with world.as_("alpha", "member") as client:
        job = client.post("/v1/jobs", json=spec).json()
        token = _wait("the trainer's report token", lambda: _report_token(job["id"]))
        _wait("the trainer's started record", lambda: _job(client, job["id"])["state"] == "RUNNING" and client.get(
            f"/v1/jobs/{job['id']}/metrics", params={"event": "started"}).json())
        url = f"/v1/jobs/{job['id']}/reports"
        auth = {"Authorization": f"Bearer {token}"}
        newer = {"event": "checkpoint", "step": 40, "uri": "file:///elsewhere/step-40", "run": "r1", "seq": 2}
        older = {"event": "checkpoint", "step": 20, "uri": "file:///elsewhere/step-20", "run": "r1", "seq": 1}
        done = {"event": "done", "step": 40, "eval": {"auc": 0.7}, "run": "r1", "seq": 3}
        for record in (newer, newer, older, done, done, older):  # retries, and a late copy of an older record
            assert client.post(url, json=record, headers=auth).status_code == 204
        # Without run and seq (an older trainer), a checkpoint still never moves back.
        legacy = {"event": "checkpoint", "step": 10, "uri": "file:///elsewhere/step-10"}
        assert client.post(url, json=legacy, headers=auth).status_code == 204
        current = _job(client, job["id"])
        assert (current["latest_checkpoint_uri"], current["checkpoint_step"]) == ("file:///elsewhere/step-40", 40)
        assert current["result"] == {"auc": 0.7}
        series = client.get(f"/v1/jobs/{job['id']}/metrics").json()
        assert [(p["event"], p["step"]) for p in series if p["event"] in ("checkpoint", "done")] == [
            ("checkpoint", 40), ("done", 40), ("checkpoint", 10)]
        client.post(f"/v1/jobs/{job['id']}/cancel")
        _wait("the cancel", lambda: _job(client, job["id"])["state"] == "CANCELLED")
