"""A fault at the usage store's database boundary, for SQLite: every statement the store's engine sends fails, as the
driver would fail it, while the fault is on. `unreachable()` fails them as a database that cannot be reached (the store
spools and replays); `broken()` as one that answers with an error no retry fixes and no row explains (the journal
mirror fails and retries). The spool has its own engine and is never touched."""

from __future__ import annotations

import sqlite3
from typing import Any

from sqlalchemy import Engine, event
from sqlalchemy.exc import OperationalError, ProgrammingError


class StoreFault:
    """Install on a store's engine; switch on and off from the test (the store's worker threads see it at once)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.error: type[Exception] | None = None
        self.failed = 0  # statements failed so far
        event.listen(engine, "before_cursor_execute", self._before)

    def unreachable(self) -> None:
        """Fail every statement with SQLite's 'unable to open database file' (the store: unreachable, spool)."""
        self.error = OperationalError

    def broken(self) -> None:
        """Fail every statement with a programming error (neither an outage nor a refused row)."""
        self.error = ProgrammingError

    def clear(self) -> None:
        """Statements pass again."""
        self.error = None

    def remove(self) -> None:
        """Uninstall."""
        self.clear()
        event.remove(self.engine, "before_cursor_execute", self._before)

    def _before(self, conn: Any, cursor: Any, statement: str, parameters: Any, context: Any, executemany: bool) -> None:
        error = self.error
        if error is None:
            return
        self.failed += 1
        if error is OperationalError:
            raise OperationalError(statement, parameters, sqlite3.OperationalError("unable to open database file"))
        raise ProgrammingError(statement, parameters, sqlite3.ProgrammingError("injected: statement refused"))
