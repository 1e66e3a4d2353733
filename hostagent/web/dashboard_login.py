"""Dashboard login and logout views: the password form (its CSRF token bound to one browser by a login cookie
before any session exists), checking a submitted credential under the login throttle, refusing a VM's token,
starting a session (a fresh id, the old one dropped) and ending it on a CSRF-checked logout. It owns the life in
the browser of the session cookie and of the device cookie that exempts a browser that has logged in before from
its address's backoff; the sessions, CSRF tokens, the throttle and device cookies live in dashboard_auth.py.
"""

from __future__ import annotations

import logging
import math
import secrets

from aiohttp import web

from hostagent.domain.errors import Forbidden
from hostagent.web.dashboard_auth import (
    DEVICE_COOKIE,
    DEVICE_COOKIE_MAX_AGE,
    LOGIN_COOKIE,
    SESSION_COOKIE,
    Session,
    check_csrf,
    dashboard_identity,
    safe_next,
    source_key,
)
from hostagent.web.dashboard_plumbing import dashboard_of, page, render, see_other
from hostagent.web.keys import DASH_SESSION

log = logging.getLogger("hostagent.dashboard")


async def login_form(request: web.Request, *, error: str | None = None, status: int = 200) -> web.Response:
    """GET /ui/login: the password form."""
    dash = dashboard_of(request)
    nonce = request.cookies.get(LOGIN_COOKIE) or secrets.token_urlsafe(24)
    nxt = safe_next(request.query.get("next") or (await _form_value(request, "next")))
    resp = render(request, "login.html", {"title": "Log in", "login_csrf": dash.sessions.login_csrf(nonce),
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
    """POST /ui/login: check the credential under the login throttle, start a session, mark the browser as a device
    that has logged in (see LoginThrottle)."""
    dash = dashboard_of(request)
    source = source_key(request.remote)
    device = dash.throttle.device(request.cookies.get(DEVICE_COOKIE))
    wait = dash.throttle.wait(source, device)
    if wait:
        seconds = math.ceil(wait)
        resp = await login_form(request, error=f"too many failed logins; try again in {seconds} s", status=429)
        resp.headers["Retry-After"] = str(seconds)
        return resp
    form = await request.post()
    if not dash.sessions.check_login_csrf(request.cookies.get(LOGIN_COOKIE), str(form.get("csrf") or "")):
        return await login_form(request, error="the login form expired; please try again", status=403)
    token = str(form.get("token") or "").strip()
    identity = dash.rt.tokens.resolve(token) if token else None
    if identity is None:
        dash.throttle.failed(source, device)
        # INFO, not WARNING: the throttle warns once per backoff step, and a spray of addresses must not flood the log
        log.info("dashboard login refused from %s", request.remote)
        return await login_form(request, error="that credential is not valid", status=401)
    if dashboard_identity(identity) is None:
        dash.throttle.failed(source, device)
        return await login_form(request, error="a VM's token cannot open the dashboard; use the operator credential",
                                status=403)
    dash.throttle.succeeded(source, device)
    old = request.cookies.get(SESSION_COOKIE)
    dash.sessions.drop(old)
    sid, session = dash.sessions.create(token)
    resp = see_other(safe_next(form.get("next")))
    resp.set_cookie(SESSION_COOKIE, sid, httponly=True, samesite="Strict", secure=request.secure, path="/")
    resp.set_cookie(DEVICE_COOKIE, dash.throttle.device_cookie(identity.subject, device), httponly=True,
                    samesite="Strict", secure=request.secure, path="/ui/login", max_age=DEVICE_COOKIE_MAX_AGE)
    resp.del_cookie(LOGIN_COOKIE, path="/ui/login")
    log.info("dashboard login: %s from %s", identity.subject, request.remote)
    return resp


@page
async def logout(request: web.Request) -> web.StreamResponse:
    """POST /ui/logout (CSRF-checked)."""
    form = await request.post()
    session: Session = request[DASH_SESSION]
    if not check_csrf(session, form.get("csrf")):  # type: ignore[arg-type]
        raise Forbidden("the form's CSRF token is missing or stale", field="csrf")
    dashboard_of(request).sessions.end(session)
    resp = see_other("/ui/login")
    resp.del_cookie(SESSION_COOKIE, path="/")
    return resp


__all__ = ["login_form", "login_submit", "logout"]
