"""Role escalation, existence probes and Idempotency-Key misuse against a real `kembed serve`.

A token sees its own tenant only, and a role can do no more than its row of the policy: another tenant's job,
tenant or token answers exactly like one that does not exist (status, body, headers), and a tenant admin cannot
see or touch the tokens of the platform's administrators.
"""

from __future__ import annotations

import json

import httpx
import pytest

from tests.builders import make_spec
from tests.security.hostile import World

# Headers that differ between any two answers whatever they say.
_VOLATILE_HEADERS = {"date"}


def _shape(response: httpx.Response, *secrets: str) -> tuple:
    """What an answer tells: its status, headers and body, with the ids it was asked about taken out."""
    body = response.text
    for secret in secrets:
        body = body.replace(secret, "<id>")
    headers = sorted((k, v if k != "content-length" else "-") for k, v in response.headers.items()
                     if k not in _VOLATILE_HEADERS)
    return response.status_code, headers, body


# ------------------------------------------------------------------------------------------------- roles
def test_a_tenant_admin_of_the_default_tenant_cannot_see_platform_admin_tokens(world: World):
    with world.as_("default", "tenant-admin") as tenant_admin:
        listed = tenant_admin.get("/v1/tenants/default/tokens")
        assert listed.status_code == 200
        assert "platform-admin" not in {token["role"] for token in listed.json()["items"]}
    with world.admin_client() as admin:  # a platform admin still sees them all
        assert "platform-admin" in {t["role"] for t in admin.get("/v1/tenants/default/tokens").json()["items"]}


def test_a_tenant_admin_cannot_revoke_a_platform_admin_token(world: World):
    with world.admin_client() as admin:
        made = admin.post("/v1/tenants/default/tokens", json={"name": "second-admin", "role": "platform-admin"})
        target = made.json()
    with world.as_("default", "tenant-admin") as tenant_admin:
        revoked = tenant_admin.delete(f"/v1/tenants/default/tokens/{target['id']}")
        missing = tenant_admin.delete("/v1/tenants/default/tokens/999999")
        assert revoked.status_code == 404
        assert _shape(revoked, str(target["id"])) == _shape(missing, "999999")
    with httpx.Client(base_url=world.url, headers={"Authorization": f"Bearer {target['token']}"}) as still:
        assert still.get("/v1/tenants").status_code == 200  # it still works: nothing was revoked


def test_a_platform_admin_token_of_another_tenant_is_hidden_from_its_tenant_admin(world: World):
    with world.as_("alpha", "tenant-admin") as tenant_admin:
        items = tenant_admin.get("/v1/tenants/alpha/tokens").json()["items"]
        assert world.token_ids["alpha", "platform-admin"] not in {t["id"] for t in items}
        answer = tenant_admin.delete(f"/v1/tenants/alpha/tokens/{world.token_ids['alpha', 'platform-admin']}")
        assert answer.status_code == 404
    with world.as_("alpha", "platform-admin") as platform_admin:
        assert platform_admin.get("/v1/tenants").status_code == 200


@pytest.mark.parametrize("role", ["viewer", "member", "tenant-admin"])
@pytest.mark.parametrize(("method", "path", "body"), [
    ("POST", "/v1/tenants", {"name": "escalated"}),
    ("GET", "/v1/tenants", None),
    ("PATCH", "/v1/tenants/alpha", {"quota": {"gpus": 1000}}),
    ("PATCH", "/v1/tenants/beta", {"quota": {"gpus": 0}}),
])
def test_only_platform_admins_manage_tenants(world: World, role, method, path, body):
    with world.as_("alpha", role) as client:
        assert client.request(method, path, json=body).status_code == 403
    with world.admin_client() as admin:
        assert admin.get("/v1/tenants/escalated").status_code == 404
        assert admin.get("/v1/tenants/alpha").json()["quota"]["gpus"] is None


@pytest.mark.parametrize(("role", "minted", "status"), [
    ("viewer", "viewer", 403), ("member", "viewer", 403),
    ("tenant-admin", "platform-admin", 403), ("tenant-admin", "tenant-admin", 201),
])
def test_nobody_mints_a_token_stronger_than_their_own(world: World, role, minted, status):
    with world.as_("alpha", role) as client:
        assert client.post("/v1/tenants/alpha/tokens", json={"name": "x", "role": minted}).status_code == status


@pytest.mark.parametrize(("method", "suffix"), [("POST", ""), ("POST", "/cancel")])
def test_viewers_only_read(world: World, method, suffix):
    with world.as_("alpha", "member") as member:
        job = member.post("/v1/jobs", json=make_spec("viewer-target").build()).json()
    with world.as_("alpha", "viewer") as viewer:
        path = "/v1/jobs" + (f"/{job['id']}{suffix}" if suffix else "")
        answer = viewer.request(method, path, json=make_spec("by-viewer").build() if not suffix else None)
        assert answer.status_code == 403
        assert viewer.get(f"/v1/jobs/{job['id']}").json()["state"] == "QUEUED"


# ------------------------------------------------------------------------------------------------- existence
_JOB_ROUTES = [
    ("GET", ""), ("POST", "/cancel"), ("GET", "/events"), ("GET", "/logs"), ("GET", "/checkpoints"),
    ("GET", "/metrics"),
]


@pytest.fixture(scope="module")
def beta_job(world: World) -> str:
    with world.as_("beta", "member") as member:
        return member.post("/v1/jobs", json=make_spec("secret-plan").build()).json()["id"]


def _unknown_like(job_id: str) -> str:
    name, suffix = job_id.rsplit("-", 1)
    return f"{name}-{'zzzzz' if suffix != 'zzzzz' else 'yyyyy'}"


@pytest.mark.parametrize("role", ["viewer", "member", "tenant-admin", "platform-admin"])
@pytest.mark.parametrize(("method", "suffix"), _JOB_ROUTES)
def test_another_tenants_job_answers_exactly_like_a_missing_one(world: World, beta_job, role, method, suffix):
    unknown = _unknown_like(beta_job)
    with world.as_("alpha", role) as client:
        foreign = client.request(method, f"/v1/jobs/{beta_job}{suffix}")
        missing = client.request(method, f"/v1/jobs/{unknown}{suffix}")
    assert foreign.status_code == (403 if (role, suffix) == ("viewer", "/cancel") else 404)
    assert _shape(foreign, beta_job) == _shape(missing, unknown)
    with world.as_("beta", "viewer") as owner:  # and the probe changed nothing (a cancel did not cancel)
        assert owner.get(f"/v1/jobs/{beta_job}").json()["state"] == "QUEUED"


@pytest.mark.parametrize("token", ["", "Bearer not-a-report-token", "Bearer {alpha_member}"])
def test_reports_to_another_tenants_job_answer_like_a_missing_job(world: World, beta_job, token):
    unknown = _unknown_like(beta_job)
    token = token.format(alpha_member=world.tokens["alpha", "member"])
    record = {"event": "progress", "step": 1, "loss": 0.1}
    with httpx.Client(base_url=world.url) as client:
        foreign = client.post(f"/v1/jobs/{beta_job}/reports", json=record, headers={"Authorization": token})
        missing = client.post(f"/v1/jobs/{unknown}/reports", json=record, headers={"Authorization": token})
    assert foreign.status_code in (401, 404)
    assert _shape(foreign, beta_job) == _shape(missing, unknown)


@pytest.mark.parametrize("job_id", ["nope%00x", "a" * 300, "UPPER-case", "%E2%80%AE-rtl"])
def test_ids_that_cannot_be_jobs_are_not_found(world: World, job_id):
    with world.as_("alpha", "member") as client:
        for method, suffix in _JOB_ROUTES:
            assert client.request(method, f"/v1/jobs/{job_id}{suffix}").status_code == 404, suffix


@pytest.mark.parametrize(("method", "suffix", "body"), [
    ("GET", "", None), ("GET", "/usage", None), ("GET", "/tokens", None),
    ("POST", "/tokens", {"name": "x", "role": "viewer"}), ("DELETE", "/tokens/1", None),
])
def test_another_tenant_answers_exactly_like_a_missing_one(world: World, method, suffix, body):
    with world.as_("alpha", "tenant-admin") as client:
        foreign = client.request(method, f"/v1/tenants/beta{suffix}", json=body)
        missing = client.request(method, f"/v1/tenants/bbbb{suffix}", json=body)
    assert foreign.status_code == 404
    assert _shape(foreign, "beta") == _shape(missing, "bbbb")


def test_another_tenants_token_answers_exactly_like_a_missing_one(world: World):
    foreign_id = world.token_ids["beta", "viewer"]
    with world.as_("alpha", "tenant-admin") as client:
        foreign = client.delete(f"/v1/tenants/alpha/tokens/{foreign_id}")
        missing = client.delete("/v1/tenants/alpha/tokens/987654")
    assert foreign.status_code == 404 and _shape(foreign, str(foreign_id)) == _shape(missing, "987654")
    with httpx.Client(base_url=world.url, headers={"Authorization": f"Bearer {world.tokens['beta', 'viewer']}"}) as c:
        assert c.get("/v1/jobs").status_code == 200  # beta's token still works


# ------------------------------------------------------------------------------------------------- idempotency
def _jobs_named(client: httpx.Client, name: str) -> list[dict]:
    return client.get("/v1/jobs", params={"name": name, "limit": 500}).json()["items"]


def test_the_same_key_with_a_different_spec_is_422_and_stores_nothing(world: World):
    with world.as_("alpha", "member") as client:
        first = client.post("/v1/jobs", json=make_spec("keyed").build(), headers={"Idempotency-Key": "deploy-42"})
        assert first.status_code == 201
        other = make_spec("keyed").with_steps(999).build()
        reused = client.post("/v1/jobs", json=other, headers={"Idempotency-Key": "deploy-42"})
        assert reused.status_code == 422
        assert "idempotency-key" in reused.json()["detail"] and "different spec" in reused.json()["detail"]
        assert len(_jobs_named(client, "keyed")) == 1


def test_the_same_key_with_the_same_spec_in_other_words_is_the_same_job(world: World):
    spec = make_spec("canonical").build()
    with world.as_("alpha", "member") as client:
        first = client.post("/v1/jobs", json=spec, headers={"Idempotency-Key": "same"})
        # the same request, keys reordered, spaced differently, with a default spelled out
        text = json.dumps({"priority": 0, **dict(reversed(list(spec.items())))}, indent=3)
        again = client.post("/v1/jobs", content=text, headers={"Idempotency-Key": "same",
                                                                "Content-Type": "application/json"})
        assert (first.status_code, again.status_code) == (201, 200)
        assert again.json()["id"] == first.json()["id"]


def test_keys_belong_to_their_tenant(world: World):
    with world.as_("alpha", "member") as alpha, world.as_("beta", "member") as beta:
        mine = alpha.post("/v1/jobs", json=make_spec("shared-key").build(), headers={"Idempotency-Key": "k-1"})
        theirs = beta.post("/v1/jobs", json=make_spec("shared-key").with_steps(7).build(),
                           headers={"Idempotency-Key": "k-1"})
        assert (mine.status_code, theirs.status_code) == (201, 201)
        assert mine.json()["id"] != theirs.json()["id"]


@pytest.mark.parametrize("key", ["", "a" * 201, "two words", "tab\there", "é".encode()])
def test_empty_oversized_or_odd_keys_are_refused(world: World, key):
    with world.as_("alpha", "member") as client:
        before = len(_jobs_named(client, "odd-key"))
        answer = client.post("/v1/jobs", json=make_spec("odd-key").build(), headers={"Idempotency-Key": key})
        assert answer.status_code == 422
        assert answer.json()["errors"][0]["loc"] == ["header", "idempotency-key"]
        assert len(_jobs_named(client, "odd-key")) == before
