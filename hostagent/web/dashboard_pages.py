"""Dashboard page views: the GET handlers that render a page (overview, one GPU, the leases table and its CSV
export, one lease, reclaim, the placement model, the fleet) and the JSON each page polls for live refresh under /ui/api
(fragments of the same templates, series for the charts). It owns which template and which data each URL gets;
every handler asks DashboardData for the page's content and renders it, nothing more.
"""

from __future__ import annotations

import logging

from aiohttp import web

from hostagent.web.dashboard_csv import csv_header, csv_lines, leases_csv_name
from hostagent.web.dashboard_plumbing import dashboard_of, page, render, render_fragment, see_other

log = logging.getLogger("hostagent.dashboard")


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
    return web.json_response({"now": data["now"], "series": data["series"], "state": data["gpu"]["state"],
                              "head": render_fragment(request, "_gpu_head.html", {"g": data}),
                              "timeline": render_fragment(request, "_timeline.html", {"g": data})})


@page
async def leases_page(request: web.Request) -> web.Response:
    """/ui/leases: filterable, sortable table, a page at a time (links to the others work without JavaScript)."""
    data = await dashboard_of(request).data.leases_page(request.query)
    return render(request, "leases.html", {"title": "Leases", "nav": "leases", "L": data, "notes": data["notes"]})


@page
async def leases_rows_json(request: web.Request) -> web.Response:
    """/ui/api/leases: the table body of the same page for live refresh (same filters, order and cursor as the
    page; `shown` is the text of the rows it shows, e.g. "101–200", which dashboard.js puts in [data-shown])."""
    data = await dashboard_of(request).data.leases_page(request.query)
    return web.json_response({"total": data["total"], "shown": data["shown"], "first": data["first"],
                              "last": data["last"], "count": data["count"],
                              "html": render_fragment(request, "_lease_rows.html", {"L": data})})


@page
async def leases_csv(request: web.Request) -> web.StreamResponse:
    """/ui/leases.csv: every lease the table's filters match, in its order, streamed in batches as they are read
    (DashboardData.lease_export), so an export of any length never sits in memory whole.

    The query is checked before anything is sent (a bad one gets the error page). Once the header is out an error
    can no longer become a status: the connection is cut before the chunked body's last chunk, so the download
    fails visibly instead of ending as a shorter file that looks complete (the CSV is the accounting path)."""
    dash = dashboard_of(request)
    query = dash.data.lease_query(request.query)
    name = leases_csv_name(dash.rt.settings.agent.host_id)
    headers = {"Content-Type": "text/csv; charset=utf-8", "Content-Disposition": f'attachment; filename="{name}"'}
    if request.method == "HEAD":  # the headers alone: a streamed body would be sent even for a HEAD
        return web.Response(headers=headers)
    resp = web.StreamResponse(headers=headers)
    resp.enable_chunked_encoding()
    await resp.prepare(request)
    try:
        await resp.write(csv_header().encode())
        async for rows in dash.data.lease_export(query):
            await resp.write(csv_lines(rows).encode())
    except Exception:  # noqa: BLE001 - any failure: log it, and cut the download short where the client sees it
        log.exception("the leases CSV export stopped part way; cutting the download short")
        if request.transport is not None:
            request.transport.abort()
        return resp
    await resp.write_eof()
    return resp


@page
async def lease_page(request: web.Request) -> web.Response:
    """/ui/leases/{lease_id}: details, usage chart, events, actions."""
    data = await dashboard_of(request).data.lease_page(request.match_info["lease_id"])
    return render(request, "lease.html", {"title": data["lease"].id, "nav": "leases", "d": data,
                                          "notes": data["notes"]})


@page
async def lease_json(request: web.Request) -> web.Response:
    """/ui/api/leases/{lease_id}: usage series per GPU, the state, and the head (facts, heartbeat, queue, actions)."""
    data = await dashboard_of(request).data.lease_page(request.match_info["lease_id"])
    return web.json_response({"now": data["now"], "state": data["lease"].state.value, "series": data["series"],
                              "head": render_fragment(request, "_lease_head.html", {"d": data})})


@page
async def reclaim_page(request: web.Request) -> web.Response:
    """/ui/reclaim: strikes in progress and recent reclaims."""
    data = await dashboard_of(request).data.reclaim_page()
    return render(request, "reclaim.html", {"title": "Reclaim", "nav": "reclaim", "r": data, "notes": data["notes"]})


@page
async def reclaim_json(request: web.Request) -> web.Response:
    """/ui/api/reclaim: the reclaim page's body for live refresh."""
    data = await dashboard_of(request).data.reclaim_page()
    return web.json_response({"now": data["now"], "html": render_fragment(request, "_reclaim_body.html", {"r": data})})


@page
async def model_page(request: web.Request) -> web.Response:
    """/ui/model: the placement model and recent decisions."""
    data = await dashboard_of(request).data.model_page()
    return render(request, "model.html", {"title": "Placement model", "nav": "model", "M": data,
                                          "notes": data["notes"]})


@page
async def calendar_page(request: web.Request) -> web.Response:
    """/ui/calendar: every GPU's time ahead (its lease until expiry, its bookings) and the bookings."""
    data = await dashboard_of(request).data.calendar_page(request.query.get("range"))
    return render(request, "calendar.html", {"title": "Calendar", "nav": "calendar", "C": data, "notes": []})


@page
async def fleet_page(request: web.Request) -> web.Response:
    """/ui/fleet: every host sharing the usage store, the fleet's idle candidates and totals."""
    data = await dashboard_of(request).data.fleet_page()
    return render(request, "fleet.html", {"title": "Fleet", "nav": "fleet", "F": data, "notes": data["notes"]})


@page
async def fleet_json(request: web.Request) -> web.Response:
    """/ui/api/fleet: the fleet page's body for live refresh."""
    data = await dashboard_of(request).data.fleet_page()
    return web.json_response({"now": data["now"], "html": render_fragment(request, "_fleet_body.html", {"F": data})})


async def ui_root(request: web.Request) -> web.StreamResponse:
    """/ui -> the overview."""
    return see_other("/")


__all__ = ["fleet_json", "fleet_page", "gpu_json", "gpu_page", "lease_json", "lease_page", "leases_csv", "leases_page", "leases_rows_json",
           "model_page", "overview", "overview_json", "reclaim_json", "reclaim_page", "ui_root"]
