"""The outage spool: a local SQLite file of pending writes, replayed in order when the usage store returns."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import Column, Double, Integer, MetaData, String, Table, Text, delete, func, insert, select

from hostagent.store.engine import make_engine

_meta = MetaData()
spool_ops = Table(
    "spool_ops", _meta,
    Column("seq", Integer, primary_key=True, autoincrement=True),
    Column("op", String(32), nullable=False),
    Column("payload", Text, nullable=False),
    Column("ts", Double, nullable=False),
)
# Ops the store refused on replay (not an outage: a bad row); kept for an operator instead of blocking the queue.
dead_ops = Table(
    "dead_ops", _meta,
    Column("seq", Integer, primary_key=True),
    Column("op", String(32), nullable=False),
    Column("payload", Text, nullable=False),
    Column("ts", Double, nullable=False),
    Column("error", Text, nullable=False),
)


@dataclass(frozen=True, slots=True)
class SpooledOp:
    """One pending write."""

    seq: int
    op: str
    payload: Any
    ts: float


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
        """Move a write the store refused to the dead-letter table."""
        with self._lock, self._engine.begin() as conn:
            conn.execute(insert(dead_ops).values(seq=item.seq, op=item.op, payload=json.dumps(item.payload),
                                                 ts=item.ts, error=error[:2000]))
            n = conn.execute(delete(spool_ops).where(spool_ops.c.seq == item.seq)).rowcount
            self._depth -= n
            self._dead += 1

    def close(self) -> None:
        """Release the file."""
        self._engine.dispose()
