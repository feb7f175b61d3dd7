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
    from alembic.config import Config

    url = f"sqlite:///{tmp_path / 'kembed.db'}"
    config = Config()
    config.set_main_option("script_location", str(kembed_api.platform.db.MIGRATIONS))
    config.set_main_option("sqlalchemy.url", url)
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
