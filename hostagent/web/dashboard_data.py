"""Dashboard view models: what each page shows, as plain dicts/lists ready for a template or for JSON. It owns the
pages' content and their query rules: the overview (counts, one row per GPU with its sparkline, the queue, strikes,
fleet hosts, store health), one GPU (lease timeline over a range, usage series, probes, events), the leases table
(filters, windows, sorting, the row limit the CSV export shares), one lease, reclaim activity and the placement
model. It builds on `DashboardSource` (dashboard_source.py: journal, store and in-memory usage) and the pure chart
geometry (dashboard_charts.py); it never handles a request. The geometry helpers and `csv_cell` stay importable
from here.
"""

from __future__ import annotations

import collections
from typing import Any

from hostagent.domain.errors import InvalidInput, NotFound
from hostagent.domain.inventory import GpuState
from hostagent.domain.lease import Lease, LeaseState
from hostagent.web.dashboard_charts import (
    Bar,
    bucket_series,
    downsample,
    lease_duration,
    lease_start,
    line_path,
    spark_segments,
    state_css,
    time_ticks,
    timeline_bars,
    with_gaps,
)
from hostagent.web.dashboard_csv import csv_cell
from hostagent.web.dashboard_source import DashboardSource, Notes

RANGES: dict[str, int] = {"1h": 3600, "6h": 6 * 3600, "24h": 86400, "7d": 7 * 86400, "30d": 30 * 86400}
DEFAULT_RANGE = "24h"
LEASE_WINDOWS: dict[str, int | None] = {"24h": 86400, "7d": 7 * 86400, "30d": 30 * 86400, "all": None}
STATE_ORDER = [s.value for s in (GpuState.FREE, GpuState.LEASED, GpuState.WARNED, GpuState.DETACH_PENDING,
                                 GpuState.QUARANTINED, GpuState.UNAVAILABLE)]
RECLAIM_KINDS = ("strike-one", "strike-cleared", "strike-two", "reclaim", "reclaim-outcome", "preempt",
                 "preempt-withdrawn")
LIVE_STATES = frozenset(s for s in LeaseState if not s.terminal)
LEASE_SORT_KEYS = ("vm", "gpus", "task", "priority", "state", "start", "duration", "util", "reason")
PAGE_ROWS = 200


def parse_range(value: str | None) -> tuple[str, int]:
    """A range name from the query (1h, 6h, 24h, 7d, 30d) and its length in seconds."""
    name = value or DEFAULT_RANGE
    if name not in RANGES:
        raise InvalidInput(f"range must be one of {', '.join(RANGES)}", field="range")
    return name, RANGES[name]


class DashboardData(DashboardSource):
    """Builds every dashboard page's data from the runtime (see DashboardSource for where it reads from)."""

    # -- overview ------------------------------------------------------------------------------------------------
    async def overview(self) -> dict[str, Any]:
        """Counts at the top, one row per GPU, the queue, reclaim activity, and fleet hosts when shared."""
        notes = Notes()
        now = self.clock()
        m = self.rt.manager
        gpus = []
        counts: collections.Counter[str] = collections.Counter()
        await self.rt.refresh_drivers()
        for gid in sorted(m.gpus):
            v = self.rt.gpu_view(gid)
            counts[v["state"]] += 1
            lease = m.lease_of(gid)
            spark = await self.sparkline(gid, now, notes)
            gpus.append({
                "id": gid, "address": v["address"], "model": v["model"], "vendor": v["vendor"],
                "memory_bytes": v["memory_bytes"], "numa_node": v["numa_node"], "iommu_group": v["iommu_group"],
                "state": v["state"], "quarantine_reason": v["quarantine_reason"], "attention": v["attention"],
                "unviable_reason": v["unviable_reason"],
                "lease": None if lease is None else {
                    "id": lease.id, "domain": lease.domain_name, "state": lease.state.value,
                    "since": lease_start(lease), "task_type": lease.request.task_type,
                    "priority": lease.request.priority, "notice": lease.notice,
                    "paused": lease.reclaim_paused},
                "spark": spark,
            })
        live = list(m.leases.values())
        reaper = self.rt.reaper
        strikes = [s for s in (reaper.status() if reaper is not None else []) if s["strike"] != "none"]
        hosts = await self.hosts(notes)
        return {
            "now": now, "host_id": self.rt.settings.agent.host_id,
            "counts": {s: counts.get(s, 0) for s in STATE_ORDER}, "total": len(gpus), "gpus": gpus,
            "live_leases": sum(1 for x in live if x.state.holds_devices),
            "queued": [{"id": x.id, "domain": x.domain_name, "gpus": x.request.gpus, "priority": x.request.priority,
                        "since": x.queued_at or x.created_at} for x in m.queue()],
            "strikes": strikes, "hosts": hosts, "store": self.store_status(),
            "ready": bool(self.rt.started and self.rt.hypervisor_ok), "notes": notes.items,
        }

    def store_status(self) -> dict[str, Any]:
        """Whether a store is configured and taking everything in time (see Runtime.store_health)."""
        if self.rt.store is None:
            return {"configured": False, "degraded": False, "problems": []}
        health = self.rt.store_health()  # the figures /readyz reports: the dashboard never says more or less
        return {"configured": True, "degraded": not health["ok"], **health}

    async def hosts(self, notes: Notes) -> list[dict[str, Any]]:
        """Hosts sharing the store (one row each with GPU counts by recorded state); [] without a store."""
        rows = await self.store_call(notes, "list_gpus", all_hosts=True) if self.has_store else None
        if not rows:
            return []
        by_host: dict[str, dict[str, Any]] = {}
        for r in rows:
            h = by_host.setdefault(r["host_id"], {"host_id": r["host_id"], "gpus": 0, "states": collections.Counter(),
                                                  "last_seen": 0.0, "models": collections.Counter()})
            h["gpus"] += 1
            h["states"][r.get("state") or "unknown"] += 1
            h["models"][r.get("model") or "?"] += 1
            h["last_seen"] = max(h["last_seen"], float(r.get("last_seen") or 0))
        me = self.rt.settings.agent.host_id
        out = []
        for h in sorted(by_host.values(), key=lambda x: (x["host_id"] != me, x["host_id"])):
            h["states"] = dict(h["states"])
            h["models"] = ", ".join(f"{n}× {k}" for k, n in h["models"].most_common())
            h["this"] = h["host_id"] == me
            out.append(h)
        return out

    # -- GPU page ------------------------------------------------------------------------------------------------
    async def gpu_page(self, gpu_id: str, range_name: str | None) -> dict[str, Any]:
        """One GPU: details, lease timeline over a range, usage series, probe scores, events."""
        if gpu_id not in self.rt.manager.gpus:
            raise NotFound(f"no GPU {gpu_id!r}", field="gpu_id")
        notes = Notes()
        name, span = parse_range(range_name)
        now = self.clock()
        since = now - span
        await self.rt.refresh_drivers(gpu_id)
        view = self.rt.gpu_view(gpu_id)
        leases = [x for x in await self.all_leases(since=since) if gpu_id in x.gpu_ids]
        bars = timeline_bars(leases, since, now)
        series = await self.gpu_series(gpu_id, since, now, notes)
        probes = await self.store_call(notes, "list_probe_results", gpu_id=gpu_id, limit=20) if self.has_store else None
        events = await self.rt.run(self.rt.journal.events, gpu_id=gpu_id, limit=200)
        return {
            "gpu": view, "range": name, "ranges": list(RANGES), "since": since, "now": now,
            "bars": bars, "ticks": time_ticks(since, now), "leases": leases[:50],
            "series": series,
            "fallback": {"util": line_path(series["ts"], series["util"], since, now, vmax=100.0),
                         "mem": line_path(series["ts"], series["mem_gib"], since, now,
                                          vmax=(view["memory_bytes"] or 0) / 1024**3 or None)},
            "probes": probes, "events": [e.to_dict() for e in reversed(events)],
            "lease": self.rt.manager.lease_of(gpu_id), "notes": notes.items, "has_store": self.has_store,
        }

    # -- leases --------------------------------------------------------------------------------------------------
    async def leases_page(self, query: dict[str, str]) -> dict[str, Any]:
        """The filtered, sorted leases table (server-rendered; the CSV export uses the same rows)."""
        notes = Notes()
        now = self.clock()
        f = {k: (query.get(k) or "").strip() for k in ("state", "vm", "gpu", "task", "window", "sort", "dir")}
        window = f["window"] or "7d"
        if window not in LEASE_WINDOWS:
            raise InvalidInput(f"window must be one of {', '.join(LEASE_WINDOWS)}", field="window")
        span = LEASE_WINDOWS[window]
        states = None
        if f["state"] == "live":
            states = list(LIVE_STATES)
        elif f["state"] == "ended":
            states = [s for s in LeaseState if s.terminal]
        elif f["state"]:
            try:
                states = [LeaseState(f["state"].upper())]
            except ValueError:
                raise InvalidInput("state must be live, ended or a lease state", field="state") from None
        sort = f["sort"] or "start"
        if sort not in LEASE_SORT_KEYS:
            raise InvalidInput(f"sort must be one of {', '.join(LEASE_SORT_KEYS)}", field="sort")
        desc = (f["dir"] or "desc") != "asc"
        rows = await self.all_leases(states=states, since=None if span is None else now - span)
        if f["vm"]:
            needle = f["vm"].lower()
            rows = [x for x in rows if needle in x.domain_name.lower() or needle in x.domain_uuid.lower()]
        if f["gpu"]:
            rows = [x for x in rows if f["gpu"] in x.gpu_ids]
        if f["task"]:
            rows = [x for x in rows if x.request.task_type == f["task"]]
        total = len(rows)
        utils: dict[str, float | None] = {}
        if sort == "util":
            utils = await self.lease_utils(rows[:5000], notes)
        keyfn = {
            "vm": lambda x: x.domain_name, "gpus": lambda x: (len(x.gpu_ids), ",".join(x.gpu_ids)),
            "task": lambda x: x.request.task_type, "priority": lambda x: x.request.priority,
            "state": lambda x: x.state.value, "start": lease_start, "duration": lambda x: lease_duration(x, now),
            "util": lambda x: (utils.get(x.id) is not None, utils.get(x.id) or 0.0),
            "reason": lambda x: x.end_reason or "",
        }[sort]
        rows.sort(key=keyfn, reverse=desc)
        shown = rows[:PAGE_ROWS]
        if sort != "util":
            utils = await self.lease_utils(shown, notes)
        out = [self.lease_row(x, now, utils.get(x.id)) for x in shown]
        tasks = sorted({x.request.task_type for x in rows} | ({f["task"]} if f["task"] else set()))
        return {"rows": out, "total": total, "shown": len(out), "filters": f | {"window": window, "sort": sort,
                "dir": "desc" if desc else "asc"}, "windows": list(LEASE_WINDOWS), "tasks": tasks,
                "states": [s.value for s in LeaseState], "gpu_ids": sorted(self.rt.manager.gpus),
                "notes": notes.items, "now": now}

    def lease_row(self, x: Lease, now: float, util: float | None) -> dict[str, Any]:
        """One row of the leases table."""
        return {"id": x.id, "vm": x.domain_name, "domain_uuid": x.domain_uuid, "gpus": list(x.gpu_ids),
                "task": x.request.task_type, "priority": x.request.priority, "state": x.state.value,
                "css": state_css(x), "start": lease_start(x), "duration": lease_duration(x, now),
                "util": util, "reason": x.end_reason, "live": not x.state.terminal,
                "requested": x.request.gpus, "paused": x.reclaim_paused, "notice": x.notice}

    async def lease_page(self, lease_id: str) -> dict[str, Any]:
        """One lease: request, devices, reasons, events, usage chart over its life."""
        notes = Notes()
        lease = self.rt.manager.get(lease_id)
        now = self.clock()
        start = lease_start(lease)
        end = lease.ended_at or now
        since = start - max(60.0, (end - start) * 0.05)
        until = min(now, end + max(60.0, (end - start) * 0.05))
        series = {}
        for gid in lease.gpu_ids:
            series[gid] = await self.gpu_series(gid, since, until, notes)
        events = await self.rt.run(self.rt.journal.events, lease_id=lease_id, limit=500)
        util = await self.lease_util(lease, notes)
        reaper = self.rt.reaper
        status = next((s for s in (reaper.status() if reaper is not None else []) if s["lease_id"] == lease_id), None)
        return {"lease": lease, "row": self.lease_row(lease, now, util), "series": series, "since": since,
                "until": until, "events": [e.to_dict() for e in reversed(events)], "reaper": status,
                "request": lease.request.to_dict(), "notes": notes.items, "now": now,
                "fallback": {gid: line_path(s["ts"], s["util"], since, until, vmax=100.0) for gid, s in series.items()}}

    # -- reclaim and model ---------------------------------------------------------------------------------------
    async def reclaim_page(self) -> dict[str, Any]:
        """The reaper's view of live leases and the recent strikes and reclaims."""
        notes = Notes()
        reaper = self.rt.reaper
        settings = reaper.settings if reaper is not None else None
        events = await self.rt.run(self.rt.journal.events, kinds=list(RECLAIM_KINDS), limit=300)
        counts = collections.Counter(e.kind for e in events)
        return {"enabled": bool(settings and settings.enabled),
                "settings": None if settings is None else {
                    "check_interval_s": settings.check_interval_s, "grace_s": settings.grace_s,
                    "notice_window_s": settings.notice_window_s,
                    "idle_util_pct": settings.policy.idle_util_pct},
                "status": reaper.status() if reaper is not None else [],
                "events": [e.to_dict() for e in reversed(events)], "counts": dict(counts), "notes": notes.items,
                "now": self.clock()}

    async def model_page(self) -> dict[str, Any]:
        """The placement model in use, stored versions with their evaluation, and recent placement decisions."""
        notes = Notes()
        versions = await self.store_call(notes, "list_model_versions", kind="placement", limit=20) if self.has_store else None
        current = getattr(self.rt, "model_version", None)
        rule = getattr(self.rt, "placement_rule", None)
        active = next((v for v in versions or [] if v.get("active")), None)
        decisions = []
        for x in await self.all_leases():
            if not x.devices:
                continue
            decisions.append({"id": x.id, "vm": x.domain_name, "gpus": list(x.gpu_ids), "at": lease_start(x),
                              "task": x.request.task_type, "requested": x.request.gpus,
                              "distance": x.distance, "reasons": list(x.reasons), "css": state_css(x)})
            if len(decisions) >= 40:
                break
        return {"current": current or (active or {}).get("version"), "rule": rule or ("model" if active else "cold-start"),
                "active": active, "versions": versions or [], "has_store": self.has_store,
                "decisions": decisions, "notes": notes.items, "now": self.clock()}


__all__ = ["Bar", "DashboardData", "Notes", "RANGES", "bucket_series", "csv_cell", "downsample", "line_path",
           "parse_range", "spark_segments", "state_css", "time_ticks", "timeline_bars", "with_gaps"]
