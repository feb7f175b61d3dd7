"""The team dashboard in Chromium against a real `kembed serve` training real (tiny) jobs."""

from __future__ import annotations

import re
import secrets
import time
from pathlib import Path

import pytest
from playwright.sync_api import expect

from kembed_api.cli.client import ApiError, Client
from tests.browser.conftest import as_browser, screenshot, session_cookie, sign_in
from tests.builders import make_spec


def long_job(name: str = "long") -> dict:
    """Trains until cancelled (as long as any test needs), reporting progress every 5 steps."""
    return make_spec(name).with_steps(1_000_000, checkpoint_every=50).with_trainer(training={"log_every": 5}).build()


def wait_until(predicate, *, timeout: float = 90, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.3)


def bar(page, dim: str):
    return page.locator(f'.bar-row[data-dim="{dim}"]')


# ------------------------------------------------------------------------------------------------ sign in
def test_sign_in_sets_a_strict_http_only_session_and_sign_out_ends_it(server, make_team, open_browser):
    team = make_team()
    page = open_browser()
    page.goto(f"{server.url}/dashboard/sign-in")
    page.get_by_label("API token").fill("kmb_not-a-token")
    page.get_by_role("button", name="Sign in").click()
    expect(page.get_by_role("alert")).to_contain_text("not valid")
    assert not [c for c in page.context.cookies() if c["name"] == "kembed_session"]
    screenshot(page, "sign-in")

    sign_in(page, server, team.tokens["member"])
    cookie = session_cookie(page)
    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict"
    assert team.tokens["member"] not in cookie["value"]  # the cookie is a session, not the token
    expect(page.locator("#who-tenant")).to_have_text(team.name)
    with as_browser(server, page) as browser:
        assert browser.get("/v1/usage").json()["tenant"] == team.name  # the API answers the session too

        page.get_by_role("button", name="Sign out").click()
        page.wait_for_url(re.compile(r".*/dashboard/sign-in$"))
        assert browser.get("/v1/usage").status_code == 401  # the old cookie is dead server-side
    page.goto(f"{server.url}/dashboard")
    assert page.url.endswith("/dashboard/sign-in")


def test_a_session_ends_with_its_token(server, make_team, open_browser):
    team = make_team()
    page = open_browser()
    sign_in(page, server, team.tokens["viewer"])
    viewer_id = next(t["id"] for t in team.client("tenant-admin").tokens(team.name)["items"] if t["role"] == "viewer")
    team.client("tenant-admin").revoke_token(team.name, viewer_id)
    with as_browser(server, page) as browser:
        # Revoked through the same replica: the token cache is cleared at once.
        assert browser.get("/v1/usage").status_code == 401


def test_writes_with_the_session_need_the_csrf_token(server, make_team, open_browser):
    team = make_team()
    page = open_browser()
    sign_in(page, server, team.tokens["member"])
    with as_browser(server, page) as browser:
        response = browser.post("/v1/jobs", json=make_spec("csrf").build())
        assert response.status_code == 403 and "X-CSRF-Token" in response.json()["detail"]
        assert team.client().jobs()["items"] == []  # nothing stored
        csrf = page.locator('meta[name="csrf-token"]').get_attribute("content")
        assert browser.post("/v1/jobs", json=make_spec("csrf").build(), headers={"X-CSRF-Token": "0" * 64}
                            ).status_code == 403
        assert browser.post("/v1/jobs", json=make_spec("csrf").build(), headers={"X-CSRF-Token": csrf}
                            ).status_code == 201


# ------------------------------------------------------------------------------------------------ team page
@pytest.mark.slow  # trains real jobs
def test_the_bars_match_usage_and_the_queue_matches_the_api(server, make_team, open_browser):
    team = make_team({"max_running_jobs": 1, "max_queued_jobs": 4, "cpu": 4})
    member = team.client()
    running = member.submit(long_job("holder"))
    team.wait_for(running["id"], lambda j: j["state"] == "RUNNING")
    queued = [member.submit(make_spec(f"waits{i}").with_priority(i % 2).build())["id"] for i in range(3)]

    page = open_browser()
    sign_in(page, server, team.tokens["member"])
    expect(page.locator("#queue tbody tr")).to_have_count(3)
    expect(bar(page, "max_queued_jobs")).to_have_attribute("data-used", "3")
    usage = member.usage()
    expected = {"gpus": (usage["used"]["gpus"], usage["quota"]["gpus"]),
                "cpu": (usage["used"]["cpu"], usage["quota"]["cpu"]),
                "max_running_jobs": (usage["used"]["running_jobs"], usage["quota"]["max_running_jobs"]),
                "max_queued_jobs": (usage["queued_jobs"], usage["quota"]["max_queued_jobs"])}
    for dim, (used, limit) in expected.items():
        row = bar(page, dim)
        assert float(row.get_attribute("data-used")) == used, dim
        assert row.get_attribute("data-limit") == ("" if limit is None else f"{limit:g}"), dim
    assert bar(page, "max_running_jobs").get_attribute("data-level") == "full"  # 1 of 1
    assert bar(page, "max_queued_jobs").get_attribute("data-level") == "warn"  # 3 of 4
    assert bar(page, "gpus").get_attribute("data-level") == "none"  # no GPU limit

    rows = page.locator("#queue tbody tr")
    on_screen = {rows.nth(i).get_attribute("data-key"): int(rows.nth(i).locator("td.position").inner_text())
                 for i in range(3)}
    from_api = {job_id: member.job(job_id)["queue_position"] for job_id in queued}
    assert on_screen == from_api
    assert sorted(on_screen.values()) == [1, 2, 3]
    assert from_api[queued[1]] == 1  # priority 1 goes first
    expect(rows.first.locator("td.why")).to_contain_text("waiting for")
    expect(page.locator("#running tbody tr")).to_have_count(1)
    expect(page.locator("#by-state")).to_have_text("3 queued · 1 running")
    screenshot(page, "team")


@pytest.mark.slow  # trains real jobs
def test_borrowing_shows_above_quota(server, make_team, open_browser):
    team = make_team({"cpu": 8})
    member = team.client()
    job = member.submit(long_job("borrower"))
    team.wait_for(job["id"], lambda j: j["state"] == "RUNNING")
    server.client.set_quota(team.name, {"cpu": 0.5})  # lowered under what runs: the job keeps running above it
    page = open_browser()
    sign_in(page, server, team.tokens["viewer"])
    expect(bar(page, "cpu")).to_have_attribute("data-level", "over")
    expect(bar(page, "cpu").locator(".bar-value")).to_contain_text("borrowed")


@pytest.mark.slow  # trains real jobs
def test_a_cohort_member_sees_what_it_borrows_and_lends(server, make_team, open_browser):
    cohort = {"cohort": f"c-{secrets.token_hex(3)}"}
    lender, borrower = make_team({"cpu": 4}), make_team({"cpu": 1})
    for team in (lender, borrower):
        server.client._call("PATCH", f"/v1/tenants/{team.name}", json={
            "quota": server.client.usage(team.name)["quota"], "sharing": cohort})
    jobs = [borrower.client().submit(long_job(f"b{i}"))["id"] for i in range(2)]  # 2 CPUs on a quota of 1
    for job_id in jobs:
        borrower.wait_for(job_id, lambda j: j["state"] == "RUNNING")
    page = open_browser()
    sign_in(page, server, borrower.tokens["viewer"])
    expect(bar(page, "cpu")).to_have_attribute("data-level", "over")
    expect(page.locator("#sharing")).to_have_text(f"Cohort {cohort['cohort']}: borrowing 1 CPU cores · lending nothing")
    page.context.clear_cookies()
    sign_in(page, server, lender.tokens["viewer"])
    expect(page.locator("#sharing")).to_have_text(f"Cohort {cohort['cohort']}: borrowing nothing · lending 1 CPU cores")


@pytest.mark.slow  # trains real jobs
def test_a_running_jobs_progress_moves_on_screen_and_cancel_works(server, make_team, open_browser):
    team = make_team()
    member = team.client()
    job = member.submit(long_job("live"))
    team.wait_for(job["id"], lambda j: j["progress"]["step"] > 0)
    page = open_browser()
    sign_in(page, server, team.tokens["member"])
    step_cell = page.locator(f'#running tr[data-key="{job["id"]}"] .step')
    expect(step_cell).to_be_visible()
    first = int(step_cell.inner_text().split("/")[0].replace(",", ""))
    wait_until(lambda: int(step_cell.inner_text().split("/")[0].replace(",", "")) > first, timeout=30,
               what="the step on screen to move")
    speed = page.locator(f'#running tr[data-key="{job["id"]}"] td.speed').inner_text()
    assert speed != "—"

    page.get_by_role("link", name=job["id"]).click()
    page.wait_for_url(re.compile(f".*/dashboard/jobs/{job['id']}$"))
    expect(page.locator("#job-state")).to_have_text("RUNNING")
    expect(page.locator("#loss-chart polyline")).to_have_count(1)
    expect(page.locator("#events li")).to_have_count(3)  # Submitted, Admitted, Started
    expect(page.locator("#checkpoints tbody tr").first).to_be_visible(timeout=60_000)
    expect(page.locator("#logs")).to_contain_text('"event": "progress"')
    screenshot(page, "job")
    page.get_by_role("button", name="Cancel job").click()
    page.get_by_role("button", name="Confirm cancel").click()
    expect(page.locator("#action-result")).to_contain_text("Cancel requested")
    expect(page.locator("#job-state")).to_have_text("CANCELLED", timeout=90_000)
    assert member.job(job["id"])["state"] == "CANCELLED"
    expect(page.get_by_role("button", name="Cancel job")).to_be_hidden()


@pytest.mark.slow  # trains real jobs
def test_a_finished_job_shows_its_result_curves_and_can_be_submitted_again(server, make_team, open_browser):
    team = make_team()
    member = team.client()
    job = member.submit(make_spec("done").with_trainer(training={"eval_every": 20}).build())
    done = team.wait_terminal(job["id"])
    assert done["state"] == "SUCCEEDED"
    page = open_browser()
    sign_in(page, server, team.tokens["member"])
    row = page.locator(f'#finished tr[data-key="{job["id"]}"]')
    expect(row.locator("td.result")).to_contain_text(f"AUC {done['result']['auc']:.4f}")
    page.goto(f"{server.url}/dashboard/jobs/{job['id']}")
    expect(page.locator("#eval-chart polyline")).not_to_have_count(0)
    assert "eval auc" in page.locator("#eval-chart svg").get_attribute("aria-label")
    page.get_by_role("button", name="Submit again").click()
    page.wait_for_url(lambda url: "/dashboard/jobs/done-" in url and not url.endswith(job["id"]))
    new_id = page.url.rsplit("/", 1)[1]
    again = member.job(new_id)
    assert again["spec"]["trainer"]["training"] == done["spec"]["trainer"]["training"]
    assert again["spec"]["trainer"]["checkpoint"]["uri"].endswith(f"/{new_id}")  # a folder of its own


# ------------------------------------------------------------------------------------------------ isolation
@pytest.mark.slow  # trains real jobs
def test_team_b_never_sees_team_a(server, make_team, open_browser):
    team_a, team_b = make_team(), make_team()
    secret_job = team_a.client().submit(make_spec("secret-a").build())
    team_b.client().submit(make_spec("mine-b").build())
    page = open_browser()
    sign_in(page, server, team_b.tokens["tenant-admin"])
    expect(page.locator("#finished tbody tr, #queue tbody tr, #running tbody tr")).not_to_have_count(0)
    for path in ("/dashboard", "/dashboard/history", "/dashboard/tokens"):
        page.goto(f"{server.url}{path}")
        page.wait_for_load_state("networkidle")
        html = page.content()
        assert secret_job["id"] not in html and team_a.name not in html
    response = page.goto(f"{server.url}/dashboard/jobs/{secret_job['id']}")
    assert response.status == 404
    expect(page.get_by_role("heading", level=1)).to_have_text("Not found")
    screenshot(page, "not-found")
    with as_browser(server, page) as browser:
        assert browser.get(f"/v1/jobs/{secret_job['id']}").status_code == 404
        assert browser.get(f"/v1/tenants/{team_a.name}/tokens").status_code == 404
    assert page.goto(f"{server.url}/dashboard/admin").status == 404  # a tenant-admin is no platform admin


@pytest.mark.slow  # trains real jobs
def test_a_viewer_sees_no_cancel_and_the_api_refuses_it_anyway(server, make_team, open_browser):
    team = make_team({"max_running_jobs": 1})
    holder = team.client().submit(long_job("holder"))
    team.wait_for(holder["id"], lambda j: j["state"] == "RUNNING")
    job = team.client().submit(make_spec("viewed").build())
    page = open_browser()
    sign_in(page, server, team.tokens["viewer"])
    page.goto(f"{server.url}/dashboard/jobs/{job['id']}")
    expect(page.locator("#job-state")).to_have_text("QUEUED")
    expect(page.get_by_role("button", name=re.compile("Cancel"))).to_have_count(0)
    expect(page.get_by_role("button", name="Submit again")).to_have_count(0)
    assert page.get_by_role("link", name="Tokens").count() == 0
    csrf = page.locator('meta[name="csrf-token"]').get_attribute("content")
    with as_browser(server, page) as browser:
        assert browser.post(f"/v1/jobs/{job['id']}/cancel", headers={"X-CSRF-Token": csrf}).status_code == 403
    with pytest.raises(ApiError) as refused:
        team.client("viewer").cancel(job["id"])
    assert refused.value.status_code == 403
    assert team.client().job(job["id"])["state"] == "QUEUED"


# ------------------------------------------------------------------------------------------------ admin
def test_a_platform_admin_edits_a_quota_in_place(server, make_team, open_browser):
    team = make_team({"gpus": 4, "max_running_jobs": 2})
    page = open_browser()
    sign_in(page, server, server.token)
    page.get_by_role("link", name="Platform").click()
    row = page.locator(f'tr[data-tenant="{team.name}"]')
    expect(row.locator('td[data-col="gpus"]')).to_contain_text("/ 4")
    screenshot(page, "admin")
    page.get_by_role("button", name=f"Edit quota of {team.name}").click()
    gpus = page.locator(f"#quota-{team.name}-gpus")
    expect(gpus).to_be_focused()
    gpus.fill("-3")
    page.locator(f"#quota-{team.name}-memory").fill("lots")
    page.get_by_role("button", name="Save quota").click()
    expect(page.locator(f"#quota-{team.name}-gpus-error")).to_contain_text("greater than or equal to 0")
    expect(page.locator(f"#quota-{team.name}-memory-error")).not_to_be_empty()
    assert gpus.get_attribute("aria-invalid") == "true"
    screenshot(page, "admin-quota-error")
    assert server.client.usage(team.name)["quota"]["gpus"] == 4  # nothing half-stored
    gpus.fill("12")
    page.locator(f"#quota-{team.name}-memory").fill("64Gi")
    page.locator(f"#quota-{team.name}-storage").fill("500Gi")
    page.get_by_role("button", name="Save quota").click()
    expect(row.locator('td[data-col="gpus"]')).to_contain_text("/ 12")
    quota = server.client.usage(team.name)["quota"]
    assert quota["gpus"] == 12 and quota["memory"] == "64Gi" and quota["max_running_jobs"] == 2
    assert quota["storage"] == "500Gi" and quota["max_run_seconds"] is None
    # Sorting by a column reorders the rows and says so to assistive technology.
    page.get_by_role("button", name="GPUs used / quota").click()
    expect(page.locator('th[aria-sort="ascending"]')).to_contain_text("GPUs")


def test_a_tenant_admin_creates_and_revokes_tokens(server, make_team, open_browser):
    team = make_team()
    page = open_browser()
    sign_in(page, server, team.tokens["tenant-admin"])
    page.get_by_role("link", name="Tokens").click()
    page.get_by_role("button", name="Create token").click()  # no name
    expect(page.locator("#token-name-error")).not_to_be_empty()
    page.get_by_label("Name").fill("ci-bot")
    page.get_by_label("Role").select_option("viewer")
    page.get_by_role("button", name="Create token").click()
    secret = page.locator("#created-secret")
    expect(secret).to_have_value(re.compile(r"^kmb_"))
    token = secret.input_value()
    with Client(server.url, token=token) as ci:
        assert ci.usage()["tenant"] == team.name
        row = page.locator("#tokens tr", has_text="ci-bot")
        expect(row).to_contain_text("viewer")
        screenshot(page, "tokens")
        page.get_by_role("button", name="Revoke token ci-bot").click()
        expect(row).to_contain_text("revoked")
        with pytest.raises(ApiError) as refused:
            ci.usage()
        assert refused.value.status_code == 401
    page.reload()
    assert token not in page.content()  # shown once


# ------------------------------------------------------------------------------------------------ history
@pytest.mark.slow  # trains real jobs
def test_history_matches_the_api_and_downloads_as_csv(server, make_team, open_browser):
    team = make_team()
    member = team.client()
    job = member.submit(make_spec("hist").build())
    team.wait_terminal(job["id"])
    page = open_browser()
    sign_in(page, server, team.tokens["viewer"])
    page.get_by_role("link", name="History").click()
    api = member._call("GET", "/v1/usage/history", params={"days": 7}).json()
    assert api["finished"] == {"SUCCEEDED": 1}
    expect(page.locator("#states tbody tr")).to_have_count(1)
    expect(page.locator("#summary")).to_contain_text("Preemptions")
    expect(page.locator("#hours-chart rect")).to_have_count(14)  # 7 days x (GPU, CPU)
    page.get_by_role("button", name="30 days").click()
    expect(page.locator("#hours-chart rect")).to_have_count(60)
    screenshot(page, "history")
    with page.expect_download() as download:
        page.get_by_role("link", name="Download CSV").click()
    lines = Path(download.value.path()).read_text().splitlines()
    assert lines[0].startswith("day,gpu_hours,cpu_hours")
    assert len(lines) == 31
    assert lines[-1].endswith(",0,0,1")  # today: CANCELLED, FAILED, SUCCEEDED


# ------------------------------------------------------------------------------------------------ accessibility
@pytest.mark.slow  # trains real jobs
def test_every_page_has_no_serious_accessibility_violation(server, make_team, open_browser):
    from axe_playwright_python.sync_playwright import Axe

    team = make_team({"max_running_jobs": 1, "gpus": 2})
    member = team.client()
    job = member.submit(make_spec("a11y").build())
    team.wait_terminal(job["id"])
    member.submit(long_job("a11y-long"))
    member.submit(make_spec("a11y-queued").build())
    axe = Axe()
    page = open_browser()
    page.goto(f"{server.url}/dashboard/sign-in")
    found = {"sign-in": axe.run(page)}
    sign_in(page, server, server.token)
    page.goto(f"{server.url}/dashboard/admin")  # the admin's own tenant has no jobs; the team pages use team's
    page.wait_for_selector("#tenants table")
    found["admin"] = axe.run(page)
    page.context.clear_cookies()
    sign_in(page, server, team.tokens["tenant-admin"])
    for name, path, ready in [
        ("team", "/dashboard", "#queue table"), ("history", "/dashboard/history", "#days table"),
        ("job", f"/dashboard/jobs/{job['id']}", "#eval-chart svg"), ("tokens", "/dashboard/tokens", "#tokens table"),
    ]:
        page.goto(f"{server.url}{path}")
        page.wait_for_selector(ready)
        found[name] = axe.run(page)
    serious = {name: [(v["id"], v["impact"], [n["target"] for n in v["nodes"]][:3])
                      for v in result.response["violations"] if v["impact"] in ("serious", "critical")]
               for name, result in found.items()}
    assert serious == {name: [] for name in found}
