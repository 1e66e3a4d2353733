"""The calendar page's data: every GPU's time ahead, its running lease until the lease's expiry and its bookings
over their windows (a mark where the agent binds them), and the list of bookings. Read from the lease manager's
memory (what the agent decides by), never the store."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hostagent.domain.errors import InvalidInput
from hostagent.domain.lease import Lease, LeaseState
from hostagent.web.dashboard_charts import time_ticks

WIDTH = 1000.0
RANGES = {"24h": 86400, "7d": 7 * 86400, "30d": 30 * 86400}
DEFAULT_RANGE = "7d"
S = LeaseState


@dataclass(frozen=True)
class Span:
    """One bar of a GPU's row: a running lease or a booking, clipped to the page's window."""

    x: float
    w: float
    lease_id: str
    css: str  # live | warned | booked
    title: str
    mark: float | None = None  # where a booking binds (its start less the lead time), x


def calendar_view(manager: Any, now: float, range_name: str | None, lead_s: float) -> dict[str, Any]:
    """Rows (one per GPU) of spans over [now, now + range), the ticks, and the bookings in start order."""
    name = range_name or DEFAULT_RANGE
    if name not in RANGES:
        raise InvalidInput(f"range must be one of {', '.join(RANGES)}", field="range")
    until = now + RANGES[name]
    span = until - now

    def x_of(t: float) -> float:
        return round(max(0.0, min(WIDTH, (t - now) / span * WIDTH)), 1)

    rows: dict[str, list[Span]] = {gid: [] for gid in sorted(manager.gpus)}
    bookings: list[Lease] = []
    for lease in manager.leases.values():
        if lease.state is S.BOOKED and lease.request.start_at is not None and lease.request.duration_s:
            bookings.append(lease)
            start, end = lease.request.start_at, lease.request.start_at + lease.request.duration_s
            if start >= until or end <= now:
                continue
            title = (f"{lease.id} · {lease.domain_name} · booked {lease.request.task_type} · priority "
                     f"{lease.request.priority}")
            for gid in lease.booked_gpus:
                if gid in rows:
                    a = x_of(start)
                    rows[gid].append(Span(a, max(2.0, x_of(end) - a), lease.id, "booked", title,
                                          x_of(start - lead_s)))
        elif lease.state.holds_devices:
            end = lease.expires_at if lease.expires_at is not None else until
            css = "warned" if lease.notice else ("pending" if lease.state is S.DETACH_PENDING else "live")
            title = f"{lease.id} · {lease.domain_name} · {lease.request.task_type} · {lease.state.value}"
            for gid in lease.gpu_ids:
                if gid in rows:
                    rows[gid].append(Span(0.0, max(2.0, x_of(end)), lease.id, css, title))
    bookings.sort(key=lambda x: (x.request.start_at or 0, x.created_at))
    return {
        "range": name, "ranges": list(RANGES), "now": now, "until": until, "lead_s": lead_s,
        "ticks": time_ticks(now, until, width=WIDTH),
        "rows": [{"gpu": gid, "model": manager.gpus[gid].model, "spans": spans,
                  "quarantined": manager.quarantined.get(gid)} for gid, spans in rows.items()],
        "bookings": [{"id": x.id, "domain": x.domain_name, "task_type": x.request.task_type,
                      "priority": x.request.priority, "gpus": list(x.booked_gpus), "start": x.request.start_at,
                      "end": (x.request.start_at or 0) + (x.request.duration_s or 0),
                      "binds_at": (x.request.start_at or 0) - lead_s, "reasons": list(x.reasons)}
                     for x in bookings],
    }
