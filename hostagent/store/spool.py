"""The outage spool: a local SQLite file of pending writes, replayed in order when the usage store returns."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import Column, Double, Integer, MetaData, String, Table, Text, delete, func, insert, select, update

from hostagent.store.engine import make_engine

SET_ASIDE_MAX = 50_000  # writes set aside at most; past that a refused write is counted and dropped
_meta = MetaData()
spool_ops = Table(
    "spool_ops", _meta,
    Column("seq", Integer, primary_key=True, autoincrement=True),
    Column("op", String(32), nullable=False),
    Column("payload", Text, nullable=False),
    Column("ts", Double, nullable=False),
)
# Writes the store refused (not an outage: a bad row), at once or on replay; kept for an operator (`hostagent db
# rejected` / `replay`) instead of blocking everything written after them.
dead_ops = Table(
    "dead_ops", _meta,
    Column("seq", Integer, primary_key=True),
    Column("op", String(32), nullable=False),
    Column("payload", Text, nullable=False),
    Column("ts", Double, nullable=False),
    Column("error", Text, nullable=False),
)


# Which agent (host id) writes this spool: its rows are that host's, and a command that replays them must be too.
spool_meta = Table(
    "spool_meta", _meta,
    Column("key", String(32), primary_key=True),
    Column("value", Text, nullable=False),
)


@dataclass(frozen=True, slots=True)
class SpooledOp:
    """One pending write."""

    seq: int
    op: str
    payload: Any
    ts: float


@dataclass(frozen=True, slots=True)
class DeadOp:
    """One write set aside, with the store's last refusal."""

    seq: int
    op: str
    payload: Any
    ts: float
    error: str


class Spool:
    """Append-only queue of writes on local disk; thread-safe."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        self._engine = make_engine(f"sqlite:///{self.path}")
        _meta.create_all(self._engine)
        self._lock = threading.Lock()
        with self._engine.connect() as conn:
            self._depth = int(conn.execute(select(func.count()).select_from(spool_ops)).scalar_one())
            self._dead = int(conn.execute(select(func.count()).select_from(dead_ops)).scalar_one())

    def owner(self, host_id: str | None = None) -> str | None:
        """The host id whose writes this spool holds; ``host_id`` claims it when no host has yet."""
        with self._lock, self._engine.begin() as conn:
            row = conn.execute(select(spool_meta.c.value).where(spool_meta.c.key == "host_id")).first()
            if row is None and host_id is not None:
                conn.execute(insert(spool_meta).values(key="host_id", value=host_id))
                return host_id
            return row[0] if row else None

    def refresh(self) -> None:
        """Count the set-aside writes again (another process, `hostagent db replay`, may have changed them)."""
        with self._lock, self._engine.connect() as conn:
            self._dead = int(conn.execute(select(func.count()).select_from(dead_ops)).scalar_one())

    @property
    def depth(self) -> int:
        """Writes waiting for replay."""
        return self._depth

    @property
    def dead(self) -> int:
        """Writes the store refused on replay."""
        return self._dead

    def append(self, op: str, payload: Any) -> None:
        """Queue one write (durable once this returns)."""
        with self._lock, self._engine.begin() as conn:
            conn.execute(insert(spool_ops).values(op=op, payload=json.dumps(payload), ts=time.time()))
            self._depth += 1

    def peek(self, limit: int = 100) -> list[SpooledOp]:
        """The oldest pending writes, in order."""
        with self._engine.connect() as conn:
            rows = conn.execute(select(spool_ops).order_by(spool_ops.c.seq).limit(limit)).all()
        return [SpooledOp(r.seq, r.op, json.loads(r.payload), r.ts) for r in rows]

    def done(self, seq: int) -> None:
        """Remove a replayed write."""
        with self._lock, self._engine.begin() as conn:
            n = conn.execute(delete(spool_ops).where(spool_ops.c.seq == seq)).rowcount
            self._depth -= n

    def bury(self, item: SpooledOp, error: str) -> None:
        """Move a spooled write the store refused to the dead-letter table."""
        with self._lock, self._engine.begin() as conn:
            self._dead += self._insert_dead(conn, item.op, json.dumps(item.payload), item.ts, error)
            n = conn.execute(delete(spool_ops).where(spool_ops.c.seq == item.seq)).rowcount
            self._depth -= n

    def set_aside(self, op: str, payload: Any, error: str) -> bool:
        """Keep a write the store refused (not an outage: a bad row) for an operator; False when the same write is
        already set aside or the table is full (``SET_ASIDE_MAX`` writes: then it is lost, and the caller counts
        it)."""
        with self._lock, self._engine.begin() as conn:
            if self._dead >= SET_ASIDE_MAX:
                return False
            added = self._insert_dead(conn, op, json.dumps(payload), time.time(), error)
            self._dead += added
            return bool(added)

    @staticmethod
    def _insert_dead(conn: Any, op: str, payload: str, ts: float, error: str) -> int:
        # The same write refused twice (a replay that failed again, a batch split again) is kept once.
        same = conn.execute(select(dead_ops.c.seq).where(dead_ops.c.op == op, dead_ops.c.payload == payload)).first()
        if same is not None:
            conn.execute(update(dead_ops).where(dead_ops.c.seq == same.seq).values(error=error[:2000]))
            return 0
        conn.execute(insert(dead_ops).values(op=op, payload=payload, ts=ts, error=error[:2000]))
        return 1

    def dead_ops(self, limit: int | None = None) -> list[DeadOp]:
        """Writes set aside, oldest first."""
        q = select(dead_ops).order_by(dead_ops.c.seq)
        if limit is not None:
            q = q.limit(limit)
        with self._engine.connect() as conn:
            rows = conn.execute(q).all()
        return [DeadOp(r.seq, r.op, json.loads(r.payload), r.ts, r.error) for r in rows]

    def forget_dead(self, seq: int) -> bool:
        """Drop a set-aside write (stored by a replay, or discarded by an operator)."""
        with self._lock, self._engine.begin() as conn:
            n = conn.execute(delete(dead_ops).where(dead_ops.c.seq == seq)).rowcount
            self._dead -= n
            return bool(n)

    def note_dead_error(self, seq: int, error: str) -> None:
        """A set-aside write was refused again: keep the newest error."""
        with self._lock, self._engine.begin() as conn:
            conn.execute(update(dead_ops).where(dead_ops.c.seq == seq).values(error=error[:2000]))

    def close(self) -> None:
        """Release the file."""
        self._engine.dispose()
