"""Run the store's Alembic migrations programmatically (no alembic.ini at runtime)."""

from __future__ import annotations

from contextlib import contextmanager
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection, Engine, func, select
from sqlalchemy.exc import SQLAlchemyError

from hostagent.domain.errors import StoreUnavailable

MIGRATIONS = Path(__file__).parent / "migrations"
_LOCK = "hostagent_store_migrate"


def alembic_config(connection: Connection | None = None) -> Config:
    """An Alembic Config pointing at the packaged migrations, optionally bound to a connection."""
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    if connection is not None:
        cfg.attributes["connection"] = connection
    return cfg


def head_revision() -> str:
    """The newest revision shipped with this package."""
    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    assert head is not None
    return head


def current_revision(bind: str | Engine) -> str | None:
    """The revision the database is at (None when never migrated)."""
    with _engine(bind) as engine, engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


def upgrade(bind: str | Engine, revision: str = "head") -> str | None:
    """Upgrade the database at ``bind`` (URL or Engine) to ``revision``; returns the revision reached."""
    try:
        with _engine(bind) as engine, engine.begin() as conn, _migration_lock(conn):
            command.upgrade(alembic_config(conn), revision)
            return MigrationContext.configure(conn).get_current_revision()
    except SQLAlchemyError as exc:
        raise StoreUnavailable(f"cannot migrate the usage store: {exc.__class__.__name__}: {exc.orig if hasattr(exc, 'orig') else exc}",
                               field="store.url") from exc


def downgrade(bind: str | Engine, revision: str) -> None:
    """Downgrade the database at ``bind`` to ``revision`` ('base' empties it)."""
    with _engine(bind) as engine, engine.begin() as conn, _migration_lock(conn):
        command.downgrade(alembic_config(conn), revision)


@contextmanager
def _engine(bind: str | Engine) -> Iterator[Engine]:
    if isinstance(bind, Engine):
        yield bind
        return
    from hostagent.store.engine import make_engine  # local: engine imports nothing of migrations

    engine = make_engine(bind)
    try:
        yield engine
    finally:
        engine.dispose()


@contextmanager
def _migration_lock(conn: Connection) -> Iterator[None]:
    """Serialize agents that start together against one MySQL (Alembic itself does not lock)."""
    if conn.dialect.name not in ("mysql", "mariadb"):
        yield  # SQLite serializes writers itself
        return
    got: Any = conn.execute(select(func.get_lock(_LOCK, 120))).scalar()
    if got != 1:
        raise StoreUnavailable("another agent is migrating the usage store; gave up after 120 s", field="store.url")
    try:
        yield
    finally:
        conn.execute(select(func.release_lock(_LOCK)))
