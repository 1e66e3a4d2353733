"""The CSV export of the store's rows, for analysis outside the agent: ``export_csv`` (one of :data:`EXPORT_KINDS` in a
time window, streamed; event kinds carry their GPUs in a ``gpu_ids`` column) and ``host_ids`` (the hosts whose leases
the store holds, to explain an empty export)."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from sqlalchemy import Connection, Select, func, select

from hostagent.domain.errors import InvalidInput
from hostagent.store import EXPORT_KINDS
from hostagent.store import schema as t
from hostagent.store.writes import StoreCore


class ExportRepo(StoreCore):
    """CSV export (a mixin of :class:`hostagent.store.repo.UsageStore`)."""

    if TYPE_CHECKING:  # from the samples' and the events' repositories
        def settle_rollups(self, timeout: float | None = None) -> bool: ...
        def _with_gpu_ids(self, c: Connection, rows: list[dict[str, Any]]) -> list[dict[str, Any]]: ...

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
