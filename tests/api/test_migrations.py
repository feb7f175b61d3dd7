"""The Alembic migrations build exactly the schema the models declare, on both databases."""

from __future__ import annotations

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import create_engine

import kembed_api.auth.models
import kembed_api.jobs.models
import kembed_api.tenants.models  # noqa: F401 - every table registered on Base.metadata
from kembed_api.db import Base, upgrade_to_head


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
