"""Dashboard view models: what each page shows, as plain dicts/lists ready for a template or for JSON. It owns the
pages' content and their query rules: the overview (counts, one row per GPU with its sparkline, the queue, strikes,
fleet hosts, store health), one GPU (lease timeline over a range, usage series, probes, events), the leases table
(filters, windows, sorting, keyset pages, and the CSV export's batches of every matching row), one lease, reclaim
activity and the placement model. It builds on `DashboardSource` (dashboard_source.py: journal, store and in-memory
usage) and the pure chart geometry (dashboard_charts.py); it never handles a request. The geometry helpers and
`csv_cell` stay importable from here.
"""

from __future__ import annotations

import bisect
import collections
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast
from urllib.parse import urlencode

from hostagent.domain.errors import HostAgentError, InvalidInput, NotFound
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
from hostagent.services.admission import queue_deadline
from hostagent.services.fleet import read_fleet
from hostagent.services.bookings import lead_s
from hostagent.store.lease_listing import LeaseFilter, Order, Position, decode_cursor, encode_cursor
from hostagent.web.dashboard_csv import csv_cell, gpu_hours
from hostagent.web.dashboard_calendar import calendar_view
from hostagent.web.dashboard_format import duration, group_note
from hostagent.web.dashboard_source import DashboardSource, Notes

RANGES: dict[str, int] = {"1h": 3600, "6h": 6 * 3600, "24h": 86400, "7d": 7 * 86400, "30d": 30 * 86400}
DEFAULT_RANGE = "24h"
LEASE_WINDOWS: dict[str, int | None] = {"24h": 86400, "7d": 7 * 86400, "30d": 30 * 86400, "all": None}
STATE_ORDER = [s.value for s in GpuState]
RECLAIM_KINDS = ("strike-one", "strike-cleared", "strike-two", "reclaim", "reclaim-outcome", "preempt",
                 "preempt-withdrawn")
LIVE_STATES = frozenset(s for s in LeaseState if not s.terminal)
LEASE_SORT_KEYS = ("vm", "gpus", "task", "priority", "state", "start", "duration", "util", "reason", "gpu_hours",
                   "project")
LEASE_PARAMS = ("state", "vm", "gpu", "task", "project", "window", "sort", "dir", "limit", "after", "before", "last")
PAGE_SIZES = (25, 50, 100, 200, 500)  # the table's rows-per-page choices (any 1..500 in a URL)
PAGE_ROWS = 100  # rows per page unless the query says
CSV_PAGE_ROWS = 500  # rows the CSV export reads from the journal, and writes, at a time


def parse_range(value: str | None) -> tuple[str, int]:
    """A range name from the query (1h, 6h, 24h, 7d, 30d) and its length in seconds."""
    name = value or DEFAULT_RANGE
    if name not in RANGES:
        raise InvalidInput(f"range must be one of {', '.join(RANGES)}", field="range")
    return name, RANGES[name]


class DashboardData(DashboardSource):
    """Builds every dashboard page's data from the runtime (see DashboardSource for where it reads from)."""

    _labels_cache: tuple[int, tuple[list[str], list[str]]] | None = None  # (journal's latest event, labels)

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
            util = self.util_now(gid, lease, now, fallback=(spark["ts"], spark["last"]))
            gpus.append({
                "id": gid, "address": v["address"], "model": v["model"], "vendor": v["vendor"],
                "memory_bytes": v["memory_bytes"], "numa_node": v["numa_node"], "iommu_group": v["iommu_group"],
                "state": v["state"], "quarantine_reason": v["quarantine_reason"], "attention": v["attention"],
                "unviable_reason": v["unviable_reason"], "group_note": group_note(v["functions"]),
                "lease": None if lease is None else {
                    "id": lease.id, "domain": lease.domain_name, "state": lease.state.value,
                    "since": lease_start(lease), "task_type": lease.request.task_type,
                    "priority": lease.request.priority, "notice": lease.notice,
                    "paused": lease.reclaim_paused, "hb": self.heartbeat(lease, now, known=spark["ts"])},
                "spark": spark, "util": util,
            })
        live = list(m.leases.values())
        reaper = self.rt.reaper
        strikes = [s for s in (reaper.status() if reaper is not None else []) if s["strike"] != "none"]
        fleet = await self.fleet(notes)
        return {
            "now": now, "host_id": self.rt.settings.agent.host_id,
            "counts": {s: counts.get(s, 0) for s in STATE_ORDER}, "total": len(gpus), "gpus": gpus,
            "live_leases": sum(1 for x in live if x.state.holds_devices),
            "queued": [{"id": x.id, "domain": x.domain_name, "gpus": x.request.gpus, "priority": x.request.priority,
                        "since": x.queued_at or x.created_at, "position": m.queue_position(x), "eta": m.eta(x),
                        "deadline": queue_deadline(m.policy, x), "note": m.queue_notes.get(x.id),
                        "consolidation": m.consolidation.get(x.id)}
                       for x in m.queue()],
            "strikes": strikes, "hosts": fleet["hosts"] if fleet else [], "fleet": fleet, "store": self.store_status(),
            "ready": bool(self.rt.started and self.rt.hypervisor_ok), "notes": notes.items,
        }

    def store_status(self) -> dict[str, Any]:
        """Whether a store is configured and taking everything in time (see Runtime.store_health)."""
        if self.rt.store is None:
            return {"configured": False, "degraded": False, "problems": []}
        health = self.rt.store_health()  # the figures /readyz reports: the dashboard never says more or less
        return {"configured": True, "degraded": not health["ok"], **health}

    async def fleet(self, notes: Notes) -> dict[str, Any] | None:
        """The hosts sharing the store as each last published itself (services.fleet: the fleet page, and the
        overview's hosts block); None without a store, or when it cannot be read (noted)."""
        if not self.has_store:
            return None
        try:
            return await read_fleet(self.rt.store, now=self.clock(), this_host=self.rt.settings.agent.host_id,
                                    interval_s=self.rt.settings.store.fleet_publish_interval_s)
        except HostAgentError as exc:
            notes.add(f"usage store: {exc.message} (the fleet's hosts cannot be shown)")
            return None

    async def fleet_page(self) -> dict[str, Any]:
        """/ui/fleet: every host of the shared store, the fleet's idle candidates and totals."""
        notes = Notes()
        return {"fleet": await self.fleet(notes), "has_store": self.has_store, "now": self.clock(),
                "interval_s": self.rt.settings.store.fleet_publish_interval_s, "notes": notes.items}

    async def calendar_page(self, range_name: str | None) -> dict[str, Any]:
        """/ui/calendar: the calendar ahead (dashboard_calendar)."""
        m = self.rt.manager
        return calendar_view(m, self.clock(), range_name, lead_s(m))

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
        holder = self.rt.manager.lease_of(gpu_id)
        return {
            "gpu": view, "range": name, "ranges": list(RANGES), "since": since, "now": now,
            "util": self.util_now(gpu_id, holder, now, fallback=self.last_point(series)),
            "hb": self.heartbeat(holder, now, known=self.last_point(series)[0]),
            "bars": bars, "ticks": time_ticks(since, now), "leases": leases[:50],
            "series": series,
            "fallback": {"util": line_path(series["ts"], series["util"], since, now, vmax=100.0),
                         "mem": line_path(series["ts"], series["mem_gib"], since, now,
                                          vmax=(view["memory_bytes"] or 0) / 1024**3 or None)},
            "probes": probes, "events": collapse_retries([e.to_dict() for e in reversed(events)]),
            "lease": holder, "notes": notes.items, "has_store": self.has_store,
            "stuck": stuck_detach(holder, events, self.rt.manager.policy.detach_retries) if holder else None,
        }

    # -- leases --------------------------------------------------------------------------------------------------
    def lease_query(self, query: Mapping[str, str]) -> LeaseQuery:
        """The leases table's query string, checked (InvalidInput names the bad field); the CSV takes the same."""
        f = {k: (query.get(k) or "").strip() for k in LEASE_PARAMS}
        window = f["window"] or "7d"
        if window not in LEASE_WINDOWS:
            raise InvalidInput(f"window must be one of {', '.join(LEASE_WINDOWS)}", field="window")
        span = LEASE_WINDOWS[window]
        states: tuple[str, ...] | None = None
        if f["state"] == "live":
            states = tuple(s.value for s in LIVE_STATES)
        elif f["state"] == "ended":
            states = tuple(s.value for s in LeaseState if s.terminal)
        elif f["state"]:
            try:
                states = (LeaseState(f["state"].upper()).value,)
            except ValueError:
                raise InvalidInput("state must be live, ended or a lease state", field="state") from None
        sort = f["sort"] or "start"
        if sort not in LEASE_SORT_KEYS:
            raise InvalidInput(f"sort must be one of {', '.join(LEASE_SORT_KEYS)}", field="sort")
        if f["dir"] not in ("", "asc", "desc"):
            raise InvalidInput("dir must be asc or desc", field="dir")
        desc = f["dir"] != "asc"
        limit = PAGE_ROWS
        if f["limit"]:
            if not f["limit"].isdigit() or not 1 <= int(f["limit"]) <= max(PAGE_SIZES):
                raise InvalidInput(f"limit must be a number of rows 1..{max(PAGE_SIZES)}", field="limit")
            limit = int(f["limit"])
        if sum(bool(x) for x in (f["after"], f["before"], f["last"])) > 1:
            raise InvalidInput("ask for one page: after, before or last", field="after")
        where = LeaseFilter(states=states, since=None if span is None else self.clock() - span, vm=f["vm"],
                            gpu=f["gpu"], task=f["task"], project=f["project"])
        shown = {k: f[k] for k in ("state", "vm", "gpu", "task", "project")}
        return LeaseQuery(shown | {"window": window, "sort": sort, "dir": "desc" if desc else "asc",
                                   "limit": str(limit)}, where, sort, desc, limit, f["after"] or None,
                          f["before"] or None, bool(f["last"]))

    async def leases_page(self, query: Mapping[str, str]) -> dict[str, Any]:
        """One page of the filtered, sorted leases table (server-rendered), the rows it shows of how many, and the
        links to the other pages (keyset cursors: see hostagent/store/lease_listing.py)."""
        notes = Notes()
        q = self.lease_query(query)
        now = self.clock()
        utils: dict[str, float | None] = {}
        if q.sort == "util":
            ordered, utils = await self.util_order(q, notes)
            as_of = now
            page, total, offset = await self.rt.run(_util_page, self.rt.journal, q, ordered)
        else:
            page, total, offset, as_of = await self.rt.run(_sql_page, self.rt.journal, q, now)
        live = self.rt.manager.leases
        leases = [live.get(x.id, x) for x, _ in page]
        if q.sort != "util":
            utils = await self.lease_utils(leases, notes)
        out = [self.lease_row(x, now, utils.get(x.id)) for x in leases]
        order = Order(q.sort, q.desc, as_of)
        pages = max(1, -(-total // q.limit))
        base = {k: v for k, v in q.filters.items() if v}
        more = offset + len(out) < total
        links = {
            "first": _href("/ui/leases", base) if offset else None,
            "prev": _href("/ui/leases", base, before=encode_cursor(order, page[0][1])) if offset and page else None,
            "next": _href("/ui/leases", base, after=encode_cursor(order, page[-1][1])) if more and page else None,
            "last": _href("/ui/leases", base, last="1") if more else None,
            "csv": _href("/ui/leases.csv", {k: v for k, v in base.items() if k != "limit"}),
            "refresh": _href("/ui/api/leases", base, after=q.after, before=q.before, last="1" if q.last else None),
        }
        sort_links = {key: _href("/ui/leases", base, sort=key,
                                 dir="asc" if key == q.sort and q.desc else "desc") for key in LEASE_SORT_KEYS}
        tasks, projects = await self.lease_labels()
        f = q.filters
        return {"rows": out, "total": total, "count": len(out), "first": offset + 1 if out else 0,
                "last": offset + len(out), "shown": f"{offset + 1}–{offset + len(out)}" if out else "0",
                "page": min(pages, offset // q.limit + 1), "pages": pages, "links": links, "sort_links": sort_links,
                "filters": f, "windows": list(LEASE_WINDOWS), "page_sizes": list(PAGE_SIZES),
                "tasks": sorted(set(tasks) | ({f["task"]} if f["task"] else set())),
                "projects": sorted(set(projects) | ({f["project"]} if f["project"] else set())),
                "states": [s.value for s in LeaseState], "gpu_ids": sorted(self.rt.manager.gpus),
                "notes": notes.items, "now": now}

    async def lease_export(self, q: LeaseQuery) -> AsyncIterator[list[dict[str, Any]]]:
        """Every row the query's filters match, in its order, as table rows, CSV_PAGE_ROWS at a time: each batch is
        read from the journal (a keyset page after the last row written) when the one before has been written, so
        an export of any length holds one batch, never the whole list. Durations and GPU-hours of live leases run
        to the time the export started; the page and size of the table are ignored (every row)."""
        notes = Notes()
        now = self.clock()
        live = self.rt.manager.leases
        if q.sort == "util":  # an order from the usage store: ids and numbers of every row, documents by batch
            ordered, utils = await self.util_order(q, notes)
            for i in range(0, len(ordered), CSV_PAGE_ROWS):
                ids = [lid for _, lid, _ in ordered[i:i + CSV_PAGE_ROWS]]
                batch = await self.rt.run(self.rt.journal.leases_by_id, ids)
                yield [self.lease_row(live.get(x.id, x), now, utils.get(x.id)) for x in batch]
            return
        order = Order(q.sort, q.desc, now)
        after: Position | None = None
        while True:
            page = await self.rt.run(self.rt.journal.sorted_page, q.where, order, limit=CSV_PAGE_ROWS, after=after)
            if not page:
                return
            leases = [live.get(x.id, x) for x, _ in page]
            utils = await self.lease_utils(leases, notes)
            yield [self.lease_row(x, now, utils.get(x.id)) for x in leases]
            if len(page) < CSV_PAGE_ROWS:
                return
            after = page[-1][1]

    async def util_order(self, q: LeaseQuery, notes: Notes
                         ) -> tuple[list[tuple[tuple[float, ...], str, Position]], dict[str, float | None]]:
        """Every matching lease in order of mean utilization (leases with none last, in either direction; ties
        newest first), as (sort tuple, id, position), with the utilizations: the usage store orders this one, so
        the journal gives ids and numbers only and the order is made here."""
        found = await self.rt.run(self.rt.journal.lease_positions, q.where)
        refs = [_Ref(lid) for lid, _, _ in found]  # lease_utils reads the ids alone: no documents parsed for them
        utils = await self.lease_utils(cast("list[Lease]", refs), notes)
        ordered: list[tuple[tuple[float, ...], str, Position]] = []
        for lid, created, rowid in found:
            u = utils.get(lid)
            keys = (1, float(u)) if u is not None else (0, 0.0)
            ordered.append((_util_sort_key(keys, created, rowid, q.desc), lid, Position(keys, created, rowid)))
        ordered.sort()
        return ordered, utils

    async def lease_labels(self) -> tuple[list[str], list[str]]:
        """The task types and projects of the journal's leases (the filters' choices), read again only after the
        journal records a new event (a full scan of the documents, like the listing's count)."""
        latest = await self.rt.run(self.rt.journal.events, limit=1)
        key = latest[-1].seq if latest else 0
        if self._labels_cache is None or self._labels_cache[0] != key:
            self._labels_cache = (key, await self.rt.run(self.rt.journal.lease_labels))
        return self._labels_cache[1]

    def lease_row(self, x: Lease, now: float, util: float | None) -> dict[str, Any]:
        """One row of the leases table (and of its CSV)."""
        return {"id": x.id, "vm": x.domain_name, "domain_uuid": x.domain_uuid, "gpus": list(x.gpu_ids),
                "task": x.request.task_type, "priority": x.request.priority, "state": x.state.value,
                "css": state_css(x), "start": lease_start(x), "duration": lease_duration(x, now),
                "util": util, "reason": x.end_reason, "live": not x.state.terminal,
                "requested": x.request.gpus, "paused": x.reclaim_paused, "notice": x.notice,
                "project": x.request.project, "end": x.ended_at, "gpu_hours": gpu_hours(x, now)}

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
        m = self.rt.manager
        queue = None if lease.state is not LeaseState.QUEUED else {
            "position": m.queue_position(lease), "length": len(m.queue()), "eta": m.eta(lease),
            "deadline": queue_deadline(m.policy, lease), "since": lease.queued_at or lease.created_at,
            "note": m.queue_notes.get(lease.id)}
        newest = max((t for t in (self.last_point(x)[0] for x in series.values()) if t is not None), default=None)
        return {"lease": lease, "row": self.lease_row(lease, now, util), "series": series, "since": since,
                "until": until, "events": collapse_retries([e.to_dict() for e in reversed(events)]),
                "stuck": stuck_detach(lease, events, m.policy.detach_retries), "reaper": status,
                "queue": queue, "hb": self.heartbeat(lease, now, known=newest),
                "util_now": {gid: self.util_now(gid, lease if lease.state.holds_devices else None, now,
                                                fallback=self.last_point(x)) for gid, x in series.items()},
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
        now = self.clock()
        status = [dict(x, hb=self.heartbeat(self.rt.manager.leases.get(x["lease_id"]), now))
                  for x in (reaper.status() if reaper is not None else [])]
        return {"enabled": bool(settings and settings.enabled),
                "settings": None if settings is None else {
                    "check_interval_s": settings.check_interval_s, "grace_s": settings.grace_s,
                    "notice_window_s": settings.notice_window_s,
                    "idle_util_pct": settings.policy.idle_util_pct},
                "status": status,
                "events": [e.to_dict() for e in reversed(events)], "counts": dict(counts), "notes": notes.items,
                "now": now}

    async def model_page(self) -> dict[str, Any]:
        """The placement model in use, stored versions with their evaluation, and recent placement decisions."""
        notes = Notes()
        versions = await self.store_call(notes, "list_model_versions", kind="placement", limit=20) if self.has_store else None
        current = getattr(self.rt, "model_version", None)
        rule = getattr(self.rt, "placement_rule", None)
        active = next((v for v in versions or [] if v.get("active")), None)
        follower = getattr(self.rt, "models", None)  # services.model_follow: the switches, the versions not loaded
        changes = [c.to_dict() for c in reversed(follower.changes)] if follower is not None else []
        if follower is not None and active is not None and active["version"] in follower.failed:
            notes.add(f"The store's active model {active['version']} could not be loaded "
                      f"({follower.failed[active['version']]}); this agent keeps {current or 'the cold-start rule'}.")
        m = self.rt.manager
        decisions = []
        for x in await self.all_leases():
            if not x.devices:
                continue
            decisions.append({"id": x.id, "vm": x.domain_name, "gpus": list(x.gpu_ids), "at": lease_start(x),
                              "task": x.request.task_type, "requested": x.request.gpus,
                              "distance": x.distance, "reasons": list(x.reasons), "css": state_css(x)})
            if len(decisions) >= 40:
                break
        return {"current": current, "rule": rule or "cold-start",
                "active": active, "versions": versions or [], "has_store": self.has_store,
                "changes": changes, "since": changes[0]["at"] if changes else None,
                "check_s": self.rt.settings.placement.model_check_interval_s,
                "decisions": decisions, "notes": notes.items, "now": self.clock(),
                "queue_order": self.rt.settings.leases.queue_order, "fairness": m.policy.fairness,
                "explore": {"epsilon": self.rt.settings.placement.explore_epsilon,
                            "max_priority": self.rt.settings.placement.explore_max_priority},
                "queue": [{"id": x.id, "vm": x.domain_name, "task": x.request.task_type,
                           "position": m.queue_position(x), "note": m.queue_notes.get(x.id)} for x in m.queue()]}


@dataclass(frozen=True, slots=True)
class LeaseQuery:
    """A checked leases-table query: the values its form and links carry, the journal's filter, the order, the
    rows per page and the page asked for (after or before a cursor, the last one, or else the first)."""

    filters: dict[str, str]
    where: LeaseFilter
    sort: str
    desc: bool
    limit: int
    after: str | None
    before: str | None
    last: bool


@dataclass(frozen=True, slots=True)
class _Ref:
    """A lease known by its id alone (all that lease_utils reads of one)."""

    id: str


def _href(path: str, base: Mapping[str, str], **extra: str | None) -> str:
    """A link to `path` with the query `base` updated by `extra` (None values left out)."""
    params = dict(base) | {k: v for k, v in extra.items() if v is not None}
    return f"{path}?{urlencode(params)}" if params else path


def _sql_page(journal: Any, q: LeaseQuery, now: float) -> tuple[list[tuple[Lease, Position]], int, int, float]:
    """(rows with their positions, total, rows before the first, as_of) of the page a query asks for, from the
    journal (worker thread). A page before a cursor that comes up short is the first page, full; a page after the
    end (its rows were pruned) is the first page too."""
    as_of, after, before = now, None, None
    if q.after:
        as_of, after = decode_cursor(q.after, q.sort, q.desc, field="after")
    if q.before:
        as_of, before = decode_cursor(q.before, q.sort, q.desc, field="before")
    order = Order(q.sort, q.desc, as_of)
    if q.last:
        total, _ = journal.count_sorted(q.where)
        page = journal.sorted_page(q.where, order, limit=(total - 1) % q.limit + 1, from_end=True) if total else []
    else:
        page = journal.sorted_page(q.where, order, limit=q.limit, after=after, before=before)
        if (before is not None and len(page) < q.limit) or (after is not None and not page):
            page = journal.sorted_page(q.where, order, limit=q.limit)
    total, offset = journal.count_sorted(q.where, order, page[0][1] if page else None)
    return page, total, offset, as_of


def _util_sort_key(keys: tuple[Any, ...], created_at: float, rowid: int, desc: bool) -> tuple[float, ...]:
    """The ascending sort tuple of a position in the utilization order; InvalidInput for keys no page wrote."""
    if len(keys) != 2 or not all(isinstance(k, (int, float)) and not isinstance(k, bool) for k in keys):
        raise InvalidInput("cursor is not one this page issued", field="after")
    s = -1.0 if desc else 1.0
    return (s * keys[0], s * keys[1], -created_at, -rowid)


def _util_page(journal: Any, q: LeaseQuery, ordered: list[tuple[tuple[float, ...], str, Position]]
               ) -> tuple[list[tuple[Lease, Position]], int, int]:
    """(rows with their positions, total, rows before the first) of the page a query asks for in an order made
    outside the journal (worker thread): the same pages as `_sql_page`, cut from the ordered list."""
    total = len(ordered)
    sort_keys = [k for k, _, _ in ordered]
    start = 0
    if q.last and total:
        start = total - ((total - 1) % q.limit + 1)
    elif q.before or q.after:
        _, pos = decode_cursor(q.before or q.after or "", q.sort, q.desc, field="before" if q.before else "after")
        key = _util_sort_key(pos.keys, pos.created_at, pos.rowid, q.desc)
        if q.before:
            i = bisect.bisect_left(sort_keys, key)
            start = i - q.limit if i >= q.limit else 0
        else:
            i = bisect.bisect_right(sort_keys, key)
            start = i if i < total else 0
    chunk = ordered[start:start + q.limit]
    where = {lid: pos for _, lid, pos in chunk}
    leases = journal.leases_by_id([lid for _, lid, _ in chunk])
    return [(x, where[x.id]) for x in leases], total, start


__all__ = ["Bar", "DashboardData", "LeaseQuery", "Notes", "RANGES", "bucket_series", "csv_cell", "downsample",
           "line_path", "parse_range", "spark_segments", "state_css", "time_ticks", "timeline_bars", "with_gaps"]


# -- a stuck detach ----------------------------------------------------------------------------------------------
RETRY = "detach retry "  # the detail of each retry the guest ignored (services.release_path.finish_release)


def collapse_retries(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Events newest first, each run of one lease's ignored detach retries as one line with its count and span: a
    detach stuck for hours reads as one entry, not one per retry."""
    out: list[dict[str, Any]] = []
    for e in events:
        retry = (e.get("to_state") == e.get("from_state") == "DETACH_PENDING"
                 and (e.get("detail") or "").startswith(RETRY))
        last = out[-1] if out else None
        if retry and last is not None and last.get("retries") and last.get("lease_id") == e.get("lease_id"):
            last["retries"] += 1
            last["first_ts"] = e["ts"]
            last["detail"] = (f"detach retried {last['retries']} times over {duration(last['ts'] - e['ts'])}: "
                              "still not acknowledged (no DEVICE_REMOVED); GPU stays on vfio-pci")
            continue
        out.append({**e, "retries": 1, "first_ts": e["ts"]} if retry else e)
    return out


def stuck_detach(lease: Lease, events: Sequence[Any], retries: int) -> dict[str, Any] | None:
    """What the operator needs about a detach the guest has not acknowledged: since when (the lease's first step to
    DETACH_PENDING), how many tries, whether the agent still retries by itself. None unless DETACH_PENDING."""
    if lease.state is not LeaseState.DETACH_PENDING:
        return None
    firsts = [e.ts for e in events if e.lease_id == lease.id and e.to_state == "DETACH_PENDING"
              and e.from_state != "DETACH_PENDING"]
    return {"since": firsts[-1] if firsts else None, "attempts": lease.detach_attempts,
            "retries_left": max(0, retries + 1 - lease.detach_attempts)}
