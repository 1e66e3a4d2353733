"""The one place that picks a dialect's upsert: MySQL ``ON DUPLICATE KEY UPDATE`` or SQLite ``ON CONFLICT``."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from sqlalchemy import Connection, Table, case
from sqlalchemy.dialects import mysql, sqlite
from sqlalchemy.sql.elements import ColumnElement

from hostagent.domain.errors import ConfigError


def upsert(conn: Connection, table: Table, rows: Sequence[Mapping[str, Any]], *, keys: Iterable[str],
           replace: Iterable[str] = (), add: Iterable[str] = (), least: Iterable[str] = (),
           greatest: Iterable[str] = ()) -> None:
    """Insert ``rows``; on a key clash replace, add to, or keep the min/max of the named columns.

    No update columns at all means "insert if absent" (the clashing row is kept as it is), which is how replayed
    events and samples stay written once.
    """
    if not rows:
        return
    name = conn.dialect.name
    if name in ("mysql", "mariadb"):
        my = mysql.insert(table)
        new = my.inserted
        sets = _sets(table, new, replace, add, least, greatest)
        if not sets:  # a no-op assignment keeps the existing row without INSERT IGNORE's swallowing of other errors
            first = list(keys)[0]
            sets = {first: table.c[first]}
        conn.execute(my.on_duplicate_key_update(**sets), list(rows))
        return
    if name == "sqlite":
        lite = sqlite.insert(table)
        sets = _sets(table, lite.excluded, replace, add, least, greatest)
        stmt = (lite.on_conflict_do_update(index_elements=list(keys), set_=sets) if sets
                else lite.on_conflict_do_nothing(index_elements=list(keys)))
        conn.execute(stmt, list(rows))
        return
    raise ConfigError(f"the usage store supports MySQL/MariaDB and SQLite, not {name}", field="store.url")


def _sets(table: Table, new: Any, replace: Iterable[str], add: Iterable[str], least: Iterable[str],
          greatest: Iterable[str]) -> dict[str, ColumnElement[Any]]:
    sets: dict[str, ColumnElement[Any]] = {}
    for c in replace:
        sets[c] = new[c]
    for c in add:
        sets[c] = table.c[c] + new[c]
    for c in least:
        sets[c] = _pick(table.c[c], new[c], smaller=True)
    for c in greatest:
        sets[c] = _pick(table.c[c], new[c], smaller=False)
    return sets


def _pick(old: Any, new: Any, *, smaller: bool) -> ColumnElement[Any]:
    # LEAST()/min() return NULL when either side is NULL; a bucket's min must ignore the side that has no value.
    better = new < old if smaller else new > old
    return case((old.is_(None), new), (new.is_(None), old), (better, new), else_=old)
