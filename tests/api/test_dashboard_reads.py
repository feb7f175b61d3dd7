"""The dashboard's read endpoints and sessions over HTTP, and its history arithmetic on a real database."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import select

from kembed_api.dashboard import service
from kembed_api.jobs.models import Job, JobEvent
from kembed_api.tenants.schemas import QuotaSpec
from kembed_api.tenants.service import create_tenant
from tests.api.conftest import bearer
from tests.api.test_tenancy_http import new_tenant
from tests.builders import make_spec

NOW = datetime(2026, 12, 10, 12, 0, tzinfo=UTC)


def _job(tenant_id: int, n: int, *, state: str, created: datetime, admitted: datetime | None = None,
         finished: datetime | None = None, gpus: int = 0, cpu: float = 1.0) -> Job:
    return Job(id=f"h-{n}", tenant_id=tenant_id, name="h", spec={}, state=state, reason="x", gpus=gpus, cpu=cpu,
               created_at=created, admitted_at=admitted, finished_at=finished)


def test_history_splits_hours_by_day_and_measures_waits(db):
    day = timedelta(days=1)
    with db.session(write=True) as session:
        tenant = create_tenant(session, name="hist", quota=QuotaSpec())
        other = create_tenant(session, name="other", quota=QuotaSpec())
        session.flush()
        midnight = datetime(2026, 12, 10, tzinfo=UTC)
        session.add_all([
            # 1 GPU from 22:00 yesterday to 02:00 today: 2 GPU-hours each day (waited 10 min)
            _job(tenant.id, 1, state="SUCCEEDED", created=midnight - timedelta(hours=2, minutes=10),
                 admitted=midnight - timedelta(hours=2), finished=midnight + timedelta(hours=2), gpus=1),
            # still running since 10:00 today on 4 GPUs: 8 GPU-hours by noon (waited 1 h)
            _job(tenant.id, 2, state="RUNNING", created=midnight + timedelta(hours=9),
                 admitted=midnight + timedelta(hours=10), gpus=4),
            # cancelled while queued today: a final state, no hours, no wait
            _job(tenant.id, 3, state="CANCELLED", created=midnight + timedelta(hours=1),
                 finished=midnight + timedelta(hours=3)),
            # ended long before the window: not counted
            _job(tenant.id, 4, state="FAILED", created=midnight - 30 * day, admitted=midnight - 30 * day,
                 finished=midnight - 29 * day, gpus=8),
            # another tenant's: never counted
            _job(other.id, 5, state="SUCCEEDED", created=midnight, admitted=midnight, finished=NOW, gpus=64),
        ])
        session.flush()
        running = session.scalar(select(Job).where(Job.id == "h-2"))
        other_job = session.scalar(select(Job).where(Job.id == "h-5"))
        session.add_all([
            JobEvent(job_seq=running.seq, time=midnight - timedelta(hours=1), state="PREEMPTED", reason="Preempted"),
            JobEvent(job_seq=running.seq, time=midnight + timedelta(hours=10), state="RESTARTING", reason="x"),
            JobEvent(job_seq=running.seq, time=midnight + timedelta(hours=11), state="RESTARTING", reason="x"),
            JobEvent(job_seq=running.seq, time=midnight - 10 * day, state="RESTARTING", reason="before the window"),
            JobEvent(job_seq=other_job.seq, time=midnight, state="PREEMPTED", reason="another tenant's"),
        ])
    with db.session() as session:
        history = service.history(session, tenant=tenant, days=7, now=NOW)
    assert [d.day.isoformat() for d in history.per_day][-2:] == ["2026-12-09", "2026-12-10"]
    yesterday, today = history.per_day[-2], history.per_day[-1]
    assert yesterday.gpu_hours == pytest.approx(2.0)
    assert today.gpu_hours == pytest.approx(2.0 + 8.0)
    assert history.gpu_hours == pytest.approx(12.0)
    assert yesterday.jobs_admitted == 1 and yesterday.avg_queue_wait_s == 600
    assert today.jobs_admitted == 1 and today.avg_queue_wait_s == 3600
    assert history.avg_queue_wait_s == 2100 and history.p90_queue_wait_s == 3600
    assert history.finished == {"SUCCEEDED": 1, "CANCELLED": 1}
    assert today.finished == {"SUCCEEDED": 1, "CANCELLED": 1}
    assert len(history.per_day) == 7 and all(d.gpu_hours == 0 for d in history.per_day[:-2])
    assert history.preemptions == 1 and history.restarts == 2
    assert (yesterday.preemptions, yesterday.restarts, today.preemptions, today.restarts) == (1, 0, 0, 2)
    csv = service.to_csv(history).splitlines()
    assert csv[0] == ("day,gpu_hours,cpu_hours,jobs_admitted,avg_queue_wait_s,p90_queue_wait_s,preemptions,restarts,"
                      "CANCELLED,FAILED,SUCCEEDED")
    assert csv[-1] == "2026-12-10,10,4,1,3600,3600,0,2,1,0,1"  # CPU: 2 h of each job
    assert len(csv) == 8


@pytest.mark.parametrize(("values", "p90"), [
    pytest.param([], None, id="none"),
    pytest.param([5.0], 5.0, id="one"),
    pytest.param([float(v) for v in range(1, 11)], 9.0, id="ten"),
    pytest.param([float(v) for v in range(1, 101)], 90.0, id="hundred"),
])
def test_p90_is_the_nearest_rank(values, p90):
    assert service._p90(values) == p90


def test_the_overview_lists_the_queue_head_in_admission_order_with_exact_positions(api_client):
    token = new_tenant(api_client, "busy", role="member", max_running_jobs=1)
    holder = api_client.post("/v1/jobs", json=make_spec("holder").build(), headers=bearer(token)).json()["id"]
    deadline = time.monotonic() + 30
    while api_client.get(f"/v1/jobs/{holder}", headers=bearer(token)).json()["state"] == "QUEUED":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    ids = [api_client.post("/v1/jobs", json=make_spec(f"q{i}").with_priority(i % 3).build(),
                           headers=bearer(token)).json()["id"] for i in range(service.QUEUE_LIMIT + 5)]
    overview = api_client.get("/v1/overview", headers=bearer(token))
    assert overview.status_code == 200
    body = overview.json()
    assert body["usage"]["queued_jobs"] == len(ids)
    assert [j["id"] for j in body["running"]] == [holder]
    assert "waiting for" in body["queue"][0]["message"]
    assert len(body["queue"]) == service.QUEUE_LIMIT
    positions = [j["queue_position"] for j in body["queue"]]
    assert positions == list(range(1, service.QUEUE_LIMIT + 1))
    for job in body["queue"][:5] + body["queue"][-2:]:
        assert api_client.get(f"/v1/jobs/{job['id']}", headers=bearer(token)).json()["queue_position"] == \
            job["queue_position"]
    assert [j["priority"] for j in body["queue"]] == sorted((j["priority"] for j in body["queue"]), reverse=True)
    assert body["jobs_by_state"]["QUEUED"] == len(ids)
    assert "spec" not in body["queue"][0]  # rows, not whole jobs
    # An unchanged answer is a 304 to a page that has it, also once it was made again (a second later).
    time.sleep(1.1)
    again = api_client.get("/v1/overview", headers={**bearer(token), "If-None-Match": overview.headers["etag"]})
    assert again.status_code == 304
    api_client.post(f"/v1/jobs/{ids[0]}/cancel", headers=bearer(token))
    time.sleep(1.1)
    changed = api_client.get("/v1/overview", headers={**bearer(token), "If-None-Match": overview.headers["etag"]})
    assert changed.status_code == 200 and changed.json()["usage"]["queued_jobs"] == len(ids) - 1


def test_the_cluster_view_is_for_platform_admins_only(api_client):
    member = new_tenant(api_client, "small", role="tenant-admin", gpus=4, cpu=8)
    assert api_client.get("/v1/cluster", headers=bearer(member)).status_code == 403
    cluster = api_client.get("/v1/cluster").json()
    assert {t["name"] for t in cluster["tenants"]} == {"default", "small"}
    assert cluster["sum_of_quotas"]["gpus"] is None  # the default tenant is unlimited
    assert cluster["capacity"]["processes"] == 4  # the fake backend's slots
    small = next(t for t in cluster["tenants"] if t["name"] == "small")
    assert small["quota"]["gpus"] == 4 and small["queued_jobs"] == 0


def test_history_refuses_a_window_out_of_range_naming_the_field(api_client):
    response = api_client.get("/v1/usage/history", params={"days": 0})
    assert response.status_code == 422 and response.json()["errors"][0]["loc"] == ["query", "days"]
    csv = api_client.get("/v1/usage/history", params={"days": 30, "format": "csv"})
    assert csv.headers["content-type"].startswith("text/csv") and len(csv.text.splitlines()) == 31


def test_sign_in_makes_a_session_that_acts_as_its_token(api_client):
    token = new_tenant(api_client, "sessions", role="member")
    api_client.headers.pop("Authorization")
    elsewhere = api_client.post("/dashboard/sign-in", data={"token": token}, follow_redirects=False,
                                headers={"Origin": "https://attacker.example"})
    assert elsewhere.status_code == 403 and "kembed_session" not in elsewhere.cookies
    refused = api_client.post("/dashboard/sign-in", data={"token": "kmb_wrong"}, follow_redirects=False)
    assert refused.status_code == 401 and "kembed_session" not in refused.cookies
    signed_in = api_client.post("/dashboard/sign-in", data={"token": token}, follow_redirects=False)
    assert signed_in.status_code == 303
    set_cookie = signed_in.headers["set-cookie"]
    assert "HttpOnly" in set_cookie and "SameSite=strict" in set_cookie and token not in set_cookie
    assert api_client.get("/v1/usage").json()["tenant"] == "sessions"
    page = api_client.get("/dashboard")
    assert page.status_code == 200 and "Team sessions" in page.text
    # Writes need the page's CSRF token; a page of another site can send the cookie but not the header.
    spec = make_spec("s").build()
    assert api_client.post("/v1/jobs", json=spec).status_code == 403
    csrf = page.text.split('name="csrf-token" content="')[1].split('"')[0]
    assert api_client.post("/v1/jobs", json=spec, headers={"X-CSRF-Token": csrf}).status_code == 201
    assert api_client.post("/dashboard/sign-out", data={"csrf_token": "nope"}).status_code == 403
    session_secret = api_client.cookies["kembed_session"]
    out = api_client.post("/dashboard/sign-out", data={"csrf_token": csrf}, follow_redirects=False)
    assert out.status_code == 303
    api_client.cookies.set("kembed_session", session_secret)  # the old cookie, kept by someone: dead server-side
    assert api_client.get("/v1/usage").status_code == 401
    api_client.cookies.clear()
    assert api_client.get("/dashboard", follow_redirects=False).headers["location"] == "/dashboard/sign-in"


def test_a_job_page_is_served_with_the_folder_its_job_checkpoints_to_by_default(api_client):
    """"Submit again" clears the old job's checkpoint folder only when it was the default one: the page is served
    that folder (the API's own rule), so the script never guesses it from the job's id."""
    token = new_tenant(api_client, "folders", role="member")
    api_client.headers.pop("Authorization")
    assert api_client.post("/dashboard/sign-in", data={"token": token}, follow_redirects=False).status_code == 303
    csrf = api_client.get("/dashboard").text.split('name="csrf-token" content="')[1].split('"')[0]
    defaulted = api_client.post("/v1/jobs", json=make_spec("plain").build(), headers={"X-CSRF-Token": csrf}).json()
    folder = defaulted["spec"]["trainer"]["checkpoint"]["uri"]
    named_spec = make_spec("named").build()
    named_spec["trainer"]["checkpoint"]["uri"] = f"{folder.rsplit('/', 1)[0]}/runs/mine"
    named = api_client.post("/v1/jobs", json=named_spec, headers={"X-CSRF-Token": csrf}).json()

    def served(job_id: str) -> str:
        page = api_client.get(f"/dashboard/jobs/{job_id}")
        assert page.status_code == 200
        return page.text.split('data-default-checkpoint-folder="')[1].split('"')[0]

    assert served(defaulted["id"]) == folder
    assert served(named["id"]) != named["spec"]["trainer"]["checkpoint"]["uri"]
