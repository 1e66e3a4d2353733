"""Engines for the usage store, and the one place that tells "the database is unreachable" from "bad request"."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError

# PyMySQL / MariaDB client error numbers that mean "the server is not there", as opposed to a refused statement.
_MYSQL_GONE = {
    1040,  # too many connections
    1053,  # server shutdown in progress
    1205,  # lock wait timeout: the statement never ran
    1213,  # deadlock: rolled back, safe to retry
    2002, 2003, 2006, 2013, 2014, 2045, 2055,  # can't connect / gone away / lost connection
}


def make_engine(url: str, *, connect_timeout: float = 3.0, io_timeout: float = 30.0, echo: bool = False) -> Engine:
    """An Engine for ``url`` with short connect timeouts (MySQL) or WAL + foreign keys (SQLite)."""
    u = make_url(url)
    kwargs: dict[str, Any] = {"echo": echo, "future": True}
    if u.get_backend_name() == "sqlite":
        if u.database and u.database != ":memory:":
            Path(u.database).parent.mkdir(parents=True, exist_ok=True)
        kwargs["connect_args"] = {"timeout": io_timeout, "check_same_thread": False}
        engine = create_engine(url, **kwargs)
        event.listen(engine, "connect", _sqlite_pragmas)
        return engine
    if u.get_backend_name() in ("mysql", "mariadb"):
        # Without read/write timeouts a cut connection hangs a worker thread for the kernel's TCP timeout.
        kwargs["connect_args"] = {"connect_timeout": max(1, int(connect_timeout)),
                                  "read_timeout": max(1, int(io_timeout)),
                                  "write_timeout": max(1, int(io_timeout)),
                                  "charset": "utf8mb4",
                                  # strict whatever the server's default: a value the column cannot hold is refused,
                                  # never cut or zeroed (the repository checks first; this is the backstop)
                                  "init_command": "SET SESSION sql_mode = TRIM(BOTH ',' FROM "
                                                  "CONCAT(@@SESSION.sql_mode, ',STRICT_ALL_TABLES'))"}
        kwargs.update(paramstyle="format", pool_pre_ping=True, pool_recycle=1800, pool_size=5, max_overflow=5, pool_timeout=io_timeout)
    return create_engine(url, **kwargs)


def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")  # readers (dashboard) do not block the ingest writer
    cur.execute("PRAGMA synchronous=NORMAL")
    cur.execute("PRAGMA foreign_keys=ON")
    cur.close()


def is_unavailable(exc: BaseException) -> bool:
    """True when ``exc`` means the database could not be reached (spool and retry), not that the write was bad."""
    if isinstance(exc, InterfaceError):
        return True
    if isinstance(exc, DBAPIError) and exc.connection_invalidated:
        return True
    if isinstance(exc, OperationalError):
        orig = exc.orig
        args = getattr(orig, "args", ())
        if args and isinstance(args[0], int):
            return args[0] in _MYSQL_GONE
        text = str(orig).lower()
        return "locked" in text or "unable to open" in text or "disk i/o" in text
    # PyMySQL raises these outside a DBAPIError wrapper when the socket dies mid-handshake.
    return isinstance(exc, (ConnectionError, TimeoutError, BrokenPipeError))


class HeldConnection:
    """One connection kept out of the pool for a single busy user (the sample writer, the roller), one
    transaction at a time; the caller serializes its use.

    A pooled checkout per transaction costs a ping (pool_pre_ping) and a rollback when the connection goes back:
    two round trips more than the work itself. A held connection is handed back to the pool, and a fresh (pinged)
    one taken, after ``idle_s`` without use (the server may have dropped it meanwhile) or after any error.
    """

    def __init__(self, engine: Engine, *, idle_s: float = 30.0) -> None:
        self.engine = engine
        self.idle_s = idle_s
        self._conn: Connection | None = None
        self._used = 0.0

    @contextmanager
    def begin(self) -> Iterator[Connection]:
        """A transaction on the held connection: committed on success, rolled back (and the connection dropped)
        on any error."""
        now = time.monotonic()
        if self._conn is not None and (now - self._used > self.idle_s or self._conn.invalidated):
            self.close()
        if self._conn is None:
            self._conn = self.engine.connect()
        conn = self._conn
        try:
            with conn.begin():
                yield conn
        except BaseException:
            self.close()
            raise
        finally:
            self._used = time.monotonic()

    def close(self) -> None:
        """Give the connection back to the pool (a later begin() takes another)."""
        conn, self._conn = self._conn, None
        if conn is not None:
            try:
                conn.close()
            except Exception:  # closing a connection the server already dropped: nothing left to release
                pass
