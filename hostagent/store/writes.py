"""The usage store's write core, which every aggregate's repository builds on: the engine and the writer's held
connection, the outage spool, the writer lock, and the store's health (degraded, reachable, status figures). Every
write of an aggregate goes through :meth:`StoreCore._write` as an op name and a JSON-able payload: applied at once by
``_apply_<op>`` (a method of the aggregate's repository) when the database answers, else appended to the spool and
replayed in order, idempotently, by :meth:`StoreCore.replay_spool`; a write the store refuses is split into its parts
(:func:`_split`) so that only the rows it refuses are set aside, for :meth:`StoreCore.replay_rejected`. Reads go
through :meth:`StoreCore._read`, which turns an outage into ``StoreUnavailable``. Op names are the spool's format:
an op spooled by an older agent must still find its ``_apply_<op>``, so they never change.
"""

from __future__ import annotations

import collections
import logging
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from sqlalchemy import Connection, select
from sqlalchemy.exc import DataError, IntegrityError, SQLAlchemyError

from hostagent.domain.errors import InvalidInput, NotFound, StoreUnavailable
from hostagent.store.engine import HeldConnection, is_unavailable, make_engine
from hostagent.store.migrate import upgrade
from hostagent.store.samples import MAX_SKEW_S, Sample
from hostagent.store.spool import SET_ASIDE_MAX, Spool

LOGGER = "hostagent.store.repo"  # the usage store's logger: its name from before the split, kept for log filters
log = logging.getLogger(LOGGER)
T = TypeVar("T")


def new_uid() -> str:
    """A fresh id for an event row, made before the write so a replay writes the same row."""
    return uuid.uuid4().hex


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


class StoreCore:
    """The write path, the spool and the store's health for one host (``host_id``); the aggregates' repositories
    (mixins composed into :class:`hostagent.store.repo.UsageStore`) add the ``_apply_<op>`` of their writes."""

    if TYPE_CHECKING:  # from the samples' repository (sample_repo.SampleRepo): a replay ends in a rollup
        def settle_rollups(self, timeout: float | None = None) -> bool: ...
        def _wrote_samples(self) -> None: ...
        def _roll_up_now(self, *, probe_ok: bool = False) -> int | None: ...

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
        # The writer keeps one connection: checking one out of the pool per batch costs a ping and a
        # rollback-on-return, two more round trips for every heartbeat batch.
        self._writer = HeldConnection(self.engine)
        self.figures: dict[str, int] = {"samples_inserted": 0, "samples_duplicate": 0, "samples_rolled_up": 0,
                                        "samples_rolled_up_in_memory": 0, "rollup_errors": 0, "ops_spooled": 0,
                                        "ops_replayed": 0, "outages": 0, "rows_set_aside": 0, "rows_lost": 0}
        # Told of every write set aside (op, payload, rows, error), in the writer's thread: the agent journals it.
        self.on_set_aside: Callable[[str, Any, int, str], None] | None = None

    # -- health --------------------------------------------------------------------------------------------------
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
        """A set-aside write as it is applied now (the lease repository rebuilds the documents it refused)."""
        return payload

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
        """Apply one write by its op name: ``_apply_<op>`` of the repository that owns it (spooled op names of
        older agents included: they never change)."""
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
