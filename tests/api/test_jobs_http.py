"""The /v1/jobs HTTP surface: validation, 404s, idempotency, pagination, cancel, reports.

The dispatcher runs for real; the backend is a fake that starts nothing (tests/e2e runs real trainers).
"""

from __future__ import annotations

import pytest

from kembed_contract import job_seconds, runtime
from tests.builders import make_spec
from tests.cluster.fixture import wait_for


@pytest.fixture
def client(api_client, backend):
    backend.slots = 2
    return api_client


def test_submit_returns_201_with_id_state_and_a_checkpoint_under_the_tenant(client):
    response = client.post("/v1/jobs", json=make_spec("ctr").build())
    assert response.status_code == 201
    job = response.json()
    assert job["id"].startswith("ctr-") and job["state"] == "QUEUED"
    assert job["spec"]["trainer"]["checkpoint"]["uri"].endswith(f"/checkpoints/default/{job['id']}")
    assert client.get(f"/v1/jobs/{job['id']}").json()["events"][0]["reason"] == "Submitted"


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        pytest.param(lambda s: s["trainer"]["training"].update(steps=-1), "trainer.training.steps", id="steps"),
        pytest.param(lambda s: s.pop("trainer"), "trainer", id="missing-trainer"),
        pytest.param(lambda s: s["resources"].update(nodes="two"), "resources.nodes", id="nodes-not-int"),
    ],
)
def test_an_invalid_spec_is_422_naming_the_field_and_stores_nothing(client, mutate, field):
    spec = make_spec().build()
    mutate(spec)
    response = client.post("/v1/jobs", json=spec)
    assert response.status_code == 422
    locations = [".".join(map(str, error["loc"][1:])) for error in response.json()["errors"]]
    assert field in locations
    assert client.get("/v1/jobs").json()["items"] == []


def test_a_job_that_can_never_fit_is_422_saying_why(client):
    response = client.post("/v1/jobs", json=make_spec().with_nodes(2, 2).build())
    assert response.status_code == 422
    assert response.json()["detail"] == "resources: needs 4 processes, the backend has 2 slots"
    assert client.get("/v1/jobs").json()["items"] == []


@pytest.mark.parametrize("path", ["/v1/jobs/nope-12345", "/v1/jobs/nope-12345/logs", "/v1/jobs/nope-12345/metrics"])
def test_unknown_ids_are_404(client, path):
    assert client.get(path).status_code == 404


def test_cancel_of_an_unknown_job_is_404(client):
    assert client.post("/v1/jobs/nope-12345/cancel").status_code == 404


def test_the_same_idempotency_key_returns_the_first_job(client):
    headers = {"Idempotency-Key": "retry-1"}
    first = client.post("/v1/jobs", json=make_spec().build(), headers=headers)
    again = client.post("/v1/jobs", json=make_spec().build(), headers=headers)
    assert (first.status_code, again.status_code) == (201, 200)
    assert first.json()["id"] == again.json()["id"]
    assert len(client.get("/v1/jobs").json()["items"]) == 1


def test_list_pages_newest_first_and_filters_by_state(client):
    ids = [client.post("/v1/jobs", json=make_spec(f"j{i}").with_nodes(1, 2).build()).json()["id"] for i in range(5)]
    seen, cursor = [], None
    while True:
        page = client.get("/v1/jobs", params={"limit": 2, **({"cursor": cursor} if cursor else {})}).json()
        seen += [job["id"] for job in page["items"]]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert seen == ids[::-1]
    wait_for(lambda: client.get(f"/v1/jobs/{ids[0]}").json()["state"] != "QUEUED", what="the first job admitted")
    queued = client.get("/v1/jobs", params={"state": "QUEUED"}).json()["items"]
    assert [job["queue_position"] for job in queued] == [4, 3, 2, 1]  # the first job runs, the rest wait
    assert client.get("/v1/jobs", params={"cursor": "garbage!"}).status_code == 422


def test_cancel_of_a_queued_job_is_immediate(client):
    client.post("/v1/jobs", json=make_spec("runs").with_nodes(1, 2).build())
    waiting = client.post("/v1/jobs", json=make_spec("waits").with_nodes(1, 2).build()).json()
    response = client.post(f"/v1/jobs/{waiting['id']}/cancel")
    assert response.status_code == 202 and response.json()["state"] == "CANCELLED"
    events = client.get(f"/v1/jobs/{waiting['id']}").json()["events"]  # the job read with its events, in order
    assert [(e["state"], e["reason"]) for e in events] == [("QUEUED", "Submitted"), ("CANCELLED", "Cancelled")]
    assert events[0]["time"] <= events[1]["time"] and events == response.json()["events"]


def test_reports_need_the_jobs_own_token_and_update_progress(client, backend):
    job = client.post("/v1/jobs", json=make_spec().build()).json()
    for _ in range(100):
        if backend.started:
            break
        client.get("/healthz")
    launch = backend.started[0]
    url = f"/v1/jobs/{job['id']}/reports"
    record = {"event": "progress", "step": 7, "total_steps": 60, "loss": 0.42, "samples_per_sec": 1000.0}
    assert client.post(url, json=record, headers={"Authorization": ""}).status_code == 401
    # a wrong token (the client's own API token is one) answers as a missing job does: 401, written nothing
    assert client.post(url, json=record).status_code == 401
    assert client.post(url, json=record, headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert client.post("/v1/jobs/nope-12345/reports", json=record,
                       headers={"Authorization": "Bearer wrong"}).status_code == 401
    auth = {"Authorization": f"Bearer {launch.report_token}"}
    assert client.post(url, json=record, headers=auth).status_code == 204
    assert client.post(url, json={"event": "checkpoint", "step": 7, "uri": "file:///c/step-7"},
                       headers=auth).status_code == 204
    current = client.get(f"/v1/jobs/{job['id']}").json()
    assert current["progress"] == {"step": 7, "total_steps": 60, "fraction": 7 / 60}
    assert current["metrics"]["loss"] == 0.42
    assert (current["latest_checkpoint_uri"], current["checkpoint_step"]) == ("file:///c/step-7", 7)
    series = client.get(f"/v1/jobs/{job['id']}/metrics", params={"event": "progress"}).json()
    assert [point["values"]["loss"] for point in series] == [0.42]


def test_the_latest_checkpoint_is_the_last_saved_not_the_best_one_a_done_record_names(client, backend):
    """With evaluation.keep_best a done record's `checkpoint` is the best eval's (an earlier step) and its
    `last_checkpoint` the latest: the job's latest_checkpoint_uri stays the step it says it is."""
    job = client.post("/v1/jobs", json=make_spec().build()).json()
    wait_for(lambda: backend.started or client.get("/healthz") and None, what="the job to start")
    url, auth = f"/v1/jobs/{job['id']}/reports", {"Authorization": f"Bearer {backend.started[0].report_token}"}
    for record in ({"event": "checkpoint", "step": 60, "uri": "file:///c/step-60"},
                   {"event": "done", "step": 60, "eval": {"auc": 0.8}, "checkpoint": "file:///c/step-20",
                    "best_step": 20, "last_checkpoint": "file:///c/step-60"}):
        assert client.post(url, json=record, headers=auth).status_code == 204
    current = client.get(f"/v1/jobs/{job['id']}").json()
    assert (current["latest_checkpoint_uri"], current["checkpoint_step"]) == ("file:///c/step-60", 60)
    assert current["result"] == {"auc": 0.8}


def test_a_record_replayed_after_another_run_reported_is_applied_once(client, backend):
    """Two trainer runs of one job report in turn (a restart, a preempted gang resumed); a retry of the first
    run's record that arrives after the second run's is still recognised as applied."""
    job = client.post("/v1/jobs", json=make_spec().build()).json()
    wait_for(lambda: backend.started or client.get("/healthz") and None, what="the job to start")
    url, auth = f"/v1/jobs/{job['id']}/reports", {"Authorization": f"Bearer {backend.started[0].report_token}"}
    first = {"event": "progress", "step": 5, "loss": 0.5, "run": "r1", "seq": 1}
    second = {"event": "progress", "step": 6, "loss": 0.4, "run": "r2", "seq": 1}
    for record in (first, second, first, second, first):
        assert client.post(url, json=record, headers=auth).status_code == 204
    series = client.get(f"/v1/jobs/{job['id']}/metrics", params={"event": "progress"}).json()
    assert [point["values"]["loss"] for point in series] == [0.5, 0.4]



def test_records_sent_together_are_applied_in_their_order_each_once_and_a_batch_is_bounded(client, backend):
    """A trainer sends the records queued behind one another in one POST (a job's POSTs are rate limited): each
    is applied as if sent alone, in order, a replayed one once; an empty list or one over the bound is refused
    whole and changes nothing."""
    job = client.post("/v1/jobs", json=make_spec().build()).json()
    wait_for(lambda: backend.started or client.get("/healthz") and None, what="the job to start")
    url, auth = f"/v1/jobs/{job['id']}/reports", {"Authorization": f"Bearer {backend.started[0].report_token}"}
    records = [{"event": "progress", "step": s, "loss": 1.0 / s, "run": "r1", "seq": s} for s in range(1, 6)]
    records.append({"event": "checkpoint", "step": 5, "uri": "file:///c/step-5", "run": "r1", "seq": 6})
    assert client.post(url, json=records[:4], headers=auth).status_code == 204
    assert client.post(url, json=records[2:], headers=auth).status_code == 204  # two of them again
    too_many = [{"event": "progress", "step": 9, "loss": 0.1}] * (runtime.MAX_RECORDS_PER_REPORT + 1)
    for refused in ([], too_many):
        assert client.post(url, json=refused, headers=auth).status_code == 422
    series = client.get(f"/v1/jobs/{job['id']}/metrics", params={"event": "progress"}).json()
    assert [point["step"] for point in series] == [1, 2, 3, 4, 5]
    current = client.get(f"/v1/jobs/{job['id']}").json()
    assert (current["progress"]["step"], current["checkpoint_step"], current["metrics"]["loss"]) == (5, 5, 0.2)

def test_the_trainer_s_seconds_split_the_job_s_wall_time_and_are_no_metric(client, backend):
    """What a trainer reports of its phases becomes the job's split (kembed_contract.job_seconds), kept to what a
    trainer may say: a negative, a non-number or a phase only the platform measures is dropped."""
    job = client.post("/v1/jobs", json=make_spec().build()).json()
    assert job["seconds"]["queued"] == job["seconds"]["wall"]  # not admitted yet: all of it queued
    wait_for(lambda: backend.started or client.get("/healthz") and None, what="the job to start")
    url, auth = f"/v1/jobs/{job['id']}/reports", {"Authorization": f"Bearer {backend.started[0].report_token}"}
    seconds = {"process_start": 0.002, "imports": 0.003, "training": -5, "data": "1", "queued": 99.0}
    record = {"event": "progress", "step": 5, "loss": 0.5, "run": "r1", "seq": 1, "seconds": seconds}
    assert client.post(url, json=record, headers=auth).status_code == 204
    read = client.get(f"/v1/jobs/{job['id']}").json()
    assert "seconds" not in read["metrics"] and read["metrics"]["loss"] == 0.5
    split = read["seconds"]
    assert split["process_start"] == 0.002 and split["imports"] == 0.003
    assert split["training"] == split["data"] == 0.0 and split["queued"] < 99.0
    assert sum(split[p] for p in job_seconds.PHASES) == pytest.approx(split["wall"], abs=0.01)
    series = client.get(f"/v1/jobs/{job['id']}/metrics", params={"event": "progress"}).json()
    assert "seconds" not in series[0]["values"]


def test_openapi_and_health(client):
    assert client.get("/healthz").json() == {"status": "ok"}
    paths = client.get("/openapi.json").json()["paths"]
    assert {"/v1/jobs", "/v1/jobs/{job_id}", "/v1/jobs/{job_id}/cancel", "/v1/jobs/{job_id}/logs"} <= set(paths)


def test_a_spec_stored_before_todays_rules_stays_readable_and_is_failed_not_run(client):
    """A job stored before a bound existed (a flood of labels, an eval that would never end) is read as stored, and
    the dispatcher fails it with the reason instead of running it (or failing every pass on it)."""
    from sqlalchemy import select

    from kembed_api.jobs.models import Job

    client.app.state.dispatcher.admission_paused = True  # it waits in the queue while its spec is "old"
    job = client.post("/v1/jobs", json=make_spec("old").build()).json()
    with client.app.state.db.session(write=True) as session:
        stored = session.scalar(select(Job).where(Job.id == job["id"]))
        spec = dict(stored.spec)
        spec["labels"] = {f"k{i}": "v" for i in range(100)}
        spec["trainer"] = {**spec["trainer"], "data": {**spec["trainer"]["data"], "eval_samples": 10**12}}
        stored.spec = spec
    read = client.get(f"/v1/jobs/{job['id']}")
    assert read.status_code == 200 and len(read.json()["spec"]["labels"]) == 100
    assert client.get("/v1/jobs").status_code == 200
    client.app.state.dispatcher.admission_paused = False
    client.app.state.dispatcher.wake()
    failed = wait_for(lambda: (j := client.get(f"/v1/jobs/{job['id']}").json())["state"] == "FAILED" and j,
                      what="the old job to be failed")
    assert failed["reason"] == "SpecInvalid" and "labels" in failed["message"]
