"""The leases: a lease's row (``insert_lease``, op ``lease``; ``update_lease``, op ``lease_update``) with its
devices (``lease_devices``, replaced whole when given), the journal's mirror (``record_lease`` and ``mirror``, op
``mirror``: leases and then their lease and reclaim events in one write, set aside row by row when refused;
``lease_doc`` and ``event_doc`` are documents the store refused before they became rows), the reads (``get_lease``,
``list_leases``) and the reference check that every write naming a lease makes first (``_require_leases``, over a
bounded cache of lease ids known to be stored). How a lease ended, for training labels, is :func:`outcome_of`. The
events themselves are written by :class:`~hostagent.store.event_repo.EventRepo`, which this repository builds on."""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from sqlalchemy import Connection, delete, func, insert, or_, select, update

from hostagent.domain.errors import InvalidInput, NotFound
from hostagent.store import schema as t
from hostagent.store.event_repo import EventRepo
from hostagent.store.limits import fit_row
from hostagent.store.upsert import upsert

TERMINAL_OUTCOMES = {"FAILED": "failed", "EXPIRED": "expired"}
REQUEST_FIELDS = ("gpus", "task_type", "data_scale", "precision", "min_memory_gib", "duration_s", "priority",
                  "accept_partial", "accept_deferred", "not_after", "idempotency_key", "project")
LEASE_MUTABLE = frozenset(c.name for c in t.leases.c) - {"id", "host_id", "created_at"}


def outcome_of(state: str | None, end_reason: str | None) -> str | None:
    """How a lease ended, for training labels: released, reclaimed (idle), preempted, expired, failed (None while
    live)."""
    if state in TERMINAL_OUTCOMES:
        return TERMINAL_OUTCOMES[state]
    if state == "RELEASED":
        reason = (end_reason or "").lower()
        if "preempt" in reason:
            return "preempted"
        return "reclaimed" if ("idle" in reason or "reclaim" in reason) else "released"
    return None


def _as_dict(x: Any) -> dict[str, Any]:
    """A journal object's dict form (its ``to_dict()``), or a mapping as a dict."""
    return x.to_dict() if hasattr(x, "to_dict") else dict(x)


class LeaseRepo(EventRepo):
    """Leases, their devices and the journal's mirror (a mixin of :class:`hostagent.store.repo.UsageStore`)."""

    KNOWN_LEASES_MAX = 4096
    # Lease ids known to be in the store (so sample writes need not ask); bounded, most recently used last:
    # a long-lived agent sees an unbounded number of leases, and a forgotten id only costs one lookup.
    _known_leases: OrderedDict[str, None]

    def _init_leases(self) -> None:
        self._known_leases = OrderedDict()

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
        """Make the lease's device rows ``devices``, touching only the rows that differ. A blanket DELETE of the
        lease's rows followed by the INSERT took InnoDB gap locks (a DELETE that matches nothing locks the gap it
        would be in), and two hosts mirroring new leases at once then deadlocked on each other's insert intention
        (``bench fleet`` saw it); rows named by their whole primary key lock only themselves."""
        d = t.lease_devices.c
        mine = (d.host_id == self.host_id, d.lease_id == lease_id)
        have = {r.gpu_id: (r.functions, r.iommu_group)
                for r in conn.execute(select(d.gpu_id, d.functions, d.iommu_group).where(*mine))}
        want = {r["gpu_id"] for r in devices}
        gone = sorted(g for g in have if g not in want)
        if gone:
            conn.execute(delete(t.lease_devices).where(*mine, d.gpu_id.in_(gone)))
        for r in devices:
            if r["gpu_id"] in have and have[r["gpu_id"]] != (r["functions"], r["iommu_group"]):
                conn.execute(update(t.lease_devices).where(*mine, d.gpu_id == r["gpu_id"])
                             .values(functions=r["functions"], iommu_group=r["iommu_group"]))
        new = [r for r in devices if r["gpu_id"] not in have]
        if new:
            conn.execute(insert(t.lease_devices), new)

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

    def finished_leases(self, *, all_hosts: bool = True) -> int:
        """How many leases have ended (every host's by default, as training reads them): what the agent's retraining
        counts as its records grow (services.retraining)."""
        q = select(func.count()).select_from(t.leases).where(t.leases.c.ended_at.is_not(None))
        if not all_hosts:
            q = q.where(t.leases.c.host_id == self.host_id)
        return int(self._read(lambda c: c.execute(q).scalar_one()))

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

    # -- set-aside lease and event documents ---------------------------------------------------------------------
    def _rebuilt(self, op: str, payload: Any) -> Any:
        """A set-aside write as it is applied now: a lease document refused before it became a row is built again
        (a newer agent may take what an older one refused)."""
        if op == "lease_doc":
            row, devices = self._lease_row(payload)
            return {"row": row, "devices": devices}
        if op == "event_doc":
            return self._mirror_event_row(payload, "agent")
        return super()._rebuilt(op, payload)

    def _apply_lease_doc(self, conn: Connection, p: dict[str, Any]) -> None:
        self._apply_lease(conn, p)

    def _apply_event_doc(self, conn: Connection, row: dict[str, Any]) -> None:
        self._apply_lease_events(conn, [row])
