"""Checkpoint-aware preemption on the embedded default: a real `kembed serve` with one local slot, real trainers."""

from __future__ import annotations

import re

from tests.builders import make_spec
from tests.cluster.fixture import wait_for
from tests.e2e.conftest import ServerProcess, frozen

_STEPS = 60  # the victim is held still (SIGSTOP) from step 5 until it is asked to stop


def _losses(server: ServerProcess, job_id: str) -> dict[int, float]:
    records = server.client._call("GET", f"/v1/jobs/{job_id}/metrics", params={"event": "progress"}).json()
    losses: dict[int, float] = {}
    for record in records:
        assert losses.setdefault(record["step"], record["values"]["loss"]) == record["values"]["loss"]
    return losses


def test_a_preempted_job_saves_gives_way_and_finishes_as_if_never_interrupted(tmp_path):
    server = ServerProcess(tmp_path / "kembed", slots=1).start()
    try:
        def job(name: str):
            return make_spec(name).with_steps(_STEPS, checkpoint_every=0).with_trainer(training={"log_every": 1})

        reference = server.client.submit(job("ref").with_priority_class("low").build())
        reference = server.wait_terminal(reference["id"], timeout=300)
        assert reference["state"] == "SUCCEEDED"

        victim = server.client.submit(job("victim").with_priority_class("low").build())
        server.wait_for(victim["id"], lambda j: j["state"] == "RUNNING")
        # Held still mid-run until it is asked to stop, so that the urgent job finds it there on any machine.
        with frozen(victim["id"], lambda: server.client.logs(victim["id"]), after_step=5) as (held_at, asked_to_stop):
            urgent = server.client.submit(make_spec("urgent").with_steps(20).with_priority_class("high").build())
            wait_for(asked_to_stop, timeout_s=120, what="the victim's trainers asked to stop (SIGTERM)")
        assert server.wait_terminal(urgent["id"], timeout=300)["state"] == "SUCCEEDED"
        done = server.wait_terminal(victim["id"], timeout=300)
        losses, reference_losses = _losses(server, done["id"]), _losses(server, reference["id"])
    finally:
        server.stop()

    events = [(e["state"], e["reason"], e["message"]) for e in done["events"]]
    preempted = [e for e in events if e[0] == "PREEMPTED"]
    assert len(preempted) == 1 and preempted[0][1] == "HigherPriority" and urgent["id"] in preempted[0][2]
    requeued = next(e for e in events if e[1] == "Requeued")
    assert re.search(r"lost_steps=0\b", requeued[2]), requeued  # it saved on SIGTERM within the grace period
    stopped_at = int(re.search(r"stopped at step (\d+)", requeued[2]).group(1))
    assert held_at <= stopped_at < _STEPS  # it stopped where it was held, or a step or two on
    assert [e[1] for e in events][-3:] == ["Admitted", "Resumed", "Completed"]
    assert done["state"] == "SUCCEEDED" and done["restart_count"] == 0  # a preemption is not a failure
    # The loss curve and the final metrics are those of the uninterrupted run, bit for bit (CPU).
    assert sorted(losses) == list(range(1, _STEPS + 1))
    assert losses == reference_losses
    assert done["result"] == reference["result"]
