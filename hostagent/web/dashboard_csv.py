"""The leases CSV export: its column names, spreadsheet-safe cells, and the leases page's rows written as CSV
text. It owns what a downloaded `hostagent-leases-<host>.csv` holds: the same rows (same filters, same sort, same
limit) as the table on /ui/leases, one lease a line, times in ISO-8601 UTC, and no cell a spreadsheet would run as
a formula (VM names come from outside). The request handler that serves it lives with the other pages.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Iterable
from typing import Any

from hostagent.web.dashboard_format import iso

CSV_COLUMNS = ("lease_id", "vm", "domain_uuid", "gpus", "requested_gpus", "task_type", "priority", "state", "start",
               "duration_s", "mean_util_pct", "end_reason")


def csv_cell(value: Any) -> str:
    """A CSV cell that a spreadsheet will not run as a formula (VM names come from outside)."""
    text = "" if value is None else str(value)
    return "'" + text if text[:1] in ("=", "+", "-", "@", "\t", "\r") else text


def leases_csv_text(rows: Iterable[dict[str, Any]]) -> str:
    """The leases table's rows (DashboardData.leases_page's "rows") as CSV text with a header line."""
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(CSV_COLUMNS)
    for r in rows:
        w.writerow([csv_cell(v) for v in (
            r["id"], r["vm"], r["domain_uuid"], " ".join(r["gpus"]), r["requested"], r["task"], r["priority"],
            r["state"], iso(r["start"]), f"{r['duration']:.0f}",
            "" if r["util"] is None else f"{r['util']:.1f}", r["reason"] or "")])
    return buf.getvalue()


def leases_csv_name(host_id: str) -> str:
    """The download's file name."""
    return f"hostagent-leases-{host_id}.csv"


__all__ = ["CSV_COLUMNS", "csv_cell", "leases_csv_name", "leases_csv_text"]
