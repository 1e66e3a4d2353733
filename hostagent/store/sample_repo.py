"""The usage samples and what is made of them: the sample writes (``add_samples``, ``write_samples``, op ``samples``:
INSERT IGNORE alone, so a replayed sample is skipped), the roller (a background thread, on its own connection, that
folds the inserted samples into the minute and hour rollups past a per-host watermark, :mod:`hostagent.store.rollup`,
overlapping the next insert; ``settle_rollups`` waits for it), the reads over the rollups (``lease_usage_summary``,
``gpu_history``, ``training_records``) and retention (``prune``)."""

from __future__ import annotations

import logging
import random
import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from sqlalchemy import Connection, Select, and_, delete, func, select
from sqlalchemy.exc import SQLAlchemyError

from hostagent.domain.errors import InvalidInput, NotFound
from hostagent.store import schema as t
from hostagent.store.engine import HeldConnection, is_unavailable
from hostagent.store.rollup import Fresh, FreshWrites, newest_id, pending, roll_up_step, rollup_engine
from hostagent.store.samples import Sample, validate_samples
from hostagent.store.upsert import insert_ignore
from hostagent.store.writes import LOGGER, StoreCore

log = logging.getLogger(LOGGER)

ROLL_EVERY_WRITES = 8  # the roller folds at least this many sample writes at once...
# ...or what it has after this long. A reader of this host's rollups never sees the lag (it settles them first:
# `settle_rollups` wakes the roller); other hosts of a fleet reading them lag by up to this much. 5 s, not 0.5:
# an agent flushing once a second then folds ~5 writes a step, not one: for 200 hosts on one server the rollers'
# client CPU went from 0.90 to 0.38 cores and the flush latency p50 from 203 to 12 ms (`hostagent bench fleet`,
# docs/benchmarks.md, with the varying wait below).
ROLL_AFTER_S = 5.0
SAMPLE_COLUMNS = ("host_id", *Sample._fields)  # a row is (host_id, *sample)


class SampleRepo(StoreCore):
    """Samples, their rollups and the reads over them (a mixin of :class:`hostagent.store.repo.UsageStore`)."""

    if TYPE_CHECKING:  # reference checks and devices, from the hosts' and the leases' repositories
        def _require_gpus(self, ids: Iterable[str], *, field: str) -> None: ...
        def _require_leases(self, ids: Iterable[str], *, field: str) -> None: ...
        def _devices(self, c: Connection,
                     keys: Sequence[tuple[str, str]]) -> dict[tuple[str, str], list[dict[str, Any]]]: ...

    # Rollups follow the sample inserts in a background thread ("the roller", on its own connection), so the next
    # batch's insert overlaps the last one's rollup. _written counts committed sample writes, _rolled how many of
    # those the rollups are known to include; readers of rollups wait for the two to meet.
    _rlock: threading.Lock  # one rollup step at a time: each reads the watermark, then moves it
    _roll_cv: threading.Condition
    _written: int
    _rolled: int
    _settling: int  # callers waiting in settle_rollups
    _roller: threading.Thread | None
    _closing: bool
    _roller_conn: HeldConnection  # the roller keeps one connection, as the writer does
    _roll_jitter: random.Random  # how long the roller lets writes gather varies (see _roll_forever)
    _fresh: FreshWrites  # committed writes whose every sample was new: the roller folds them from memory
    _staged: Fresh | None  # the write being applied, until its transaction commits

    def _init_rollups(self) -> None:
        self._rlock = threading.Lock()
        self._roll_cv = threading.Condition()
        self._written = 0
        self._rolled = 0
        self._settling = 0
        self._roller = None
        self._closing = False
        self._roller_conn = HeldConnection(rollup_engine(self.engine))
        self._roll_jitter = random.Random()
        self._fresh = FreshWrites()
        self._staged = None

    def _stop_roller(self) -> None:
        """Stop the roller and wait for it (its connection stays open for a last rollup step)."""
        with self._roll_cv:
            self._closing = True
            self._roll_cv.notify_all()
        if self._roller is not None:
            self._roller.join()

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
        with self._wlock, self._fresh.writing():
            self._staged = None
            payload = batch if isinstance(batch, list) else list(batch)
            result = self._write("samples", payload, set_aside=set_aside)
            staged, self._staged = self._staged, None
            # applied whole in one committed transaction, every sample new: the roller may fold it from memory
            if staged is not None and result == len(payload) == len(staged.samples):
                self._fresh.add(staged)
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
        samples = [r if isinstance(r, Sample) else Sample(**r) for r in rows]
        values = [(host, *s) for s in samples]  # a Sample's fields are the columns after host_id, in order
        after = newest_id(conn, host)
        inserted = insert_ignore(conn, t.usage_samples, SAMPLE_COLUMNS, values)
        # the host's rows past `after` are this write's alone (one writer per host): with none skipped, they are
        # exactly `samples`, which write_samples hands to the roller once the transaction has committed
        self._staged = Fresh(after, newest_id(conn, host), samples) if inserted == len(values) else None
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
                # The wait varies (0.5-1.5 x ROLL_AFTER_S): agents of a fleet started together would otherwise
                # fold in step, every host's roller at the same instant (`bench fleet` saw 464 statements at once).
                self._roll_cv.wait_for(lambda: self._closing or self._settling > 0 or self._down
                                       or self._written - self._rolled >= ROLL_EVERY_WRITES,
                                       ROLL_AFTER_S * (0.5 + self._roll_jitter.random()))
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
        total, deferred = 0, False
        try:
            while True:
                with self._roller_conn.begin() as conn:
                    n, more = roll_up_step(conn, self.host_id, now=self._clock(), fresh=self._fresh,
                                           defer=not deferred)
                if more and not n:  # a write is handing its samples over: fold them from memory once it has
                    deferred = True
                    self._fresh.wait_written(self.io_timeout)
                    continue
                deferred = False
                total += n
                self.figures["samples_rolled_up"] += n
                self.figures["samples_rolled_up_in_memory"] = self._fresh.used
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

    # -- reads over the rollups, and retention -------------------------------------------------------------------
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
