from __future__ import annotations

import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi.testclient import TestClient

from kembed_api.app import create_app
from kembed_api.backends.base import Exit, Launch, Observed
from kembed_api.platform.db import Database, upgrade_to_head
from kembed_api.platform.ports import free_port
from kembed_api.platform.settings import Settings
from kembed_api.quota.admission import Quota
from kembed_contract.spec import JobSpec


@pytest.fixture
def db(tmp_path):
    url = f"sqlite:///{tmp_path / 'kembed.db'}"
    upgrade_to_head(url)
    database = Database(url)
    yield database
    database.dispose()


@dataclass
class FakeBackend:
    """Stands in for the place trainers run, so dispatcher logic is tested without processes.

    The local backend itself is tested for real by tests/e2e.
    """

    slots: int = 4
    started: list[Launch] = field(default_factory=list)
    exits: dict[str, Exit | Observed] = field(default_factory=dict)
    stopped: list[str] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    reclaimed: list[str] = field(default_factory=list)

    def check_fits(self, spec: JobSpec) -> None:
        if spec.resources.num_processes > self.slots:
            raise ValueError(f"resources: needs {spec.resources.num_processes} processes, "
                             f"the backend has {self.slots} slots")

    def capacity(self) -> Quota:
        return Quota(max_processes=self.slots)

    shows_tenant_usage = False

    def sync_tenant(self, name: str, quota, sharing, policy=None) -> None:
        pass

    def show_usage(self, name: str, usage) -> None:
        pass

    def start(self, launch: Launch) -> dict[str, Any]:
        self.started.append(launch)
        return {"attempt": launch.attempt}

    def poll(self, job_id: str) -> Exit | Observed | None:
        return self.exits.pop(job_id, None)

    def stop(self, job_id: str) -> None:
        self.stopped.append(job_id)

    def preempt(self, job_id: str) -> None:
        self.preempted.append(job_id)

    def kill_overdue(self) -> None:
        pass

    def watch_exits(self, wake) -> None:
        pass

    def reclaim(self, job_id: str, backend_state: dict[str, Any]) -> bool:
        self.reclaimed.append(job_id)
        return True

    def read_logs(self, job_id: str, *, tail_lines: int | None = None) -> str:
        return ""

    def log_bytes(self, job_id: str) -> int:
        return 0

    def stream_logs(self, job_id: str):
        yield from ()

    def shutdown(self) -> None:
        pass

    # what a test makes happen
    def finish(self, job_id: str, *, succeeded: bool = True, retryable: bool = True, reason: str = "") -> None:
        reason = reason or ("Completed" if succeeded else "TrainerFailed")
        self.exits[job_id] = Exit(succeeded=succeeded, retryable=retryable, reason=reason, message="")

    def observe(self, job_id: str, state, *, reason: str = "", restart_count: int = 0) -> None:
        """The next poll sees the gang in `state` (a backend that restarts and stops gangs itself)."""
        self.exits[job_id] = Observed(state=state, reason=reason or state.title(), message="",
                                      restart_count=restart_count)

    def started_ids(self) -> list[str]:
        return [launch.job_id for launch in self.started]


@pytest.fixture
def backend():
    return FakeBackend()


# Migrating an empty database takes a second or more here, for each of the hundreds of HTTP tests: they start from a
# copy of one database migrated once per run instead (the app's own upgrade at start-up then finds it current).
# Migrations from an empty database are tested in test_migrations.py and test_concurrency.py.
@pytest.fixture(scope="session")
def sqlite_at_head(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("sqlite-at-head") / "kembed.db"
    upgrade_to_head(f"sqlite:///{path}")
    return path


@pytest.fixture(scope="session")
def postgres_at_head(postgres_server) -> str:
    """The name of a PostgreSQL database at head, only ever copied (a template has no connections)."""
    url = postgres_server.new_database()
    upgrade_to_head(url)
    return url.rsplit("/", 1)[1]


@pytest.fixture(params=["sqlite", "postgres"])
def database_url(request, tmp_path):
    """Every HTTP test runs on both databases kembed supports (PostgreSQL: a real server), each in a database of
    its own, already migrated to head."""
    if request.param == "sqlite":
        path = tmp_path / "kembed.db"
        shutil.copyfile(request.getfixturevalue("sqlite_at_head"), path)
        return f"sqlite:///{path}"
    return request.getfixturevalue("postgres_server").new_database(
        template=request.getfixturevalue("postgres_at_head"))


@pytest.fixture
def api_client(tmp_path, backend, database_url):
    """The app over HTTP (TestClient) with a real dispatcher and database, as the bootstrap platform admin."""
    settings = Settings(data_dir=tmp_path, database_url=database_url, dispatch_interval_s=0.05)
    with TestClient(create_app(settings, backend=backend)) as client:
        client.headers["Authorization"] = f"Bearer {(tmp_path / 'admin-token').read_text().strip()}"
        yield client


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def wait_state(url: str, headers: dict[str, str], job_id: str, *states: str, timeout_s: float = 90.0) -> dict:
    """The job as the API at `url` shows it once its state is one of `states`; fails naming where it stuck."""
    deadline = time.monotonic() + timeout_s
    while True:
        job = httpx.get(f"{url}/v1/jobs/{job_id}", headers=headers).json()
        if job["state"] in states:
            return job
        assert time.monotonic() < deadline, f"{job_id} stuck in {job['state']}: {job['message']}"
        time.sleep(0.3)


class ThreadedServer:
    """A real uvicorn server for `app` on a free port of 127.0.0.1, in a thread of the test process."""

    def __init__(self, app) -> None:
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> ThreadedServer:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.05)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
