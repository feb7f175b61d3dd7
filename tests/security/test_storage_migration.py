"""Tenants from before storage policies existed keep what they had: their own checkpoint folder, plus what the
platform admin configured as defaults, written in by the first server start after the migration."""

from __future__ import annotations

from alembic import command
from alembic.config import Config
from fastapi.testclient import TestClient
from sqlalchemy import create_engine, text

import kembed_api.platform.db
from kembed_api.app import create_app
from kembed_api.platform.settings import Settings
from tests.api.conftest import FakeBackend


def test_existing_tenants_get_their_own_folder_plus_the_defaults(tmp_path):
    data_dir = tmp_path / "kembed"
    data_dir.mkdir()
    url = f"sqlite:///{data_dir / 'kembed.db'}"
    config = Config()
    config.set_main_option("script_location", str(kembed_api.platform.db.MIGRATIONS))
    config.set_main_option("sqlalchemy.url", url)
    command.upgrade(config, "0007")
    engine = create_engine(url)
    with engine.begin() as connection:
        connection.execute(text("INSERT INTO tenants (id, name, created_at, quota_gpus) "
                                "VALUES (1, 'default', '2026-11-30', NULL), (2, 'team-a', '2026-11-30', 4)"))
    engine.dispose()
    datasets = tmp_path / "datasets"
    datasets.mkdir()
    settings = Settings(data_dir=data_dir, database_url=url, storage_read_prefixes=[str(datasets)],
                        storage_write_prefixes=["s3://exports/shared"])
    with TestClient(create_app(settings, backend=FakeBackend())) as client:
        token = (data_dir / "admin-token").read_text().strip()
        tenants = client.get("/v1/tenants", headers={"Authorization": f"Bearer {token}"}).json()["items"]
    by_name = {t["name"]: t for t in tenants}
    assert by_name["team-a"]["quota"]["gpus"] == 4  # nothing stored is lost
    for name in ("default", "team-a"):
        assert by_name[name]["storage"] == {"own": f"{(data_dir / 'checkpoints').as_uri()}/{name}",
                                            "read": [datasets.as_uri()], "write": ["s3://exports/shared"]}
    engine = create_engine(url)
    with engine.connect() as connection:  # written in, not computed on the fly: later defaults change nothing
        stored = connection.execute(text("SELECT storage_read_prefixes FROM tenants WHERE name = 'team-a'")).scalar()
    engine.dispose()
    assert datasets.as_uri() in stored
