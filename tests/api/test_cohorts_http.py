"""Cohorts and priority classes over HTTP: borrowing idle quota, reclaiming it, and the limits on classes."""

from __future__ import annotations

from tests.api.conftest import bearer
from tests.builders import make_spec


def member(client, name: str, *, gpus: int, **sharing) -> str:
    """A tenant of cohort `research` with `gpus` nominal GPUs; returns a member token of it."""
    body = {"name": name, "quota": {"gpus": gpus}, "sharing": {"cohort": "research", **sharing}}
    created = client.post("/v1/tenants", json=body)
    assert created.status_code == 201, created.text
    token = client.post(f"/v1/tenants/{name}/tokens", json={"name": "t", "role": "member"})
    return token.json()["token"]


def one_gpu_job(name: str) -> dict:
    return make_spec(name).with_gpus(1).build()


def wait_state(client, token: str, job_id: str, state: str, *, dispatcher) -> dict:
    for _ in range(50):
        dispatcher.run_once()
        job = client.get(f"/v1/jobs/{job_id}", headers=bearer(token)).json()
        if job["state"] == state:
            return job
    raise AssertionError(f"{job_id} never reached {state}: {job['state']} {job['reason']} {job['message']}")


def test_a_member_borrows_idle_quota_and_its_lender_reclaims_it(api_client, backend):
    dispatcher = api_client.app.state.dispatcher
    a, b = member(api_client, "lab-a", gpus=1), member(api_client, "lab-b", gpus=1)
    first = api_client.post("/v1/jobs", json=one_gpu_job("a-first"), headers=bearer(a)).json()
    wait_state(api_client, a, first["id"], "RUNNING", dispatcher=dispatcher)
    second = api_client.post("/v1/jobs", json=one_gpu_job("a-second"), headers=bearer(a)).json()
    borrowed = wait_state(api_client, a, second["id"], "RUNNING", dispatcher=dispatcher)
    assert "borrowing its cohort's idle quota" in borrowed["events"][-2]["message"]

    usage_a = api_client.get("/v1/usage", headers=bearer(a)).json()["sharing"]
    usage_b = api_client.get("/v1/usage", headers=bearer(b)).json()["sharing"]
    assert (usage_a["nominal"]["gpus"], usage_a["borrowed"]["gpus"], usage_a["lent"]["gpus"]) == (1, 1, 0)
    assert (usage_b["borrowed"]["gpus"], usage_b["lent"]["gpus"]) == (0, 1)

    reclaiming = api_client.post("/v1/jobs", json=one_gpu_job("b-own"), headers=bearer(b)).json()
    victim = wait_state(api_client, a, second["id"], "PREEMPTED", dispatcher=dispatcher)
    assert victim["reason"] == "ReclaimedByLender" and "another team's job" in victim["message"]
    # The lender's job is its own team's business: its name reaches no event of the borrower's.
    assert all(reclaiming["id"] not in e["message"] and reclaiming["name"] not in e["message"]
               for e in victim["events"])
    assert backend.preempted == [second["id"]]  # the newest borrower, the only one needed; a keeps its own
    assert api_client.get(f"/v1/jobs/{reclaiming['id']}", headers=bearer(b)).json()["state"] == "QUEUED"

    backend.finish(second["id"], succeeded=False, retryable=True, reason="TrainerExitedRetryably")  # it saved
    wait_state(api_client, b, reclaiming["id"], "RUNNING", dispatcher=dispatcher)
    requeued = wait_state(api_client, a, second["id"], "QUEUED", dispatcher=dispatcher)
    assert requeued["reason"] == "Requeued" and requeued["restart_count"] == 0
    assert "waiting for" in requeued["message"] and "gpus" in requeued["message"]  # every wait has its reason


def test_priority_classes_are_the_platforms_and_a_tenant_uses_them_up_to_its_limit(api_client):
    unknown = api_client.post("/v1/tenants", json={"name": "lab-x", "sharing": {"max_priority_class": "vip"}})
    assert unknown.status_code == 422 and "sharing.max_priority_class" in unknown.text
    token = member(api_client, "lab-c", gpus=4, max_priority_class="normal")
    too_high = api_client.post("/v1/jobs", json=make_spec("x").with_priority_class("high").build(),
                               headers=bearer(token))
    assert too_high.status_code == 422 and "priority_class" in too_high.text and "'normal'" in too_high.text
    bogus = api_client.post("/v1/jobs", json=make_spec("x").with_priority_class("vip").build(), headers=bearer(token))
    assert bogus.status_code == 422 and "not one of the platform's classes" in bogus.text
    low = api_client.post("/v1/jobs", json=make_spec("x").with_priority_class("low").build(), headers=bearer(token))
    assert low.status_code == 201 and low.json()["priority"] == -100


def test_a_job_bigger_than_its_tenants_quota_runs_by_borrowing_but_never_beyond_the_borrowing_limit(api_client):
    dispatcher = api_client.app.state.dispatcher
    token = member(api_client, "lab-d", gpus=1, borrowing_limit={"gpus": 1})
    member(api_client, "lab-e", gpus=2)  # leaves its 2 GPUs idle
    two, three = one_gpu_job("two"), one_gpu_job("three")
    two["resources"]["gpus_per_node"], three["resources"]["gpus_per_node"] = 2, 3
    refused = api_client.post("/v1/jobs", json=three, headers=bearer(token))
    assert refused.status_code == 422 and refused.json()["detail"] == (  # 1 + 1 borrowable < 3
        "resources: the job needs 3 GPUs but the tenant's quota plus its borrowing limit (quota.gpus) is 2")
    job = api_client.post("/v1/jobs", json=two, headers=bearer(token))
    assert job.status_code == 201, job.text
    running = wait_state(api_client, token, job.json()["id"], "RUNNING", dispatcher=dispatcher)
    assert any("borrowing its cohort's idle quota" in e["message"] for e in running["events"])


def test_a_victim_killed_before_it_saved_resumes_from_its_last_checkpoint_and_the_event_counts_the_lost_steps(
        api_client, backend):
    dispatcher = api_client.app.state.dispatcher
    a, b = member(api_client, "lab-f", gpus=1), member(api_client, "lab-g", gpus=1)
    jobs = [api_client.post("/v1/jobs", json=one_gpu_job(f"f-{i}"), headers=bearer(a)).json()["id"] for i in range(2)]
    for job_id in jobs:  # the second one borrows lab-g's idle GPU
        wait_state(api_client, a, job_id, "RUNNING", dispatcher=dispatcher)
        launch = next(s for s in backend.started if s.job_id == job_id)
        for record in ({"event": "checkpoint", "step": 40, "uri": f"file:///ckpt/{job_id}/step-40"},
                       {"event": "progress", "step": 57, "loss": 0.5}):
            reported = api_client.post(f"/v1/jobs/{job_id}/reports", json=record, headers=bearer(launch.report_token))
            assert reported.status_code < 300, reported.text
    api_client.post("/v1/jobs", json=one_gpu_job("g-own"), headers=bearer(b))  # the lender reclaims its GPU
    for _ in range(20):
        dispatcher.run_once()
        if backend.preempted:
            break
    [victim] = backend.preempted
    # The gang did not save within the grace period: killed, its last complete checkpoint is step 40.
    backend.finish(victim, succeeded=False, retryable=True, reason="KilledAfterGracePeriod")
    requeued = wait_state(api_client, a, victim, "QUEUED", dispatcher=dispatcher)
    event = next(e for e in requeued["events"] if e["reason"] == "Requeued")
    assert event["message"] == "stopped at step 57; resumes from checkpoint step 40; lost_steps=17"
    assert requeued["checkpoint_step"] == 40 and requeued["restart_count"] == 0
