"""Admission never over-admits: 50 concurrent submissions over real HTTP, on SQLite and on PostgreSQL, and with
two API replicas sharing one PostgreSQL database (each with its own dispatcher)."""

from __future__ import annotations

import contextlib
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from sqlalchemy import create_engine, func, select, update

from kembed_api.app import create_app
from kembed_api.jobs.models import Job
from kembed_api.platform.settings import Settings
from kembed_api.tenants.models import Tenant
from kembed_contract.lifecycle import ACTIVE_STATES
from tests.api.conftest import FakeBackend, ThreadedServer, bearer
from tests.builders import make_spec

QUOTA_CPU = 5


def _active_cpu(engine) -> float:
    with engine.connect() as connection:
        return connection.execute(
            select(func.coalesce(func.sum(Job.cpu), 0.0)).where(Job.state.in_([s.value for s in ACTIVE_STATES]))
        ).scalar()


@pytest.mark.parametrize(
    ("database", "replicas"),
    [pytest.param("sqlite", 1, id="sqlite"), pytest.param("postgres", 1, id="postgres"),
     pytest.param("postgres", 2, id="postgres-two-replicas")],
)
def test_quota_is_never_exceeded_under_50_concurrent_submissions(request, tmp_path, database, replicas):
    url = (f"sqlite:///{tmp_path / 'kembed.db'}" if database == "sqlite"
           else request.getfixturevalue("postgres_server").new_database())
    backend = FakeBackend(slots=10_000)  # one shared place to run (like one cluster): only the quota limits
    apps = [create_app(Settings(data_dir=tmp_path, database_url=url, dispatch_interval_s=0.02), backend=backend)
            for _ in range(replicas)]
    engine = create_engine(url)
    peak, watching = [0.0], threading.Event()

    def watch() -> None:  # samples what is admitted, from the database, all through the test
        while not watching.is_set():
            peak[0] = max(peak[0], _active_cpu(engine))
            time.sleep(0.01)

    with contextlib.ExitStack() as stack:
        servers = [stack.enter_context(ThreadedServer(app)) for app in apps]
        first, second = servers[0], servers[-1]
        admin = bearer((tmp_path / "admin-token").read_text().strip())
        assert httpx.post(f"{first.url}/v1/tenants", headers=admin,
                          json={"name": "team", "quota": {"cpu": QUOTA_CPU}}).status_code == 201
        token = bearer(httpx.post(f"{first.url}/v1/tenants/team/tokens", headers=admin,
                                  json={"name": "ci", "role": "member"}).json()["token"])
        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()

        def submit(i: int) -> int:
            server = (first, second)[i % 2]
            spec = make_spec(f"job-{i}").build()
            return httpx.post(f"{server.url}/v1/jobs", json=spec, headers=token, timeout=60).status_code

        with ThreadPoolExecutor(max_workers=50) as pool:
            assert sorted(pool.map(submit, range(50))) == [201] * 50

        def settled(expected_started: int) -> None:
            deadline = time.monotonic() + 30
            while len(backend.started) < expected_started:
                assert time.monotonic() < deadline, f"only {len(backend.started)} started"
                time.sleep(0.05)
            time.sleep(0.5)  # several more passes: nothing else may be admitted

        settled(QUOTA_CPU)
        assert len(backend.started) == QUOTA_CPU and _active_cpu(engine) == QUOTA_CPU
        for launch in backend.started[:3]:  # three jobs end: exactly three more start
            backend.finish(launch.job_id)
        settled(QUOTA_CPU + 3)
        assert len(backend.started) == QUOTA_CPU + 3 and _active_cpu(engine) == QUOTA_CPU
        assert len({launch.job_id for launch in backend.started}) == QUOTA_CPU + 3  # nothing started twice

        watching.set()
        watcher.join()
    assert peak[0] <= QUOTA_CPU


@pytest.mark.parametrize(
    ("database", "replicas"),
    [pytest.param("sqlite", 1, id="sqlite"), pytest.param("postgres", 1, id="postgres"),
     pytest.param("postgres", 2, id="postgres-two-replicas")],
)
def test_concurrent_submissions_never_overfill_a_queue_and_one_key_stores_one_job(request, tmp_path, database,
                                                                                  replicas):
    """Submissions are stored in batches (kembed_api.jobs.intake): the batch counts the queue against
    quota.max_queued_jobs, numbers the queue positions, and answers a repeated Idempotency-Key with one job."""
    url = (f"sqlite:///{tmp_path / 'kembed.db'}" if database == "sqlite"
           else request.getfixturevalue("postgres_server").new_database())
    apps = [create_app(Settings(data_dir=tmp_path, database_url=url, admission_paused=True), backend=FakeBackend())
            for _ in range(replicas)]
    with contextlib.ExitStack() as stack:
        servers = [stack.enter_context(ThreadedServer(app)) for app in apps]
        admin = bearer((tmp_path / "admin-token").read_text().strip())
        tokens = {}
        for name, quota in (("limited", {"max_queued_jobs": 20}), ("keyed", {})):
            assert httpx.post(f"{servers[0].url}/v1/tenants", headers=admin,
                              json={"name": name, "quota": quota}).status_code == 201
            tokens[name] = bearer(httpx.post(f"{servers[0].url}/v1/tenants/{name}/tokens", headers=admin,
                                             json={"name": "ci", "role": "member"}).json()["token"])

        def submit(i: int, tenant: str, headers: dict[str, str]) -> httpx.Response:
            name = "retried" if headers else f"job-{i}"  # a retry with a key resends the same spec
            return httpx.post(f"{servers[i % replicas].url}/v1/jobs", json=make_spec(name).build(),
                              headers={**tokens[tenant], **headers}, timeout=60)

        with ThreadPoolExecutor(max_workers=50) as pool:
            limited = list(pool.map(lambda i: submit(i, "limited", {}), range(50)))
            keyed = list(pool.map(lambda i: submit(i, "keyed", {"Idempotency-Key": "once"}), range(30)))

        accepted = [r.json() for r in limited if r.status_code == 201]
        assert sorted(r.status_code for r in limited) == [201] * 20 + [429] * 30
        assert sorted(job["queue_position"] for job in accepted) == list(range(1, 21))
        listed = httpx.get(f"{servers[0].url}/v1/jobs", params={"limit": 500}, headers=tokens["limited"]).json()
        assert sorted(job["id"] for job in listed["items"]) == sorted(job["id"] for job in accepted)

        assert sorted(r.status_code for r in keyed) == [200] * 29 + [201]
        assert len({r.json()["id"] for r in keyed}) == 1
        assert len(httpx.get(f"{servers[0].url}/v1/jobs", headers=tokens["keyed"]).json()["items"]) == 1


def test_replicas_starting_together_on_a_new_database_all_come_up(postgres_server, tmp_path):
    """The first start of several replicas: each creates the default tenant and the bootstrap token unless they
    exist; without a lock across replicas, all but one could fail on the tenant's unique name (a crash loop)."""
    from kembed_api.app import _bootstrap, platform_storage
    from kembed_api.platform.db import Database, upgrade_to_head
    from kembed_api.tenants.models import Tenant

    replicas = 8
    settings = Settings(data_dir=tmp_path, bootstrap_admin_token="kmb_the-one-from-a-secret")
    for _ in range(5):  # a race: a few fresh databases make it all but certain to show
        url = postgres_server.new_database()
        upgrade_to_head(url)
        databases = [Database(url) for _ in range(replicas)]
        together = threading.Barrier(replicas)

        def start(db, together=together) -> None:
            with db.engine.connect():  # connected already, so that they reach the bootstrap together
                pass
            together.wait()
            _bootstrap(settings, db, platform_storage(settings))

        with ThreadPoolExecutor(max_workers=replicas) as pool:
            list(pool.map(start, databases))  # raises what any replica raised
        with databases[0].session() as session:
            assert session.scalar(select(func.count()).select_from(Tenant)) == 1
        for db in databases:
            db.dispose()


def test_a_cancel_waits_for_a_dispatcher_pass_instead_of_deadlocking_with_it(tmp_path, postgres_server):
    """A dispatcher pass changes a tenant's queue count (its row) and then writes a queued job of it (why it
    waits); a cancel of that job locks the job's row, then the tenant's. On PostgreSQL the two deadlocked (one
    of them aborted). Here a pass is held open between its two writes while the cancel comes in: the cancel
    waits for the pass, then cancels."""
    url = postgres_server.new_database()
    backend = FakeBackend(slots=1)  # the first job takes the one slot and keeps it: the second stays queued
    app = create_app(Settings(data_dir=tmp_path, database_url=url, dispatch_interval_s=0.05), backend=backend)
    tenants = Tenant.__table__
    with ThreadedServer(app) as server, ThreadPoolExecutor(1) as pool:
        admin = bearer((tmp_path / "admin-token").read_text().strip())
        assert httpx.post(f"{server.url}/v1/tenants", headers=admin, json={"name": "team"}).status_code == 201
        token = bearer(httpx.post(f"{server.url}/v1/tenants/team/tokens", headers=admin,
                                  json={"name": "ci", "role": "member"}).json()["token"])
        jobs = [httpx.post(f"{server.url}/v1/jobs", headers=token, json=make_spec(f"j{i}").build()).json()["id"]
                for i in range(2)]
        deadline = time.monotonic() + 30
        while httpx.get(f"{server.url}/v1/jobs/{jobs[0]}", headers=token).json()["state"] == "QUEUED":
            assert time.monotonic() < deadline, "the first job was never admitted"
            time.sleep(0.05)
        queued = jobs[1]
        db = app.state.db
        with db.session(write=True) as session:  # a pass, as the dispatcher runs it
            db.lock_across_replicas(session)
            session.execute(update(tenants).where(tenants.c.name == "team")
                            .values(queue_version=tenants.c.queue_version + 1))
            cancelling = pool.submit(httpx.post, f"{server.url}/v1/jobs/{queued}/cancel", headers=token,
                                     timeout=60)
            time.sleep(1.5)  # PostgreSQL looks for deadlocks after 1 s of waiting
            assert not cancelling.done(), cancelling.result().text
            session.execute(update(Job).where(Job.id == queued).values(message="waiting for a free slot"))
        cancelled = cancelling.result(timeout=60)
        assert cancelled.status_code == 202, cancelled.text
        assert cancelled.json()["state"] == "CANCELLED"
