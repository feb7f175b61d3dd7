"""Schemathesis generates requests from our OpenAPI document against a real server, and runs every check it has
on each answer: no 5xx, every status and content type documented, every body in its documented schema (the one
error shape included), valid data accepted, invalid data refused, missing headers and tokens refused."""

from __future__ import annotations

import contextlib

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.config import SchemathesisConfig

from kembed_api.app import create_app
from kembed_api.platform.settings import Settings
from tests.api.conftest import FakeBackend, ThreadedServer, bearer
from tests.builders import make_spec

# Where a request the schema allows may still be refused with 422, because the rule cannot be said in JSON Schema:
# a job spec's cross-field rules (a DLRM's bottom MLP ends in the tables' width, features are unique across
# tables, ...) and whether the job could ever run (quota, memory estimate, the backend's capacity); the ranges of
# Kubernetes quantities (memory); an Idempotency-Key reused with another spec. Every such 422 names its field.
_SEMANTIC_422 = [("POST", "/v1/jobs"), ("POST", "/v1/tenants"), ("PATCH", "/v1/tenants/{name}")]


def _config() -> SchemathesisConfig:
    accepted = ["2xx", "401", "403", "404", "409", "429"]
    return SchemathesisConfig.from_dict({"operations": [
        {"include-method": method, "include-path": path,
         "checks": {"positive_data_acceptance": {"expected-statuses": [*accepted, "422"]}}}
        for method, path in _SEMANTIC_422
    ]})


@pytest.fixture(scope="module")
def live_api(tmp_path_factory):
    data_dir = tmp_path_factory.mktemp("fuzz")
    # Without rate limits: the fuzzer's thousands of requests from one address, many with invalid tokens, would
    # be mostly 429s (the limits are tested in tests/api/test_ratelimit.py and tests/security/test_fair_api.py).
    app = create_app(Settings(data_dir=data_dir, dispatch_interval_s=0.05, rate_limits=False),
                     backend=FakeBackend(slots=4))
    with ThreadedServer(app) as server:
        admin = bearer((data_dir / "admin-token").read_text().strip())
        # something to find: a tenant with a quota, and a job, so generated ids sometimes hit real objects
        httpx.post(f"{server.url}/v1/tenants", json={"name": "team", "quota": {"gpus": 8}}, headers=admin)
        httpx.post(f"{server.url}/v1/jobs", json=make_spec("seed").build(), headers=admin)
        yield server, admin


def test_every_check_passes_on_every_operation(live_api):
    # Driven through schemathesis' API rather than its pytest plugin, which does not support pytest 9 yet.
    server, admin = live_api
    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json", config=_config())
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 15

    for operation in operations:
        # Positive data with the admin's token added to each request; negative data with the token part of the
        # case, so that a case whose mutation is a missing or broken header is not repaired by it.
        _run(operation.as_strategy(GenerationMode.POSITIVE), headers=admin, examples=25)
        # Unsatisfiable: nothing of the operation's request can be wrong (a plain string in the path, say).
        with contextlib.suppress(Unsatisfiable):
            _run(operation.as_strategy(GenerationMode.NEGATIVE, headers=admin), headers=None, examples=10)


def _run(strategy, *, headers: dict[str, str] | None, examples: int) -> None:
    @given(case=strategy)
    @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    def call(case) -> None:
        case.call_and_validate(headers=headers)  # every check schemathesis has

    call()
