"""Dashboard page views: the GET handlers that render a page (overview, one GPU, the leases table and its CSV
export, one lease, reclaim, the placement model) and the JSON each page polls for live refresh under /ui/api
(fragments of the same templates, series for the charts). It owns which template and which data each URL gets;
every handler asks DashboardData for the page's content and renders it, nothing more.
"""

from __future__ import annotations

from aiohttp import web

from hostagent.web.dashboard_csv import leases_csv_name, leases_csv_text
from hostagent.web.dashboard_plumbing import dashboard_of, page, render, render_fragment, see_other


@page
async def overview(request: web.Request) -> web.Response:
    """/ : counts, GPUs, queue, strikes, hosts."""
    data = await dashboard_of(request).data.overview()
    return render(request, "overview.html", {"title": "Overview", "nav": "overview", "o": data,
                                             "notes": data["notes"]})


@page
async def overview_json(request: web.Request) -> web.Response:
    """/ui/api/overview: the overview's fragments for live refresh."""
    data = await dashboard_of(request).data.overview()
    return web.json_response({"now": data["now"], "counts": data["counts"], "total": data["total"],
                              "html": render_fragment(request, "_overview_body.html", {"o": data})})


@page
async def gpu_page(request: web.Request) -> web.Response:
    """/ui/gpus/{gpu_id}: timeline, charts, probes, events."""
    data = await dashboard_of(request).data.gpu_page(request.match_info["gpu_id"], request.query.get("range"))
    return render(request, "gpu.html", {"title": data["gpu"]["id"], "nav": "overview", "g": data,
                                        "notes": data["notes"]})


@page
async def gpu_json(request: web.Request) -> web.Response:
    """/ui/api/gpus/{gpu_id}: series plus the timeline fragment, for live refresh."""
    data = await dashboard_of(request).data.gpu_page(request.match_info["gpu_id"], request.query.get("range"))
    return web.json_response({"series": data["series"], "state": data["gpu"]["state"],
                              "timeline": render_fragment(request, "_timeline.html", {"g": data})})


@page
async def leases_page(request: web.Request) -> web.Response:
    """/ui/leases: filterable, sortable table."""
    data = await dashboard_of(request).data.leases_page(dict(request.query))
    return render(request, "leases.html", {"title": "Leases", "nav": "leases", "L": data, "notes": data["notes"]})


@page
async def leases_rows_json(request: web.Request) -> web.Response:
    """/ui/api/leases: the table body for live refresh (same filters as the page)."""
    data = await dashboard_of(request).data.leases_page(dict(request.query))
    return web.json_response({"total": data["total"], "shown": data["shown"],
                              "html": render_fragment(request, "_lease_rows.html", {"L": data})})


@page
async def leases_csv(request: web.Request) -> web.Response:
    """/ui/leases.csv: the filtered table as CSV (every matching row up to the page limit)."""
    data = await dashboard_of(request).data.leases_page(dict(request.query))
    name = leases_csv_name(dashboard_of(request).rt.settings.agent.host_id)
    return web.Response(text=leases_csv_text(data["rows"]), content_type="text/csv",
                        headers={"Content-Disposition": f'attachment; filename="{name}"'})


@page
async def lease_page(request: web.Request) -> web.Response:
    """/ui/leases/{lease_id}: details, usage chart, events, actions."""
    data = await dashboard_of(request).data.lease_page(request.match_info["lease_id"])
    return render(request, "lease.html", {"title": data["lease"].id, "nav": "leases", "d": data,
                                          "notes": data["notes"]})


@page
async def lease_json(request: web.Request) -> web.Response:
    """/ui/api/leases/{lease_id}: usage series per GPU and the state."""
    data = await dashboard_of(request).data.lease_page(request.match_info["lease_id"])
    return web.json_response({"state": data["lease"].state.value, "series": data["series"]})


@page
async def reclaim_page(request: web.Request) -> web.Response:
    """/ui/reclaim: strikes in progress and recent reclaims."""
    data = await dashboard_of(request).data.reclaim_page()
    return render(request, "reclaim.html", {"title": "Reclaim", "nav": "reclaim", "r": data, "notes": data["notes"]})


@page
async def model_page(request: web.Request) -> web.Response:
    """/ui/model: the placement model and recent decisions."""
    data = await dashboard_of(request).data.model_page()
    return render(request, "model.html", {"title": "Placement model", "nav": "model", "M": data,
                                          "notes": data["notes"]})


async def ui_root(request: web.Request) -> web.StreamResponse:
    """/ui -> the overview."""
    return see_other("/")


__all__ = ["gpu_json", "gpu_page", "lease_json", "lease_page", "leases_csv", "leases_page", "leases_rows_json",
           "model_page", "overview", "overview_json", "reclaim_page", "ui_root"]
