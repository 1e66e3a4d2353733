"""Where the dashboard's numbers come from: the runtime's journal, the optional usage store and the heartbeats
held in memory. It owns reading them safely for a page: every journal lease (parsed once per journal change, live
ones overlaid from the manager), store calls that note a failure instead of raising (the store may be absent or
down, and the page then says so and shows what the agent holds in memory), usage per GPU or per lease (chart
series, sparklines, mean utilization), and how fresh it is: a figure's age, and when the agent last heard from a
lease's guest (stale past `dashboard.stale_after_s`). `DashboardSource` is the base of `DashboardData`, which
builds the pages.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from hostagent.domain.errors import HostAgentError, NotFound
from hostagent.domain.lease import Lease, LeaseState
from hostagent.web.dashboard_charts import bucket_series, downsample, lease_start, spark_segments, with_gaps
from hostagent.web.dashboard_format import age_view, heartbeat_view

SPARK_WINDOW_S = 3600
SPARK_BUCKET_S = 60
OWN_SAMPLE_SLACK_S = 60.0  # a GPU's newest sample counts as its current lease's when at most this much older


@dataclass
class Notes:
    """Problems met while gathering a page (store unreachable...), shown as a banner instead of failing."""

    items: list[str] = field(default_factory=list)

    def add(self, text: str) -> None:
        """Remember a problem once."""
        if text not in self.items:
            self.items.append(text)


class DashboardSource:
    """Reads leases and usage from the runtime for the dashboard; the store is optional and may be down."""

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

    # -- freshness -----------------------------------------------------------------------------------------------
    @property
    def stale_after(self) -> float:
        """dashboard.stale_after_s: a heartbeat or a figure older than this is stale."""
        return float(self.rt.settings.dashboard.stale_after_s)

    def newest_sample(self, gpu_id: str, lease_id: str | None = None) -> tuple[float, float] | None:
        """(ts, util) of the newest guest sample held in memory for a GPU (from one lease's window, when given)."""
        windows = ([self.rt.recent_samples.get(lease_id) or ()] if lease_id is not None
                   else list(self.rt.recent_samples.values()))
        best: tuple[float, float] | None = None
        for window in windows:
            for smp in list(window):
                if smp.get("gpu_id") == gpu_id and (best is None or smp["ts"] > best[0]):
                    best = (float(smp["ts"]), float(smp["util_pct"]))
        return best

    def heard_from(self, lease: Lease, known: float | None = None) -> float | None:
        """When the agent last heard from a lease's guest: its last heartbeat's arrival or the newest sample held in
        memory, else `known` (a sample time from the store, e.g. after the agent restarted)."""
        times = [getattr(self.rt, "last_heartbeat", {}).get(lease.id)]
        window = self.rt.recent_samples.get(lease.id)
        if window:
            times.append(max(float(smp["ts"]) for smp in list(window)))
        if known is not None and known >= lease_start(lease) - OWN_SAMPLE_SLACK_S:
            times.append(known)
        found = [t for t in times if t is not None]
        return max(found) if found else None

    def heartbeat(self, lease: Lease | None, now: float, known: float | None = None) -> dict[str, Any] | None:
        """The heartbeat line of a lease that holds GPUs (see dashboard_format.heartbeat_view); None otherwise."""
        if lease is None or not lease.state.holds_devices:
            return None
        return heartbeat_view(self.heard_from(lease, known), lease_start(lease), now, self.stale_after)

    def util_now(self, gpu_id: str, lease: Lease | None, now: float,
                 fallback: tuple[float | None, float | None] | None = None) -> dict[str, Any]:
        """A GPU's current utilization under its lease, with its age: the newest sample held in memory, else
        `fallback` (ts, value) from the store; nothing when the newest data predates the lease (another guest's)."""
        if lease is None:
            return {"value": None, **age_view(None, now, self.stale_after)}
        found = self.newest_sample(gpu_id, lease.id)
        if found is None and fallback is not None and fallback[0] is not None and fallback[1] is not None:
            found = (float(fallback[0]), float(fallback[1]))
        if found is None or found[0] < lease_start(lease) - OWN_SAMPLE_SLACK_S:
            return {"value": None, **age_view(None, now, self.stale_after)}
        return {"value": round(found[1], 1), **age_view(found[0], now, self.stale_after)}

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

    @staticmethod
    def last_point(series: dict[str, Any]) -> tuple[float | None, float | None]:
        """(ts, util) of a chart series' last point with data."""
        return next(((t, v) for t, v in zip(reversed(series["ts"]), reversed(series["util"])) if v is not None),
                    (None, None))

    async def sparkline(self, gpu_id: str, now: float, notes: Notes) -> dict[str, Any]:
        """Last hour of utilization in one-minute buckets, as SVG segments, plus the latest value."""
        since = now - SPARK_WINDOW_S
        rows = None
        if self.has_store:
            rows = await self.store_call(notes, "gpu_history", gpu_id, since, now, "minute")
        held = self._window_points(gpu_id, since, now + 1.0)
        if rows is not None:
            samples = [(float(r["ts"]), r.get("util_mean")) for r in rows]
            samples += [(p[0], p[1]) for p in self._fresher(gpu_id, samples, now, SPARK_BUCKET_S)]
        else:
            samples = [(p[0], p[1]) for p in held if p[0] < now]
        values = bucket_series(samples, since, now, SPARK_BUCKET_S)
        last = next((v for v in reversed(values) if v is not None), None)
        # when the newest sample was taken: held in memory to the second; from the store, its minute's start
        newest = max((p[0] for p in held), default=None)
        if newest is None:
            newest = max((t for t, v in samples if v is not None), default=None)
        return {"segments": spark_segments(values), "last": None if last is None else round(last, 1),
                "points": sum(1 for v in values if v is not None), "ts": newest}

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


__all__ = ["SPARK_BUCKET_S", "SPARK_WINDOW_S", "DashboardSource", "Notes"]
