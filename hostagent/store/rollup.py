"""Rollups kept out of the sample insert: fold a host's raw samples past its id watermark into usage_rollups.

Inserting a heartbeat batch is one ``INSERT IGNORE`` and nothing else. This step then aggregates, on the database
server, the host's rows with ``last_id < id <= high`` per (GPU, bucket, lease) for each resolution, adds them into
``usage_rollups`` and moves the host's watermark to ``high`` in the same transaction. Hence exactly once: a crash
before the commit leaves both as they were (the next step folds the same rows), a replayed sample is ignored by the
insert and never gets a new id, and a committed step never sees its rows again.

It relies on a host's sample ids growing in commit order, which holds because one ``UsageStore`` writes a host's
samples one transaction at a time (its writer lock) and ids are never reused (AUTO_INCREMENT; AUTOINCREMENT on
SQLite). Two agents writing samples under the same host id at once are not supported.

Most steps need not read the raw rows again: the writer keeps each write whose every sample was new as a
:class:`Fresh` (the host's newest sample id before and after its insert, read in its transaction, and the samples),
and a step whose watermark is where a chain of them begins folds their samples in Python (``rollup_rows``) and
upserts the few rollup rows that make. The host's rows in ``(after, top]`` of a fresh write are exactly its samples
(one writer per host), so the chain covers the rows past the watermark exactly; anything else past it (a spool
replay, a write that skipped duplicates, a write kept no longer) breaks the chain, and the server folds from the
watermark as above. ``hostagent bench fleet``: the server's fold was the store path's largest cost over a raw insert.

A write is handed to the roller only after its transaction has committed, so a step can come between the two: it
would see the rows without their chain and fold them on the server (correct, but the cost the chain saves). The
writer marks that window (:meth:`FreshWrites.writing`), and a step that finds no chain while a write is in it
defers once (it returns ``(0, True)`` having done nothing) and the roller waits for the window to close.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import BigInteger, Connection, CursorResult, Engine, Integer, bindparam, case, func, literal, select
from sqlalchemy.engine import Dialect

from hostagent.store import schema as t
from hostagent.store.samples import (
    IDLE_UTIL_PCT,
    RESOLUTIONS,
    ROLLUP_ADD,
    ROLLUP_GREATEST,
    ROLLUP_KEYS,
    ROLLUP_LEAST,
    Sample,
    rollup_rows,
)
from hostagent.store.upsert import upsert, upsert_select, upsert_statement

STEP_ROWS = 50_000  # at most this many raw rows per transaction, so a long replay does not make one huge one

ROLLUP_COLUMNS = ("host_id", "gpu_id", "resolution", "bucket", "lease_id", "n", "util_n", "util_sum", "util_min",
                  "util_max", "idle_n", "mem_n", "mem_sum", "mem_max", "work_n", "work_sum", "irq_n", "irq_sum",
                  "first_ms", "last_ms")


def rollup_engine(engine: Engine) -> Engine:
    """The engine for rollup steps: on MySQL, READ COMMITTED, so that reading the new samples is a consistent read
    that takes no next-key locks (under REPEATABLE READ, INSERT ... SELECT would lock the gap past the newest
    sample and stall the concurrent insert of the next batch until the step commits)."""
    if engine.dialect.name in ("mysql", "mariadb"):
        return engine.execution_options(isolation_level="READ COMMITTED")
    return engine  # SQLite has one writer at a time anyway; its readers never block it (WAL)


def watermark(conn: Connection, host_id: str, *, lock: bool = False) -> int:
    """The highest sample id of ``host_id`` already in the rollups (0 before its first step)."""
    return int(_run(conn, "mark_lock" if lock else "mark", host_id=host_id).scalar() or 0)


def pending(conn: Connection, host_id: str) -> int:
    """How many raw samples of ``host_id`` wait to be folded into the rollups."""
    s = t.usage_samples.c
    return int(conn.execute(select(func.count()).where(s.host_id == host_id,
                                                       s.id > watermark(conn, host_id))).scalar_one())


def newest_id(conn: Connection, host_id: str) -> int:
    """The highest sample id of ``host_id`` (0 when it has none): one dive into the (host_id, id) index."""
    return int(_run(conn, "newest", host_id=host_id).scalar() or 0)


@dataclass(frozen=True, slots=True)
class Fresh:
    """A committed sample write whose every sample was inserted: the host's rows with ``after < id <= top`` are
    exactly ``samples``."""

    after: int
    top: int
    samples: Sequence[Sample]


class FreshWrites:
    """The writer's fresh writes not yet folded, in commit order (written by the writer, taken by the roller).

    At most ``cap`` samples are kept: past that the oldest writes are dropped, which breaks the chain, and the
    server folds those rows instead (a roller that lags, or stopped by an outage, costs memory no longer)."""

    def __init__(self, cap: int = STEP_ROWS) -> None:
        self.cap = cap
        self._lock = threading.Lock()
        self._written = threading.Condition(self._lock)
        self._writes: collections.deque[Fresh] = collections.deque()
        self._n = 0
        self._open = 0  # writes between their start and handing their samples over (or not)
        self.used = 0  # samples folded from memory so far
        self.deferred = 0  # steps that waited for a write in that window

    @contextlib.contextmanager
    def writing(self) -> Iterator[None]:
        """Mark a sample write from its start until its samples are handed over with :meth:`add`, or not."""
        with self._lock:
            self._open += 1
        try:
            yield
        finally:
            with self._lock:
                self._open -= 1
                self._written.notify_all()

    @property
    def busy(self) -> bool:
        """Whether a write is between its start and handing its samples over."""
        with self._lock:
            return self._open > 0

    def wait_written(self, timeout: float) -> bool:
        """Wait until no write is in that window; False when ``timeout`` came first."""
        with self._lock:
            return self._written.wait_for(lambda: self._open == 0, timeout)

    def add(self, write: Fresh) -> None:
        with self._lock:
            self._writes.append(write)
            self._n += len(write.samples)
            while self._n > self.cap:
                self._n -= len(self._writes.popleft().samples)

    def chain(self, mark: int, limit: int) -> list[Fresh]:
        """The fresh writes that continue from ``mark`` one after another, at most ``limit`` samples (at least one
        write); empty when none begins at ``mark``. Writes already folded (``top <= mark``) are forgotten."""
        with self._lock:
            self._forget(mark)
            out: list[Fresh] = []
            at, n = mark, 0
            for w in self._writes:
                if w.after != at or (out and n + len(w.samples) > limit):
                    break
                out.append(w)
                at, n = w.top, n + len(w.samples)
            return out

    def folded(self, mark: int) -> None:
        """Forget the writes whose rows are all at or below the watermark ``mark``."""
        with self._lock:
            self._forget(mark)

    def __len__(self) -> int:
        with self._lock:
            return len(self._writes)

    def _forget(self, mark: int) -> None:
        while self._writes and self._writes[0].top <= mark:
            self._n -= len(self._writes.popleft().samples)


def roll_up_step(conn: Connection, host_id: str, *, now: float, limit: int = STEP_ROWS,
                 fresh: FreshWrites | None = None, defer: bool = False) -> tuple[int, bool]:
    """Fold pending samples of ``host_id`` (at most ``limit``) into the rollups and move the watermark past them;
    returns how many, and whether more are pending. Run it inside one transaction (the caller's ``begin()``).

    With ``fresh``, a chain of fresh writes that begins at the watermark is folded from memory instead of from the
    raw rows (see the module's notes). With ``defer`` too, a step that finds no chain while a write is still
    handing its samples over does nothing and returns ``(0, True)``: wait (``fresh.wait_written``) and step again
    without ``defer``."""
    low = watermark(conn, host_id, lock=True)  # MySQL: a second agent on the same host id waits here
    if fresh is not None:
        chain = fresh.chain(low, limit)
        if chain:
            samples = [s for w in chain for s in w.samples]
            upsert(conn, t.usage_rollups, rollup_rows(host_id, samples), keys=ROLLUP_KEYS, add=ROLLUP_ADD,
                   least=ROLLUP_LEAST, greatest=ROLLUP_GREATEST)
            top = chain[-1].top
            _run(conn, "move", host_id=host_id, last_id=top, updated_at=now)
            # forgotten before the commit: should it fail, the watermark stays and no chain begins there any more,
            # so the server folds these rows (test_a_fold_from_memory_rolled_back_is_caught_up_by_the_server)
            fresh.folded(top)
            fresh.used += len(samples)
            # more past the chain: the next write's chain, or rows only the server can fold (a replay)
            return len(samples), _run(conn, "bounds", host_id=host_id, low=top).one()[0] is not None
        if defer and fresh.busy:
            fresh.deferred += 1
            return 0, True
    bounds: Any = _run(conn, "bounds", host_id=host_id, low=low).one()
    first, last = bounds
    if first is None:
        return 0, False
    # At most ``limit`` ids, hence at most that many rows (other hosts' rows take ids in between too).
    high = min(int(last), int(first) + limit - 1)
    n = int(_run(conn, "count", host_id=host_id, low=low, high=high).scalar_one())
    for res in RESOLUTIONS:
        _run(conn, f"fold/{res}", host_id=host_id, low=low, high=high)
    _run(conn, "move", host_id=host_id, last_id=high, updated_at=now)
    if fresh is not None:
        fresh.folded(high)
    return n, high < int(last)


# -- statements, compiled once per dialect ----------------------------------------------------------------------
# A step runs after every flushed batch; building and compiling these Core statements each time cost more client
# CPU than the rest of the step. Their text and parameter order are made once and run with exec_driver_sql.

def _run(conn: Connection, name: str, **params: Any) -> CursorResult[Any]:
    sql, order, defaults = _compiled(conn.dialect, name)
    return conn.exec_driver_sql(sql, tuple(params[k] if k in params else defaults[k] for k in order))


@functools.lru_cache(maxsize=64)
def _compiled(dialect: Dialect, name: str) -> tuple[str, tuple[str, ...], dict[str, Any]]:
    kind, _, arg = name.partition("/")
    compiled = _BUILDERS[kind](dialect, arg).compile(dialect=dialect)
    return str(compiled), tuple(compiled.positiontup or ()), dict(compiled.params)


def _mark(dialect: Dialect, arg: str, *, lock: bool = False) -> Any:
    m = t.usage_rollup_marks.c
    q = select(m.last_id).where(m.host_id == bindparam("host_id"))
    return q.with_for_update() if lock else q  # FOR UPDATE renders as nothing on SQLite


def _bounds(dialect: Dialect, arg: str) -> Any:
    s = t.usage_samples.c
    # MIN/MAX over the (host_id, id) index: two index dives, however many rows the host has
    return select(func.min(s.id), func.max(s.id)).where(s.host_id == bindparam("host_id"), s.id > bindparam("low"))


def _newest(dialect: Dialect, arg: str) -> Any:
    s = t.usage_samples.c
    return select(func.max(s.id)).where(s.host_id == bindparam("host_id"))


def _host_range(q: Any) -> Any:
    """``q`` restricted to the host's rows ``low < id <= high``, read through the (host_id, id) index."""
    s = t.usage_samples.c
    q = q.where(s.host_id == bindparam("host_id"), s.id > bindparam("low"), s.id <= bindparam("high"))
    # MariaDB's optimizer sometimes takes that index as a 'ref' on host_id alone, scanning the host's whole
    # history for each step; FORCE INDEX makes it the range it is.
    for name in ("mysql", "mariadb"):
        q = q.with_hint(t.usage_samples, "FORCE INDEX (ix_usage_samples_host_id_id)", name)
    return q


def _count(dialect: Dialect, arg: str) -> Any:
    return _host_range(select(func.count()).select_from(t.usage_samples))


def _fold(dialect: Dialect, arg: str) -> Any:
    """Per (GPU, bucket, lease) sums of the rows ``low < id <= high``, added into the rollups: the same figures as
    ``samples.rollup_rows`` makes in Python."""
    res = int(arg)
    s = t.usage_samples.c
    # ts_ms minus its remainder is a multiple of 1000, so a plain "/" is exact integer arithmetic on both backends
    # (no FLOOR over MySQL's DECIMAL quotient); the same buckets as ``sec - sec % res`` in rollup_rows
    bucket = (s.ts_ms - s.ts_ms % (1000 * res)).self_group().op("/", return_type=BigInteger)(1000)
    total = func.coalesce
    source = _host_range(select(
        s.host_id, s.gpu_id, literal(res, Integer), bucket, s.lease_id,
        func.count(), func.count(s.util_pct), total(func.sum(s.util_pct), 0.0), func.min(s.util_pct),
        func.max(s.util_pct), total(func.sum(case((s.util_pct < IDLE_UTIL_PCT, 1), else_=0)), 0),
        func.count(s.mem_used_bytes), total(func.sum(s.mem_used_bytes * 1.0), 0.0),  # * 1.0: no BIGINT overflow
        func.max(s.mem_used_bytes), func.count(s.work_rate), total(func.sum(s.work_rate), 0.0),
        func.count(s.vfio_irq_rate), total(func.sum(s.vfio_irq_rate), 0.0), func.min(s.ts_ms), func.max(s.ts_ms),
    )).group_by(s.host_id, s.gpu_id, bucket, s.lease_id)
    return upsert_select(dialect, t.usage_rollups, ROLLUP_COLUMNS, source, keys=ROLLUP_KEYS, add=ROLLUP_ADD,
                         least=ROLLUP_LEAST, greatest=ROLLUP_GREATEST)


def _move(dialect: Dialect, arg: str) -> Any:
    return upsert_statement(dialect, t.usage_rollup_marks, keys=["host_id"], replace=["last_id", "updated_at"],
                            values={"host_id": bindparam("host_id"), "last_id": bindparam("last_id"),
                                    "updated_at": bindparam("updated_at")})


_BUILDERS: dict[str, Callable[[Dialect, str], Any]] = {
    "mark": _mark, "mark_lock": functools.partial(_mark, lock=True), "bounds": _bounds, "newest": _newest,
    "count": _count,
    "fold": _fold, "move": _move,
}
