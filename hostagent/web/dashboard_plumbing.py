"""Dashboard request plumbing that every page, action and login view shares. It owns the per-app `Dashboard` state
(sessions, login throttle, the page data) under the `DASHBOARD` app key, the template environment (autoescaping,
strict undefined names, the formatting filters), rendering a page or a live-refresh fragment with the session's
common context (identity, CSRF token, flash messages, the agent's now and the [dashboard] settings that live figures
tick from; a fragment's forms go back to its page, never to its JSON), the `page` guard (a dashboard session is
required; domain errors become an HTML error page, while the JSON helpers let the app's error middleware answer),
the `html_errors` middleware (an unknown /ui/* path gets the HTML error page; /ui/api and /v1 keep JSON), the
`action` guard for operator form POSTs (CSRF and operator checks, flash, redirect back), and the security headers
(CSP and friends) on every dashboard response.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp_jinja2
import jinja2
from aiohttp import web

from hostagent.domain.errors import Forbidden, HostAgentError, Unauthorized
from hostagent.web.auth import Identity
from hostagent.web.dashboard_auth import (
    DEVICE_KEY_FILE,
    SESSION_COOKIE,
    LoginThrottle,
    Session,
    SessionBook,
    check_csrf,
    dashboard_identity,
    load_device_key,
    safe_next,
)
from hostagent.web.dashboard_data import RANGES, DashboardData
from hostagent.web.dashboard_format import countdown_tag, duration, gib, iso, pct, time_tag
from hostagent.web.keys import DASH_FORM, DASH_IDENTITY, DASH_SESSION

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
        # the device-cookie key lives in the state dir so that browsers stay recognised across restarts
        self.throttle = LoginThrottle(key=load_device_key(Path(runtime.settings.agent.state_dir) / DEVICE_KEY_FILE))
        self.data = DashboardData(runtime, clock=runtime.clock)


DASHBOARD: web.AppKey[Dashboard] = web.AppKey(DASH_KEY, Dashboard)


def setup_templates(app: web.Application) -> jinja2.Environment:
    """aiohttp-jinja2 on the app: autoescaping on, undefined names fail loudly, the dashboard's filters."""
    filters: dict[str, Callable[..., str]] = {"time": time_tag, "dur": duration, "gib": gib, "pct": pct, "iso": iso,
                                             "countdown": countdown_tag}
    env = aiohttp_jinja2.setup(app, loader=jinja2.FileSystemLoader(str(TEMPLATES)), autoescape=True,
                               undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True, filters=filters)
    env.globals.update(ranges=list(RANGES))
    return env


def dashboard_of(request: web.Request) -> Dashboard:
    """The app's dashboard state."""
    return request.app[DASHBOARD]


def live_context(request: web.Request) -> dict[str, Any]:
    """What every page and fragment shares for live figures: the agent's clock now (dashboard.js ticks ages and
    countdowns from it, whatever the browser's clock says), and the [dashboard] settings."""
    dash = dashboard_of(request)
    cfg = dash.rt.settings.dashboard
    return {"now": dash.data.clock(), "stale_after": cfg.stale_after_s, "refresh_ms": int(cfg.refresh_s * 1000)}


def render(request: web.Request, template: str, ctx: dict[str, Any], status: int = 200) -> web.Response:
    """A whole page: the template with the session's common context (flash messages shown once) under ctx."""
    session: Session | None = request.get(DASH_SESSION)
    identity: Identity | None = request.get(DASH_IDENTITY)
    base = {
        "request_path": request.path_qs, "path": request.path, "identity": identity,
        "is_operator": bool(identity and identity.is_operator),
        "csrf": session.csrf if session else "", "flash": list(session.flash) if session else [],
        "host_id": dashboard_of(request).rt.settings.agent.host_id, "notes": [], "nav": "", "title": "",
        **live_context(request),
    }
    if session is not None:
        session.flash.clear()
    base.update(ctx)
    html = aiohttp_jinja2.get_env(request.app).get_template(template).render(base)
    return web.Response(text=html, content_type="text/html", status=status)


def page_of(api_path: str) -> str:
    """The page a live-refresh fragment belongs to (/ui/api/leases?x -> /ui/leases?x, /ui/api/overview -> /): where
    a form in the fragment sends the browser back to, never the JSON it came in."""
    if not api_path.startswith("/ui/api/"):
        return api_path
    path = "/ui/" + api_path[len("/ui/api/"):]
    return "/" if path.split("?")[0] == "/ui/overview" else path


def render_fragment(request: web.Request, template: str, ctx: dict[str, Any]) -> str:
    """A partial template's HTML for live refresh (the flash messages stay for the next whole page)."""
    session: Session | None = request.get(DASH_SESSION)
    identity: Identity | None = request.get(DASH_IDENTITY)
    base: dict[str, Any] = {"identity": identity, "is_operator": bool(identity and identity.is_operator),
            "csrf": session.csrf if session else "", "request_path": page_of(request.path_qs), "notes": [],
            **live_context(request)}
    base.update(ctx)
    return aiohttp_jinja2.get_env(request.app).get_template(template).render(base)


def see_other(location: str) -> web.Response:
    """A 303 that can carry cookies (raising HTTPSeeOther would lose them)."""
    return web.Response(status=303, headers={"Location": location})


def _login_redirect(request: web.Request) -> web.Response:
    target = request.path_qs if request.method == "GET" else "/"
    return see_other(f"/ui/login?next={_quote(target)}")


def _quote(text: str) -> str:
    from urllib.parse import quote

    return quote(text, safe="/")


def page(handler: Handler) -> Handler:
    """Require a dashboard session; render domain errors as an HTML error page."""

    @functools.wraps(handler)
    async def wrapper(request: web.Request) -> web.StreamResponse:
        dash = dashboard_of(request)
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
            return render(request, "error.html", {"error": exc, "title": "Error"}, status=exc.http_status)

    return wrapper


def action(handler: Callable[[web.Request, Identity], Awaitable[str]]) -> Handler:
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
            return see_other(back)
        request[DASH_FORM] = form
        try:
            message = await handler(request, identity)
            session.flash.append(("ok", message))
        except HostAgentError as exc:
            session.flash.append(("error", exc.message))
        return see_other(back)

    return page(wrapper)


def is_page_path(path: str) -> bool:
    """A path under /ui that a browser asks for (the dashboard's JSON under /ui/api is not one)."""
    return (path == "/ui" or path.startswith("/ui/")) and not path.startswith("/ui/api/")


def _static_file(rel: str) -> bool:
    """Whether a path under /ui/static/ names one of the dashboard's files."""
    target = (STATIC / rel).resolve()
    return target.is_file() and STATIC.resolve() in target.parents


@web.middleware
async def html_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """An unknown /ui/* path (or a method a page does not take) answers the HTML error page, with the dashboard's
    header when the browser has a session; the JSON API (/v1, /ui/api) keeps the error middleware's JSON."""
    try:
        if request.path.startswith("/ui/static/") and not _static_file(request.path[len("/ui/static/"):]):
            raise web.HTTPNotFound()  # aiohttp's file response would answer an empty 404 of its own
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status not in (404, 405) or not is_page_path(request.path):
            raise
        dash = dashboard_of(request)
        session = dash.sessions.get(request.cookies.get(SESSION_COOKIE))
        identity = dashboard_identity(dash.rt.tokens.resolve(session.token)) if session else None
        if session is not None and identity is not None:
            request[DASH_SESSION] = session
            request[DASH_IDENTITY] = identity
        if exc.status == 404:
            error = {"http_status": 404, "code": "not_found", "message": f"no page at {request.path}", "field": None}
        else:
            error = {"http_status": 405, "code": "method_not_allowed", "field": None,
                     "message": f"method {request.method} is not allowed on {request.path}"}
        resp = render(request, "error.html", {"error": error, "title": "Not found" if exc.status == 404 else "Error"},
                      status=exc.status)
        if "Allow" in exc.headers:
            resp.headers["Allow"] = exc.headers["Allow"]
        return resp


async def security_headers(request: web.Request, response: web.StreamResponse) -> None:
    """CSP and friends on every dashboard response (not on the JSON API, which has its own clients)."""
    if request.path == "/" or request.path.startswith("/ui"):
        response.headers.setdefault("Content-Security-Policy", CSP)
        response.headers.setdefault("X-Content-Type-Options", "nosniff")
        response.headers.setdefault("Referrer-Policy", "same-origin")
        response.headers.setdefault("X-Frame-Options", "DENY")
        if not request.path.startswith("/ui/static/"):
            response.headers.setdefault("Cache-Control", "no-store")


__all__ = ["CSP", "DASHBOARD", "DASH_KEY", "STATIC", "TEMPLATES", "Dashboard", "Handler", "action", "dashboard_of",
           "html_errors", "is_page_path", "live_context", "page", "render", "render_fragment", "security_headers",
           "see_other", "setup_templates"]
