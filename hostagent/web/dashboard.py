"""The operators' web dashboard: server-rendered pages under /ui (and / for the overview), JSON for live refresh
under /ui/api, operator actions as CSRF-checked form POSTs. `install(app, runtime)` adds it to the agent's app.

Pages work without JavaScript (tables and the lease timeline are HTML/SVG from the server); JavaScript adds
live refresh, local time zones and the uPlot charts. Handlers return pages or raise domain errors; `_page`
turns errors into an HTML error page (the JSON helpers let the app's error middleware answer).
"""

from __future__ import annotations

import csv
import datetime as dt
import functools
import io
import logging
import secrets
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp_jinja2
import jinja2
from aiohttp import web
from markupsafe import Markup

from hostagent.domain.errors import Forbidden, HostAgentError, InvalidInput, NotFound, Unauthorized
from hostagent.web.auth import Identity
from hostagent.web.dashboard_auth import (
    LOGIN_COOKIE,
    SESSION_COOKIE,
    LoginThrottle,
    Session,
    SessionBook,
    check_csrf,
    dashboard_identity,
    safe_next,
)
from hostagent.web.dashboard_data import RANGES, DashboardData, csv_cell
from hostagent.web.keys import DASH_FORM, DASH_IDENTITY, DASH_SESSION

log = logging.getLogger("hostagent.dashboard")

HERE = Path(__file__).resolve().parent
TEMPLATES = HERE / "templates"
STATIC = HERE / "static"
DASH_KEY = "hostagent_dashboard"
CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
       "object-src 'none'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class Dashboard:
    """Per-app dashboard state: sessions, login throttle, data access."""

    def __init__(self, runtime: Any) -> None:
        self.rt = runtime
        self.sessions = SessionBook()
        self.throttle = LoginThrottle()
        self.data = DashboardData(runtime, clock=runtime.clock)


DASHBOARD: web.AppKey[Dashboard] = web.AppKey(DASH_KEY, Dashboard)


# ---- template helpers ------------------------------------------------------------------------------------------


def iso(ts: float | None) -> str:
    """ISO-8601 UTC for a <time datetime=...>."""
    if ts is None:
        return ""
    return dt.datetime.fromtimestamp(float(ts), dt.UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


def time_tag(ts: float | None, style: str = "datetime") -> Markup:
    """A <time> element with UTC fallback text; dashboard.js rewrites it in the viewer's time zone."""
    if ts is None:
        return Markup('<span class="muted">—</span>')
    d = dt.datetime.fromtimestamp(float(ts), dt.UTC)
    text = {"time": "%H:%M:%S UTC", "hm": "%H:%M UTC"}.get(style, "%Y-%m-%d %H:%M UTC")
    text = d.strftime(text)
    return Markup('<time datetime="{}" data-style="{}">{}</time>').format(iso(ts), style, text)


def duration(seconds: float | None) -> str:
    """'3d 4h', '2h 05m', '4m 10s', '12s'."""
    if seconds is None:
        return "—"
    s = int(max(0, seconds))
    d, rem = divmod(s, 86400)
    h, rem = divmod(rem, 3600)
    m, sec = divmod(rem, 60)
    if d:
        return f"{d}d {h}h"
    if h:
        return f"{h}h {m:02d}m"
    if m:
        return f"{m}m {sec:02d}s"
    return f"{sec}s"


def gib(nbytes: float | None) -> str:
    """Bytes as GiB ('80 GiB', '11.5 GiB')."""
    if not nbytes:
        return "—"
    v = float(nbytes) / 1024**3
    return f"{v:.0f} GiB" if v >= 20 or v.is_integer() else f"{v:.1f} GiB"


def pct(value: float | None) -> str:
    """'42%' or '—'."""
    return "—" if value is None else f"{value:.0f}%"


def setup_templates(app: web.Application) -> jinja2.Environment:
    """aiohttp-jinja2 on the app: autoescaping on, undefined names fail loudly, the dashboard's filters."""
    filters: dict[str, Callable[..., str]] = {"time": time_tag, "dur": duration, "gib": gib, "pct": pct, "iso": iso}
    env = aiohttp_jinja2.setup(app, loader=jinja2.FileSystemLoader(str(TEMPLATES)), autoescape=True,
                               undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True, filters=filters)
    env.globals.update(ranges=list(RANGES))
    return env


# ---- plumbing --------------------------------------------------------------------------------------------------


def _dash(request: web.Request) -> Dashboard:
    return request.app[DASHBOARD]


def _render(request: web.Request, template: str, ctx: dict[str, Any], status: int = 200) -> web.Response:
    session: Session | None = request.get(DASH_SESSION)
    identity: Identity | None = request.get(DASH_IDENTITY)
    base = {
        "request_path": request.path_qs, "path": request.path, "identity": identity,
        "is_operator": bool(identity and identity.is_operator),
        "csrf": session.csrf if session else "", "flash": list(session.flash) if session else [],
        "host_id": _dash(request).rt.settings.agent.host_id, "notes": [], "nav": "", "title": "",
    }
    if session is not None:
        session.flash.clear()
    base.update(ctx)
    html = aiohttp_jinja2.get_env(request.app).get_template(template).render(base)
    return web.Response(text=html, content_type="text/html", status=status)


def _fragment(request: web.Request, template: str, ctx: dict[str, Any]) -> str:
    session: Session | None = request.get(DASH_SESSION)
    identity: Identity | None = request.get(DASH_IDENTITY)
    base: dict[str, Any] = {"identity": identity, "is_operator": bool(identity and identity.is_operator),
            "csrf": session.csrf if session else "", "request_path": request.path_qs, "notes": []}
    base.update(ctx)
    return aiohttp_jinja2.get_env(request.app).get_template(template).render(base)


def _see_other(location: str) -> web.Response:
    """A 303 that can carry cookies (raising HTTPSeeOther would lose them)."""
    return web.Response(status=303, headers={"Location": location})


def _login_redirect(request: web.Request) -> web.Response:
    target = request.path_qs if request.method == "GET" else "/"
    return _see_other(f"/ui/login?next={_quote(target)}")


def _quote(text: str) -> str:
    from urllib.parse import quote

    return quote(text, safe="/")


def _page(handler: Handler) -> Handler:
    """Require a dashboard session; render domain errors as an HTML error page."""

    @functools.wraps(handler)
    async def wrapper(request: web.Request) -> web.StreamResponse:
        dash = _dash(request)
        is_api = request.path.startswith("/ui/api/")
        session = dash.sessions.get(request.cookies.get(SESSION_COOKIE))
        identity = dashboard_identity(dash.rt.tokens.resolve(session.token)) if session else None
        if session is not None and identity is None:  # credential revoked or rotated: the session ends with it
            dash.sessions.end(session)
            session = None
        if session is None:
            if is_api:
                raise Unauthorized("log in to the dashboard first", field="session")
            return _login_redirect(request)
        request[DASH_SESSION] = session
        request[DASH_IDENTITY] = identity
        if is_api:
            return await handler(request)
        try:
            return await handler(request)
        except HostAgentError as exc:
            return _render(request, "error.html", {"error": exc, "title": "Error"}, status=exc.http_status)

    return wrapper


def _action(handler: Callable[[web.Request, Identity], Awaitable[str]]) -> Handler:
    """An operator action from a form: CSRF check, operator check, flash the outcome, redirect back."""

    @functools.wraps(handler)
    async def wrapper(request: web.Request) -> web.StreamResponse:
        form = await request.post()
        session: Session = request[DASH_SESSION]
        identity: Identity = request[DASH_IDENTITY]
        if not check_csrf(session, form.get("csrf")):  # type: ignore[arg-type]
            raise Forbidden("the form's CSRF token is missing or stale; reload the page and try again", field="csrf")
        back = safe_next(form.get("next"))
        if not identity.is_operator:
            session.flash.append(("error", "this credential is read-only; actions need the operator credential"))
            return _see_other(back)
        request[DASH_FORM] = form
        try:
            message = await handler(request, identity)
            session.flash.append(("ok", message))
        except HostAgentError as exc:
            session.flash.append(("error", exc.message))
        return _see_other(back)

    return _page(wrapper)


async def _security_headers(request: web.Request, response: web.StreamResponse) -> None:
    """CSP and friends on every dashboard response (not on the JSON API, which has its own clients)."""
    if request.path == "/" or request.path.startswith("/ui"):
        response.headers.setdefault("Content-Security-Policy", CSP)
        response.headers.setdefault("X-Content-Type-Options", "nosniff")
        response.headers.setdefault("Referrer-Policy", "same-origin")
        response.headers.setdefault("X-Frame-Options", "DENY")
        if not request.path.startswith("/ui/static/"):
            response.headers.setdefault("Cache-Control", "no-store")


# ---- login -----------------------------------------------------------------------------------------------------


async def login_form(request: web.Request, *, error: str | None = None, status: int = 200) -> web.Response:
    """GET /ui/login: the password form."""
    dash = _dash(request)
    nonce = request.cookies.get(LOGIN_COOKIE) or secrets.token_urlsafe(24)
    nxt = safe_next(request.query.get("next") or (await _form_value(request, "next")))
    resp = _render(request, "login.html", {"title": "Log in", "login_csrf": dash.sessions.login_csrf(nonce),
                                           "next": nxt, "error": error}, status=status)
    resp.set_cookie(LOGIN_COOKIE, nonce, httponly=True, samesite="Strict", secure=request.secure, path="/ui/login",
                    max_age=3600)
    return resp


async def _form_value(request: web.Request, name: str) -> str:
    if request.method != "POST":
        return ""
    form = await request.post()
    return str(form.get(name) or "")


async def login_submit(request: web.Request) -> web.StreamResponse:
    """POST /ui/login: check the credential, start a session."""
    dash = _dash(request)
    who = request.remote or "?"
    wait = dash.throttle.blocked(who)
    if wait:
        return await login_form(request, error=f"too many failed logins; try again in {wait:.0f} s", status=429)
    form = await request.post()
    if not dash.sessions.check_login_csrf(request.cookies.get(LOGIN_COOKIE), str(form.get("csrf") or "")):
        return await login_form(request, error="the login form expired; please try again", status=403)
    token = str(form.get("token") or "").strip()
    identity = dash.rt.tokens.resolve(token) if token else None
    if identity is None:
        dash.throttle.failed(who)
        log.warning("dashboard login refused from %s", who)
        return await login_form(request, error="that credential is not valid", status=401)
    if dashboard_identity(identity) is None:
        dash.throttle.failed(who)
        return await login_form(request, error="a VM's token cannot open the dashboard; use the operator credential",
                                status=403)
    dash.throttle.succeeded(who)
    old = request.cookies.get(SESSION_COOKIE)
    dash.sessions.drop(old)
    sid, session = dash.sessions.create(token)
    resp = _see_other(safe_next(form.get("next")))
    resp.set_cookie(SESSION_COOKIE, sid, httponly=True, samesite="Strict", secure=request.secure, path="/")
    resp.del_cookie(LOGIN_COOKIE, path="/ui/login")
    log.info("dashboard login: %s from %s", identity.subject, who)
    return resp


@_page
async def logout(request: web.Request) -> web.StreamResponse:
    """POST /ui/logout (CSRF-checked)."""
    form = await request.post()
    session: Session = request[DASH_SESSION]
    if not check_csrf(session, form.get("csrf")):  # type: ignore[arg-type]
        raise Forbidden("the form's CSRF token is missing or stale", field="csrf")
    _dash(request).sessions.end(session)
    resp = _see_other("/ui/login")
    resp.del_cookie(SESSION_COOKIE, path="/")
    return resp


# ---- pages -----------------------------------------------------------------------------------------------------


@_page
async def overview(request: web.Request) -> web.Response:
    """/ : counts, GPUs, queue, strikes, hosts."""
    data = await _dash(request).data.overview()
    return _render(request, "overview.html", {"title": "Overview", "nav": "overview", "o": data,
                                              "notes": data["notes"]})


@_page
async def overview_json(request: web.Request) -> web.Response:
    """/ui/api/overview: the overview's fragments for live refresh."""
    data = await _dash(request).data.overview()
    return web.json_response({"now": data["now"], "counts": data["counts"], "total": data["total"],
                              "html": _fragment(request, "_overview_body.html", {"o": data})})


@_page
async def gpu_page(request: web.Request) -> web.Response:
    """/ui/gpus/{gpu_id}: timeline, charts, probes, events."""
    data = await _dash(request).data.gpu_page(request.match_info["gpu_id"], request.query.get("range"))
    return _render(request, "gpu.html", {"title": data["gpu"]["id"], "nav": "overview", "g": data,
                                         "notes": data["notes"]})


@_page
async def gpu_json(request: web.Request) -> web.Response:
    """/ui/api/gpus/{gpu_id}: series plus the timeline fragment, for live refresh."""
    data = await _dash(request).data.gpu_page(request.match_info["gpu_id"], request.query.get("range"))
    return web.json_response({"series": data["series"], "state": data["gpu"]["state"],
                              "timeline": _fragment(request, "_timeline.html", {"g": data})})


@_page
async def leases_page(request: web.Request) -> web.Response:
    """/ui/leases: filterable, sortable table."""
    data = await _dash(request).data.leases_page(dict(request.query))
    return _render(request, "leases.html", {"title": "Leases", "nav": "leases", "L": data, "notes": data["notes"]})


@_page
async def leases_rows_json(request: web.Request) -> web.Response:
    """/ui/api/leases: the table body for live refresh (same filters as the page)."""
    data = await _dash(request).data.leases_page(dict(request.query))
    return web.json_response({"total": data["total"], "shown": data["shown"],
                              "html": _fragment(request, "_lease_rows.html", {"L": data})})


CSV_COLUMNS = ("lease_id", "vm", "domain_uuid", "gpus", "requested_gpus", "task_type", "priority", "state", "start",
               "duration_s", "mean_util_pct", "end_reason")


@_page
async def leases_csv(request: web.Request) -> web.Response:
    """/ui/leases.csv: the filtered table as CSV (every matching row up to the page limit)."""
    data = await _dash(request).data.leases_page(dict(request.query))
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(CSV_COLUMNS)
    for r in data["rows"]:
        w.writerow([csv_cell(v) for v in (
            r["id"], r["vm"], r["domain_uuid"], " ".join(r["gpus"]), r["requested"], r["task"], r["priority"],
            r["state"], iso(r["start"]), f"{r['duration']:.0f}",
            "" if r["util"] is None else f"{r['util']:.1f}", r["reason"] or "")])
    name = f"hostagent-leases-{_dash(request).rt.settings.agent.host_id}.csv"
    return web.Response(text=buf.getvalue(), content_type="text/csv",
                        headers={"Content-Disposition": f'attachment; filename="{name}"'})


@_page
async def lease_page(request: web.Request) -> web.Response:
    """/ui/leases/{lease_id}: details, usage chart, events, actions."""
    data = await _dash(request).data.lease_page(request.match_info["lease_id"])
    return _render(request, "lease.html", {"title": data["lease"].id, "nav": "leases", "d": data,
                                           "notes": data["notes"]})


@_page
async def lease_json(request: web.Request) -> web.Response:
    """/ui/api/leases/{lease_id}: usage series per GPU and the state."""
    data = await _dash(request).data.lease_page(request.match_info["lease_id"])
    return web.json_response({"state": data["lease"].state.value, "series": data["series"]})


@_page
async def reclaim_page(request: web.Request) -> web.Response:
    """/ui/reclaim: strikes in progress and recent reclaims."""
    data = await _dash(request).data.reclaim_page()
    return _render(request, "reclaim.html", {"title": "Reclaim", "nav": "reclaim", "r": data, "notes": data["notes"]})


@_page
async def model_page(request: web.Request) -> web.Response:
    """/ui/model: the placement model and recent decisions."""
    data = await _dash(request).data.model_page()
    return _render(request, "model.html", {"title": "Placement model", "nav": "model", "M": data,
                                           "notes": data["notes"]})


# ---- actions ---------------------------------------------------------------------------------------------------


@_action
async def release_action(request: web.Request, who: Identity) -> str:
    """Operator: release a lease."""
    rt = _dash(request).rt
    lease_id = request.match_info["lease_id"]
    lease = await rt.manager.release(lease_id, actor=f"dashboard:{who.subject}", reason="released by operator")
    if lease.state.value == "DETACH_PENDING":
        return f"lease {lease_id}: the guest has not acknowledged the detach yet (DETACH_PENDING)"
    return f"lease {lease_id} released ({lease.state.value})"


@_action
async def reclaim_action(request: web.Request, who: Identity) -> str:
    """Operator: pause or resume idle reclaim on a lease."""
    rt = _dash(request).rt
    form = request[DASH_FORM]
    value = str(form.get("paused") or "")
    if value not in ("0", "1"):
        raise InvalidInput("paused must be 0 or 1", field="paused")
    lease_id = request.match_info["lease_id"]
    if rt.reaper is None:
        raise NotFound("idle reclaim is not running on this agent", field="reaper")
    await rt.reaper.set_paused(lease_id, value == "1", actor=f"dashboard:{who.subject}")
    return f"idle reclaim {'paused' if value == '1' else 'resumed'} for lease {lease_id}"


@_action
async def clear_quarantine_action(request: web.Request, who: Identity) -> str:
    """Operator: put a quarantined GPU back into service."""
    rt = _dash(request).rt
    gpu_id = request.match_info["gpu_id"]
    await rt.manager.clear_quarantine(gpu_id, actor=f"dashboard:{who.subject}")
    return f"quarantine cleared on {gpu_id}"


async def ui_root(request: web.Request) -> web.StreamResponse:
    """/ui -> the overview."""
    return _see_other("/")


# ---- installation ----------------------------------------------------------------------------------------------


def install(app: web.Application, runtime: Any) -> Dashboard:
    """Add the dashboard's routes, templates, static files and headers to the agent's app."""
    dash = Dashboard(runtime)
    app[DASHBOARD] = dash
    setup_templates(app)
    app.on_response_prepare.append(_security_headers)
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
    r.add_get("/ui/api/overview", overview_json)
    r.add_get("/ui/api/gpus/{gpu_id}", gpu_json)
    r.add_get("/ui/api/leases", leases_rows_json)
    r.add_get("/ui/api/leases/{lease_id}", lease_json)
    r.add_static("/ui/static/", STATIC, name="dashboard-static", append_version=False)
    return dash


__all__ = ["DASHBOARD", "Dashboard", "duration", "gib", "install", "iso", "setup_templates", "time_tag"]
