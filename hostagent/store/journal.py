"""The local crash-safe lease journal: SQLite in WAL mode with synchronous=FULL, plus the boot id.

Every lease transition is written here (and fsync'd) before the step it announces runs (a step that changes
nothing outside the agent, like REQUESTED, shares the next one's transaction); the usage store gets a
mirror afterwards. On start the journal says what was intended; sysfs and libvirt say what is true.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hostagent.domain.lease import Lease, LeaseState, Step

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS leases (
    id TEXT PRIMARY KEY, state TEXT NOT NULL, domain_uuid TEXT NOT NULL, idem_key TEXT,
    doc TEXT NOT NULL, updated_at REAL NOT NULL);
CREATE INDEX IF NOT EXISTS leases_state ON leases(state);
CREATE TABLE IF NOT EXISTS events (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, lease_id TEXT, gpu_id TEXT, ts REAL NOT NULL, kind TEXT NOT NULL,
    from_state TEXT, to_state TEXT, actor TEXT NOT NULL, detail TEXT, error TEXT, mirrored INTEGER NOT NULL DEFAULT 0);
CREATE INDEX IF NOT EXISTS events_lease ON events(lease_id);
CREATE INDEX IF NOT EXISTS events_mirror ON events(mirrored);
CREATE TABLE IF NOT EXISTS quarantine (gpu_id TEXT PRIMARY KEY, reason TEXT NOT NULL, since REAL NOT NULL);
CREATE TABLE IF NOT EXISTS tokens (
    sha256 TEXT PRIMARY KEY, role TEXT NOT NULL, domain_uuid TEXT, domain_name TEXT, created REAL NOT NULL,
    revoked REAL);
"""


@dataclass(frozen=True, slots=True)
class JournalEvent:
    """One recorded event: a transition, a repair, a strike, a quarantine."""

    seq: int
    lease_id: str | None
    gpu_id: str | None
    ts: float
    kind: str
    from_state: str | None
    to_state: str | None
    actor: str
    detail: str | None
    error: str | None

    def to_dict(self) -> dict[str, Any]:
        """JSON form."""
        return {
            "seq": self.seq, "lease_id": self.lease_id, "gpu_id": self.gpu_id, "ts": self.ts, "kind": self.kind,
            "from_state": self.from_state, "to_state": self.to_state, "actor": self.actor,
            "detail": self.detail, "error": self.error,
        }


def read_boot_id(proc_root: Path = Path("/proc")) -> str:
    """The kernel's boot id (changes on every boot); 'unknown' when unreadable."""
    try:
        return (proc_root / "sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return "unknown"


class Journal:
    """Synchronous, thread-safe journal; callers on the event loop use it through a thread."""

    def __init__(self, path: Path, *, clock: Any = time.time) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._clock = clock
        self._lock = threading.Lock()
        self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.executescript(_SCHEMA)
        self._unique_idempotency_keys()

    def _unique_idempotency_keys(self) -> None:
        """One lease per (VM, idempotency key), enforced by the journal itself. A journal written before the
        constraint may hold duplicates (concurrent requests once made several): the oldest keeps the key, the
        later ones keep everything but it, and the constraint goes on."""
        if self._db.execute("SELECT 1 FROM sqlite_master WHERE type='index' AND name='leases_idem'").fetchone():
            return
        with self._transaction():
            self._db.execute(
                "UPDATE leases SET idem_key=NULL WHERE idem_key IS NOT NULL AND rowid NOT IN ("
                " SELECT MIN(rowid) FROM leases WHERE idem_key IS NOT NULL GROUP BY domain_uuid, idem_key)")
            self._db.execute("CREATE UNIQUE INDEX leases_idem ON leases(domain_uuid, idem_key) "
                             "WHERE idem_key IS NOT NULL")

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[None]:
        """One write transaction under the journal's lock: committed (fsync'd) on success, rolled back otherwise."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    def close(self) -> None:
        """Close the database."""
        with self._lock:
            self._db.close()

    # -- boot id -------------------------------------------------------------------------------------------------
    def swap_boot_id(self, boot_id: str) -> str | None:
        """Store the current boot id and return the previous one (None on first start)."""
        with self._lock:
            row = self._db.execute("SELECT value FROM meta WHERE key='boot_id'").fetchone()
            self._db.execute("INSERT OR REPLACE INTO meta(key, value) VALUES('boot_id', ?)", (boot_id,))
            return row[0] if row else None

    # -- leases --------------------------------------------------------------------------------------------------
    def record(self, lease: Lease, *, from_state: LeaseState | None, actor: str, detail: str | None = None,
               error: str | None = None, earlier: Sequence[Step] = ()) -> None:
        """Persist the lease and its transition event in one durable transaction (one fsync).

        `earlier` are transitions the lease went through on the way to this one without being journaled on their
        own (e.g. REQUESTED on the way to BINDING): each gets its event, in order, in the same transaction.
        """
        now = self._clock()
        gpus = ",".join(lease.gpu_ids) or None
        events = [(s.from_state, s.to_state, s.detail, None) for s in earlier]
        if from_state != lease.state or detail or error:
            events.append((from_state, lease.state, detail, error))
        with self._transaction():
            # An upsert updates the row where it is; INSERT OR REPLACE deletes it and inserts a copy under a new
            # rowid, which rewrites the table's and the primary key index's pages too (about a third more WAL per
            # lease step, and so more frequent checkpoints inside a step's commit).
            self._db.execute(
                "INSERT INTO leases(id, state, domain_uuid, idem_key, doc, updated_at) VALUES(?,?,?,?,?,?)"
                " ON CONFLICT(id) DO UPDATE SET state=excluded.state, domain_uuid=excluded.domain_uuid,"
                " idem_key=excluded.idem_key, doc=excluded.doc, updated_at=excluded.updated_at",
                (lease.id, lease.state.value, lease.domain_uuid, lease.request.idempotency_key,
                 json.dumps(lease.to_dict()), now),
            )
            self._db.executemany(
                "INSERT INTO events(lease_id, gpu_id, ts, kind, from_state, to_state, actor, detail, error)"
                " VALUES(?,?,?,?,?,?,?,?,?)",
                [(lease.id, gpus, now, "transition" if frm != to else "update", frm.value if frm else None,
                  to.value, actor, det, err) for frm, to, det, err in events],
            )

    def event(self, kind: str, *, actor: str, lease_id: str | None = None, gpu_id: str | None = None,
              detail: str | None = None, error: str | None = None) -> None:
        """Record a non-transition event (repair, strike, quarantine, probe...)."""
        with self._lock:
            self._db.execute(
                "INSERT INTO events(lease_id, gpu_id, ts, kind, actor, detail, error) VALUES(?,?,?,?,?,?,?)",
                (lease_id, gpu_id, self._clock(), kind, actor, detail, error),
            )

    def get(self, lease_id: str) -> Lease | None:
        """One lease, or None."""
        with self._lock:
            row = self._db.execute("SELECT doc FROM leases WHERE id=?", (lease_id,)).fetchone()
        return Lease.from_dict(json.loads(row[0])) if row else None

    def docs(self, lease_ids: Iterable[str]) -> dict[str, dict[str, Any]]:
        """The stored documents (``Lease.to_dict()`` form) of these leases, by id; unknown ids are left out. One
        query, and no Lease objects: the mirror copies documents as they are."""
        ids = list(dict.fromkeys(lease_ids))
        out: dict[str, dict[str, Any]] = {}
        for i in range(0, len(ids), 500):  # SQLite's bound-parameter limit is far above; keep statements small
            chunk = ids[i:i + 500]
            with self._lock:
                rows = self._db.execute(f"SELECT id, doc FROM leases WHERE id IN ({','.join('?' * len(chunk))})",
                                        chunk).fetchall()
            out.update((lease_id, json.loads(doc)) for lease_id, doc in rows)
        return out

    def by_idempotency_key(self, domain_uuid: str, key: str) -> Lease | None:
        """The lease a VM made earlier with this idempotency key."""
        with self._lock:
            row = self._db.execute(
                "SELECT doc FROM leases WHERE domain_uuid=? AND idem_key=? ORDER BY updated_at DESC LIMIT 1",
                (domain_uuid, key),
            ).fetchone()
        return Lease.from_dict(json.loads(row[0])) if row else None

    def leases(self, *, states: Iterable[LeaseState] | None = None, domain_uuid: str | None = None,
               since: float | None = None, limit: int = 1000) -> list[Lease]:
        """Leases, newest first (ties in creation time in the order they were first journaled)."""
        sql = "SELECT doc, rowid FROM leases WHERE 1=1"
        args: list[Any] = []
        if states is not None:
            st = [s.value for s in states]
            sql += f" AND state IN ({','.join('?' * len(st))})"
            args += st
        if domain_uuid is not None:
            sql += " AND domain_uuid=?"
            args.append(domain_uuid)
        with self._lock:
            rows = self._db.execute(sql, args).fetchall()
        found = [(Lease.from_dict(json.loads(doc)), rowid) for doc, rowid in rows]
        if since is not None:
            found = [(x, n) for x, n in found if x.created_at >= since or (x.ended_at or 1e18) >= since]
        found.sort(key=lambda xn: (xn[0].created_at, xn[1]), reverse=True)
        return [x for x, _ in found[:limit]]

    def live_leases(self) -> list[Lease]:
        """Leases not yet in a terminal state."""
        return self.leases(states=[s for s in LeaseState if not s.terminal], limit=1_000_000)

    def prune(self, before: float, *, mirrored_only: bool) -> tuple[int, int]:
        """Forget what ended before `before`: leases in a terminal state last changed then, their events, and older
        events of no lease; returns (leases, events) deleted. Live leases and their events always stay, and with
        `mirrored_only` (a usage store is configured) nothing whose events have not reached the store yet goes.
        Deleted pages are reused, so the file stops growing once history and retention balance."""
        terminal = [s.value for s in LeaseState if s.terminal]
        ended = f"state IN ({','.join('?' * len(terminal))}) AND updated_at < ?"
        if mirrored_only:
            ended += " AND NOT EXISTS (SELECT 1 FROM events e WHERE e.lease_id = leases.id AND e.mirrored = 0)"
        args = (*terminal, before)
        with self._transaction():
            # Their events first: the condition reads only events that stay (unmirrored ones keep their lease).
            events = self._db.execute(f"DELETE FROM events WHERE lease_id IN (SELECT id FROM leases WHERE {ended})",
                                      args).rowcount
            leases = self._db.execute(f"DELETE FROM leases WHERE {ended}", args).rowcount
            events += self._db.execute(
                "DELETE FROM events WHERE lease_id IS NULL AND ts < ?" + (" AND mirrored = 1" if mirrored_only else ""),
                (before,)).rowcount
        return leases, events

    # -- events --------------------------------------------------------------------------------------------------
    def events(self, *, lease_id: str | None = None, gpu_id: str | None = None, kinds: Iterable[str] | None = None,
               since_seq: int = 0, limit: int = 500) -> list[JournalEvent]:
        """Events, oldest first, filtered."""
        sql = "SELECT seq, lease_id, gpu_id, ts, kind, from_state, to_state, actor, detail, error FROM events WHERE seq>?"
        args: list[Any] = [since_seq]
        if lease_id is not None:
            sql += " AND lease_id=?"
            args.append(lease_id)
        if gpu_id is not None:
            sql += " AND (',' || gpu_id || ',') LIKE ?"
            args.append(f"%,{gpu_id},%")
        if kinds is not None:
            k = list(kinds)
            sql += f" AND kind IN ({','.join('?' * len(k))})"
            args += k
        sql += " ORDER BY seq DESC LIMIT ?"
        args.append(limit)
        with self._lock:
            rows = self._db.execute(sql, args).fetchall()
        return [JournalEvent(*r) for r in reversed(rows)]

    def unmirrored(self, limit: int = 500) -> list[JournalEvent]:
        """Events not yet copied to the usage store, oldest first."""
        with self._lock:
            rows = self._db.execute(
                "SELECT seq, lease_id, gpu_id, ts, kind, from_state, to_state, actor, detail, error FROM events"
                " WHERE mirrored=0 ORDER BY seq LIMIT ?", (limit,),
            ).fetchall()
        return [JournalEvent(*r) for r in rows]

    def backlog(self) -> tuple[int, float | None]:
        """Events not yet copied to the usage store: how many, and the oldest one's time (None when none)."""
        with self._lock:
            n, oldest = self._db.execute("SELECT count(*), min(ts) FROM events WHERE mirrored=0").fetchone()
        return int(n), oldest

    def mark_mirrored(self, seqs: Iterable[int]) -> None:
        """Mark events as copied."""
        s = list(seqs)
        if not s:
            return
        with self._lock:
            # Bookkeeping, not a lease step: no fsync of its own (WAL, synchronous=NORMAL for this commit only);
            # the next lease step's fsync makes it durable too. A crash before that re-mirrors these events, which
            # the store takes idempotently (their uids). Lease steps stay synchronous=FULL.
            self._db.execute("PRAGMA synchronous=NORMAL")
            try:
                self._db.execute(f"UPDATE events SET mirrored=1 WHERE seq IN ({','.join('?' * len(s))})", s)
            finally:
                self._db.execute("PRAGMA synchronous=FULL")

    # -- quarantine ----------------------------------------------------------------------------------------------
    def quarantine(self, gpu_id: str, reason: str, *, actor: str) -> None:
        """Mark a GPU quarantined (excluded from placement until cleared)."""
        with self._lock:
            self._db.execute("INSERT OR REPLACE INTO quarantine(gpu_id, reason, since) VALUES(?,?,?)",
                             (gpu_id, reason, self._clock()))
        self.event("quarantine", actor=actor, gpu_id=gpu_id, detail=reason)

    def clear_quarantine(self, gpu_id: str, *, actor: str) -> bool:
        """Clear a quarantine; False when the GPU was not quarantined."""
        with self._lock:
            cur = self._db.execute("DELETE FROM quarantine WHERE gpu_id=?", (gpu_id,))
        if cur.rowcount:
            self.event("quarantine-cleared", actor=actor, gpu_id=gpu_id)
        return bool(cur.rowcount)

    def quarantined(self) -> dict[str, str]:
        """gpu_id -> reason."""
        with self._lock:
            return dict(self._db.execute("SELECT gpu_id, reason FROM quarantine").fetchall())

    # -- tokens (hashed) -----------------------------------------------------------------------------------------
    def add_token(self, sha256: str, *, role: str, domain_uuid: str | None, domain_name: str | None) -> None:
        """Store a token's hash with what it may do."""
        with self._lock:
            self._db.execute(
                "INSERT OR REPLACE INTO tokens(sha256, role, domain_uuid, domain_name, created) VALUES(?,?,?,?,?)",
                (sha256, role, domain_uuid, domain_name, self._clock()),
            )

    def lookup_token(self, sha256: str) -> tuple[str, str | None, str | None] | None:
        """(role, domain_uuid, domain_name) of a live token hash."""
        with self._lock:
            row = self._db.execute(
                "SELECT role, domain_uuid, domain_name FROM tokens WHERE sha256=? AND revoked IS NULL", (sha256,)
            ).fetchone()
        return (row[0], row[1], row[2]) if row else None

    def revoke_tokens(self, *, domain_uuid: str) -> int:
        """Revoke every token of a domain; returns how many."""
        with self._lock:
            cur = self._db.execute("UPDATE tokens SET revoked=? WHERE domain_uuid=? AND revoked IS NULL",
                                   (self._clock(), domain_uuid))
        return cur.rowcount

    def list_tokens(self) -> list[dict[str, Any]]:
        """Token records without their hashes' full text."""
        with self._lock:
            rows = self._db.execute(
                "SELECT substr(sha256,1,12), role, domain_uuid, domain_name, created, revoked FROM tokens"
            ).fetchall()
        return [dict(zip(("hash_prefix", "role", "domain_uuid", "domain_name", "created", "revoked"), r)) for r in rows]
