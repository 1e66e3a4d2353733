"""The one place that picks a dialect's insert flavour: MySQL ``ON DUPLICATE KEY UPDATE`` / ``INSERT IGNORE`` or
SQLite ``ON CONFLICT`` / ``INSERT OR IGNORE``."""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from sqlalchemy import Connection, Select, Table, bindparam, case, insert
from sqlalchemy.dialects import mysql, sqlite
from sqlalchemy.engine import Dialect
from pymysql.converters import escape_float  # type: ignore[import-untyped]
from sqlalchemy.sql.elements import ColumnElement

from hostagent.domain.errors import ConfigError

_MYSQL = ("mysql", "mariadb")


def upsert(conn: Connection, table: Table, rows: Sequence[Mapping[str, Any]], *, keys: Iterable[str],
           replace: Iterable[str] = (), add: Iterable[str] = (), least: Iterable[str] = (),
           greatest: Iterable[str] = ()) -> None:
    """Insert ``rows``; on a key clash replace, add to, or keep the min/max of the named columns.

    No update columns at all means "insert if absent" (the clashing row is kept as it is), which is how replayed
    events stay written once.
    """
    if not rows:
        return
    stmt = _row_upsert(conn.dialect, table, tuple(keys), tuple(replace), tuple(add), tuple(least), tuple(greatest))
    conn.execute(stmt, list(rows))


def upsert_select(dialect: Dialect, table: Table, columns: Sequence[str], source: Select[Any], *,
                  keys: Iterable[str], replace: Iterable[str] = (), add: Iterable[str] = (),
                  least: Iterable[str] = (), greatest: Iterable[str] = ()) -> Any:
    """The statement of :func:`upsert` for ``dialect``, with the rows made on the server by ``source`` (a SELECT
    of ``columns``, in order)."""
    return _upsert(dialect, table, (list(columns), source), keys, replace, add, least, greatest)


def upsert_statement(dialect: Dialect, table: Table, *, values: Mapping[str, Any], keys: Iterable[str],
                     replace: Iterable[str] = (), add: Iterable[str] = (), least: Iterable[str] = (),
                     greatest: Iterable[str] = ()) -> Any:
    """The statement of :func:`upsert` for ``dialect`` and one row of ``values`` (constants or bind parameters)."""
    return _upsert(dialect, table, None, keys, replace, add, least, greatest).values(dict(values))


def insert_ignore(conn: Connection, table: Table, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> int:
    """Insert ``rows`` (tuples in ``columns`` order), skipping those whose unique key is stored; returns how many
    were new.

    Skipping clashes in the statement saves a SELECT of the keys first. On SQLite the rows go to the DBAPI's
    ``executemany`` (one prepared statement); on MySQL they become one multi-row ``INSERT ... VALUES`` (see
    :func:`_mysql_values`). INSERT IGNORE also turns some other errors into warnings on MySQL, so callers pass
    only values they have checked (``Sample`` objects are).
    """
    if not rows:
        return 0
    sql = _insert_ignore_sql(conn.dialect, table, tuple(columns))
    if conn.dialect.name in _MYSQL and conn.dialect.driver == "pymysql":
        return _mysql_values(conn, sql, rows)
    result = conn.exec_driver_sql(sql, rows if isinstance(rows, list) else list(rows))
    return max(0, int(result.rowcount))  # the rows really inserted, summed over the executemany


def _mysql_values(conn: Connection, sql: str, rows: Sequence[Sequence[Any]], max_len: int = 1_000_000) -> int:
    """Send ``rows`` as multi-row INSERTs of literals, each under ``max_len`` characters; returns rows inserted.

    This is what PyMySQL's ``executemany`` does for this statement form, with PyMySQL's own escaping, minus its
    per-value dispatch: a heartbeat batch repeats a handful of strings (host, GPU, lease, source), escaped once
    here, and its numbers take PyMySQL's int/float encoders directly. Escaping was the largest client cost of a
    flush, paid on the writer thread while the database waits.
    """
    escape = conn.connection.driver_connection.escape  # type: ignore[union-attr]
    prefix = sql[:sql.rindex(" VALUES ")] + " VALUES "
    strings: dict[str, str] = {}
    inserted = 0
    chunk: list[str] = []
    size = len(prefix)
    for row in rows:
        parts = []
        for v in row:
            kind = type(v)
            if kind is float:
                parts.append(escape_float(v))
            elif v is None:
                parts.append("NULL")
            elif kind is int:
                parts.append(str(v))  # what PyMySQL's escape_int does
            elif kind is str:
                lit = strings.get(v)
                if lit is None:
                    lit = strings[v] = escape(v)
                parts.append(lit)
            else:
                parts.append(escape(v))
        literal = "(" + ",".join(parts) + ")"
        if chunk and size + len(literal) + 1 > max_len:
            inserted += _execute_literal(conn, prefix + ",".join(chunk))
            chunk, size = [], len(prefix)
        chunk.append(literal)
        size += len(literal) + 1
    inserted += _execute_literal(conn, prefix + ",".join(chunk))
    return inserted


def _execute_literal(conn: Connection, sql: str) -> int:
    # no_parameters: the driver must not treat a "%" inside a value as a placeholder
    result = conn.exec_driver_sql(sql, execution_options={"no_parameters": True})
    return max(0, int(result.rowcount))


# -- statements ----------------------------------------------------------------------------------------------------
def _upsert(dialect: Dialect, table: Table, source: tuple[list[str], Select[Any]] | None, keys: Iterable[str],
            replace: Iterable[str], add: Iterable[str], least: Iterable[str], greatest: Iterable[str]) -> Any:
    name = _supported(dialect)
    if name in _MYSQL:
        my = mysql.insert(table)
        if source is not None:
            my = my.from_select(*source)
        sets = _sets(table, my.inserted, replace, add, least, greatest)
        if not sets:  # a no-op assignment keeps the existing row without INSERT IGNORE's swallowing of other errors
            first = list(keys)[0]
            sets = {first: table.c[first]}
        return my.on_duplicate_key_update(**sets)
    lite = sqlite.insert(table)
    if source is not None:
        lite = lite.from_select(*source)
    sets = _sets(table, lite.excluded, replace, add, least, greatest)
    return (lite.on_conflict_do_update(index_elements=list(keys), set_=sets) if sets
            else lite.on_conflict_do_nothing(index_elements=list(keys)))


@functools.lru_cache(maxsize=64)
def _row_upsert(dialect: Dialect, table: Table, keys: tuple[str, ...], replace: tuple[str, ...], add: tuple[str, ...],
                least: tuple[str, ...], greatest: tuple[str, ...]) -> Any:
    """:func:`upsert`'s statement, built once per table and column choice: building it is most of an upsert's
    client time (SQLite's ``excluded`` copies every column of the table each time), and a statement is immutable,
    so the same one serves every call and every thread."""
    return _upsert(dialect, table, None, keys, replace, add, least, greatest)


@functools.lru_cache(maxsize=32)
def _insert_ignore_sql(dialect: Dialect, table: Table, columns: tuple[str, ...]) -> str:
    """The dialect's ``INSERT IGNORE`` / ``INSERT OR IGNORE`` text with positional parameters in ``columns`` order."""
    _supported(dialect)
    stmt = (insert(table).values({c: bindparam(c) for c in columns})
            .prefix_with("IGNORE", dialect="mysql").prefix_with("IGNORE", dialect="mariadb")
            .prefix_with("OR IGNORE", dialect="sqlite"))
    compiled = stmt.compile(dialect=dialect)
    if tuple(compiled.positiontup or ()) != columns:  # a named paramstyle would not take tuples
        raise ConfigError(f"the {dialect.name} driver's parameter style ({dialect.paramstyle}) is not positional",
                          field="store.url")
    return str(compiled)


def _supported(dialect: Dialect) -> str:
    if dialect.name in _MYSQL or dialect.name == "sqlite":
        return str(dialect.name)
    raise ConfigError(f"the usage store supports MySQL/MariaDB and SQLite, not {dialect.name}", field="store.url")


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
