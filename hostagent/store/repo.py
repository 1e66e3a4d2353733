"""The usage store's repository: plain dicts in and out, synchronous on an Engine, spooling writes during outages.

Callers on the event loop use :class:`hostagent.store.aio.AsyncUsageStore`, which runs these methods in threads.
Writes that describe what happened (host, GPUs, leases, events, samples, reclaims, probes) go through
:meth:`UsageStore._write`: applied at once when the database answers, else appended to the local spool and
replayed in order, idempotently, by :meth:`UsageStore.replay_spool`. Reads raise ``StoreUnavailable`` during an
outage. Tokens and model versions are not spooled: an operator action fails loudly instead.

Samples are inserted with INSERT IGNORE alone; a background thread then folds them into the rollups past a
per-host watermark (:mod:`hostagent.store.rollup`), overlapping the next insert. Methods that read rollups wait for
it first, as does an empty ``write_samples([])`` (the ingestor's flush), so reads after a write are exact.
"""

from __future__ import annotations

import collections
import csv
import hashlib
import logging
import secrets
import socket
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO, TypeVar

from sqlalchemy import Connection, Select, and_, delete, func, insert, or_, select, update
from sqlalchemy.exc import DataError, IntegrityError, SQLAlchemyError

from hostagent.domain.errors import HostAgentError, InvalidInput, NotFound, StoreUnavailable
from hostagent.domain.inventory import Gpu
from hostagent.store import schema as t
from hostagent.store.engine import HeldConnection, is_unavailable, make_engine
from hostagent.store.limits import fit_row
from hostagent.store.migrate import upgrade
from hostagent.store.rollup import pending, roll_up_step, rollup_engine
from hostagent.store.samples import MAX_SKEW_S, Sample, validate_samples
from hostagent.store.spool import SET_ASIDE_MAX, Spool
from hostagent.store.upsert import insert_ignore, upsert

log = logging.getLogger(__name__)
T = TypeVar("T")

TERMINAL_OUTCOMES = {"FAILED": "failed", "EXPIRED": "expired"}
REQUEST_FIELDS = ("gpus", "task_type", "data_scale", "precision", "min_memory_gib", "duration_s", "priority",
                  "accept_partial", "accept_deferred", "not_after", "idempotency_key", "project")
LEASE_MUTABLE = frozenset(c.name for c in t.leases.c) - {"id", "host_id", "created_at"}
GPU_COLUMNS = frozenset(c.name for c in t.gpus.c) - {"host_id", "first_seen", "last_seen"}
TOKEN_ROLES = ("guest", "operator", "reader")
ROLL_EVERY_WRITES = 8  # the roller folds at least this many sample writes at once...
ROLL_AFTER_S = 0.5  # ...or what it has after this long (rollup readers lag the raw rows by about this much)
SAMPLE_COLUMNS = ("host_id", "gpu_id", "ts_ms", "lease_id", "source", "util_pct", "mem_used_bytes", "work_rate",
                  "vfio_irq_rate")
EXPORT_KINDS = ("leases", "lease_events", "samples", "rollups_minute", "rollups_hour", "reclaim_events",
                "probe_results")


def new_uid() -> str:
    """A fresh id for an event row, made before the write so a replay writes the same row."""
    return uuid.uuid4().hex


def hash_token(token: str) -> str:
    """SHA-256 hex of a bearer token: only this is stored."""
    return hashlib.sha256(token.encode()).hexdigest()


def gpu_record(gpu: Gpu, **extra: Any) -> dict[str, Any]:
    """The store's row for a discovered GPU (identity, model, memory, topology)."""
    p = gpu.primary
    chain = p.parent_chain
    rec: dict[str, Any] = {
        "gpu_id": gpu.id, "address": str(gpu.address), "vendor": gpu.vendor, "model": gpu.model,
        "vendor_id": p.vendor_id, "device_id": p.device_id, "memory_bytes": gpu.memory_bytes,
        "iommu_group": gpu.iommu_group, "numa_node": gpu.numa_node,
        # GPUs behind one PCIe switch share its upstream port: the bridge just below the root port
        "switch_id": str(chain[-2]) if len(chain) > 1 else None,
        "root_port": str(chain[-1]) if chain else None,
        "link_speed": p.link_speed, "link_width": p.link_width,
    }
    rec.update(extra)
    return rec


def gpu_ids(value: str | Sequence[str] | None) -> list[str]:
    """The GPU ids an event names: the journal joins a multi-GPU lease's with commas; a list is taken as it is."""
    if value is None:
        return []
    parts = value.split(",") if isinstance(value, str) else list(value)
    out = [p.strip() if isinstance(p, str) else p for p in parts]
    out = [p for p in out if p != ""]
    for g in out:
        if not isinstance(g, str) or not 0 < len(g) <= t.ID:
            raise InvalidInput(f"an event's GPU id must be 1..{t.ID} characters; got {g!r:.80}", field="gpu_id")
    return sorted(set(out))


def _transient(exc: BaseException) -> bool:
    """The database could not be reached: spool and retry."""
    if isinstance(exc, SQLAlchemyError):
        return is_unavailable(exc)
    return isinstance(exc, (ConnectionError, TimeoutError))


def _refused(exc: BaseException) -> bool:
    """The store refused the write itself (a value it cannot hold, a missing reference): no retry will help."""
    return isinstance(exc, (DataError, IntegrityError, InvalidInput, NotFound))


def _error_text(exc: BaseException) -> str:
    orig = getattr(exc, "orig", None)
    text = str(orig) if orig is not None else str(exc)
    return f"{type(exc).__name__}: {text}"[:2000]


def _storable(op: str, payload: Any) -> Any:
    """A write's payload as the spool keeps it (JSON): samples as dicts."""
    return [x.to_dict() if isinstance(x, Sample) else x for x in payload] if op == "samples" else payload


def _split(op: str, payload: Any) -> list[tuple[str, Any]] | None:
    """The parts of a write, to find the rows the store refuses (None: one row, nothing to split)."""
    if op == "samples" and len(payload) > 1:
        half = len(payload) // 2
        return [("samples", payload[:half]), ("samples", payload[half:])]
    if op == "gpus" and len(payload) > 1:
        return [("gpus", [row]) for row in payload]
    if op == "mirror":
        leases, events, reclaims = payload["leases"], payload["events"], payload.get("reclaims") or []
        if reclaims:
            rest = [("mirror", {"leases": leases, "events": events})] if leases or events else []
            return rest + [("reclaim", r) for r in reclaims]
        if leases:
            return [("lease", x) for x in leases] + ([("mirror", {"leases": [], "events": events})] if events else [])
        if len(events) > 1:
            half = len(events) // 2
            return [("mirror", {"leases": [], "events": events[:half]}),
                    ("mirror", {"leases": [], "events": events[half:]})]
        return [("lease_event", events[0])] if events else None
    return None


def _as_dict(x: Any) -> dict[str, Any]:
    """A journal object's dict form (its ``to_dict()``), or a mapping as a dict."""
    return x.to_dict() if hasattr(x, "to_dict") else dict(x)


class UsageStore:
    """Repository over the usage store for one host (``host_id``), with an outage spool."""

    def __init__(self, url: str, host_id: str | None = None, *, spool_path: Path | str, auto_upgrade: bool = True,
                 hostname: str | None = None, agent_version: str | None = None, max_skew_s: float = MAX_SKEW_S,
                 connect_timeout: float = 3.0, io_timeout: float = 30.0,
                 clock: Callable[[], float] = time.time) -> None:
        self.url = url
        self.host_id = host_id or socket.gethostname()
        self.hostname = hostname or socket.gethostname()
        self.agent_version = agent_version
        self.max_skew_s = max_skew_s
        self.io_timeout = io_timeout
        self.auto_upgrade = auto_upgrade
        self.engine = make_engine(url, connect_timeout=connect_timeout, io_timeout=io_timeout)
        self.spool = Spool(spool_path)
        self.spool.owner(self.host_id)  # the first store to open a spool owns it (see replay_rejected)
        self._clock = clock
        self._wlock = threading.RLock()  # one writer at a time keeps spool order == write order
        self._down = False
        self._schema_ready = not auto_upgrade
        # Lease ids known to be in the store (so sample writes need not ask); bounded, most recently used last:
        # a long-lived agent sees an unbounded number of leases, and a forgotten id only costs one lookup.
        self._known_leases: OrderedDict[str, None] = OrderedDict()
        self._known_gpus: set[str] = set()
        # Rollups follow the sample inserts in a background thread ("the roller", on its own connection), so the
        # next batch's insert overlaps the last one's rollup. _written counts committed sample writes, _rolled how
        # many of those the rollups are known to include; readers of rollups wait for the two to meet.
        self._rlock = threading.Lock()  # one rollup step at a time: each reads the watermark, then moves it
        self._roll_cv = threading.Condition()
        self._written = 0
        self._rolled = 0
        self._settling = 0  # callers waiting in settle_rollups
        self._roller: threading.Thread | None = None
        self._closing = False
        # The writer and the roller each keep one connection: checking one out of the pool per batch costs a ping
        # and a rollback-on-return, two more round trips for every heartbeat batch.
        self._writer = HeldConnection(self.engine)
        self._roller_conn = HeldConnection(rollup_engine(self.engine))
        self.figures: dict[str, int] = {"samples_inserted": 0, "samples_duplicate": 0, "samples_rolled_up": 0,
                                        "rollup_errors": 0, "ops_spooled": 0, "ops_replayed": 0, "outages": 0,
                                        "rows_set_aside": 0, "rows_lost": 0}
        # Told of every write set aside (op, payload, rows, error), in the writer's thread: the agent journals it.
        self.on_set_aside: Callable[[str, Any, int, str], None] | None = None
        self._ensure_schema()
        self.upsert_host()
        if not self.degraded:
            self.roll_up()  # rows that a crash left between their insert and their rollup step

    # -- lifecycle -----------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the roller, dispose of the engine and the spool (spooled writes stay on disk for the next start)."""
        with self._roll_cv:
            self._closing = True
            self._roll_cv.notify_all()
        if self._roller is not None:
            self._roller.join()
        with self._wlock:
            self._writer.close()
        with self._rlock:
            self._roller_conn.close()
        self.engine.dispose()
        self.spool.close()

    @property
    def degraded(self) -> bool:
        """True while the database is unreachable or spooled writes wait for replay."""
        return self._down or self.spool.depth > 0

    @property
    def reachable(self) -> bool:
        """False after a write or read found the database unreachable, until a replay reaches it again."""
        return not self._down

    @property
    def spool_depth(self) -> int:
        """Writes waiting in the spool."""
        return self.spool.depth

    def status(self) -> dict[str, Any]:
        """Figures for /readyz and metrics."""
        return {"degraded": self.degraded, "reachable": not self._down, "spool_depth": self.spool.depth,
                "spool_dead": self.spool.dead, **self.figures}

    def _ensure_schema(self) -> None:
        if self._schema_ready:
            return
        try:
            upgrade(self.engine)
            self._schema_ready = True
        except StoreUnavailable as exc:
            if exc.__cause__ is None or not is_unavailable(exc.__cause__):
                raise
            self._mark_down(exc.__cause__)

    def _mark_down(self, exc: BaseException) -> None:
        if not self._down:
            self.figures["outages"] += 1
            log.warning("usage store unreachable, spooling writes: %s", exc)
        self._down = True

    # -- the write path ------------------------------------------------------------------------------------------
    def _write(self, op: str, payload: Any, *, set_aside: bool = False) -> Any:
        """Apply a write now, or spool it when the store is down or older writes still wait (order matters).

        A write the store refuses for a reason no retry can fix (a data error, a row the store cannot hold) raises,
        unless ``set_aside``: then its rows are tried one part at a time, every part the store takes is written,
        and each row it refuses is set aside in the spool with its error (:meth:`replay_rejected` tries them again).
        """
        with self._wlock:
            if not self.degraded:
                try:
                    with self._writer.begin() as conn:
                        return self._apply(conn, op, payload)
                except Exception as exc:
                    if _transient(exc):
                        self._mark_down(exc)
                    elif set_aside and _refused(exc):
                        self._apply_parts(op, payload, exc, in_replay=False)
                        return None
                    else:
                        raise
            self._spool(op, payload)
            return None

    def _spool(self, op: str, payload: Any) -> None:
        self.spool.append(op, _storable(op, payload))
        self.figures["ops_spooled"] += 1

    def _apply_parts(self, op: str, payload: Any, exc: BaseException, *, in_replay: bool) -> None:
        """Write what the store takes of a refused write, part by part in order; set aside the rows it refuses.

        An outage in the middle spools the parts left (live), or raises StoreUnavailable so that the spooled write
        stays where it is and is tried again whole (replay: every write is idempotent, and a row set aside twice is
        kept once)."""
        todo = collections.deque(_split(op, payload) or [])
        if not todo:
            self._set_aside(op, payload, exc)
            return
        gone = False  # an outage began during this call
        while todo:
            part_op, part = todo.popleft()
            if gone:
                self._spool(part_op, part)
                continue
            try:
                with self._writer.begin() as conn:
                    self._apply(conn, part_op, part)
            except Exception as e:
                if _transient(e):
                    self._mark_down(e)
                    if in_replay:
                        raise StoreUnavailable("the usage store went away during a replay",
                                               field="store.url") from e
                    gone = True
                    todo.appendleft((part_op, part))
                    continue
                if not _refused(e):
                    raise
                smaller = _split(part_op, part)
                if smaller:
                    todo.extendleft(reversed(smaller))
                else:
                    self._set_aside(part_op, part, e)

    def _set_aside(self, op: str, payload: Any, exc: BaseException) -> None:
        error = _error_text(exc)
        rows = len(payload) if op == "samples" else 1
        stored = _storable(op, payload)
        if self.spool.set_aside(op, stored, error):
            self.figures["rows_set_aside"] += rows
            log.error("the usage store refused a %s write (%d row(s)); set aside for `hostagent db rejected`: %s",
                      op, rows, error)
        elif self.spool.dead >= SET_ASIDE_MAX:
            self.figures["rows_lost"] += rows
            log.error("the usage store refused a %s write and %d writes are already set aside: %d row(s) lost: %s",
                      op, self.spool.dead, rows, error)
        if self.on_set_aside is not None:
            try:
                self.on_set_aside(op, stored, rows, error)
            except Exception:
                log.exception("the set-aside listener failed")

    def rejected(self, limit: int | None = None) -> list[dict[str, Any]]:
        """Writes set aside (refused by the store), oldest first, with what they hold and the store's error."""
        return [{"seq": d.seq, "op": d.op, "rows": len(d.payload) if d.op == "samples" else 1, "ts": d.ts,
                 "error": d.error, "payload": d.payload} for d in self.spool.dead_ops(limit)]

    def replay_rejected(self, seqs: Iterable[int] | None = None) -> dict[str, Any]:
        """Try the set-aside writes again (all, or those of ``seqs``), oldest first: each one the store now takes is
        written (once: every write is idempotent) and forgotten; one it refuses again keeps its place with the new
        error. StoreUnavailable when the store cannot be reached (nothing is lost)."""
        owner = self.spool.owner()
        if owner != self.host_id:
            raise InvalidInput(f"the spool {self.spool.path} holds the writes of host {owner!r}, not "
                               f"{self.host_id!r}: replay them as that host", field="host")
        wanted = None if seqs is None else set(seqs)
        items = [d for d in self.spool.dead_ops() if wanted is None or d.seq in wanted]
        stored, failed, errors = 0, 0, []
        with self._wlock:
            if self.degraded:
                raise StoreUnavailable("the usage store is unreachable or still replaying its spool; try again",
                                       field="store.url")
            for item in items:
                try:
                    with self._writer.begin() as conn:
                        self._apply(conn, item.op, self._rebuilt(item.op, item.payload))
                except Exception as exc:
                    if _transient(exc):
                        self._mark_down(exc)
                        raise StoreUnavailable("the usage store went away during the replay",
                                               field="store.url") from exc
                    if not _refused(exc):
                        raise
                    failed += 1
                    self.spool.note_dead_error(item.seq, _error_text(exc))
                    errors.append({"seq": item.seq, "op": item.op, "error": _error_text(exc)})
                    continue
                if item.op == "samples":
                    self._wrote_samples()
                self.spool.forget_dead(item.seq)
                stored += 1
        if stored:
            self.settle_rollups()
        return {"stored": stored, "failed": failed, "left": self.spool.dead, "errors": errors}

    def discard_rejected(self, seqs: Iterable[int]) -> int:
        """Forget set-aside writes an operator decided not to keep; returns how many."""
        return sum(1 for s in seqs if self.spool.forget_dead(s))

    def _rebuilt(self, op: str, payload: Any) -> Any:
        """A set-aside write as it is applied now: a lease document refused before it became a row is built again
        (a newer agent may take what an older one refused)."""
        if op == "lease_doc":
            row, devices = self._lease_row(payload)
            return {"row": row, "devices": devices}
        if op == "event_doc":
            return self._mirror_event_row(payload, "agent")
        return payload

    def _apply_lease_doc(self, conn: Connection, p: dict[str, Any]) -> None:
        self._apply_lease(conn, p)

    def _apply_event_doc(self, conn: Connection, row: dict[str, Any]) -> None:
        self._apply_lease_events(conn, [row])

    def replay_spool(self, max_ops: int = 200) -> bool:
        """Replay spooled writes in order; True when the store is reachable and the spool is empty."""
        try:
            with self.engine.connect() as conn:  # cheap probe outside the writer lock
                conn.execute(select(1))
        except SQLAlchemyError as exc:
            self._mark_down(exc)
            return False
        with self._wlock:
            try:
                if not self._schema_ready:
                    self._ensure_schema()
                    if not self._schema_ready:
                        return False
                for item in self.spool.peek(max_ops):
                    try:
                        with self._writer.begin() as conn:
                            self._apply(conn, item.op, item.payload)
                    except Exception as exc:
                        if _transient(exc):
                            self._mark_down(exc)
                            return False
                        if not _refused(exc):
                            log.error("spooled %s #%d refused by the store, moved aside: %s", item.op, item.seq, exc)
                            self.spool.bury(item, _error_text(exc))
                            continue
                        # one bad row must not take the batch's good rows with it: set aside only what is refused
                        self._apply_parts(item.op, item.payload, exc, in_replay=True)
                    self.spool.done(item.seq)
                    self.figures["ops_replayed"] += 1
            except StoreUnavailable:
                return False
            # the replayed samples, and any that an outage kept from their rollup step
            if self._roll_up_now(probe_ok=True) is None:
                return False
            if self.spool.depth == 0:
                if self._down:
                    log.warning("usage store reachable again; spool replayed")
                self._down = False
                return True
            self._down = False  # reachable; more to replay on the next call
            return False

    def _apply(self, conn: Connection, op: str, payload: Any) -> Any:
        fn = getattr(self, f"_apply_{op}")
        return fn(conn, payload)

    # -- reads ---------------------------------------------------------------------------------------------------
    def _read(self, fn: Callable[[Connection], T]) -> T:
        """Run a read; an outage becomes StoreUnavailable (and flips the store to degraded)."""
        try:
            with self.engine.connect() as conn:
                return fn(conn)
        except SQLAlchemyError as exc:
            if not is_unavailable(exc):
                raise
            self._mark_down(exc)
            raise StoreUnavailable("the usage store is unreachable; writes are spooled, reads must wait",
                                   field="store.url") from exc

    # -- hosts and GPUs ------------------------------------------------------------------------------------------
    def upsert_host(self, info: Mapping[str, Any] | None = None) -> None:
        """Record (or refresh) this host."""
        now = self._clock()
        self._write("host", fit_row(t.hosts, {
            "id": self.host_id, "hostname": self.hostname, "agent_version": self.agent_version, "first_seen": now,
            "last_seen": now, "info": dict(info) if info else None}))

    def _apply_host(self, conn: Connection, row: dict[str, Any]) -> None:
        upsert(conn, t.hosts, [row], keys=["id"], replace=["hostname", "agent_version", "last_seen", "info"])

    def upsert_gpus(self, gpus: Iterable[Mapping[str, Any] | Gpu]) -> int:
        """Record the host's GPUs (dicts with the ``gpus`` columns, or domain Gpus); returns how many."""
        now = self._clock()
        rows = []
        for i, g in enumerate(gpus):
            d = gpu_record(g) if isinstance(g, Gpu) else dict(g)
            unknown = set(d) - GPU_COLUMNS
            if unknown:
                raise InvalidInput(f"gpus[{i}].{sorted(unknown)[0]} is not a GPU field", field=f"gpus[{i}].{sorted(unknown)[0]}")
            for req in ("gpu_id", "address"):
                if not isinstance(d.get(req), str) or not d[req]:
                    raise InvalidInput(f"gpus[{i}].{req} is required", field=f"gpus[{i}].{req}")
            rows.append(fit_row(t.gpus, {c: d.get(c) for c in GPU_COLUMNS} | {"host_id": self.host_id,
                                                                                "first_seen": now, "last_seen": now}))
        self._write("gpus", rows)
        self._known_gpus.update(r["gpu_id"] for r in rows)
        return len(rows)

    def _apply_gpus(self, conn: Connection, rows: list[dict[str, Any]]) -> None:
        upsert(conn, t.gpus, rows, keys=["host_id", "gpu_id"], replace=sorted(GPU_COLUMNS - {"gpu_id"}) + ["last_seen"])

    def list_gpus(self, *, all_hosts: bool = False) -> list[dict[str, Any]]:
        """GPUs recorded for this host (or every host)."""
        q = select(t.gpus).order_by(t.gpus.c.host_id, t.gpus.c.gpu_id)
        if not all_hosts:
            q = q.where(t.gpus.c.host_id == self.host_id)
        return self._read(lambda c: [dict(r._mapping) for r in c.execute(q)])

    # -- leases --------------------------------------------------------------------------------------------------
    def insert_lease(self, lease: Mapping[str, Any]) -> str:
        """Record a lease (the journal's ``Lease.to_dict()`` form, request nested or flat); an upsert, so idempotent."""
        row, devices = self._lease_row(lease)
        self._write("lease", {"row": row, "devices": devices})
        self._remember_leases((row["id"],))
        return str(row["id"])

    def _lease_row(self, d: Mapping[str, Any]) -> tuple[dict[str, Any], list[dict[str, Any]] | None]:
        if not isinstance(d, Mapping):
            raise InvalidInput("lease must be an object", field="lease")
        req = d.get("request") if isinstance(d.get("request"), Mapping) else {k: d[k] for k in REQUEST_FIELDS if k in d}
        lease_id = d.get("id")
        if not isinstance(lease_id, str) or not lease_id or len(lease_id) > 64:
            raise InvalidInput("lease id must be a string of 1..64 characters", field="id")
        if not isinstance(d.get("domain_uuid"), str) or not d["domain_uuid"]:
            raise InvalidInput("domain_uuid is required", field="domain_uuid")
        if not isinstance(d.get("state"), str):
            raise InvalidInput("state is required", field="state")
        created = d.get("created_at")
        if isinstance(created, bool) or not isinstance(created, (int, float)):
            raise InvalidInput("created_at must be unix seconds", field="created_at")
        gpus_requested = req.get("gpus", 1)
        if isinstance(gpus_requested, bool) or not isinstance(gpus_requested, int) or gpus_requested < 1:
            raise InvalidInput("request.gpus must be a positive integer", field="request.gpus")
        state = d["state"]
        row = {
            "id": lease_id, "host_id": self.host_id, "domain_uuid": d["domain_uuid"],
            "domain_name": d.get("domain_name"), "state": state,
            "gpus_requested": gpus_requested, "task_type": req.get("task_type"), "data_scale": req.get("data_scale"),
            "precision": req.get("precision"), "min_memory_gib": req.get("min_memory_gib"),
            "duration_s": req.get("duration_s"), "priority": int(req.get("priority") or 0),
            "accept_partial": bool(req.get("accept_partial")), "accept_deferred": bool(req.get("accept_deferred")),
            "not_after": req.get("not_after"), "idempotency_key": req.get("idempotency_key"),
            "project": req.get("project"), "request": dict(req),
            "granted_gpus": int(d.get("granted_gpus") or 0), "reasons": list(d.get("reasons") or []),
            "created_at": float(created), "queued_at": d.get("queued_at"), "granted_at": d.get("granted_at"),
            "expires_at": d.get("expires_at"), "ended_at": d.get("ended_at"), "end_reason": d.get("end_reason"),
            "outcome": d.get("outcome") or outcome_of(state, d.get("end_reason")), "error": d.get("error"),
            "updated_at": self._clock(),
        }
        row = fit_row(t.leases, row)
        devices = None
        if "devices" in d:
            devices = [self._device_row(lease_id, i, dev) for i, dev in enumerate(d["devices"] or [])]
        return row, devices

    def _device_row(self, lease_id: str, i: int, dev: Any) -> dict[str, Any]:
        if isinstance(dev, str):
            dev = {"gpu_id": dev}
        if not isinstance(dev, Mapping) or not isinstance(dev.get("gpu_id"), str):
            raise InvalidInput(f"devices[{i}].gpu_id is required", field=f"devices[{i}].gpu_id")
        return fit_row(t.lease_devices, {"lease_id": lease_id, "gpu_id": dev["gpu_id"], "host_id": self.host_id,
                                         "functions": list(dev.get("functions") or []),
                                         "iommu_group": dev.get("iommu_group")})

    def _apply_lease(self, conn: Connection, p: dict[str, Any]) -> None:
        row = p["row"]
        upsert(conn, t.leases, [row], keys=["host_id", "id"], replace=sorted(LEASE_MUTABLE))
        if p["devices"] is not None:
            self._replace_devices(conn, row["id"], p["devices"])

    def _replace_devices(self, conn: Connection, lease_id: str, devices: list[dict[str, Any]]) -> None:
        d = t.lease_devices.c
        conn.execute(delete(t.lease_devices).where(d.host_id == self.host_id, d.lease_id == lease_id))
        if devices:
            conn.execute(insert(t.lease_devices), devices)

    def update_lease(self, lease_id: str, changes: Mapping[str, Any]) -> None:
        """Change some columns of a lease (state, ended_at, outcome, devices...); NotFound for an unknown lease."""
        self._require_leases([lease_id], field="lease_id")
        values: dict[str, Any] = {}
        devices = None
        for k, v in changes.items():
            if k == "devices":
                devices = [self._device_row(lease_id, i, d) for i, d in enumerate(v or [])]
            elif k == "request" and isinstance(v, Mapping):
                values["request"] = dict(v)
            elif k in LEASE_MUTABLE:
                values[k] = list(v) if k == "reasons" else v
            elif k in ("id", "host_id", "domain_uuid", "created_at"):
                continue  # identity: fixed at insert (callers may pass a whole lease dict)
            else:
                raise InvalidInput(f"{k} is not a lease field that can change", field=k)
        if "state" in values and "outcome" not in values:
            derived = outcome_of(values["state"], values.get("end_reason"))
            if derived:
                values["outcome"] = derived
        values["updated_at"] = self._clock()
        self._write("lease_update", {"id": lease_id, "values": values, "devices": devices})

    def _apply_lease_update(self, conn: Connection, p: dict[str, Any]) -> None:
        conn.execute(update(t.leases).where(t.leases.c.host_id == self.host_id, t.leases.c.id == p["id"])
                     .values(**p["values"]))
        if p["devices"] is not None:
            self._replace_devices(conn, p["id"], p["devices"])

    def record_lease(self, lease: Any, event: Any | None = None, *, actor: str = "agent") -> None:
        """Mirror a journal lease (anything with ``to_dict()``) and, optionally, its transition event."""
        d = _as_dict(lease)
        events = []
        if event is not None:
            e = _as_dict(event)
            events.append({**e, "lease_id": e.get("lease_id") or d["id"]})
        self.mirror([d], events, actor=actor)

    def mirror(self, leases: Sequence[Any], events: Sequence[Any], *, actor: str = "agent",
               reclaims: Sequence[Mapping[str, Any]] = (), set_aside: bool = False) -> None:
        """Mirror journal leases (each written once, as it is now) and then their events, all events in one write.

        The journal's sequence number in each event's uid makes this idempotent across agent restarts too. One
        store transaction for the whole call (one spooled write while the store is down). With ``set_aside`` (the
        agent's mirror), a lease or event the store refuses is set aside with its error and everything else is
        written: one bad row never holds up the rows after it."""
        lease_ops = []
        for lease in leases:
            doc = _as_dict(lease)
            try:
                row, devices = self._lease_row(doc)
            except InvalidInput as exc:
                if not set_aside:
                    raise
                self._set_aside("lease_doc", doc, exc)
                continue
            lease_ops.append({"row": row, "devices": devices})
        mirrored = {op["row"]["id"] for op in lease_ops}
        rows = []
        for event in events:
            e = _as_dict(event)
            try:
                rows.append(self._mirror_event_row(e, actor))
            except InvalidInput as exc:
                if not set_aside:
                    raise
                self._set_aside("event_doc", {**e, "actor": e.get("actor") or actor}, exc)
        reclaim_rows = [self._reclaim_row(**r) for r in reclaims]
        others = sorted({r["lease_id"] for r in rows + reclaim_rows if r["lease_id"] and r["lease_id"] not in mirrored})
        if others and not set_aside:  # no foreign keys on events: a set-aside lease's events still go in
            self._require_leases(others, field="lease_id")
        if lease_ops or rows or reclaim_rows:
            payload: dict[str, Any] = {"leases": lease_ops, "events": rows}
            if reclaim_rows:
                payload["reclaims"] = reclaim_rows
            self._write("mirror", payload, set_aside=set_aside)
            self._remember_leases(sorted(mirrored))

    def _mirror_event_row(self, e: Mapping[str, Any], actor: str) -> dict[str, Any]:
        seq = e.get("seq")
        return self._event_row(
            e["lease_id"], kind=e.get("kind") or "transition", from_state=e.get("from_state"),
            to_state=e.get("to_state"), actor=e.get("actor") or actor, ts=e.get("ts"), error=e.get("error"),
            detail=e.get("detail"), gpu_id=e.get("gpu_ids", e.get("gpu_id")),
            uid=hashlib.sha256(f"{self.host_id}/{e['lease_id']}/{seq}".encode()).hexdigest()[:32] if seq else None,
        )

    def _apply_mirror(self, conn: Connection, p: dict[str, Any]) -> None:
        for op in p["leases"]:
            self._apply_lease(conn, op)
        self._apply_lease_events(conn, p["events"])
        if p.get("reclaims"):
            self._upsert_events(conn, t.reclaim_events, p["reclaims"])

    def get_lease(self, lease_id: str) -> dict[str, Any]:
        """One lease with its devices and events; NotFound when unknown."""
        def q(c: Connection) -> dict[str, Any]:
            r = c.execute(select(t.leases).where(t.leases.c.host_id == self.host_id,
                                                 t.leases.c.id == lease_id)).first()
            if r is None:
                raise NotFound(f"no lease {lease_id}", field="lease_id")
            lease = dict(r._mapping)
            lease["devices"] = self._devices(c, [(self.host_id, lease_id)]).get((self.host_id, lease_id), [])
            ev = t.lease_events.c
            lease["events"] = self._with_gpu_ids(c, [dict(e._mapping) for e in c.execute(
                select(t.lease_events).where(ev.host_id == self.host_id, ev.lease_id == lease_id)
                .order_by(t.lease_events.c.ts, t.lease_events.c.id))])
            return lease
        return self._read(q)

    def list_leases(self, *, state: str | Iterable[str] | None = None, since: float | None = None,
                    domain_uuid: str | None = None, limit: int = 100, all_hosts: bool = False) -> list[dict[str, Any]]:
        """Leases, newest first; ``since`` keeps those still running or ended after it."""
        q = select(t.leases).order_by(t.leases.c.created_at.desc(), t.leases.c.id).limit(max(1, min(limit, 10_000)))
        if not all_hosts:
            q = q.where(t.leases.c.host_id == self.host_id)
        if state is not None:
            q = q.where(t.leases.c.state.in_([state] if isinstance(state, str) else list(state)))
        if since is not None:
            q = q.where(or_(t.leases.c.ended_at.is_(None), t.leases.c.ended_at >= since))
        if domain_uuid is not None:
            q = q.where(t.leases.c.domain_uuid == domain_uuid)

        def run(c: Connection) -> list[dict[str, Any]]:
            out = [dict(r._mapping) for r in c.execute(q)]
            devs = self._devices(c, [(x["host_id"], x["id"]) for x in out])
            for x in out:
                x["devices"] = devs.get((x["host_id"], x["id"]), [])
            return out
        return self._read(run)

    def _devices(self, c: Connection, keys: Sequence[tuple[str, str]]) -> dict[tuple[str, str], list[dict[str, Any]]]:
        """Devices of the (host_id, lease_id) pairs, in chunks so IN lists stay short."""
        d = t.lease_devices.c
        out: dict[tuple[str, str], list[dict[str, Any]]] = {}
        wanted = set(keys)
        ids = sorted({k[1] for k in keys})
        for i in range(0, len(ids), 500):
            for r in c.execute(select(t.lease_devices).where(d.lease_id.in_(ids[i:i + 500])).order_by(d.gpu_id)):
                if (r.host_id, r.lease_id) in wanted:
                    out.setdefault((r.host_id, r.lease_id), []).append(dict(r._mapping))
        return out

    KNOWN_LEASES_MAX = 4096

    def _remember_leases(self, ids: Iterable[str]) -> None:
        for x in ids:
            self._known_leases[x] = None
            self._known_leases.move_to_end(x)
        while len(self._known_leases) > self.KNOWN_LEASES_MAX:
            self._known_leases.popitem(last=False)

    def _require_leases(self, ids: Iterable[str], *, field: str) -> None:
        ids = [x for x in ids if x]
        missing = {x for x in ids if x not in self._known_leases}
        self._remember_leases(x for x in ids if x not in missing)  # still in use: keep them
        if not missing:
            return
        if self.degraded:
            # Cannot ask the store; the spool replays in order, so a lease written before the outage is there.
            return
        found = self._read(lambda c: {r[0] for r in c.execute(
            select(t.leases.c.id).where(t.leases.c.id.in_(sorted(missing)), t.leases.c.host_id == self.host_id))})
        self._remember_leases(sorted(found))
        if missing - found:
            raise NotFound(f"unknown lease {sorted(missing - found)[0]}", field=field)

    def _require_gpus(self, ids: Iterable[str], *, field: str) -> None:
        missing = {x for x in ids if x not in self._known_gpus}
        if not missing or self.degraded:
            return
        found = self._read(lambda c: {r[0] for r in c.execute(
            select(t.gpus.c.gpu_id).where(t.gpus.c.gpu_id.in_(sorted(missing)), t.gpus.c.host_id == self.host_id))})
        self._known_gpus.update(found)
        if missing - found:
            raise NotFound(f"unknown GPU {sorted(missing - found)[0]}", field=field)

    # -- events --------------------------------------------------------------------------------------------------
    def add_lease_event(self, lease_id: str | None, *, actor: str, kind: str = "transition",
                        from_state: str | None = None, to_state: str | None = None, ts: float | None = None,
                        error: str | None = None, detail: str | None = None,
                        gpu_id: str | Sequence[str] | None = None, uid: str | None = None) -> str:
        """Record a lease state transition (or other lease event); returns its uid. ``gpu_id`` names the GPUs
        the event concerns: one id, a list, or the journal's comma-joined ids."""
        if lease_id:
            self._require_leases([lease_id], field="lease_id")
        row = self._event_row(lease_id, actor=actor, kind=kind, from_state=from_state, to_state=to_state, ts=ts,
                              error=error, detail=detail, gpu_id=gpu_id, uid=uid)
        self._write("lease_event", row)
        return str(row["uid"])

    def _event_row(self, lease_id: str | None, *, actor: str, kind: str, from_state: str | None,
                   to_state: str | None, ts: float | None, error: str | None, detail: str | None,
                   gpu_id: str | Sequence[str] | None, uid: str | None) -> dict[str, Any]:
        if not actor:
            raise InvalidInput("actor is required", field="actor")
        row = fit_row(t.lease_events, {
            "uid": uid or new_uid(), "host_id": self.host_id, "lease_id": lease_id or None,
            "ts": self._clock() if ts is None else float(ts), "kind": kind, "from_state": from_state,
            "to_state": to_state, "actor": actor, "detail": detail, "error": error})
        return row | {"gpu_ids": gpu_ids(gpu_id)}

    def _apply_lease_event(self, conn: Connection, row: dict[str, Any]) -> None:
        self._apply_lease_events(conn, [row])

    def _apply_lease_events(self, conn: Connection, rows: list[dict[str, Any]]) -> None:
        self._upsert_events(conn, t.lease_events, rows)

    def _upsert_events(self, conn: Connection, table: Any, rows: list[dict[str, Any]]) -> None:
        """Event rows (each with its ``gpu_ids``) and their event_gpus rows; a replayed event is written once."""
        upsert(conn, table, [{k: v for k, v in r.items() if k not in ("gpu_ids", "gpu_id")} for r in rows],
               keys=["uid"])
        links = [{"uid": r["uid"], "gpu_id": g, "host_id": r["host_id"]}
                 for r in rows for g in (r["gpu_ids"] if "gpu_ids" in r else gpu_ids(r.get("gpu_id")))]
        upsert(conn, t.event_gpus, links, keys=["uid", "gpu_id"])

    def _with_gpu_ids(self, c: Connection, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Rows of lease_events or reclaim_events, each with the ``gpu_ids`` (sorted) of its event."""
        uids = [r["uid"] for r in rows]
        found: dict[str, list[str]] = {}
        e = t.event_gpus.c
        for i in range(0, len(uids), 500):
            for uid, gpu in c.execute(select(e.uid, e.gpu_id).where(e.uid.in_(uids[i:i + 500]))
                                      .order_by(e.uid, e.gpu_id)):
                found.setdefault(uid, []).append(gpu)
        return [r | {"gpu_ids": found.get(r["uid"], [])} for r in rows]

    def add_reclaim_event(self, *, action: str, lease_id: str | None = None,
                          gpu_id: str | Sequence[str] | None = None,
                          reason: str | None = None, details: Mapping[str, Any] | None = None,
                          ts: float | None = None, uid: str | None = None) -> str:
        """Record a reaper step (strike, clear, notice, detach, rebind); returns its uid."""
        if not action:
            raise InvalidInput("action is required", field="action")
        if lease_id:
            self._require_leases([lease_id], field="lease_id")
        row = self._reclaim_row(action=action, lease_id=lease_id, gpu_id=gpu_id, reason=reason, details=details,
                                ts=ts, uid=uid)
        self._write("reclaim", row)
        return str(row["uid"])

    def _reclaim_row(self, *, action: str, lease_id: str | None = None, gpu_id: str | Sequence[str] | None = None,
                     reason: str | None = None, details: Mapping[str, Any] | None = None, ts: float | None = None,
                     uid: str | None = None) -> dict[str, Any]:
        return fit_row(t.reclaim_events, {
            "uid": uid or new_uid(), "host_id": self.host_id, "lease_id": lease_id or None,
            "ts": self._clock() if ts is None else float(ts), "action": action, "reason": reason,
            "details": dict(details) if details else None}) | {"gpu_ids": gpu_ids(gpu_id)}

    def _apply_reclaim(self, conn: Connection, row: dict[str, Any]) -> None:
        self._upsert_events(conn, t.reclaim_events, [row])

    def list_reclaim_events(self, *, lease_id: str | None = None, since: float | None = None,
                            limit: int = 500) -> list[dict[str, Any]]:
        """Reaper steps of this host, oldest first."""
        q = select(t.reclaim_events).where(t.reclaim_events.c.host_id == self.host_id)
        if lease_id:
            q = q.where(t.reclaim_events.c.lease_id == lease_id)
        if since is not None:
            q = q.where(t.reclaim_events.c.ts >= since)
        q = q.order_by(t.reclaim_events.c.ts, t.reclaim_events.c.id).limit(limit)
        return self._read(lambda c: self._with_gpu_ids(c, [dict(r._mapping) for r in c.execute(q)]))

    def add_probe_result(self, gpu_id: str, *, score: float | None, spread: float | None = None, ok: bool = True,
                         details: Mapping[str, Any] | None = None, ts: float | None = None,
                         uid: str | None = None) -> str:
        """Record a GPU health probe's result; returns its uid."""
        self._require_gpus([gpu_id], field="gpu_id")
        row = fit_row(t.probe_results, {
            "uid": uid or new_uid(), "host_id": self.host_id, "gpu_id": gpu_id,
            "ts": self._clock() if ts is None else float(ts), "score": score, "spread": spread, "ok": bool(ok),
            "details": dict(details) if details else None})
        self._write("probe", row)
        return str(row["uid"])

    def _apply_probe(self, conn: Connection, row: dict[str, Any]) -> None:
        upsert(conn, t.probe_results, [row], keys=["uid"])

    def list_probe_results(self, *, gpu_id: str | None = None, since: float | None = None,
                           limit: int = 100) -> list[dict[str, Any]]:
        """Probe results of this host, newest first."""
        q = select(t.probe_results).where(t.probe_results.c.host_id == self.host_id)
        if gpu_id:
            q = q.where(t.probe_results.c.gpu_id == gpu_id)
        if since is not None:
            q = q.where(t.probe_results.c.ts >= since)
        q = q.order_by(t.probe_results.c.ts.desc(), t.probe_results.c.id.desc()).limit(limit)
        return self._read(lambda c: [dict(r._mapping) for r in c.execute(q)])

    # -- samples -------------------------------------------------------------------------------------------------
    def add_samples(self, samples: Iterable[Mapping[str, Any] | Sample], *, now: float | None = None,
                    check_refs: bool = True) -> int:
        """Validate a whole batch, then write it (or spool it) in one transaction; returns how many were accepted.

        Out-of-range values or timestamps too far in the future raise InvalidInput; an unknown lease or GPU raises
        NotFound; in both cases nothing is written. A sample already stored (a replay) is skipped. The rollups
        include the batch when this returns (unless the store is unreachable: then the replay rolls it up).
        """
        batch = validate_samples(samples, now=self._clock() if now is None else now, max_skew_s=self.max_skew_s)
        n = self.write_samples(batch, check_refs=check_refs)
        if n:
            self.settle_rollups()
        return n

    def write_samples(self, batch: Sequence[Sample], *, check_refs: bool = True, set_aside: bool = False) -> int:
        """Write Samples that ``validate_samples`` already produced (the ingestor's path); see add_samples.

        The rollups of the batch are made in the background, overlapping the next write. An empty batch is the
        ingestor's flush marker: it waits until the rollups include every sample written before it. With
        ``set_aside`` (the agent's flusher), samples the store refuses (an unknown lease or GPU, a row it cannot
        hold) are set aside with the error instead of failing the batch; the count returned includes them.
        """
        if not batch:
            self.settle_rollups()
            return 0
        if check_refs and set_aside:
            unknown = self._unknown_refs(batch)
            if unknown:
                batch = [s for s in batch if s not in unknown]
                bad = next(iter(unknown.values()))
                self._set_aside("samples", list(unknown), NotFound(bad, field="samples.lease_id"))
                if not batch:
                    return len(unknown)
            n_aside = len(unknown)
        else:
            n_aside = 0
            if check_refs:
                self._require_gpus({s.gpu_id for s in batch}, field="samples.gpu_id")
                self._require_leases({s.lease_id for s in batch}, field="samples.lease_id")
        with self._wlock:
            self._write("samples", batch if isinstance(batch, list) else list(batch), set_aside=set_aside)
            applied = not self.degraded  # else it went to the spool, and the replay rolls it up
        if applied:
            self._wrote_samples()
        return len(batch) + n_aside

    def _unknown_refs(self, batch: Sequence[Sample]) -> dict[Sample, str]:
        """The samples of a batch whose GPU or lease the store does not know, each with why."""
        out: dict[Sample, str] = {}
        for ids, require, what in (({s.gpu_id for s in batch}, self._require_gpus, "gpu_id"),
                                   ({s.lease_id for s in batch}, self._require_leases, "lease_id")):
            missing = set()
            for x in sorted(ids):
                try:
                    require([x], field=f"samples.{what}")
                except NotFound:
                    missing.add(x)
            if missing:
                for s in batch:
                    if getattr(s, what) in missing and s not in out:
                        out[s] = f"unknown {what.split('_')[0].replace('gpu', 'GPU')} {getattr(s, what)}"
        return out

    def _apply_samples(self, conn: Connection, rows: list[dict[str, Any]] | list[Sample]) -> int:
        # INSERT IGNORE: a sample already stored (a replay, a retried heartbeat) is skipped by its unique key, and
        # since only inserted rows get an id past the watermark, the rollup step never counts it twice.
        host = self.host_id
        values = [(host, s.gpu_id, s.ts_ms, s.lease_id, s.source, s.util_pct, s.mem_used_bytes, s.work_rate,
                   s.vfio_irq_rate) for s in (r if isinstance(r, Sample) else Sample(**r) for r in rows)]
        inserted = insert_ignore(conn, t.usage_samples, SAMPLE_COLUMNS, values)
        self.figures["samples_duplicate"] += len(values) - inserted
        self.figures["samples_inserted"] += inserted
        return inserted

    # -- rollups -------------------------------------------------------------------------------------------------
    def roll_up(self) -> int:
        """Fold every stored sample of this host not yet in the rollups into them, now; returns how many."""
        return self._roll_up_now() or 0

    def settle_rollups(self, timeout: float | None = None) -> bool:
        """Wait until the rollups include every sample written so far; False when an outage (or ``timeout``,
        by default the store's I/O timeout) came first."""
        with self._roll_cv:
            target = self._written
            self._settling += 1
            self._roll_cv.notify_all()  # the roller goes at once instead of waiting for more batches
            try:
                self._roll_cv.wait_for(lambda: self._rolled >= target or self._down or self._closing,
                                       self.io_timeout if timeout is None else timeout)
            finally:
                self._settling -= 1
            return self._rolled >= target

    def _wrote_samples(self) -> None:
        """Count a committed sample write and wake the roller (started on the first one)."""
        with self._roll_cv:
            self._written += 1
            if self._roller is None and not self._closing:
                self._roller = threading.Thread(target=self._roll_forever, name="usage-rollup", daemon=True)
                self._roller.start()
            self._roll_cv.notify_all()

    def _roll_forever(self) -> None:
        while True:
            with self._roll_cv:
                # Idle while caught up, and during an outage (the replay that ends it rolls up itself). Under load,
                # let a few batches gather first: one step over many rows costs the server much less per row than
                # a step per batch. A reader waiting for the rollups (settle_rollups) cuts the wait short.
                self._roll_cv.wait_for(lambda: self._closing or (self._rolled < self._written and not self._down))
                self._roll_cv.wait_for(lambda: self._closing or self._settling > 0 or self._down
                                       or self._written - self._rolled >= ROLL_EVERY_WRITES, ROLL_AFTER_S)
                if self._closing:
                    return
            self._roll_up_now()

    def _roll_up_now(self, *, probe_ok: bool = False) -> int | None:
        """Run rollup steps until none is pending; None when an outage stopped them (the store is marked down)."""
        if self._down and not probe_ok:
            return None
        with self._roll_cv:
            target = self._written  # every write counted here is committed, so the steps below will see it
        with self._rlock:
            total = self._roll_up_steps()
        if total is not None:
            with self._roll_cv:
                self._rolled = max(self._rolled, target)
                self._roll_cv.notify_all()
        return total

    def _roll_up_steps(self) -> int | None:
        total = 0
        try:
            while True:
                with self._roller_conn.begin() as conn:
                    n, more = roll_up_step(conn, self.host_id, now=self._clock())
                total += n
                self.figures["samples_rolled_up"] += n
                if not more:
                    return total
        except SQLAlchemyError as exc:
            if is_unavailable(exc):
                self._mark_down(exc)
                self._wake_waiters()
                return None
            log.error("rolling up usage samples failed; rollups lag until the next step: %s", exc)
        except (ConnectionError, TimeoutError) as exc:
            self._mark_down(exc)
            self._wake_waiters()
            return None
        except Exception:  # a bug must not stop the roller for good, nor hang the readers waiting on it
            log.exception("rolling up usage samples failed; rollups lag until the next step")
        # the raw rows are safe and the watermark did not move: the next step tries them again
        self.figures["rollup_errors"] += 1
        return total

    def _wake_waiters(self) -> None:
        with self._roll_cv:
            self._roll_cv.notify_all()

    def rollup_pending(self) -> int:
        """Stored samples of this host not yet counted in the rollups."""
        return self._read(lambda c: pending(c, self.host_id))

    def lease_usage_summary(self, lease_id: str) -> dict[str, Any]:
        """Usage of a lease so far, per GPU and in total, from the hourly rollups (no raw scan)."""
        self.settle_rollups()
        r = t.usage_rollups.c

        def q(c: Connection) -> dict[str, Any]:
            if c.execute(select(t.leases.c.id).where(t.leases.c.host_id == self.host_id,
                                                     t.leases.c.id == lease_id)).first() is None:
                raise NotFound(f"no lease {lease_id}", field="lease_id")
            mine = (r.host_id == self.host_id, r.lease_id == lease_id, r.resolution == t.RES_HOUR)
            rows = c.execute(_agg(select(r.gpu_id)).where(*mine).group_by(r.gpu_id).order_by(r.gpu_id)).all()
            per_gpu = {row.gpu_id: _summary(row) for row in rows}
            total = c.execute(_agg(select()).where(*mine)).first()
            return {"lease_id": lease_id, "gpus": per_gpu, "total": _summary(total)}
        return self._read(q)

    def gpu_history(self, gpu_id: str, since: float, until: float | None = None,
                    resolution: int | str = "auto", *, host_id: str | None = None) -> list[dict[str, Any]]:
        """Time series of one GPU: raw samples, or rollup buckets of ``resolution`` seconds (60, 3600, or a
        multiple of 3600); 'auto' picks by span so a dashboard never scans months of raw rows."""
        until = self._clock() if until is None else until
        host = host_id or self.host_id
        res = _resolution(resolution, until - since)
        if res == 0:
            s = t.usage_samples.c
            q = (select(s.ts_ms, s.lease_id, s.source, s.util_pct, s.mem_used_bytes, s.work_rate, s.vfio_irq_rate)
                 .where(s.host_id == host, s.gpu_id == gpu_id, s.ts_ms >= int(since * 1000),
                        s.ts_ms < int(until * 1000)).order_by(s.ts_ms).limit(100_000))
            return self._read(lambda c: [
                {"ts": row.ts_ms / 1000.0, "n": 1, "lease_id": row.lease_id, "source": row.source,
                 "util_mean": row.util_pct, "util_min": row.util_pct, "util_max": row.util_pct,
                 "mem_mean": row.mem_used_bytes, "mem_max": row.mem_used_bytes, "work_rate": row.work_rate,
                 "vfio_irq_rate": row.vfio_irq_rate} for row in c.execute(q)])
        self.settle_rollups()
        base = t.RES_MINUTE if res < t.RES_HOUR else t.RES_HOUR
        r = t.usage_rollups.c
        bucket = (r.bucket - r.bucket % res).label("b") if res != base else r.bucket.label("b")
        lo = int(since) - int(since) % base
        q = (_agg(select(bucket)).where(r.host_id == host, r.gpu_id == gpu_id, r.resolution == base,
                                        r.bucket >= lo, r.bucket < until)
             .group_by(bucket).order_by(bucket))

        def run(c: Connection) -> list[dict[str, Any]]:
            out = []
            for row in c.execute(q):
                d = _summary(row)
                d["ts"] = float(row.b)
                d["work_rate"] = d.pop("work_mean")
                d["vfio_irq_rate"] = d.pop("irq_mean")
                out.append(d)
            return out
        return self._read(run)

    def prune(self, raw_older_than_s: float, minute_older_than_s: float, *, now: float | None = None,
              chunk_s: int = 6 * 3600) -> dict[str, int]:
        """Delete raw samples and minute rollups past their retention (hourly rollups stay); returns counts."""
        now = self._clock() if now is None else now
        self.settle_rollups()  # a raw row must be in the rollups before it may go
        raw_cut = int((now - raw_older_than_s) * 1000)
        minute_cut = int(now - minute_older_than_s)
        s = t.usage_samples.c
        r = t.usage_rollups.c
        counts = {"samples": 0, "minute_rollups": 0}

        def run(c: Connection) -> None:
            oldest = c.execute(select(func.min(s.ts_ms)).where(s.host_id == self.host_id)).scalar()
            c.commit()
            # Small windows keep each DELETE's transaction (and MySQL's undo log) short.
            step = chunk_s * 1000
            start = oldest if oldest is not None else raw_cut
            while start < raw_cut:
                end = min(start + step, raw_cut)
                counts["samples"] += c.execute(delete(t.usage_samples).where(
                    s.host_id == self.host_id, s.ts_ms < end)).rowcount
                c.commit()
                start = end
            counts["minute_rollups"] += c.execute(delete(t.usage_rollups).where(
                r.host_id == self.host_id, r.resolution == t.RES_MINUTE, r.bucket < minute_cut)).rowcount
            c.commit()
        with self._wlock:
            self._read(run)
        return counts

    # -- training and export -------------------------------------------------------------------------------------
    def training_records(self, *, since: float | None = None, until: float | None = None, finished_only: bool = True,
                         all_hosts: bool = True) -> list[dict[str, Any]]:
        """One record per lease: the request, what was granted, the devices' models and the usage it made."""
        self.settle_rollups()
        r = t.usage_rollups.c
        usage = (_agg(select(r.host_id, r.lease_id)).where(r.resolution == t.RES_HOUR, r.lease_id != "")
                 .group_by(r.host_id, r.lease_id).subquery("u"))
        L = t.leases.c
        q = select(t.leases, *[usage.c[k] for k in usage.c.keys() if k not in ("host_id", "lease_id")]).select_from(
            t.leases.outerjoin(usage, and_(usage.c.host_id == L.host_id, usage.c.lease_id == L.id))
        ).order_by(L.created_at, L.host_id, L.id)
        if not all_hosts:
            q = q.where(L.host_id == self.host_id)
        if since is not None:
            q = q.where(L.created_at >= since)
        if until is not None:
            q = q.where(L.created_at < until)
        if finished_only:
            q = q.where(L.ended_at.is_not(None))

        def run(c: Connection) -> list[dict[str, Any]]:
            rows = c.execute(q).all()
            devs = self._devices(c, [(row.host_id, row.id) for row in rows])
            models = {(g.host_id, g.gpu_id): g for g in c.execute(
                select(t.gpus.c.host_id, t.gpus.c.gpu_id, t.gpus.c.model, t.gpus.c.memory_bytes, t.gpus.c.numa_node))}
            out = []
            for row in rows:
                m = row._mapping
                rec = {k: m[k] for k in t.leases.c.keys()}
                rec["usage"] = _summary(row)
                held = (m["ended_at"] or 0) - (m["granted_at"] or m["ended_at"] or 0)
                rec["held_s"] = max(0.0, held) if m["granted_at"] else 0.0
                rec["devices"] = []
                for d in devs.get((row.host_id, row.id), []):
                    g = models.get((d["host_id"], d["gpu_id"]))
                    rec["devices"].append({"gpu_id": d["gpu_id"], "model": g.model if g else None,
                                           "memory_bytes": g.memory_bytes if g else None,
                                           "numa_node": g.numa_node if g else None})
                out.append(rec)
            return out
        return self._read(run)

    def export_csv(self, kind: str, since: float | None, until: float | None, out: TextIO | Path | str, *,
                   host_id: str | None = None, all_hosts: bool = False) -> int:
        """Write rows of ``kind`` (one of EXPORT_KINDS) in [since, until) as CSV; returns the row count.

        Rows of this store's host by default, of ``host_id`` when given, of every host with ``all_hosts``. Event
        kinds carry the event's GPUs in a ``gpu_ids`` column, space-separated."""
        if kind not in EXPORT_KINDS:
            raise InvalidInput(f"kind must be one of {', '.join(EXPORT_KINDS)}", field="kind")
        q = _export_query(kind, None if all_hosts else host_id or self.host_id, since, until)
        if kind.startswith("rollups"):
            self.settle_rollups()
        if isinstance(out, (str, Path)):
            with open(out, "w", newline="") as fh:
                return self.export_csv(kind, since, until, fh, host_id=host_id, all_hosts=all_hosts)
        events = kind in ("lease_events", "reclaim_events")

        def run(c: Connection) -> int:
            result = c.execution_options(stream_results=True, yield_per=2000).execute(q)
            w = csv.writer(out)
            keys = list(result.keys())
            w.writerow(keys + ["gpu_ids"] if events else keys)
            n = 0
            for part in result.partitions(2000):
                if events:
                    rows = self._with_gpu_ids(c, [dict(r._mapping) for r in part])
                    w.writerows([*(r[k] for k in keys), " ".join(r["gpu_ids"])] for r in rows)
                else:
                    w.writerows(part)
                n += len(part)
            return n
        return self._read(run)

    def host_ids(self) -> dict[str, int]:
        """The hosts whose leases this store holds, with how many leases each (for "exported 0 rows: ...")."""
        c = t.leases.c
        return self._read(lambda conn: {r[0]: int(r[1]) for r in conn.execute(
            select(c.host_id, func.count()).group_by(c.host_id).order_by(c.host_id))})

    # -- model versions ------------------------------------------------------------------------------------------
    def save_model_version(self, version: str, *, kind: str = "placement", artifact: bytes | None = None,
                           artifact_path: str | None = None, metrics: Mapping[str, Any] | None = None,
                           params: Mapping[str, Any] | None = None, trained_on: int | None = None,
                           activate: bool = False, fleet: bool = True, created_at: float | None = None) -> dict[str, Any]:
        """Store a trained model (bytes or a path) with its evaluation figures; optionally make it the active one."""
        if not version or len(version) > 64:
            raise InvalidInput("version must be a string of 1..64 characters", field="version")
        if artifact is None and artifact_path is None:
            raise InvalidInput("a model version needs its artifact bytes or a path", field="artifact")
        row = {"version": version, "kind": kind, "host_id": None if fleet else self.host_id,
               "created_at": self._clock() if created_at is None else created_at, "trained_on": trained_on,
               "metrics": dict(metrics) if metrics else None, "params": dict(params) if params else None,
               "artifact": artifact, "artifact_path": artifact_path,
               "sha256": hashlib.sha256(artifact).hexdigest() if artifact is not None else None, "active": False}

        def run(c: Connection) -> None:
            with c.begin():
                try:
                    c.execute(insert(t.model_versions).values(**row))
                except IntegrityError as exc:
                    raise InvalidInput(f"model version {version} exists already", field="version") from exc
                if activate:
                    self._activate(c, kind, version)
        with self._wlock:
            self._read(run)
        return self.get_model_version(version, with_artifact=False)

    def _activate(self, c: Connection, kind: str, version: str) -> None:
        m = t.model_versions.c
        c.execute(update(t.model_versions).where(m.kind == kind).values(active=False))
        n = c.execute(update(t.model_versions).where(m.kind == kind, m.version == version).values(active=True)).rowcount
        if not n:
            raise NotFound(f"no {kind} model version {version}", field="version")

    def activate_model_version(self, version: str, *, kind: str = "placement") -> None:
        """Make ``version`` the active model of its kind."""
        def run(c: Connection) -> None:
            with c.begin():
                self._activate(c, kind, version)
        with self._wlock:
            self._read(run)

    def list_model_versions(self, *, kind: str | None = None, limit: int = 100) -> list[dict[str, Any]]:
        """Model versions, newest first, without their artifact bytes."""
        m = t.model_versions.c
        q = select(*[col for col in t.model_versions.c if col.name != "artifact"]).order_by(
            m.created_at.desc(), m.id.desc()).limit(limit)
        if kind:
            q = q.where(m.kind == kind)
        return self._read(lambda c: [dict(r._mapping) for r in c.execute(q)])

    def get_model_version(self, version: str | None = None, *, kind: str = "placement",
                          with_artifact: bool = True) -> dict[str, Any]:
        """One model version (by name, or the active one of ``kind`` when None); NotFound when absent."""
        m = t.model_versions.c
        cols = [col for col in t.model_versions.c if with_artifact or col.name != "artifact"]
        q = select(*cols)
        q = q.where(m.version == version) if version else q.where(m.kind == kind, m.active.is_(True))

        def run(c: Connection) -> dict[str, Any]:
            r = c.execute(q).first()
            if r is None:
                raise NotFound(f"no model version {version or '(active ' + kind + ')'}", field="version")
            return dict(r._mapping)
        return self._read(run)

    # -- tokens --------------------------------------------------------------------------------------------------
    @property
    def tokens(self) -> TokenRepo:
        """Bearer tokens (hashed), bound to a domain UUID and a role."""
        return TokenRepo(self)


class TokenRepo:
    """Issue, look up and revoke bearer tokens; only SHA-256 hashes are stored."""

    def __init__(self, store: UsageStore) -> None:
        self._s = store

    def issue(self, *, role: str, domain_uuid: str | None = None, domain_name: str | None = None,
              expires_at: float | None = None, note: str | None = None) -> tuple[str, dict[str, Any]]:
        """Make a new token; returns (the token, shown once; its record)."""
        token = secrets.token_urlsafe(32)
        return token, self.add_hash(hash_token(token), role=role, domain_uuid=domain_uuid, domain_name=domain_name,
                                    expires_at=expires_at, note=note)

    def add_hash(self, sha256: str, *, role: str, domain_uuid: str | None = None, domain_name: str | None = None,
                 expires_at: float | None = None, note: str | None = None) -> dict[str, Any]:
        """Store a token given by its hash (the caller made the token)."""
        if role not in TOKEN_ROLES:
            raise InvalidInput(f"role must be one of {', '.join(TOKEN_ROLES)}", field="role")
        if role == "guest" and not domain_uuid:
            raise InvalidInput("a guest token must be bound to a domain uuid", field="domain_uuid")
        if len(sha256) != 64 or any(ch not in "0123456789abcdef" for ch in sha256):
            raise InvalidInput("sha256 must be 64 lowercase hex digits", field="sha256")
        row = {"sha256": sha256, "host_id": self._s.host_id, "role": role, "domain_uuid": domain_uuid,
               "domain_name": domain_name, "created_at": self._s._clock(), "expires_at": expires_at,
               "revoked_at": None, "note": note}

        def run(c: Connection) -> None:
            with c.begin():
                c.execute(insert(t.tokens).values(**row))
        self._s._read(run)
        return _public_token(row)

    def lookup(self, token: str) -> dict[str, Any] | None:
        """The live record for a presented token, or None (unknown, revoked or expired)."""
        return self.lookup_hash(hash_token(token))

    def lookup_hash(self, sha256: str) -> dict[str, Any] | None:
        """The live record for a token hash, or None."""
        k = t.tokens.c
        now = self._s._clock()
        q = select(t.tokens).where(k.sha256 == sha256, k.revoked_at.is_(None),
                                   or_(k.expires_at.is_(None), k.expires_at > now))
        row = self._s._read(lambda c: c.execute(q).first())
        return _public_token(dict(row._mapping)) if row else None

    def revoke(self, sha256: str) -> bool:
        """Revoke one token by hash (or by its 12-character prefix as listed); False when none was live."""
        k = t.tokens.c
        cond = k.sha256 == sha256 if len(sha256) == 64 else k.sha256.startswith(sha256, autoescape=True)
        if len(sha256) < 12:
            raise InvalidInput("give the token hash or at least its 12-character prefix", field="sha256")
        return self._revoke(and_(cond, k.revoked_at.is_(None))) > 0

    def revoke_domain(self, domain_uuid: str) -> int:
        """Revoke every live token of a domain; returns how many."""
        k = t.tokens.c
        return self._revoke(and_(k.domain_uuid == domain_uuid, k.revoked_at.is_(None)))

    def _revoke(self, cond: Any) -> int:
        now = self._s._clock()

        def run(c: Connection) -> int:
            with c.begin():
                return int(c.execute(update(t.tokens).where(cond).values(revoked_at=now)).rowcount)
        return self._s._read(run)

    def list(self, *, domain_uuid: str | None = None, include_revoked: bool = False) -> list[dict[str, Any]]:
        """Token records (hash prefix only), oldest first."""
        k = t.tokens.c
        q: Select[Any] = select(t.tokens).order_by(k.created_at)
        if domain_uuid:
            q = q.where(k.domain_uuid == domain_uuid)
        if not include_revoked:
            q = q.where(k.revoked_at.is_(None))
        return self._s._read(lambda c: [_public_token(dict(r._mapping)) for r in c.execute(q)])


def _public_token(row: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in row.items() if k != "sha256"}
    out["hash_prefix"] = row["sha256"][:12]
    return out


def outcome_of(state: str | None, end_reason: str | None) -> str | None:
    """How a lease ended, for training labels: released, reclaimed, expired, failed (None while live)."""
    if state in TERMINAL_OUTCOMES:
        return TERMINAL_OUTCOMES[state]
    if state == "RELEASED":
        reason = (end_reason or "").lower()
        return "reclaimed" if ("idle" in reason or "reclaim" in reason) else "released"
    return None


def _agg(q: Select[Any]) -> Select[Any]:
    r = t.usage_rollups.c
    return q.add_columns(
        func.sum(r.n).label("n"), func.sum(r.util_n).label("util_n"), func.sum(r.util_sum).label("util_sum"),
        func.min(r.util_min).label("util_min"), func.max(r.util_max).label("util_max"),
        func.sum(r.idle_n).label("idle_n"), func.sum(r.mem_n).label("mem_n"), func.sum(r.mem_sum).label("mem_sum"),
        func.max(r.mem_max).label("mem_max"), func.sum(r.work_n).label("work_n"),
        func.sum(r.work_sum).label("work_sum"), func.sum(r.irq_n).label("irq_n"), func.sum(r.irq_sum).label("irq_sum"),
        func.min(r.first_ms).label("first_ms"), func.max(r.last_ms).label("last_ms"),
    )


def _summary(row: Any) -> dict[str, Any]:
    def div(a: Any, b: Any) -> float | None:
        return float(a) / float(b) if a is not None and b else None
    n = int(row.n or 0) if row is not None else 0
    if row is None or not n:
        return {"n": 0, "util_mean": None, "util_min": None, "util_max": None, "idle_fraction": None,
                "mem_mean": None, "mem_max": None, "work_sum": 0.0, "work_mean": None, "irq_mean": None,
                "first_ts": None, "last_ts": None}
    return {
        "n": n, "util_mean": div(row.util_sum, row.util_n),
        "util_min": None if row.util_min is None else float(row.util_min),
        "util_max": None if row.util_max is None else float(row.util_max),
        "idle_fraction": div(row.idle_n, row.util_n), "mem_mean": div(row.mem_sum, row.mem_n),
        "mem_max": None if row.mem_max is None else int(row.mem_max), "work_sum": float(row.work_sum or 0.0),
        "work_mean": div(row.work_sum, row.work_n), "irq_mean": div(row.irq_sum, row.irq_n),
        "first_ts": int(row.first_ms) / 1000.0, "last_ts": int(row.last_ms) / 1000.0,
    }


def _resolution(resolution: int | str, span: float) -> int:
    if resolution == "auto":
        return 0 if span <= 2 * 3600 else t.RES_MINUTE if span <= 3 * 86400 else t.RES_HOUR
    if resolution == "raw":
        return 0
    if resolution == "minute":
        return t.RES_MINUTE
    if resolution == "hour":
        return t.RES_HOUR
    if isinstance(resolution, int) and not isinstance(resolution, bool) and (
            resolution in (0, t.RES_MINUTE) or (resolution > 0 and resolution % t.RES_HOUR == 0)
            or (resolution > 0 and resolution < t.RES_HOUR and resolution % t.RES_MINUTE == 0)):
        return resolution
    raise InvalidInput("resolution must be auto, raw, minute, hour, 0, or a multiple of 60 s (under an hour) "
                       "or of 3600 s", field="resolution")


def _export_query(kind: str, host_id: str | None, since: float | None, until: float | None) -> Select[Any]:
    def window(col: Any, scale: int = 1) -> list[Any]:
        conds = [] if host_id is None else [col.table.c.host_id == host_id]
        if since is not None:
            conds.append(col >= since * scale)
        if until is not None:
            conds.append(col < until * scale)
        return conds
    if kind == "leases":
        c = t.leases.c
        return select(t.leases).where(*window(c.created_at)).order_by(c.created_at, c.id)
    if kind == "lease_events":
        c = t.lease_events.c
        return select(t.lease_events).where(*window(c.ts)).order_by(c.ts, c.id)
    if kind == "samples":
        c = t.usage_samples.c
        return (select(*[x for x in t.usage_samples.c if x.name != "id"]).where(*window(c.ts_ms, 1000))
                .order_by(c.ts_ms, c.gpu_id))
    if kind in ("rollups_minute", "rollups_hour"):
        c = t.usage_rollups.c
        res = t.RES_MINUTE if kind == "rollups_minute" else t.RES_HOUR
        return (select(t.usage_rollups).where(c.resolution == res, *window(c.bucket))
                .order_by(c.bucket, c.gpu_id, c.lease_id))
    if kind == "reclaim_events":
        c = t.reclaim_events.c
        return select(t.reclaim_events).where(*window(c.ts)).order_by(c.ts, c.id)
    c = t.probe_results.c
    return select(t.probe_results).where(*window(c.ts)).order_by(c.ts, c.id)
