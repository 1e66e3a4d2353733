"""The local crash-safe lease journal: SQLite in WAL mode with synchronous=FULL, plus the boot id.

Every lease transition is written here (and fsync'd) before the step it announces runs (a step that changes
nothing outside the agent, like REQUESTED, shares the next one's transaction); the usage store gets a
mirror afterwards. On start the journal says what was intended; sysfs and libvirt say what is true.
"""

from __future__ import annotations

import base64
import collections
import contextlib
import json
import math
import sqlite3
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hostagent.domain.errors import InvalidInput
from hostagent.domain.lease import Lease, LeaseState, Step
from hostagent.store import lease_listing as listing

ENDED_PARSED_KEPT = 4096  # ended leases kept parsed for lease_page (each never changes again)
_TERMINAL_STATES = frozenset(st.value for st in LeaseState if st.terminal)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS leases (
    id TEXT PRIMARY KEY, state TEXT NOT NULL, domain_uuid TEXT NOT NULL, idem_key TEXT,
    doc TEXT NOT NULL, updated_at REAL NOT NULL, created_at REAL, ended_at REAL);
CREATE TABLE IF NOT EXISTS lease_gpus (
    gpu_id TEXT NOT NULL, lease_id TEXT NOT NULL, created_at REAL NOT NULL, reclaimed INTEGER NOT NULL,
    PRIMARY KEY(gpu_id, lease_id)) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS lease_gpus_time ON lease_gpus(gpu_id, created_at);
CREATE INDEX IF NOT EXISTS lease_gpus_lease ON lease_gpus(lease_id);
CREATE TABLE IF NOT EXISTS events (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, lease_id TEXT, gpu_id TEXT, ts REAL NOT NULL, kind TEXT NOT NULL,
    from_state TEXT, to_state TEXT, actor TEXT NOT NULL, detail TEXT, error TEXT, mirrored INTEGER NOT NULL DEFAULT 0);
CREATE INDEX IF NOT EXISTS events_lease ON events(lease_id);
CREATE INDEX IF NOT EXISTS events_mirror ON events(mirrored);
CREATE TABLE IF NOT EXISTS event_gpus (gpu_id TEXT NOT NULL, seq INTEGER NOT NULL, PRIMARY KEY(gpu_id, seq))
    WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS event_gpus_seq ON event_gpus(seq);
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


def _cursor(created_at: float, rowid: int) -> str:
    """The opaque cursor of a position in the lease order: URL-safe base64 of 'created_at:rowid', unpadded."""
    return base64.urlsafe_b64encode(f"{created_at!r}:{rowid}".encode()).decode().rstrip("=")


def _position(cursor: str) -> tuple[float, int]:
    """The position a cursor names; InvalidInput for any text `_cursor` would not have written."""
    try:
        created_at, _, rowid = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode().partition(":")
        position = (float(created_at), int(rowid))
    except ValueError:  # bad base64, bytes that are not UTF-8, or numbers that are not numbers
        position = None
    if (position is None or not math.isfinite(position[0]) or not listing.sqlite_integer(position[1])
            or _cursor(*position) != cursor):
        raise InvalidInput("cursor is not one this API issued", field="cursor")
    return position


def _lower(text: Any) -> Any:
    """SQL py_lower(): Python's lower() of text, anything else as it is."""
    return text.lower() if isinstance(text, str) else text


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
        # Ended leases never change again: a page parses each one once (listings of a long history are re-read
        # often, and parsing holds the GIL the event loop needs); the oldest parsed fall out past the bound.
        self._ended: collections.OrderedDict[str, Lease] = collections.OrderedDict()
        self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.executescript(_SCHEMA)
        # the dashboard's VM filter matches any case as Python does (SQLite's lower() folds ASCII only)
        self._db.create_function("py_lower", 1, _lower, deterministic=True)
        self._unique_idempotency_keys()
        self._indexed_history()

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

    def _indexed_history(self) -> None:
        """Lease lists and GPU history read indexed columns and tables, not every document. A journal written before
        them gets the columns (from its documents) and the GPU tables (from its leases and events) once, in one
        transaction; the indexes on the new columns come after, as they need the columns."""
        if "created_at" not in {row[1] for row in self._db.execute("PRAGMA table_info(leases)")}:
            with self._transaction():
                self._db.execute("ALTER TABLE leases ADD COLUMN created_at REAL")
                self._db.execute("ALTER TABLE leases ADD COLUMN ended_at REAL")
                self._db.execute("UPDATE leases SET created_at=json_extract(doc, '$.created_at'),"
                                 " ended_at=json_extract(doc, '$.ended_at')")
                for lease_id, doc in self._db.execute("SELECT id, doc FROM leases").fetchall():
                    d = json.loads(doc)
                    self._index_lease_gpus(lease_id, [x["gpu_id"] for x in d.get("devices", ())], d["created_at"],
                                           d.get("end_reason"))
                for seq, gpus in self._db.execute("SELECT seq, gpu_id FROM events WHERE gpu_id IS NOT NULL").fetchall():
                    self._index_event_gpus(seq, gpus)
        # creation time then rowid (an index ends with it) is the order of every lease list, alone, within a VM's
        # leases and within a state's (the index on state alone, of older journals, goes)
        self._db.execute("CREATE INDEX IF NOT EXISTS leases_created ON leases(created_at)")
        self._db.execute("CREATE INDEX IF NOT EXISTS leases_domain ON leases(domain_uuid, created_at)")
        self._db.execute("CREATE INDEX IF NOT EXISTS leases_state_created ON leases(state, created_at)")
        self._db.execute("DROP INDEX IF EXISTS leases_state")

    def _index_lease_gpus(self, lease_id: str, gpu_ids: Sequence[str], created_at: float,
                          end_reason: str | None) -> None:
        """A lease's rows of GPU history, one per GPU it names now (inside the caller's transaction). A row that
        would not change is not rewritten: a step that changes neither the lease's GPUs nor its end writes nothing
        here."""
        self._db.execute(f"DELETE FROM lease_gpus WHERE lease_id=? AND gpu_id NOT IN ({','.join('?' * len(gpu_ids))})",
                         (lease_id, *gpu_ids))
        reclaimed = int((end_reason or "").startswith("reclaim"))
        self._db.executemany(
            "INSERT INTO lease_gpus(gpu_id, lease_id, created_at, reclaimed) VALUES(?,?,?,?)"
            " ON CONFLICT(gpu_id, lease_id) DO UPDATE SET created_at=excluded.created_at, reclaimed=excluded.reclaimed"
            " WHERE created_at IS NOT excluded.created_at OR reclaimed IS NOT excluded.reclaimed",
            [(gpu_id, lease_id, created_at, reclaimed) for gpu_id in gpu_ids])

    def _index_event_gpus(self, seq: int | None, gpus: str | None) -> None:
        """One row per GPU of an event's comma-joined GPU ids (inside the caller's transaction)."""
        self._db.executemany("INSERT OR IGNORE INTO event_gpus(gpu_id, seq) VALUES(?,?)",
                             [(gpu_id, seq) for gpu_id in (gpus or "").split(",") if gpu_id])

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
            # lease step, and so more frequent checkpoints inside a step's commit). A lease's VM and creation time
            # never change: left out of the update, the indexes on them are not rewritten on every step either.
            self._db.execute(
                "INSERT INTO leases(id, state, domain_uuid, idem_key, doc, updated_at, created_at, ended_at)"
                " VALUES(?,?,?,?,?,?,?,?) ON CONFLICT(id) DO UPDATE SET state=excluded.state,"
                " idem_key=excluded.idem_key, doc=excluded.doc, updated_at=excluded.updated_at,"
                " ended_at=excluded.ended_at",
                (lease.id, lease.state.value, lease.domain_uuid, lease.request.idempotency_key,
                 json.dumps(lease.to_dict()), now, lease.created_at, lease.ended_at),
            )
            self._index_lease_gpus(lease.id, lease.gpu_ids, lease.created_at, lease.end_reason)
            self._ended.pop(lease.id, None)  # a parsed copy must never outlive a rewrite (under the lock)
            for frm, to, det, err in events:
                seq = self._db.execute(
                    "INSERT INTO events(lease_id, gpu_id, ts, kind, from_state, to_state, actor, detail, error)"
                    " VALUES(?,?,?,?,?,?,?,?,?)",
                    (lease.id, gpus, now, "transition" if frm != to else "update", frm.value if frm else None,
                     to.value, actor, det, err),
                ).lastrowid
                self._index_event_gpus(seq, gpus)

    def event(self, kind: str, *, actor: str, lease_id: str | None = None, gpu_id: str | None = None,
              detail: str | None = None, error: str | None = None) -> None:
        """Record a non-transition event (repair, strike, quarantine, probe...)."""
        with self._transaction():
            seq = self._db.execute(
                "INSERT INTO events(lease_id, gpu_id, ts, kind, actor, detail, error) VALUES(?,?,?,?,?,?,?)",
                (lease_id, gpu_id, self._clock(), kind, actor, detail, error),
            ).lastrowid
            self._index_event_gpus(seq, gpu_id)

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
               since: float | None = None, limit: int = 1000, cursor: str | None = None) -> list[Lease]:
        """Leases, newest first (ties in creation time in the order they were first journaled); with `since`, those
        created or ended at or after it and those not ended; with `cursor`, those after an earlier page's end."""
        return self.lease_page(states=states, domain_uuid=domain_uuid, since=since, limit=limit, cursor=cursor)[0]

    def lease_page(self, *, states: Iterable[LeaseState] | None = None, domain_uuid: str | None = None,
                   since: float | None = None, limit: int = 200,
                   cursor: str | None = None) -> tuple[list[Lease], str | None]:
        """One page of `leases()` and the cursor of the next page (None after the last one).

        SQL filters, orders and limits on indexed columns, so a page costs its own rows, not the journal's. The
        cursor is a position in the order (creation time, then rowid), not an offset: leases journaled while a
        caller pages neither shift nor repeat the leases that were there when it started.
        """
        sql = "SELECT doc, created_at, rowid, id, state FROM leases WHERE 1=1"
        args: list[Any] = []
        if states is not None:
            st = [s.value for s in states]
            sql += f" AND state IN ({','.join('?' * len(st))})"
            args += st
        if domain_uuid is not None:
            sql += " AND domain_uuid=?"
            args.append(domain_uuid)
        if since is not None:
            sql += " AND (created_at >= ? OR ended_at IS NULL OR ended_at >= ?)"
            args += [since, since]
        if cursor is not None:
            sql += " AND (created_at, rowid) < (?, ?)"
            args += _position(cursor)
        limit = max(limit, 0)
        sql += " ORDER BY created_at DESC, rowid DESC LIMIT ?"
        args.append(limit + 1)  # one more than asked: whether there is a next page
        with self._lock:
            rows = self._db.execute(sql, args).fetchall()
            page = rows[:limit]
            known = {lid: self._ended[lid] for _, _, _, lid, _ in page if lid in self._ended}
        following = _cursor(page[-1][1], page[-1][2]) if page and len(rows) > limit else None
        return self._parse([(doc, lid, state) for doc, _, _, lid, state in page], known), following

    def _parse(self, rows: Sequence[tuple[str, str, str]], known: dict[str, Lease]) -> list[Lease]:
        """The leases of (doc, id, state) rows: those in `known` (read from the cache under the lock that read the
        rows) as they are, the others parsed, and the ended ones among them kept parsed for the next page."""
        out = []
        parsed: list[Lease] = []
        for doc, lid, state in rows:
            lease = known.get(lid)
            if lease is None:
                lease = Lease.from_dict(json.loads(doc))
                if state in _TERMINAL_STATES:
                    parsed.append(lease)
            out.append(lease)
        if parsed:
            with self._lock:
                for lease in parsed:
                    self._ended[lease.id] = lease
                while len(self._ended) > ENDED_PARSED_KEPT:
                    self._ended.popitem(last=False)
        return out

    def _select_leases(self, sql: str, params: Any) -> list[tuple[Lease, tuple[Any, ...]]]:
        """Each lease of a statement whose first columns are doc, id, state, with the rest of its row."""
        with self._lock:
            rows = self._db.execute(sql, params).fetchall()
            known = {r[1]: self._ended[r[1]] for r in rows if r[1] in self._ended}
        return list(zip(self._parse([r[:3] for r in rows], known), (tuple(r[3:]) for r in rows)))

    # -- sorted listings (the dashboard's leases table and CSV; SQL in lease_listing.py) -------------------------
    def sorted_page(self, f: listing.LeaseFilter, order: listing.Order, *, limit: int,
                    after: listing.Position | None = None, before: listing.Position | None = None,
                    from_end: bool = False) -> list[tuple[Lease, listing.Position]]:
        """Up to `limit` leases of a sorted, filtered listing with their positions, in the listing's order: the
        first ones, those after `after`, those just before `before`, or the last ones (`from_end`)."""
        sql, params = listing.page_sql(f, order, limit=limit, after=after, before=before, from_end=from_end)
        rows = [(lease, listing.Position(tuple(rest[2:]), rest[0], rest[1]))
                for lease, rest in self._select_leases(sql, params)]
        return rows[::-1] if before is not None or from_end else rows

    def count_sorted(self, f: listing.LeaseFilter, order: listing.Order | None = None,
                     position: listing.Position | None = None) -> tuple[int, int]:
        """How many leases a listing holds, and how many of them come before `position` in `order`."""
        sql, params = listing.count_sql(f, order, position)
        with self._lock:
            total, ahead = self._db.execute(sql, params).fetchone()
        return int(total), int(ahead)

    def lease_positions(self, f: listing.LeaseFilter) -> list[tuple[str, float, int]]:
        """(id, created_at, rowid) of every lease a listing holds, for an order computed outside the journal."""
        sql, params = listing.positions_sql(f)
        with self._lock:
            return [(lid, float(created), int(rowid)) for lid, created, rowid in self._db.execute(sql, params)]

    def leases_by_id(self, lease_ids: Sequence[str]) -> list[Lease]:
        """These leases, in the order asked (unknown ids left out)."""
        found: dict[str, Lease] = {}
        for i in range(0, len(lease_ids), 500):
            chunk = list(lease_ids[i:i + 500])
            sql = f"SELECT doc, id, state FROM leases WHERE id IN ({','.join('?' * len(chunk))})"
            found.update((x.id, x) for x, _ in self._select_leases(sql, chunk))
        return [found[lid] for lid in lease_ids if lid in found]

    def lease_labels(self) -> tuple[list[str], list[str]]:
        """Every task type and every project the journal's leases name, sorted (the filters' choices)."""
        with self._lock:
            rows = self._db.execute(listing.LABELS_SQL).fetchall()
        return (sorted({t for t, _ in rows if isinstance(t, str)}), sorted({p for _, p in rows if isinstance(p, str)}))

    def gpu_history(self, gpu_id: str) -> dict[str, Any]:
        """A GPU's lease history from its index rows: how many leases it had, the newest one's creation time and id
        (ties in the order first journaled, as in `leases()`), and how many ended by reclaim."""
        with self._lock:
            n, reclaims, last_at = self._db.execute(
                "SELECT count(*), total(reclaimed), max(created_at) FROM lease_gpus WHERE gpu_id=?", (gpu_id,)
            ).fetchone()
            last = self._db.execute(
                "SELECT g.lease_id FROM lease_gpus g JOIN leases l ON l.id=g.lease_id"
                " WHERE g.gpu_id=? AND g.created_at=? ORDER BY l.rowid DESC LIMIT 1", (gpu_id, last_at),
            ).fetchone()
        return {"leases": n, "last_lease_at": last_at, "last_lease_id": last[0] if last else None,
                "reclaims": int(reclaims)}

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
        of_leases = f"lease_id IN (SELECT id FROM leases WHERE {ended})"
        of_none = "lease_id IS NULL AND ts < ?" + (" AND mirrored = 1" if mirrored_only else "")
        with self._transaction():
            # Their events first: the condition reads only events that stay (unmirrored ones keep their lease).
            # Index rows go before what they index, whose rows still say which they are.
            self._db.execute(f"DELETE FROM event_gpus WHERE seq IN (SELECT seq FROM events WHERE {of_leases})", args)
            events = self._db.execute(f"DELETE FROM events WHERE {of_leases}", args).rowcount
            self._db.execute(f"DELETE FROM lease_gpus WHERE {of_leases}", args)
            leases = self._db.execute(f"DELETE FROM leases WHERE {ended}", args).rowcount
            self._db.execute(f"DELETE FROM event_gpus WHERE seq IN (SELECT seq FROM events WHERE {of_none})", (before,))
            events += self._db.execute(f"DELETE FROM events WHERE {of_none}", (before,)).rowcount
        return leases, events

    # -- events --------------------------------------------------------------------------------------------------
    def events(self, *, lease_id: str | None = None, gpu_id: str | None = None, kinds: Iterable[str] | None = None,
               since_seq: int = 0, before_seq: int | None = None, limit: int = 500) -> list[JournalEvent]:
        """Events, oldest first, filtered; the newest `limit` of them (before `before_seq` when given: the page
        older than one already read). A GPU's events are found through its index rows, newest first, so the limit
        ends the walk."""
        cols = "e.seq, e.lease_id, e.gpu_id, e.ts, e.kind, e.from_state, e.to_state, e.actor, e.detail, e.error"
        args: list[Any]
        if gpu_id is None:
            sql, key, args = f"SELECT {cols} FROM events e WHERE e.seq>?", "e.seq", [since_seq]
        else:
            sql = f"SELECT {cols} FROM event_gpus g JOIN events e ON e.seq=g.seq WHERE g.gpu_id=? AND g.seq>?"
            key, args = "g.seq", [gpu_id, since_seq]
        if before_seq is not None:
            sql += f" AND {key}<?"
            args.append(before_seq)
        if lease_id is not None:
            sql += " AND e.lease_id=?"
            args.append(lease_id)
        if kinds is not None:
            k = list(kinds)
            sql += f" AND e.kind IN ({','.join('?' * len(k))})"
            args += k
        sql += f" ORDER BY {key} DESC LIMIT ?"
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
