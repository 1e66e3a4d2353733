"""Dashboard chart geometry and series shaping: pure functions from leases and samples to what a chart draws. It
owns the server-rendered SVG (sparklines, the lease timeline's bars and ticks, the no-JavaScript line charts),
the thinning of usage series for uPlot (downsampling, null points at gaps so no line crosses missing data), and
the small lease facts they rest on (when a lease started, how long it ran, its colour class). Nothing here reads
the runtime, the store or a request, so all of it is tested without a browser or an agent.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from hostagent.domain.lease import Lease, LeaseState

MAX_POINTS = 600  # a chart never gets more points than a laptop screen has pixels for


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


__all__ = ["MAX_POINTS", "Bar", "bucket_series", "downsample", "lease_duration", "lease_start", "line_path",
           "spark_segments", "state_css", "time_ticks", "timeline_bars", "with_gaps"]
