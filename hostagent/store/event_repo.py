"""The event logs: lease events (state transitions and other lease events, op ``lease_event``) and reclaim events (the
reaper's steps, op ``reclaim``), append-only rows keyed by a uid made before the write (so a replay writes each once),
each with its ``event_gpus`` rows (one per GPU the event names; :func:`gpu_ids` reads the journal's comma-joined form),
and ``_with_gpu_ids``, which puts those GPUs back on the event rows that a read returns."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from sqlalchemy import Connection, select

from hostagent.domain.errors import InvalidInput
from hostagent.store import schema as t
from hostagent.store.limits import fit_row
from hostagent.store.upsert import upsert
from hostagent.store.writes import StoreCore, new_uid


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


class EventRepo(StoreCore):
    """Lease events and reclaim events with their GPUs (a mixin of :class:`hostagent.store.repo.UsageStore`)."""

    if TYPE_CHECKING:  # from the leases' repository (lease_repo.LeaseRepo): an event names a stored lease
        def _require_leases(self, ids: Iterable[str], *, field: str) -> None: ...

    # -- lease events --------------------------------------------------------------------------------------------
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

    # -- reclaim events ------------------------------------------------------------------------------------------
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
