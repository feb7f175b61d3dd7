"""Alembic environment: the URL comes from the caller (kembed_api.platform.db.upgrade_to_head or alembic.ini)."""

from alembic import context
from sqlalchemy import engine_from_config, pool

from kembed_api import models_registry  # noqa: F401  (registers every table on Base.metadata)
from kembed_api.platform.db import Base

config = context.config
target_metadata = Base.metadata


def run_migrations_offline() -> None:
    context.configure(url=config.get_main_option("sqlalchemy.url"), target_metadata=target_metadata,
                      literal_binds=True, render_as_batch=True)
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    engine = engine_from_config(config.get_section(config.config_ini_section, {}), prefix="sqlalchemy.",
                                poolclass=pool.NullPool)
    with engine.connect() as connection:
        # render_as_batch: SQLite can only ALTER tables by copying them; batch mode does that for us.
        context.configure(connection=connection, target_metadata=target_metadata, render_as_batch=True)
        with context.begin_transaction():
            context.run_migrations()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
