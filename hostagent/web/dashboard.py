"""The operators' web dashboard: server-rendered pages under /ui (and / for the overview), JSON for live refresh
under /ui/api, operator actions as CSRF-checked form POSTs. This module owns the route table, and
`install(app, runtime)` adds the whole dashboard (state, templates, routes, static files, security headers) to the
agent's app; the rest lives in rooms of its own: the views (dashboard_pages.py, dashboard_actions.py,
dashboard_login.py, sharing dashboard_plumbing.py and dashboard_format.py), what the pages show
(dashboard_data.py over dashboard_source.py and dashboard_charts.py), the CSV export (dashboard_csv.py) and the
sessions (dashboard_auth.py). Pages work without JavaScript (tables and the lease timeline are HTML/SVG from the
server); JavaScript adds live refresh (every `dashboard.refresh_s`), times in the viewer's zone, ages and countdowns
that tick, and the uPlot charts whose window slides with the clock. The names other modules import
from here (`install`, `DASHBOARD`, `CSP`, `TEMPLATES`, the formatting filters...) stay importable from here.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from hostagent.web.dashboard_actions import clear_quarantine_action, reclaim_action, release_action
from hostagent.web.dashboard_csv import CSV_COLUMNS
from hostagent.web.dashboard_format import duration, gib, iso, pct, time_tag
from hostagent.web.dashboard_login import login_form, login_submit, logout
from hostagent.web.dashboard_pages import (
    calendar_page,
    fleet_json,
    fleet_page,
    gpu_json,
    gpu_page,
    lease_json,
    lease_page,
    leases_csv,
    leases_page,
    leases_rows_json,
    model_page,
    overview,
    overview_json,
    reclaim_json,
    reclaim_page,
    ui_root,
)
from hostagent.web.dashboard_plumbing import (
    CSP,
    DASH_KEY,
    DASHBOARD,
    HERE,
    STATIC,
    TEMPLATES,
    Dashboard,
    Handler,
    html_errors,
    security_headers,
    setup_templates,
)


def install(app: web.Application, runtime: Any) -> Dashboard:
    """Add the dashboard's routes, templates, static files and headers to the agent's app."""
    dash = Dashboard(runtime)
    app[DASHBOARD] = dash
    setup_templates(app)
    app.on_response_prepare.append(security_headers)
    app.middlewares.append(html_errors)  # innermost: unknown /ui/* paths get the HTML error page, not JSON
    r = app.router
    r.add_get("/", overview)
    r.add_get("/ui", ui_root)
    r.add_get("/ui/", ui_root)
    r.add_get("/ui/login", login_form)
    r.add_post("/ui/login", login_submit)
    r.add_post("/ui/logout", logout)
    r.add_get("/ui/gpus/{gpu_id}", gpu_page)
    r.add_post("/ui/gpus/{gpu_id}/clear-quarantine", clear_quarantine_action)
    r.add_get("/ui/leases", leases_page)
    r.add_get("/ui/leases.csv", leases_csv)
    r.add_get("/ui/leases/{lease_id}", lease_page)
    r.add_post("/ui/leases/{lease_id}/release", release_action)
    r.add_post("/ui/leases/{lease_id}/reclaim", reclaim_action)
    r.add_get("/ui/reclaim", reclaim_page)
    r.add_get("/ui/model", model_page)
    r.add_get("/ui/calendar", calendar_page)
    r.add_get("/ui/fleet", fleet_page)
    r.add_get("/ui/api/overview", overview_json)
    r.add_get("/ui/api/reclaim", reclaim_json)
    r.add_get("/ui/api/fleet", fleet_json)
    r.add_get("/ui/api/gpus/{gpu_id}", gpu_json)
    r.add_get("/ui/api/leases", leases_rows_json)
    r.add_get("/ui/api/leases/{lease_id}", lease_json)
    r.add_static("/ui/static/", STATIC, name="dashboard-static", append_version=False)
    return dash


__all__ = [
    # this module's own
    "install",
    # re-exported from the rooms the dashboard was split into (existing imports keep working)
    "CSP", "CSV_COLUMNS", "DASHBOARD", "DASH_KEY", "HERE", "STATIC", "TEMPLATES", "Dashboard", "Handler",
    "calendar_page", "clear_quarantine_action", "duration", "fleet_json", "fleet_page", "gib", "gpu_json", "gpu_page", "iso", "lease_json", "lease_page",
    "leases_csv", "leases_page", "leases_rows_json", "login_form", "login_submit", "logout", "model_page", "overview",
    "overview_json", "pct", "reclaim_action", "reclaim_json", "reclaim_page", "release_action", "setup_templates",
    "time_tag",
    "ui_root",
]
