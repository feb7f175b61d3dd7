"""Schemathesis generates requests from our OpenAPI document against a real server: none may end in a 5xx."""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error

from kembed_api.app import create_app
from kembed_api.settings import Settings
from tests.api.conftest import FakeBackend, ThreadedServer, bearer
from tests.builders import make_spec


@pytest.fixture(scope="module")
def live_api(tmp_path_factory):
    data_dir = tmp_path_factory.mktemp("fuzz")
    app = create_app(Settings(data_dir=data_dir, dispatch_interval_s=0.05), backend=FakeBackend(slots=4))
    with ThreadedServer(app) as server:
        admin = bearer((data_dir / "admin-token").read_text().strip())
        # something to find: a tenant with a quota, and a job, so generated ids sometimes hit real objects
        httpx.post(f"{server.url}/v1/tenants", json={"name": "team", "quota": {"gpus": 8}}, headers=admin)
        httpx.post(f"{server.url}/v1/jobs", json=make_spec("seed").build(), headers=admin)
        yield server, admin


def test_no_generated_request_makes_the_server_fail(live_api):
    # Driven through schemathesis' API rather than its pytest plugin, which does not support pytest 9 yet.
    server, admin = live_api
    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 15

    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        def call(case) -> None:
            case.call_and_validate(headers=admin, checks=[not_a_server_error])

        call()
