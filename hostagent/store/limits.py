"""Every column's limits, enforced before a row reaches the database, and the same limits inside SQLite.

MariaDB in strict mode refuses a string longer than its ``VARCHAR(n)``, an integer outside its type's range and a
non-finite DOUBLE; SQLite takes all three. So that both backends behave alike, the repository passes every row it
makes through :func:`fit_row`, which refuses such a value with ``InvalidInput`` naming the column (or, for the
free-text columns listed in ``NORMALISE``, shortens it with a marker), and SQLite stores carry triggers
(:func:`sqlite_guards`) that refuse what slipped past, with MariaDB's wording, so the fast SQLite tests see the
errors MariaDB would raise. The engine also asks MariaDB for strict mode on every connection
(:mod:`hostagent.store.engine`), whatever the server's default.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import Any

from sqlalchemy import DDL, BigInteger, Connection, Double, Integer, MetaData, String, Table, Text, event, text

from hostagent.domain.errors import InvalidInput

INT32 = (-(2**31), 2**31 - 1)
INT64 = (-(2**63), 2**63 - 1)
TEXT_MAX_CHARS = 16_000  # MySQL's TEXT holds 65,535 bytes: 16,000 characters of up to 4 bytes each fit
ELLIPSIS = "…"
# Free text whose end matters less than the row: shortened (with a marker) instead of refused. Identifiers, states
# and keys are never shortened: two different values must never be stored as one.
NORMALISE: dict[str, frozenset[str]] = {
    "lease_events": frozenset({"actor", "detail", "error"}),
    "leases": frozenset({"domain_name", "end_reason", "error"}),
    "reclaim_events": frozenset({"reason"}),
    "tokens": frozenset({"domain_name", "note"}),
    "hosts": frozenset({"hostname"}),
    "gpus": frozenset({"vendor", "model", "link_speed"}),
}


def _limit(col: Any) -> int | None:
    """The character limit of a string column (None: no limit of ours)."""
    if isinstance(col.type, String) and col.type.length:
        return int(col.type.length)
    if isinstance(col.type, Text):
        return TEXT_MAX_CHARS
    return None


def _shorten(value: str, limit: int) -> str:
    return value[:limit - len(ELLIPSIS)] + ELLIPSIS


def fit_row(table: Table, row: Mapping[str, Any]) -> dict[str, Any]:
    """``row`` as it may be stored in ``table`` on any backend: too-long free text shortened (``NORMALISE``);
    any other value the column cannot hold refused with InvalidInput naming ``table.column``."""
    out = dict(row)
    loose = NORMALISE.get(table.name, frozenset())
    for name, value in row.items():
        if value is None or name not in table.c:
            continue
        col = table.c[name]
        where = f"{table.name}.{name}"
        if isinstance(value, str):
            limit = _limit(col)
            if limit is not None and len(value) > limit:
                if name in loose or isinstance(col.type, Text):
                    out[name] = _shorten(value, limit)
                else:
                    raise InvalidInput(f"{where} holds at most {limit} characters; got {len(value)}", field=where)
        elif isinstance(value, bool):
            continue
        elif isinstance(value, int) and isinstance(col.type, (Integer, BigInteger)):
            lo, hi = INT64 if isinstance(col.type, BigInteger) else INT32
            if not lo <= value <= hi:
                raise InvalidInput(f"{where} must be within {lo}..{hi}; got {value}", field=where)
        elif isinstance(value, float) and isinstance(col.type, Double) and not math.isfinite(value):
            raise InvalidInput(f"{where} must be a finite number; got {value}", field=where)
    return out


# -- SQLite: the same limits as triggers -------------------------------------------------------------------------

def _guarded(table: Table) -> list[tuple[str, int]]:
    return [(c.name, n) for c in table.c if isinstance(c.type, String) and (n := _limit(c))]


def sqlite_guards(table: Table) -> Iterator[str]:
    """CREATE TRIGGER statements that make SQLite refuse, as MariaDB does, a string longer than its column."""
    cols = _guarded(table)
    if not cols:
        return
    for op in ("insert", "update"):
        checks = " ".join(
            f"SELECT RAISE(ABORT, 'Data too long for column ''{name}'' (at most {n} characters)') "
            f"WHERE length(NEW.{name}) > {n};" for name, n in cols)
        yield (f"CREATE TRIGGER IF NOT EXISTS guard_{table.name}_{op} BEFORE {op.upper()} ON {table.name} "
               f"BEGIN {checks} END")


def install_sqlite_guards(conn: Connection, metadata: MetaData) -> int:
    """(Re)create every table's guard triggers from ``metadata`` (a migration that changes a column's length calls
    this again); returns how many were made. SQLite only: a no-op elsewhere."""
    if conn.dialect.name != "sqlite":
        return 0
    existing = {r[0] for r in conn.execute(text("SELECT name FROM sqlite_master WHERE type='trigger'"))}
    made = 0
    for table in metadata.sorted_tables:
        for op in ("insert", "update"):
            name = f"guard_{table.name}_{op}"
            if name in existing:
                conn.execute(text(f"DROP TRIGGER {name}"))
        if table.name not in {r[0] for r in conn.execute(text("SELECT name FROM sqlite_master WHERE type='table'"))}:
            continue
        for stmt in sqlite_guards(table):
            conn.execute(text(stmt))
            made += 1
    return made


def attach_sqlite_guards(metadata: MetaData) -> None:
    """Make ``metadata.create_all`` on SQLite create the guard triggers too (migrations install them themselves)."""
    for table in metadata.tables.values():
        for stmt in sqlite_guards(table):
            event.listen(table, "after_create", DDL(stmt).execute_if(dialect="sqlite"))
