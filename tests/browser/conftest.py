"""The dashboard in a real browser: Debian's Chromium driven by Playwright, against a real `kembed serve`.

Each signed-in user gets a browser context of its own (cookies, storage and cache of its own, as a fresh profile
would have) in one Chromium for the run, so sessions never leak from one test user to another.
`KEMBED_SCREENSHOTS=<folder>` makes the tests save a PNG of each page there (the ones in docs/img/ were made with
`KEMBED_SCREENSHOTS=docs/img`).
"""

from __future__ import annotations

import os
import secrets
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from kembed_api.cli.client import Client
from tests.e2e.conftest import ServerProcess

TERMINAL = ("SUCCEEDED", "FAILED", "CANCELLED")
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
# Nothing reaches out of the machine: no sync, no component updates, no QUIC, no first-run pages.
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[ServerProcess]:
    instance = ServerProcess(tmp_path_factory.mktemp("server") / "kembed", slots=2).start()
    yield instance
    instance.stop()


@dataclass
class Team:
    """A tenant made for one test, with a token per role."""

    name: str
    tokens: dict[str, str]
    server: ServerProcess

    def client(self, role: str = "member") -> Client:
        return Client(self.server.url, token=self.tokens[role])

    def wait_for(self, job_id: str, predicate: Callable[[dict], bool], *, timeout: float = 180) -> dict:
        with self.client() as client:
            deadline = time.monotonic() + timeout
            while not predicate(job := client.job(job_id)):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{job_id}: last seen {job['state']} {job['reason']}: {job['message']}")
                time.sleep(0.3)
        return job

    def wait_terminal(self, job_id: str, *, timeout: float = 180) -> dict:
        return self.wait_for(job_id, lambda j: j["state"] in TERMINAL, timeout=timeout)


@pytest.fixture
def make_team(server):
    """make_team(quota) -> a new tenant with a token per role; its unfinished jobs are cancelled afterwards, so
    the server's trainer slots are free for the next test."""
    teams: list[Team] = []

    def make(quota: dict | None = None, *, roles: tuple[str, ...] = ("tenant-admin", "member", "viewer")) -> Team:
        name = f"team-{secrets.token_hex(3)}"
        server.client.create_tenant(name, quota or {})
        tokens = {role: server.client.create_token(name, name=f"{role}-token", role=role)["token"] for role in roles}
        teams.append(team := Team(name=name, tokens=tokens, server=server))
        return team

    yield make
    for team in teams:
        with team.client("member") as member:
            unfinished = [j["id"] for j in member.jobs(limit=500)["items"] if j["state"] not in TERMINAL]
            for job_id in unfinished:
                member.cancel(job_id)
        for job_id in unfinished:
            team.wait_terminal(job_id)


@pytest.fixture(scope="module")
def playwright_instance():
    """Module-scoped, never session-scoped: Playwright's sync API keeps an asyncio loop marked running in this
    thread while it lives, and `asyncio.run()` in any test that the random order puts after it would fail."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        yield playwright


@pytest.fixture(scope="module")
def chromium(playwright_instance):
    """One Chromium process for the module: starting one takes seconds, and each user gets a context of its own."""
    browser = playwright_instance.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
    yield browser
    browser.close()


@pytest.fixture
def open_browser(chromium):
    """open_browser() -> a page in a new browser context (cookies, storage and cache of its own, like a fresh
    profile); closed at the end of the test."""
    contexts = []

    def open_one():
        context = chromium.new_context(viewport={"width": 1200, "height": 900})
        context.set_default_timeout(20_000)
        contexts.append(context)
        return context.new_page()

    yield open_one
    for context in contexts:
        context.close()


def sign_in(page, server: ServerProcess, token: str) -> None:
    page.goto(f"{server.url}/dashboard")
    assert page.url.endswith("/dashboard/sign-in")  # no session yet: to the sign-in form
    page.get_by_label("API token").fill(token)
    page.get_by_role("button", name="Sign in").click()
    page.wait_for_url(f"{server.url}/dashboard")


def session_cookie(page) -> dict:
    return next(c for c in page.context.cookies() if c["name"] == "kembed_session")


def as_browser(server: ServerProcess, page) -> httpx.Client:
    """An HTTP client holding the page's session cookie (and nothing else): what a script of the page can do."""
    cookie = session_cookie(page)
    return httpx.Client(base_url=server.url, cookies={cookie["name"]: cookie["value"]})


def screenshot(page, name: str) -> None:
    folder = os.environ.get("KEMBED_SCREENSHOTS")
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(Path(folder) / f"dashboard-{name}.png"), full_page=True)
