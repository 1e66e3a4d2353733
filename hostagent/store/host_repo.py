"""The hosts and their GPUs: this host's row (``upsert_host``, op ``host``), its GPUs' rows (``upsert_gpus``, op
``gpus``, built from a discovered :class:`~hostagent.domain.inventory.Gpu` by :func:`gpu_record`), ``list_gpus``, and
the reference check that every write naming a GPU makes first (``_require_gpus``, with the set of GPU ids known to be
stored so that a sample write need not ask). The fleet: ``publish_fleet`` (op ``fleet``) writes this host's live
state, its ``hosts`` row (``last_seen``, ``info``) and its GPUs' ``state``, in one transaction; ``fleet_hosts`` reads
every host's back (services.fleet publishes and builds the fleet view)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from sqlalchemy import Connection, bindparam, select, update

from hostagent.domain.errors import InvalidInput, NotFound
from hostagent.domain.inventory import Gpu
from hostagent.store import schema as t
from hostagent.store.limits import fit_row
from hostagent.store.upsert import upsert
from hostagent.store.writes import StoreCore

GPU_COLUMNS = frozenset(c.name for c in t.gpus.c) - {"host_id", "first_seen", "last_seen"}


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


class HostRepo(StoreCore):
    """Hosts and GPUs (a mixin of :class:`hostagent.store.repo.UsageStore`)."""

    _known_gpus: set[str]  # GPU ids known to be in the store (so sample writes need not ask)

    def _init_hosts(self) -> None:
        self._known_gpus = set()

    def upsert_host(self, info: Mapping[str, Any] | None = None) -> None:
        """Record (or refresh) this host; without ``info`` the stored one is kept (a CLI opening the store as this
        host must not wipe what its agent published for the fleet)."""
        now = self._clock()
        self._write("host", fit_row(t.hosts, {
            "id": self.host_id, "hostname": self.hostname, "agent_version": self.agent_version, "first_seen": now,
            "last_seen": now, "info": dict(info) if info else None}))

    def _apply_host(self, conn: Connection, row: dict[str, Any]) -> None:
        keep = [c for c in ("info", "agent_version") if row.get(c) is None]  # unknown here: kept as stored
        upsert(conn, t.hosts, [row], keys=["id"],
               replace=[c for c in ("hostname", "agent_version", "last_seen", "info") if c not in keep])

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

    def publish_fleet(self, info: Mapping[str, Any], states: Mapping[str, str], *,
                      agent_version: str | None = None) -> None:
        """This host's live state for the fleet: its ``hosts`` row (``last_seen`` now, ``info`` as given) and each
        GPU's ``state`` (``states``: GPU id -> state), one write (spooled like any other during an outage)."""
        now = self._clock()
        row = fit_row(t.hosts, {"id": self.host_id, "hostname": self.hostname,
                                "agent_version": agent_version or self.agent_version, "first_seen": now,
                                "last_seen": now, "info": dict(info)})
        gpus = [fit_row(t.gpus, {"gpu_id": g, "state": s}) for g, s in sorted(states.items())]
        self._write("fleet", {"host": row, "gpus": gpus})

    def _apply_fleet(self, conn: Connection, payload: dict[str, Any]) -> None:
        row = payload["host"]
        upsert(conn, t.hosts, [row], keys=["id"], replace=["hostname", "agent_version", "last_seen", "info"])
        by_state: dict[str | None, list[str]] = {}
        for g in payload["gpus"]:
            by_state.setdefault(g["state"], []).append(g["gpu_id"])
        c = t.gpus.c
        for state, ids in sorted(by_state.items(), key=lambda kv: str(kv[0])):  # one statement per state, not per GPU
            conn.execute(update(t.gpus).where(c.host_id == row["id"], c.gpu_id.in_(bindparam("ids", expanding=True)))
                         .values(state=state, last_seen=row["last_seen"]), {"ids": ids})

    def fleet_hosts(self) -> list[dict[str, Any]]:
        """Every host of the store with its ``info`` and its GPUs (id, model, memory, published state), by host id."""
        c = t.gpus.c
        cols = (c.host_id, c.gpu_id, c.model, c.memory_bytes, c.state, c.last_seen)

        def run(conn: Connection) -> list[dict[str, Any]]:
            hosts = {r.id: dict(r._mapping, gpus=[]) for r in conn.execute(select(t.hosts).order_by(t.hosts.c.id))}
            for r in conn.execute(select(*cols).order_by(c.host_id, c.gpu_id)):
                if r.host_id in hosts:
                    hosts[r.host_id]["gpus"].append(dict(r._mapping))
            return list(hosts.values())
        return self._read(run)

    def list_gpus(self, *, all_hosts: bool = False) -> list[dict[str, Any]]:
        """GPUs recorded for this host (or every host)."""
        q = select(t.gpus).order_by(t.gpus.c.host_id, t.gpus.c.gpu_id)
        if not all_hosts:
            q = q.where(t.gpus.c.host_id == self.host_id)
        return self._read(lambda c: [dict(r._mapping) for r in c.execute(q)])

    def _require_gpus(self, ids: Iterable[str], *, field: str) -> None:
        missing = {x for x in ids if x not in self._known_gpus}
        if not missing or self.degraded:
            return
        found = self._read(lambda c: {r[0] for r in c.execute(
            select(t.gpus.c.gpu_id).where(t.gpus.c.gpu_id.in_(sorted(missing)), t.gpus.c.host_id == self.host_id))})
        self._known_gpus.update(found)
        if missing - found:
            raise NotFound(f"unknown GPU {sorted(missing - found)[0]}", field=field)
