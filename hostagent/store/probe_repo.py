"""The GPU health probes' results: ``add_probe_result`` (op ``probe``, an append-only row keyed by a uid made before
the write, for a GPU the store knows) and ``list_probe_results``."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from sqlalchemy import Connection, select

from hostagent.store import schema as t
from hostagent.store.limits import fit_row
from hostagent.store.upsert import upsert
from hostagent.store.writes import StoreCore, new_uid


class ProbeRepo(StoreCore):
    """Probe results (a mixin of :class:`hostagent.store.repo.UsageStore`)."""

    if TYPE_CHECKING:  # from the hosts' repository (host_repo.HostRepo): a probe names a stored GPU
        def _require_gpus(self, ids: Iterable[str], *, field: str) -> None: ...

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
