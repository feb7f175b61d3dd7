"""The Alembic migrations build exactly the schema the models declare, on both databases."""

from __future__ import annotations

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import create_engine, text

import kembed_api.auth.models
import kembed_api.jobs.models
import kembed_api.platform.db
import kembed_api.tenants.models  # noqa: F401 - every table registered on Base.metadata
from kembed_api.platform.db import Base, upgrade_to_head


@pytest.mark.parametrize("database", ["sqlite", "postgres"])
def test_migrating_a_new_database_gives_the_models_schema(request, tmp_path, database):
    url = (f"sqlite:///{tmp_path / 'kembed.db'}" if database == "sqlite"
           else request.getfixturevalue("postgres_server").new_database())
    upgrade_to_head(url)
    engine = create_engine(url)
    with engine.connect() as connection:
        differences = compare_metadata(MigrationContext.configure(connection), Base.metadata)
    engine.dispose()
    assert differences == [], "a model changed without a migration (alembic revision --autogenerate)"


def test_upgrading_counts_the_queues_already_there(tmp_path):
    """Migration 0006 starts each tenant's queue length from the jobs it already has queued."""
    from alembic import command

    url = f"sqlite:///{tmp_path / 'kembed.db'}"
    config = _alembic_config(url)
    command.upgrade(config, "0005")
    engine = create_engine(url)
    with engine.begin() as connection:
        connection.execute(text("INSERT INTO tenants (id, name, created_at) VALUES (1, 'a', '2026-11-30'), "
                                "(2, 'b', '2026-11-30')"))
        for seq, (tenant, state) in enumerate([(1, "QUEUED"), (1, "QUEUED"), (1, "RUNNING"), (2, "SUCCEEDED")], 1):
            connection.execute(text(
                "INSERT INTO jobs (seq, id, tenant_id, name, spec, priority, gpus, cpu, memory_bytes, processes, "
                "state, reason, message, cancel_requested, restart_count, created_at, step, total_steps, metrics, "
                f"backend_state) VALUES ({seq}, 'job-{seq}', {tenant}, 'job', '{{}}', 0, 0, 1, 1, 1, '{state}', "
                "'', '', 0, 0, '2026-11-30', 0, 1, '{}', '{}')"))
    upgrade_to_head(url)
    with engine.connect() as connection:
        counts = dict(connection.execute(text("SELECT name, queued_jobs FROM tenants")).all())
    engine.dispose()
    assert counts == {"a": 2, "b": 0}


@pytest.mark.parametrize("database", ["sqlite", "postgres"])
def test_upgrading_renames_the_latest_checkpoint_column_and_keeps_every_value(request, tmp_path, database):
    """Migration 0017 renames jobs.checkpoint_uri (the latest complete step) to latest_checkpoint_uri in place,
    and back on a downgrade."""
    from alembic import command

    url = (f"sqlite:///{tmp_path / 'kembed.db'}" if database == "sqlite"
           else request.getfixturevalue("postgres_server").new_database())
    config = _alembic_config(url)
    command.upgrade(config, "0016")
    engine = create_engine(url)
    with engine.begin() as connection:
        connection.execute(text("INSERT INTO tenants (id, name, created_at) VALUES (1, 'a', '2026-12-01')"))
        for seq, uri in [(1, "file:///c/a/job-1/step-40"), (2, None)]:
            connection.execute(text(
                "INSERT INTO jobs (seq, id, tenant_id, name, spec, priority, gpus, cpu, memory_bytes, processes, "
                "state, reason, message, cancel_requested, restart_count, created_at, step, total_steps, metrics, "
                "backend_state, checkpoint_uri, checkpoint_step) VALUES (:seq, :id, 1, 'job', '{}', 0, 0, 1, 1, 1, "
                "'RUNNING', '', '', false, 0, '2026-12-01', 40, 60, '{}', '{}', :uri, :step)"),
                {"seq": seq, "id": f"job-{seq}", "uri": uri, "step": 40 if uri else None})
    engine.dispose()

    def latest(column: str) -> dict[str, str | None]:
        engine = create_engine(url)
        with engine.connect() as connection:
            found = dict(connection.execute(text(f"SELECT id, {column} FROM jobs ORDER BY seq")).all())
        engine.dispose()
        return found

    upgrade_to_head(url)
    assert latest("latest_checkpoint_uri") == {"job-1": "file:///c/a/job-1/step-40", "job-2": None}
    command.downgrade(config, "0016")
    assert latest("checkpoint_uri") == {"job-1": "file:///c/a/job-1/step-40", "job-2": None}


def _alembic_config(url: str):
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(kembed_api.platform.db.MIGRATIONS))
    config.set_main_option("sqlalchemy.url", url)
    return config
