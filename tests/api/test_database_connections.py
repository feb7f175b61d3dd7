"""PostgreSQL dropping the API's connections (a restart, a failover, an idle timeout) costs no request."""

from __future__ import annotations

import psycopg
from fastapi.testclient import TestClient

from kembed_api.app import create_app
from kembed_api.platform.settings import Settings
from tests.api.conftest import FakeBackend
from tests.builders import make_spec


def _backends(postgres_server, database: str, what: str = "pid") -> list:
    """`what` of every server process serving `database`."""
    with psycopg.connect(postgres_server.url().replace("postgresql+psycopg", "postgresql"),
                         autocommit=True) as admin:
        return [row[0] for row in admin.execute(
            f"SELECT {what} FROM pg_stat_activity WHERE datname = %s", (database,)
        ).fetchall()]


def _drop_every_connection_of(postgres_server, database: str) -> int:
    """Terminate every server process serving `database`, as a PostgreSQL restart would."""
    return len(_backends(postgres_server, database, what="pg_terminate_backend(pid)"))


def test_the_read_pool_is_open_before_the_first_poll(postgres_server, tmp_path):
    """A burst of polls never waits for new PostgreSQL backends: the read pool's 20 are opened at start."""
    url = postgres_server.new_database()
    with TestClient(create_app(Settings(data_dir=tmp_path, database_url=url), backend=FakeBackend())):
        assert len(_backends(postgres_server, url.rsplit("/", 1)[1])) >= 20


def test_polls_submissions_and_usage_survive_postgresql_dropping_every_connection(postgres_server, tmp_path):
    url = postgres_server.new_database()
    settings = Settings(data_dir=tmp_path, database_url=url, dispatch_interval_s=0.05)
    with TestClient(create_app(settings, backend=FakeBackend())) as client:
        client.headers["Authorization"] = f"Bearer {(tmp_path / 'admin-token').read_text().strip()}"
        job = client.post("/v1/jobs", json=make_spec("ctr").build()).json()
        for _ in range(3):  # the read pool holds connections now
            assert client.get(f"/v1/jobs/{job['id']}").status_code == 200
            assert client.get("/v1/usage").status_code == 200

        assert _drop_every_connection_of(postgres_server, url.rsplit("/", 1)[1]) > 0

        polled = client.get(f"/v1/jobs/{job['id']}")
        assert polled.status_code == 200 and polled.json()["id"] == job["id"]
        assert client.get("/v1/usage").json()["tenant"] == "default"
        second = client.post("/v1/jobs", json=make_spec("ctr").build())
        assert second.status_code == 201
        assert [j["id"] for j in client.get("/v1/jobs").json()["items"]] == [second.json()["id"], job["id"]]
