"""Alembic environment, configured in code: the caller passes a Connection in ``config.attributes``."""

from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine

from hostagent.store.schema import metadata

config = context.config


def run() -> None:
    """Run migrations on the connection the caller handed over, or on a fresh engine for ``sqlalchemy.url``."""
    connection = config.attributes.get("connection")
    if connection is not None:
        _migrate(connection)
        return
    engine = create_engine(config.get_main_option("sqlalchemy.url") or "")
    with engine.begin() as conn:
        _migrate(conn)
    engine.dispose()


def _migrate(connection) -> None:  # type: ignore[no-untyped-def]
    # render_as_batch lets ALTERs work on SQLite (it copies the table) with the same scripts as MySQL.
    context.configure(connection=connection, target_metadata=metadata, render_as_batch=True,
                      compare_type=True)
    with context.begin_transaction():
        context.run_migrations()


if context.is_offline_mode():
    context.configure(url=config.get_main_option("sqlalchemy.url"), target_metadata=metadata,
                      literal_binds=True, render_as_batch=True)
    with context.begin_transaction():
        context.run_migrations()
else:
    run()
