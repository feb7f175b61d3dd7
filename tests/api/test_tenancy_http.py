"""Tenants, tokens, roles and quotas over HTTP: a token sees only its tenant, and does only what its role may."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import create_engine, text

from kembed_api.app import create_app
from kembed_api.platform.settings import Settings
from tests.api.conftest import bearer
from tests.builders import make_spec


def new_tenant(client, name: str, *, role: str = "tenant-admin", **quota) -> str:
    """Create a tenant and return a token of it with `role`."""
    assert client.post("/v1/tenants", json={"name": name, "quota": quota}).status_code == 201
    created = client.post(f"/v1/tenants/{name}/tokens", json={"name": f"{name}-{role}", "role": role})
    assert created.status_code == 201, created.text
    return created.json()["token"]


@pytest.fixture
def two_tenants(api_client):
    """Tenants a and b, each with a tenant-admin token, and one job of b's."""
    a, b = new_tenant(api_client, "team-a"), new_tenant(api_client, "team-b")
    job = api_client.post("/v1/jobs", json=make_spec("b-job").build(), headers=bearer(b)).json()
    return a, b, job["id"]


@pytest.mark.parametrize(
    ("method", "path"),
    [
        pytest.param("GET", "/v1/jobs/{id}", id="get"),
        pytest.param("POST", "/v1/jobs/{id}/cancel", id="cancel"),
        pytest.param("GET", "/v1/jobs/{id}/logs", id="logs"),
        pytest.param("GET", "/v1/jobs/{id}/events", id="events"),
        pytest.param("GET", "/v1/jobs/{id}/metrics", id="metrics"),
        pytest.param("GET", "/v1/jobs/{id}/checkpoints", id="checkpoints"),
        pytest.param("GET", "/v1/tenants/team-b", id="tenant"),
        pytest.param("GET", "/v1/tenants/team-b/usage", id="usage"),
        pytest.param("GET", "/v1/tenants/team-b/tokens", id="tokens"),
    ],
)
def test_another_tenants_resources_are_404_not_403(api_client, two_tenants, method, path):
    a, b, b_job = two_tenants
    response = api_client.request(method, path.format(id=b_job), headers=bearer(a))
    assert response.status_code == 404, response.text
    assert "team-b" not in response.text or "not found" in response.text  # nothing but "not found"
    assert api_client.request(method, path.format(id=b_job), headers=bearer(b)).status_code in (200, 202)


def test_a_tenant_lists_only_its_own_jobs(api_client, two_tenants):
    a, b, b_job = two_tenants
    assert api_client.get("/v1/jobs", headers=bearer(a)).json()["items"] == []
    assert [j["id"] for j in api_client.get("/v1/jobs", headers=bearer(b)).json()["items"]] == [b_job]
    assert api_client.get("/v1/usage", headers=bearer(a)).json()["queued_jobs"] == 0


@pytest.mark.parametrize(
    ("role", "submit", "read", "manage_tokens"),
    [
        pytest.param("viewer", 403, 200, 403, id="viewer"),
        pytest.param("member", 201, 200, 403, id="member"),
        pytest.param("tenant-admin", 201, 200, 201, id="tenant-admin"),
    ],
)
def test_roles(api_client, role, submit, read, manage_tokens):
    token = new_tenant(api_client, "team", role=role)
    assert api_client.post("/v1/jobs", json=make_spec().build(), headers=bearer(token)).status_code == submit
    assert api_client.get("/v1/jobs", headers=bearer(token)).status_code == read
    created = api_client.post("/v1/tenants/team/tokens", json={"name": "x", "role": "viewer"}, headers=bearer(token))
    assert created.status_code == manage_tokens
    assert api_client.post("/v1/tenants", json={"name": "other"}, headers=bearer(token)).status_code == 403


def test_a_viewer_cannot_cancel(api_client):
    admin = new_tenant(api_client, "team")
    viewer = api_client.post("/v1/tenants/team/tokens", json={"name": "v", "role": "viewer"},
                             headers=bearer(admin)).json()["token"]
    job = api_client.post("/v1/jobs", json=make_spec().build(), headers=bearer(admin)).json()
    assert api_client.post(f"/v1/jobs/{job['id']}/cancel", headers=bearer(viewer)).status_code == 403
    assert api_client.get(f"/v1/jobs/{job['id']}", headers=bearer(viewer)).json()["state"] != "CANCELLED"


def test_a_tenant_admin_cannot_mint_platform_admins(api_client):
    admin = new_tenant(api_client, "team")
    response = api_client.post("/v1/tenants/team/tokens", json={"name": "up", "role": "platform-admin"},
                               headers=bearer(admin))
    assert response.status_code == 403


def test_tokens_are_shown_once_stored_hashed_revocable_and_expire(api_client, database_url):
    admin = new_tenant(api_client, "team")
    listed = api_client.get("/v1/tenants/team/tokens", headers=bearer(admin)).json()["items"]
    assert all("token" not in t for t in listed) and listed[0]["prefix"] == admin[:8]
    with create_engine(database_url).connect() as connection:
        stored = " ".join(str(row) for row in connection.execute(text("SELECT * FROM api_tokens")))
    assert admin not in stored  # only the hash is kept

    member = api_client.post("/v1/tenants/team/tokens", json={"name": "m", "role": "member"},
                             headers=bearer(admin)).json()
    assert api_client.get("/v1/jobs", headers=bearer(member["token"])).status_code == 200
    assert api_client.delete(f"/v1/tenants/team/tokens/{member['id']}", headers=bearer(admin)).status_code == 204
    assert api_client.get("/v1/jobs", headers=bearer(member["token"])).status_code == 401

    past = (datetime.now(UTC) - timedelta(seconds=1)).isoformat()
    expired = api_client.post("/v1/tenants/team/tokens", json={"name": "e", "role": "member", "expires_at": past},
                              headers=bearer(admin)).json()
    assert api_client.get("/v1/jobs", headers=bearer(expired["token"])).status_code == 401
    assert api_client.get("/v1/jobs", headers=bearer("kmb_made_up")).status_code == 401
    assert api_client.get("/v1/jobs", headers={"Authorization": ""}).status_code == 401


def test_a_token_revoked_through_another_replica_stops_working_within_the_cache_time(
    api_client, backend, database_url, tmp_path
):
    admin = new_tenant(api_client, "team")
    member = api_client.post("/v1/tenants/team/tokens", json={"name": "m", "role": "member"},
                             headers=bearer(admin)).json()
    other = Settings(data_dir=tmp_path / "replica", database_url=database_url, token_cache_s=1.0,
                     bootstrap_admin_token=(tmp_path / "admin-token").read_text().strip())
    with TestClient(create_app(other, backend=backend)) as replica:
        assert replica.get("/v1/jobs", headers=bearer(member["token"])).status_code == 200  # now remembered there
        assert api_client.delete(f"/v1/tenants/team/tokens/{member['id']}", headers=bearer(admin)).status_code == 204
        assert api_client.get("/v1/jobs", headers=bearer(member["token"])).status_code == 401  # here: at once
        time.sleep(1.1)
        assert replica.get("/v1/jobs", headers=bearer(member["token"])).status_code == 401  # there: after 1 s


def test_a_job_bigger_than_the_quota_is_refused_saying_why(api_client):
    token = new_tenant(api_client, "small", cpu=1)
    response = api_client.post("/v1/jobs", json=make_spec().with_nodes(1, 1).build() | {
        "resources": {"nodes": 2, "cpu_per_node": 1}}, headers=bearer(token))
    assert response.status_code == 422
    assert response.json()["detail"] == "resources: the job needs 2 CPU cores but the tenant's quota (quota.cpu) is 1"


def test_a_job_whose_tables_cannot_fit_its_memory_is_refused(api_client):
    spec = make_spec().build()
    spec["resources"]["memory_per_node"] = "128Mi"  # above the floor (64Mi), below the 256 MiB runtime baseline
    response = api_client.post("/v1/jobs", json=spec)
    assert response.status_code == 422 and "resources.memory_per_node" in response.json()["detail"]
    assert "the job needs about" in response.json()["detail"]


def test_a_full_queue_is_429_and_keeps_what_was_queued(api_client, backend):
    backend.slots = 1
    token = new_tenant(api_client, "busy", max_queued_jobs=2)
    for name in ("runs", "waits-1", "waits-2"):
        response = api_client.post("/v1/jobs", json=make_spec(name).build(), headers=bearer(token))
        assert response.status_code == 201
        if name == "runs":  # admitted to the one slot, so the queue holds the next two (they stay QUEUED)
            _wait_admitted_or_queued(api_client, response.json()["id"], token)
    refused = api_client.post("/v1/jobs", json=make_spec("one-too-many").build(), headers=bearer(token))
    assert refused.status_code == 429 and "quota.max_queued_jobs is 2" in refused.json()["detail"]
    assert len(api_client.get("/v1/jobs", headers=bearer(token)).json()["items"]) == 3


def _wait_admitted_or_queued(client, job_id, token):
    for _ in range(200):
        if client.get(f"/v1/jobs/{job_id}", headers=bearer(token)).json()["state"] != "QUEUED":
            return
        client.get("/healthz")


def test_quota_changes_apply_and_usage_reports_them(api_client, backend):
    token = new_tenant(api_client, "team", gpus=0, max_running_jobs=1)
    first = api_client.post("/v1/jobs", json=make_spec("first").build(), headers=bearer(token)).json()
    second = api_client.post("/v1/jobs", json=make_spec("second").build(), headers=bearer(token)).json()
    _wait_admitted_or_queued(api_client, first["id"], token)
    # The pass that admitted the first job may have run before the second arrived: the next pass says why it waits.
    deadline = time.monotonic() + 10
    while "quota.max_running_jobs" not in (
            waiting := api_client.get(f"/v1/jobs/{second['id']}", headers=bearer(token)).json())["message"]:
        assert time.monotonic() < deadline, waiting["message"]
        time.sleep(0.05)
    assert waiting["state"] == "QUEUED" and waiting["queue_position"] == 1
    usage = api_client.get("/v1/usage", headers=bearer(token)).json()
    assert usage["used"]["running_jobs"] == 1 and usage["queued_jobs"] == 1
    assert usage["quota"]["max_running_jobs"] == 1

    assert api_client.patch("/v1/tenants/team", json={"quota": {"max_running_jobs": 2}}).status_code == 200
    _wait_admitted_or_queued(api_client, second["id"], token)
    assert api_client.get(f"/v1/jobs/{second['id']}", headers=bearer(token)).json()["state"] == "RUNNING"


def test_bad_tenant_input_names_the_field(api_client):
    response = api_client.post("/v1/tenants", json={"name": "Team_A", "quota": {"memory": "lots"}})
    assert response.status_code == 422
    assert {".".join(map(str, e["loc"][1:])) for e in response.json()["errors"]} == {"name", "quota.memory"}
    assert api_client.post("/v1/tenants", json={"name": "dup"}).status_code == 201
    assert api_client.post("/v1/tenants", json={"name": "dup"}).status_code == 409
    assert api_client.get("/v1/tenants").json()["items"][-1]["name"] == "dup"


def test_metrics_show_jobs_queue_and_quota(api_client):
    token = new_tenant(api_client, "team", gpus=4)
    job = api_client.post("/v1/jobs", json=make_spec().build(), headers=bearer(token)).json()
    _wait_admitted_or_queued(api_client, job["id"], token)
    body = api_client.get("/metrics").text
    assert 'kembed_jobs{state="RUNNING",tenant="team"} 1.0' in body
    assert 'kembed_quota_limit{resource="gpus",tenant="team"} 4.0' in body
    assert 'kembed_admission_wait_seconds_count{tenant="team"} 1.0' in body


def test_a_job_cannot_point_its_checkpoints_into_another_tenants_folder(api_client):
    token = new_tenant(api_client, "team-a")
    root = api_client.post("/v1/jobs", json=make_spec().build(), headers=bearer(token)).json()[
        "spec"]["trainer"]["checkpoint"]["uri"].rsplit("/team-a/", 1)[0]
    spec = make_spec().build()
    spec["trainer"]["checkpoint"]["uri"] = f"{root}/team-b/stolen"
    response = api_client.post("/v1/jobs", json=spec, headers=bearer(token))
    assert response.status_code == 422 and "trainer.checkpoint.uri" in response.json()["detail"]
    spec["trainer"]["checkpoint"]["uri"] = f"{root}/team-a/my-own-folder"
    assert api_client.post("/v1/jobs", json=spec, headers=bearer(token)).status_code == 201
