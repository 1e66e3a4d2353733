"""Alembic migrations: an empty MariaDB and an empty SQLite reach head, and the schema equals the metadata."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect

from hostagent.domain.errors import StoreUnavailable
from hostagent.store.engine import make_engine
from hostagent.store.migrate import current_revision, downgrade, head_revision, upgrade
from hostagent.store.schema import metadata
from tests.support.store import mysql_database, mysql_url


@pytest.fixture(params=["sqlite", "mysql"])
def empty_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A database with nothing in it."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'empty.sqlite3'}"
        return
    with mysql_database("ha_migrate") as name:
        yield mysql_url(name)


def test_upgrade_empty_database_to_head_matches_metadata(empty_url: str) -> None:
    assert current_revision(empty_url) is None
    assert upgrade(empty_url) == head_revision()
    assert upgrade(empty_url) == head_revision()  # a second start is a no-op
    engine = make_engine(empty_url)
    try:
        with engine.connect() as conn:
            diff = compare_metadata(MigrationContext.configure(conn, opts={"compare_type": True}), metadata)
            tables = set(inspect(conn).get_table_names())
        assert diff == []
        assert tables == set(metadata.tables) | {"alembic_version"}
    finally:
        engine.dispose()


def test_downgrade_to_base_and_back(empty_url: str) -> None:
    upgrade(empty_url)
    downgrade(empty_url, "base")
    engine = make_engine(empty_url)
    try:
        with engine.connect() as conn:
            assert set(inspect(conn).get_table_names()) <= {"alembic_version"}
    finally:
        engine.dispose()
    assert upgrade(empty_url) == head_revision()


def test_unreachable_server_is_store_unavailable() -> None:
    with pytest.raises(StoreUnavailable) as err:
        upgrade("mysql+pymysql://root@127.0.0.1:1/nothing")  # port 1: nothing listens
    assert err.value.field == "store.url"


def test_migrations_ship_inside_the_package() -> None:
    import hostagent.store.migrate as m

    versions = list((m.MIGRATIONS / "versions").glob("*.py"))
    assert (m.MIGRATIONS / "env.py").is_file() and versions
    assert not (Path(m.__file__).parent / "alembic.ini").exists()
