"""The leases CSV export: its column names, spreadsheet-safe cells, GPU-hours, and the leases table's rows written
as CSV text. It owns what a downloaded `hostagent-leases-<host>.csv` holds: every row the table's filters match
(not just one page), in the table's order, one lease a line, times in ISO-8601 UTC, and no cell a spreadsheet
would run as a formula (VM names and projects come from outside). The request handler streams it (header first,
then one `csv_lines` batch at a time, as DashboardData.lease_export reads them); it lives with the other pages.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Iterable
from typing import Any

from hostagent.domain.lease import Lease
from hostagent.web.dashboard_format import iso

CSV_COLUMNS = ("lease_id", "vm", "domain_uuid", "gpus", "requested_gpus", "task_type", "priority", "state", "start",
               "duration_s", "mean_util_pct", "end_reason", "project", "end", "gpu_hours")


def csv_cell(value: Any) -> str:
    """A CSV cell that a spreadsheet will not run as a formula (VM names come from outside)."""
    text = "" if value is None else str(value)
    return "'" + text if text[:1] in ("=", "+", "-", "@", "\t", "\r") else text


def gpu_hours(lease: Lease, now: float) -> float:
    """GPUs held x hours held: from the grant to the end, or to `now` while the lease still runs (a lease never
    granted held none; one that ended without an end time, none past its grant). The rule of the GPU-hours quotas
    (domain.admission.gpu_hours) without their one-day window; store/lease_listing.py sorts by the same in SQL."""
    if lease.granted_at is None or not lease.devices:
        return 0.0
    end = lease.ended_at if lease.ended_at is not None else (lease.granted_at if lease.state.terminal else now)
    return len(lease.devices) * max(0.0, end - lease.granted_at) / 3600.0


def csv_header() -> str:
    """The header line."""
    return csv_lines((), header=True)


def csv_lines(rows: Iterable[dict[str, Any]], *, header: bool = False) -> str:
    """Leases table rows (DashboardData.lease_row) as CSV lines, after the header line when asked."""
    buf = io.StringIO()
    w = csv.writer(buf)
    if header:
        w.writerow(CSV_COLUMNS)
    for r in rows:
        w.writerow([csv_cell(v) for v in (
            r["id"], r["vm"], r["domain_uuid"], " ".join(r["gpus"]), r["requested"], r["task"], r["priority"],
            r["state"], iso(r["start"]), f"{r['duration']:.0f}",
            "" if r["util"] is None else f"{r['util']:.1f}", r["reason"] or "", r["project"] or "", iso(r["end"]),
            f"{r['gpu_hours']:.4f}")])
    return buf.getvalue()


def leases_csv_text(rows: Iterable[dict[str, Any]]) -> str:
    """Rows as a whole CSV text with its header line (small exports and tests; the handler streams)."""
    return csv_lines(rows, header=True)


def leases_csv_name(host_id: str) -> str:
    """The download's file name."""
    return f"hostagent-leases-{host_id}.csv"


__all__ = ["CSV_COLUMNS", "csv_cell", "csv_header", "csv_lines", "gpu_hours", "leases_csv_name", "leases_csv_text"]
