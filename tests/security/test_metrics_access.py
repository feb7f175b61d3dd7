"""`/metrics` against a real `kembed serve`: an anonymous caller learns no tenant's name; the platform's monitoring
(the scrape token, or a platform admin) sees every tenant; once a scrape token is set, nothing else gets in."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.builders import make_spec
from tests.security.hostile import TENANTS, World, start_world

SCRAPE_TOKEN = "kembed-scrape-0123456789abcdef"  # noqa: S105 - a test's own token


@pytest.fixture(scope="module")
def scraped_world(tmp_path_factory) -> Iterator[World]:
    instance = start_world(tmp_path_factory.mktemp("scraped") / "kembed", env={"KEMBED_METRICS_TOKEN": SCRAPE_TOKEN})
    yield instance
    instance.server.stop()


def _get(world: World, token: str | None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.get(f"{world.url}/metrics", headers=headers, timeout=30)


def test_without_a_scrape_token_an_anonymous_caller_gets_totals_naming_no_tenant(world: World):
    for tenant in TENANTS:
        with world.as_(tenant, "member") as member:
            member.post("/v1/jobs", json=make_spec("counted").build()).raise_for_status()
    anonymous = _get(world, None)
    assert anonymous.status_code == 200
    assert "tenant=" not in anonymous.text
    for tenant in TENANTS:
        assert tenant not in anonymous.text
    assert 'kembed_jobs{state="QUEUED"} 2.0' in anonymous.text  # the platform's totals are still there
    per_tenant = _get(world, world.admin)
    assert per_tenant.status_code == 200 and 'tenant="alpha"' in per_tenant.text and 'tenant="beta"' in per_tenant.text


@pytest.mark.parametrize(("tenant", "role"), [("alpha", "tenant-admin"), ("beta", "viewer"), ("default", "member")])
def test_a_tenant_token_does_not_see_the_other_tenants(world: World, tenant, role):
    assert _get(world, world.tokens[tenant, role]).status_code == 403


def test_a_wrong_token_is_refused(world: World):
    assert _get(world, "kmb_not-a-token").status_code == 401


def test_with_a_scrape_token_only_it_and_platform_admins_get_in(scraped_world: World):
    with scraped_world.as_("alpha", "member") as member:
        member.post("/v1/jobs", json=make_spec("counted").build()).raise_for_status()
    assert _get(scraped_world, None).status_code == 401
    assert _get(scraped_world, SCRAPE_TOKEN[:-1] + "0").status_code == 401
    assert _get(scraped_world, scraped_world.tokens["alpha", "member"]).status_code == 403
    for token in (SCRAPE_TOKEN, scraped_world.admin):
        answer = _get(scraped_world, token)
        assert answer.status_code == 200 and 'tenant="alpha"' in answer.text, answer.text[:500]
