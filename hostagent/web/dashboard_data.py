"""Dashboard view models: what each page shows, gathered from the runtime (manager, journal, reaper, store).

Everything here returns plain dicts/lists ready for a template or for JSON. The usage store is optional: without
it (or while it is unreachable) usage comes from the in-memory heartbeat window and the page says so. The
geometry of the server-rendered SVG (sparklines, lease timeline, fallback line charts) lives here as pure
functions so it can be tested without a browser.
"""

from __future__ import annotations

import collections
import inspect
import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from hostagent.domain.errors import HostAgentError, InvalidInput, NotFound
from hostagent.domain.inventory import GpuState
from hostagent.domain.lease import Lease, LeaseState

RANGES: dict[str, int] = {"1h": 3600, "6h": 6 * 3600, "24h": 86400, "7d": 7 * 86400, "30d": 30 * 86400}
DEFAULT_RANGE = "24h"
LEASE_WINDOWS: dict[str, int | None] = {"24h": 86400, "7d": 7 * 86400, "30d": 30 * 86400, "all": None}
STATE_ORDER = [s.value for s in (GpuState.FREE, GpuState.LEASED, GpuState.WARNED, GpuState.DETACH_PENDING,
                                 GpuState.QUARANTINED, GpuState.UNAVAILABLE)]
RECLAIM_KINDS = ("strike-one", "strike-cleared", "strike-two", "reclaim", "reclaim-outcome")
LIVE_STATES = frozenset(s for s in LeaseState if not s.terminal)
MAX_POINTS = 600  # a chart never gets more points than a laptop screen has pixels for
SPARK_WINDOW_S = 3600
SPARK_BUCKET_S = 60
LEASE_SORT_KEYS = ("vm", "gpus", "task", "priority", "state", "start", "duration", "util", "reason")
PAGE_ROWS = 200


# ---- small pure helpers ----------------------------------------------------------------------------------------


def parse_range(value: str | None) -> tuple[str, int]:
    """A range name from the query (1h, 6h, 24h, 7d, 30d) and its length in seconds."""
    name = value or DEFAULT_RANGE
    if name not in RANGES:
        raise InvalidInput(f"range must be one of {', '.join(RANGES)}", field="range")
    return name, RANGES[name]


def lease_start(lease: Lease) -> float:
    """When the lease started holding devices (or was asked for, when never granted)."""
    return lease.granted_at or lease.created_at


def lease_duration(lease: Lease, now: float) -> float:
    """Seconds from start to end (or to now while live)."""
    return max(0.0, (lease.ended_at or now) - lease_start(lease))


def downsample(points: Sequence[tuple[float, float | None, float | None]], max_points: int = MAX_POINTS
               ) -> list[tuple[float, float | None, float | None]]:
    """Average (ts, util, mem) points into at most max_points time buckets (keeps chart payloads small)."""
    if len(points) <= max_points:
        return list(points)
    lo, hi = points[0][0], points[-1][0]
    width = (hi - lo) / max_points or 1.0
    acc: dict[int, list[Any]] = {}
    for ts, util, mem in points:
        k = min(max_points - 1, int((ts - lo) / width))
        a = acc.setdefault(k, [ts, 0.0, 0, 0.0, 0])
        if util is not None:
            a[1] += util
            a[2] += 1
        if mem is not None:
            a[3] += mem
            a[4] += 1
    return [(a[0], a[1] / a[2] if a[2] else None, a[3] / a[4] if a[4] else None) for _, a in sorted(acc.items())]


def with_gaps(points: Sequence[tuple[float, float | None, float | None]], *, step_s: float | None = None
              ) -> list[tuple[float, float | None, float | None]]:
    """Insert a null point where samples stop for a while, so charts do not draw a line across the gap."""
    if len(points) < 3:
        return list(points)
    if step_s is None:
        steps = sorted(b[0] - a[0] for a, b in zip(points, points[1:]))
        step_s = steps[len(steps) // 2]
    limit = max(step_s * 3, 1.0)
    out = [points[0]]
    for prev, cur in zip(points, points[1:]):
        if cur[0] - prev[0] > limit:
            out.append((prev[0] + step_s, None, None))
        out.append(cur)
    return out


def spark_segments(values: Sequence[float | None], *, width: float = 120, height: float = 28,
                   vmax: float = 100.0) -> list[str]:
    """SVG polyline point lists for a sparkline; a None breaks the line (no data is not zero)."""
    if not values:
        return []
    n = len(values)
    dx = width / max(1, n - 1)
    segs: list[str] = []
    cur: list[str] = []
    for i, v in enumerate(values):
        if v is None:
            if cur:
                segs.append(" ".join(cur))
                cur = []
            continue
        y = height - 1 - (min(max(v, 0.0), vmax) / vmax) * (height - 2)
        cur.append(f"{i * dx:.1f},{y:.1f}")
    if cur:
        segs.append(" ".join(cur))
    # a lone point would be invisible as a polyline: give it a tiny horizontal extent
    return [s if " " in s else f"{s} {float(s.split(',')[0]) + 1:.1f},{s.split(',')[1]}" for s in segs]


def bucket_series(samples: Iterable[tuple[float, float | None]], since: float, until: float, bucket_s: float
                  ) -> list[float | None]:
    """Mean value per fixed bucket over [since, until); None for empty buckets."""
    n = max(1, int(math.ceil((until - since) / bucket_s)))
    sums = [0.0] * n
    counts = [0] * n
    for ts, v in samples:
        if v is None or ts < since or ts >= until:
            continue
        k = int((ts - since) // bucket_s)
        sums[k] += v
        counts[k] += 1
    return [sums[i] / counts[i] if counts[i] else None for i in range(n)]


@dataclass(frozen=True, slots=True)
class Bar:
    """One lease on a timeline: x and width in SVG units."""

    x: float
    w: float
    lease_id: str
    label: str
    css: str
    start: float
    end: float | None
    title: str


def timeline_bars(leases: Sequence[Lease], since: float, until: float, *, width: float = 1000.0) -> list[Bar]:
    """Bars for the leases overlapping [since, until), clipped to the window, in start order; a live lease runs
    to `until`."""
    span = max(1.0, until - since)
    bars = []
    for x in sorted(leases, key=lease_start):
        start = lease_start(x)
        end = x.ended_at
        stop = end if end is not None else until
        if stop < since or start >= until:
            continue
        a = max(start, since)
        b = min(stop, until)
        px = (a - since) / span * width
        pw = max(2.0, (b - a) / span * width)
        css = state_css(x)
        title = f"{x.id} · {x.domain_name} · {x.request.task_type} · {x.state.value}"
        if x.end_reason:
            title += f" · {x.end_reason}"
        bars.append(Bar(round(px, 1), round(min(pw, width - px), 1), x.id, x.domain_name, css, start, end, title))
    return bars


def time_ticks(since: float, until: float, *, width: float = 1000.0, target: int = 6) -> list[tuple[float, float]]:
    """(x, ts) of round-valued tick marks across a window."""
    span = max(1.0, until - since)
    steps = (60, 300, 900, 1800, 3600, 3 * 3600, 6 * 3600, 12 * 3600, 86400, 2 * 86400, 7 * 86400)
    step = next((s for s in steps if span / s <= target), steps[-1])
    first = math.ceil(since / step) * step
    out = []
    t = first
    while t < until:
        out.append((round((t - since) / span * width, 1), float(t)))
        t += step
    return out


def line_path(ts: Sequence[float], values: Sequence[float | None], since: float, until: float, *,
              width: float = 1000.0, height: float = 120.0, vmax: float | None = None) -> list[str]:
    """Server-rendered line chart (the no-JavaScript fallback): polyline point lists, broken at gaps."""
    vals = [v for v in values if v is not None]
    top = vmax if vmax is not None else (max(vals) * 1.1 if vals else 1.0) or 1.0
    span = max(1.0, until - since)
    segs: list[str] = []
    cur: list[str] = []
    for t, v in zip(ts, values):
        if v is None:
            if cur:
                segs.append(" ".join(cur))
                cur = []
            continue
        x = (t - since) / span * width
        y = height - (min(v, top) / top) * (height - 4) - 2
        cur.append(f"{x:.1f},{y:.1f}")
    if cur:
        segs.append(" ".join(cur))
    return segs


def state_css(lease: Lease) -> str:
    """The colour class of a lease: live, warned, pending, reclaimed, failed, ended."""
    if lease.state is LeaseState.DETACH_PENDING:
        return "pending"
    if lease.state is LeaseState.FAILED:
        return "failed"
    if lease.state is LeaseState.QUEUED:
        return "queued"
    if not lease.state.terminal:
        return "warned" if lease.notice else "live"
    if (lease.end_reason or "").startswith("reclaim"):
        return "reclaimed"
    if lease.state is LeaseState.EXPIRED:
        return "expired"
    return "ended"


def csv_cell(value: Any) -> str:
    """A CSV cell that a spreadsheet will not run as a formula (VM names come from outside)."""
    text = "" if value is None else str(value)
    return "'" + text if text[:1] in ("=", "+", "-", "@", "\t", "\r") else text


# ---- the runtime-facing part -----------------------------------------------------------------------------------


@dataclass
class Notes:
    """Problems met while gathering a page (store unreachable...), shown as a banner instead of failing."""

    items: list[str] = field(default_factory=list)

    def add(self, text: str) -> None:
        """Remember a problem once."""
        if text not in self.items:
            self.items.append(text)


class DashboardData:
    """Reads everything a dashboard page needs from the runtime; the store is optional and may be down."""

    def __init__(self, runtime: Any, clock: Any = time.time) -> None:
        self.rt = runtime
        self.clock = clock
        self._leases_cache: tuple[int, list[Lease]] | None = None

    async def all_leases(self, *, states: Iterable[LeaseState] | None = None, since: float | None = None
                         ) -> list[Lease]:
        """Every journal lease, newest first, live ones as the manager holds them now.

        Parsing every lease document is the dashboard's biggest cost, so the parsed list is kept until the
        journal records a new event (every transition writes one; live leases are overlaid from memory anyway).
        """
        latest = await self.rt.run(self.rt.journal.events, limit=1)
        key = latest[-1].seq if latest else 0
        if self._leases_cache is None or self._leases_cache[0] != key:
            self._leases_cache = (key, await self.rt.run(self.rt.journal.leases, limit=10_000_000))
        live = self.rt.manager.leases
        rows = [live.get(x.id, x) for x in self._leases_cache[1]]
        if states is not None:
            wanted = set(states)
            rows = [x for x in rows if x.state in wanted]
        if since is not None:  # the journal's own rule: created after, or still running / ended after
            rows = [x for x in rows if x.created_at >= since or (x.ended_at or 1e18) >= since]
        return rows

    # -- store access --------------------------------------------------------------------------------------------
    @property
    def has_store(self) -> bool:
        """True when a usage store is configured."""
        return self.rt.store is not None

    async def store_call(self, notes: Notes, name: str, *args: Any, **kwargs: Any) -> Any:
        """Call a store method (sync in a thread, or async); None when absent or failing (noted)."""
        store = self.rt.store
        fn = getattr(store, name, None) if store is not None else None
        if fn is None:
            return None
        try:
            if inspect.iscoroutinefunction(fn):
                return await fn(*args, **kwargs)
            return await self.rt.run(fn, *args, **kwargs)
        except NotFound:
            return None
        except HostAgentError as exc:
            notes.add(f"usage store: {exc.message} (showing what this agent holds in memory)")
            return None

    # -- usage ---------------------------------------------------------------------------------------------------
    def _window_points(self, gpu_id: str, since: float, until: float) -> list[tuple[float, float | None, float | None]]:
        """(ts, util, mem) of heartbeat samples held in memory for one GPU."""
        pts: list[tuple[float, float | None, float | None]] = []
        for window in list(self.rt.recent_samples.values()):
            for s in list(window):
                if s.get("gpu_id") == gpu_id and since <= s["ts"] < until:
                    pts.append((float(s["ts"]), float(s["util_pct"]), float(s.get("mem_used_bytes") or 0)))
        pts.sort(key=lambda p: p[0])
        return pts

    def _fresher(self, gpu_id: str, stored: Sequence[tuple[Any, ...]], until: float, bucket_s: float
                 ) -> list[tuple[float, float | None, float | None]]:
        """Heartbeats held in memory that are newer than the store's last point (still queued for the store)."""
        if not stored:
            return self._window_points(gpu_id, float("-inf"), until)
        # a rollup bucket is stamped with its start: skip memory points inside the last stored bucket
        last = max(p[0] for p in stored) + bucket_s
        return [p for p in self._window_points(gpu_id, last, until) if p[0] > last]

    async def gpu_series(self, gpu_id: str, since: float, until: float, notes: Notes) -> dict[str, Any]:
        """Utilization (%) and memory (GiB) of one GPU over a window, columnar for uPlot."""
        rows = None
        step: float | None = None
        if self.has_store:
            rows = await self.store_call(notes, "gpu_history", gpu_id, since, until, "auto")
        if rows is not None:
            pts = [(float(r["ts"]), r.get("util_mean"), r.get("mem_mean")) for r in rows]
            if len(rows) > 1 and rows[0].get("n", 1) > 1:
                step = 3600.0 if until - since > 3 * 86400 else 60.0
            pts += [p for p in self._fresher(gpu_id, pts, until, step or 0.0) if p[0] >= since]
            source = "store"
        else:
            pts = self._window_points(gpu_id, since, until)
            source = "memory"
        pts = with_gaps(downsample(pts), step_s=step)
        gib = 1024.0 ** 3
        return {"gpu_id": gpu_id, "since": since, "until": until, "source": source,
                "ts": [p[0] for p in pts],
                "util": [None if p[1] is None else round(float(p[1]), 2) for p in pts],
                "mem_gib": [None if p[2] is None else round(float(p[2]) / gib, 3) for p in pts]}

    async def sparkline(self, gpu_id: str, now: float, notes: Notes) -> dict[str, Any]:
        """Last hour of utilization in one-minute buckets, as SVG segments, plus the latest value."""
        since = now - SPARK_WINDOW_S
        rows = None
        if self.has_store:
            rows = await self.store_call(notes, "gpu_history", gpu_id, since, now, "minute")
        if rows is not None:
            samples = [(float(r["ts"]), r.get("util_mean")) for r in rows]
            samples += [(p[0], p[1]) for p in self._fresher(gpu_id, samples, now, SPARK_BUCKET_S)]
        else:
            samples = [(p[0], p[1]) for p in self._window_points(gpu_id, since, now)]
        values = bucket_series(samples, since, now, SPARK_BUCKET_S)
        last = next((v for v in reversed(values) if v is not None), None)
        return {"segments": spark_segments(values), "last": None if last is None else round(last, 1),
                "points": sum(1 for v in values if v is not None)}

    async def lease_util(self, lease: Lease, notes: Notes) -> float | None:
        """Mean utilization of a lease (store rollups, else the in-memory window)."""
        if self.has_store:
            summary = await self.store_call(notes, "lease_usage_summary", lease.id)
            if summary is not None:
                total = summary.get("total") or {}
                return total.get("util_mean")
        window = self.rt.recent_samples.get(lease.id)
        if not window:
            return None
        vals = [float(s["util_pct"]) for s in list(window)]
        return sum(vals) / len(vals) if vals else None

    async def lease_utils(self, leases: Sequence[Lease], notes: Notes) -> dict[str, float | None]:
        """Mean utilization of many leases in one store query (hourly rollups), else the in-memory windows."""
        out: dict[str, float | None] = {}
        ids = [x.id for x in leases]
        if self.has_store and ids:
            sync = getattr(self.rt.store, "store", self.rt.store)  # the sync UsageStore behind the async facade
            try:
                out = await self.rt.run(_rollup_util_means, sync, ids)
            except HostAgentError as exc:
                notes.add(f"usage store: {exc.message} (showing what this agent holds in memory)")
            except Exception as exc:  # an unreachable database must not take the dashboard down
                notes.add(f"usage store unreachable ({type(exc).__name__}); showing what this agent holds in memory")
        for x in leases:
            if out.get(x.id) is None:
                window = self.rt.recent_samples.get(x.id)
                vals = [float(s["util_pct"]) for s in list(window or ())]
                out[x.id] = sum(vals) / len(vals) if vals else None
        return out

    # -- overview ------------------------------------------------------------------------------------------------
    async def overview(self) -> dict[str, Any]:
        """Counts at the top, one row per GPU, the queue, reclaim activity, and fleet hosts when shared."""
        notes = Notes()
        now = self.clock()
        m = self.rt.manager
        gpus = []
        counts: collections.Counter[str] = collections.Counter()
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


def _rollup_util_means(store: Any, lease_ids: Sequence[str]) -> dict[str, float | None]:
    """Mean utilization per lease from the store's hourly rollups (worker thread; chunks keep IN lists short).

    Uses the store's own method when it has one; otherwise reads the rollups table directly (read-only).
    """
    own = getattr(store, "lease_util_means", None)
    if own is not None:
        return dict(own(list(lease_ids)))
    from sqlalchemy import func, select
    from sqlalchemy.exc import SQLAlchemyError

    from hostagent.domain.errors import StoreUnavailable
    from hostagent.store import schema as t

    r = t.usage_rollups.c
    out: dict[str, float | None] = {}
    try:
        with store.engine.connect() as c:
            for i in range(0, len(lease_ids), 500):
                chunk = list(lease_ids[i:i + 500])
                q = (select(r.lease_id, func.sum(r.util_sum), func.sum(r.util_n))
                     .where(r.host_id == store.host_id, r.resolution == t.RES_HOUR, r.lease_id.in_(chunk))
                     .group_by(r.lease_id))
                for lid, total, n in c.execute(q):
                    out[lid] = float(total) / float(n) if n else None
    except SQLAlchemyError as exc:
        raise StoreUnavailable(f"cannot read lease usage: {type(exc).__name__}") from exc
    return out


__all__ = ["Bar", "DashboardData", "Notes", "RANGES", "bucket_series", "csv_cell", "downsample", "line_path",
           "parse_range", "spark_segments", "state_css", "time_ticks", "timeline_bars", "with_gaps"]
