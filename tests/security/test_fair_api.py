"""One member cannot stall the API for everyone, against a real `kembed serve`: a flood is answered 429 with
Retry-After while another tenant goes on; a spec past its bounds is refused naming the bound; failed sign-ins
are bounded per address; a report with a wrong token is refused without taking the database's write lock.

How fast the API stays for the others under a flood is measured by benchmarks/api_fairness.py, not here."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.builders import make_spec
from tests.security.hostile import World, start_world

# Small limits, so that a flood is a few dozen requests (the defaults are documented in kembed_api.platform.settings).
_LIMITS = {"KEMBED_RATE_TOKEN_PER_S": "0.5", "KEMBED_RATE_TOKEN_BURST": "70",
           "KEMBED_RATE_TENANT_PER_S": "0.5", "KEMBED_RATE_TENANT_BURST": "120"}


@pytest.fixture(scope="module")
def limited(tmp_path_factory) -> Iterator[World]:
    instance = start_world(tmp_path_factory.mktemp("fair") / "kembed", env=_LIMITS)
    yield instance
    instance.server.stop()


def _flood(client: httpx.Client, path: str, count: int) -> list[httpx.Response]:
    return [client.get(path) for _ in range(count)]


def test_a_flooding_token_gets_429_with_retry_after_while_another_tenant_goes_on(limited: World):
    with limited.as_("alpha", "viewer") as flooder, limited.as_("default", "viewer") as other:
        answers = _flood(flooder, "/v1/jobs", 74)  # a 429 comes after a pause of up to a second
        refused = [a for a in answers if a.status_code == 429]
        assert refused, "no request of the flood was refused"
        assert {a.status_code for a in answers} == {200, 429}
        assert int(refused[0].headers["retry-after"]) >= 1
        body = refused[0].json()
        assert "too many requests" in body["detail"] and body["errors"] == []
        # Another tenant's reads are answered all along.
        for path in ("/v1/usage", "/v1/jobs"):
            assert other.get(path).status_code == 200


def test_a_tenants_tokens_share_one_limit(limited: World):
    with limited.as_("beta", "member") as first, limited.as_("beta", "tenant-admin") as second:
        answers = _flood(first, "/v1/usage", 68) + _flood(second, "/v1/usage", 68)
        refused = [a for a in answers if a.status_code == 429]
        # 136 requests of one tenant, each token under its own 70: the tenant's 120 were spent
        assert refused and all("the tenant's requests" in a.json()["detail"] for a in refused)
    with limited.as_("default", "member") as other:
        assert other.get("/v1/usage").status_code == 200


def _tables(count: int, features_each: int) -> dict:
    spec = make_spec("oversized").build()
    first = spec["trainer"]["embeddings"]["tables"][0]
    spec["trainer"]["embeddings"]["tables"] = [
        dict(first, name=f"t{i}", features=[f"f{i}_{j}" for j in range(features_each)]) for i in range(count)]
    return spec


def test_the_hostile_spec_of_1024_tables_of_55_features_is_413_before_it_is_parsed(world: World):
    with world.as_("alpha", "tenant-admin") as client:  # 0.7 MB: most of a token's burst
        response = client.post("/v1/jobs", json=_tables(1024, 55))
        assert response.status_code == 413
        assert response.json()["detail"] == "request body: more than 16384 JSON values"


@pytest.mark.parametrize(("tables", "features_each", "says"), [
    pytest.param(1024, 1, "trainer.embeddings.tables: should have at most 512 items", id="1024-tables"),
    pytest.param(2, 300, "trainer.embeddings.tables.0.features: should have at most 256 items",
                 id="features-of-a-table"),
    pytest.param(300, 4, "trainer.embeddings: tables: at most 1024 features over all tables", id="features-in-all"),
])
def test_a_spec_past_its_bounds_is_422_naming_the_bound(world: World, tables, features_each, says):
    with world.as_("alpha", "member") as client:
        response = client.post("/v1/jobs", json=_tables(tables, features_each))
        assert response.status_code == 422, response.text
        assert response.json()["detail"].splitlines()[0] == says


def test_a_body_of_too_many_values_is_413_before_it_is_parsed(world: World):
    spec = make_spec("values").build()
    spec["trainer"]["data"]["dense"] = [1] * 20_000  # ~40 KB: small, but 20,000 values to parse
    with world.as_("alpha", "member") as client:
        response = client.post("/v1/jobs", json=spec)
        assert response.status_code == 413
        assert "more than 16384 JSON values" in response.json()["detail"]


def test_failed_sign_ins_are_bounded_per_address_and_working_tokens_go_on(tmp_path: Path):
    world = start_world(tmp_path / "kembed", env={"KEMBED_RATE_AUTH_FAILURES_BURST": "20",
                                                  "KEMBED_RATE_AUTH_FAILURES_PER_S": "0.01"})
    try:
        with world.as_("alpha", "viewer") as known:
            assert known.get("/v1/jobs").status_code == 200
            statuses = [httpx.get(f"{world.url}/v1/jobs", headers={"Authorization": f"Bearer kmb_guess{i}"})
                        .status_code for i in range(25)]
            assert statuses[:20] == [401] * 20 and set(statuses[20:]) == {429}
            # The token that worked before still works from this address; one never used yet waits.
            assert known.get("/v1/jobs").status_code == 200
            with world.as_("beta", "viewer") as unseen:
                refused = unseen.get("/v1/jobs")
                assert refused.status_code == 429 and "failed sign-ins" in refused.json()["detail"]
    finally:
        world.server.stop()


def _metrics_and_events(client: httpx.Client, job_id: str) -> tuple[list, list]:
    return client.get(f"/v1/jobs/{job_id}/metrics").json(), client.get(f"/v1/jobs/{job_id}/events").json()


def test_a_report_with_a_wrong_token_is_401_without_the_write_lock(world: World):
    with world.as_("alpha", "member") as client:
        job = client.post("/v1/jobs", json=make_spec("wrong-report").build()).json()
        before = _metrics_and_events(client, job["id"])
        record = {"event": "progress", "step": 5, "loss": 0.1}
        # Hold the database's write lock: a route that opened a write transaction for this report would wait
        # for it (SQLite's busy timeout, 10 s) instead of answering.
        lock = sqlite3.connect(Path(world.server.data_dir) / "kembed.db", isolation_level=None, timeout=30)
        try:
            lock.execute("BEGIN IMMEDIATE")
            for token in ("wrong", client.headers["Authorization"].removeprefix("Bearer ")):
                response = httpx.post(f"{world.url}/v1/jobs/{job['id']}/reports", json=record,
                                      headers={"Authorization": f"Bearer {token}"}, timeout=5)
                assert response.status_code == 401, response.text
                assert job["id"] not in response.text
        finally:
            lock.execute("ROLLBACK")
            lock.close()
        assert _metrics_and_events(client, job["id"]) == before  # nothing of the refused records was stored
