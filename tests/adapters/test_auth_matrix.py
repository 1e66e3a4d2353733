"""Every route the app registers x every identity: the expected status, and no data of another VM in any response.
Tokens, CSRF tokens and session ids are compared in constant time (or looked up by digest).

The set of routes comes from the app's router, so a new endpoint without a row in API or DASHBOARD fails the test
(HEAD, which aiohttp adds to every GET, is checked with its GET's row). API routes take a bearer token; the
dashboard takes a login session cookie, and its POSTs a CSRF token.
"""

from __future__ import annotations

import hmac
import re
import time
from pathlib import Path
from typing import Any

import pytest

from hostagent.runtime import make_app
from hostagent.web.dashboard import DASHBOARD
from hostagent.web.dashboard_auth import SESSION_COOKIE
from tests.support.agent import CSRF, AgentRig, make_rig, operator_login, start_rig

# API identities: no token, a token nobody issued, VM B's token, VM A's own token, the operator's token, and the
# operator's dashboard session cookie without a bearer token (a cookie must never authenticate the API: it has no
# CSRF protection there)
WHO = ("none", "bad", "other", "own", "operator", "session")
# dashboard identities: no session, a session cookie nobody issued, VM A's token as a bearer (a guest's token must
# not open the dashboard), the operator's login session
DASH_WHO = ("none", "bad", "vm", "operator")

PUBLIC = {"none": 200, "bad": 401, "other": 200, "own": 200, "operator": 200, "session": 200}
GUEST_OR_OPERATOR = {"none": 401, "bad": 401, "other": 200, "own": 200, "operator": 200, "session": 401}
OWNER_OR_OPERATOR = {"none": 401, "bad": 401, "other": 404, "own": 200, "operator": 200, "session": 401}
OPERATOR = {"none": 401, "bad": 401, "other": 403, "own": 403, "operator": 200, "session": 401}

# (method, route) -> (body, {who: status}); {gpu_id} is VM A's leased GPU, {lease_id} VM A's lease
API: dict[tuple[str, str], tuple[Any, dict[str, int]]] = {
    ("GET", "/healthz"): (None, PUBLIC),
    ("GET", "/readyz"): (None, PUBLIC),
    ("GET", "/metrics"): (None, OPERATOR),  # or on a listener of its own (agent.metrics_listen)
    ("GET", "/v1/openapi.json"): (None, GUEST_OR_OPERATOR),
    ("GET", "/v1/gpus"): (None, GUEST_OR_OPERATOR),
    ("GET", "/v1/gpus/{gpu_id}"): (None, GUEST_OR_OPERATOR),
    ("GET", "/v1/topology"): (None, GUEST_OR_OPERATOR),
    ("GET", "/v1/probes"): (None, GUEST_OR_OPERATOR),
    ("POST", "/v1/gpus/{gpu_id}/clear-quarantine"): ({}, {**OPERATOR, "operator": 409}),  # not quarantined
    ("POST", "/v1/gpus/{gpu_id}/probe"): ({}, {**OPERATOR, "operator": 409}),  # leased: not probed
    ("POST", "/v1/leases"): ({"gpus": 1}, {**GUEST_OR_OPERATOR, "other": 201, "own": 201, "operator": 400}),
    ("GET", "/v1/leases"): (None, GUEST_OR_OPERATOR),
    ("GET", "/v1/leases/{lease_id}"): (None, OWNER_OR_OPERATOR),
    ("DELETE", "/v1/leases/{lease_id}"): (None, OWNER_OR_OPERATOR),  # own and operator: each on a lease of its own
    ("POST", "/v1/leases/{lease_id}/heartbeat"): ("samples", OWNER_OR_OPERATOR),
    ("POST", "/v1/leases/{lease_id}/renew"): ({"duration_s": 600}, OWNER_OR_OPERATOR),
    ("POST", "/v1/leases/{lease_id}/reclaim"): ({"paused": True}, OPERATOR),
    ("POST", "/v1/leases/{lease_id}/move"): ({"to": "gpu-nope"}, {**OPERATOR, "operator": 404}),  # no such GPU
    ("POST", "/v1/leases/{lease_id}/move/done"): ({}, {**OWNER_OR_OPERATOR, "own": 409, "operator": 409}),
    ("GET", "/v1/reaper"): (None, OPERATOR),
    ("GET", "/v1/events"): (None, OPERATOR),
    ("GET", "/v1/fleet"): (None, OPERATOR),
}

PAGE = {"none": 303, "bad": 303, "vm": 303, "operator": 200}  # 303: to the login page
DASH_JSON = {"none": 401, "bad": 401, "vm": 401, "operator": 200}
OPEN = {"none": 200, "bad": 200, "vm": 200, "operator": 200}
# POSTs: without a session to the login page; with one, 403 without the session's CSRF token, else 303 back
ACTION = {"none": 303, "bad": 303, "vm": 303, "operator": 303}

# (method, route) -> (form, {who: status}); a form of None: not a POST
DASHBOARD_ROUTES: dict[tuple[str, str], tuple[dict[str, str] | None, dict[str, int]]] = {
    ("GET", "/"): (None, PAGE),
    ("GET", "/ui"): (None, {w: 303 for w in DASH_WHO}),  # to /, which decides
    ("GET", "/ui/"): (None, {w: 303 for w in DASH_WHO}),
    ("GET", "/ui/login"): (None, OPEN),
    ("POST", "/ui/login"): ({"token": "x"}, {w: 403 for w in DASH_WHO}),  # no login-form CSRF token: refused
    ("POST", "/ui/logout"): ({}, ACTION),  # the operator's last: it ends the session
    ("GET", "/ui/gpus/{gpu_id}"): (None, PAGE),
    ("POST", "/ui/gpus/{gpu_id}/clear-quarantine"): ({}, ACTION),
    ("GET", "/ui/leases"): (None, PAGE),
    ("GET", "/ui/leases.csv"): (None, PAGE),
    ("GET", "/ui/leases/{lease_id}"): (None, PAGE),
    ("POST", "/ui/leases/{lease_id}/release"): ({}, ACTION),  # the operator's on a lease of its own
    ("POST", "/ui/leases/{lease_id}/reclaim"): ({"paused": "1"}, ACTION),
    ("GET", "/ui/reclaim"): (None, PAGE),
    ("GET", "/ui/model"): (None, PAGE),
    ("GET", "/ui/fleet"): (None, PAGE),
    ("GET", "/ui/calendar"): (None, PAGE),
    ("GET", "/ui/api/overview"): (None, DASH_JSON),
    ("GET", "/ui/api/reclaim"): (None, DASH_JSON),
    ("GET", "/ui/api/fleet"): (None, DASH_JSON),
    ("GET", "/ui/api/gpus/{gpu_id}"): (None, DASH_JSON),
    ("GET", "/ui/api/leases"): (None, DASH_JSON),
    ("GET", "/ui/api/leases/{lease_id}"): (None, DASH_JSON),
    ("GET", "/ui/static"): (None, OPEN),  # fetched as /ui/static/dashboard.js
}
UNDOCUMENTED_API = {"/metrics"}  # served by the API's rules but not in the OpenAPI document (Prometheus text)


def registered_routes(app: Any) -> set[tuple[str, str]]:
    """(method, canonical path) of every route, HEAD folded into its GET."""
    return {("GET" if r.method == "HEAD" else r.method, r.resource.canonical) for r in app.router.routes()}


def is_dashboard(path: str) -> bool:
    return path == "/" or path == "/ui" or path.startswith("/ui/")


@pytest.fixture
async def rig(tmp_path: Path, aiohttp_client: Any) -> AgentRig:
    return await start_rig(make_rig(tmp_path), aiohttp_client)


def test_every_registered_route_has_a_row(tmp_path: Path) -> None:
    """A route added to the app without a row here fails, so no endpoint escapes the matrix."""
    routes = registered_routes(make_app(make_rig(tmp_path).runtime))
    rows = set(API) | set(DASHBOARD_ROUTES)
    assert routes - rows == set(), f"routes without an auth-matrix row: {sorted(routes - rows)}"
    assert rows - routes == set(), f"rows for routes the app does not register: {sorted(rows - routes)}"
    assert all(not is_dashboard(p) for _, p in API) and all(is_dashboard(p) for _, p in DASHBOARD_ROUTES)
    assert len(routes) >= 39


class Secrets:
    """What VM A owns and no one else may read: uuid, name, lease ids, task type, project, heartbeat values."""

    def __init__(self, rig: AgentRig) -> None:
        self.values = [rig.uuids["vm-a"], "vm-a", "secret-task-of-a", "project-of-a", "61.8125", "987654321",
                       "31337.75"]

    def add(self, *values: str) -> None:
        self.values.extend(values)

    def leaked(self, text: str, path: str) -> list[str]:
        return [s for s in self.values if s in text and s not in path]  # echoing the caller's own path is fine


async def lease_of_a(rig: AgentRig, secrets: Secrets) -> dict[str, Any]:
    r = await rig.client.post("/v1/leases", headers=rig.auth("vm-a"),
                              json={"gpus": 1, "task_type": "secret-task-of-a", "project": "project-of-a"})
    assert r.status == 201, await r.text()
    lease = dict(await r.json())
    secrets.add(lease["id"])
    return lease


def api_headers(rig: AgentRig, who: str) -> dict[str, str]:
    return {"none": {}, "bad": {"Authorization": "Bearer vm_not-a-real-token"}, "other": rig.auth("vm-b"),
            "own": rig.auth("vm-a"), "operator": rig.auth("operator"), "session": {}}[who]


async def operator_session(rig: AgentRig) -> str:
    """Log the operator in; the session id of the cookie."""
    r = await operator_login(rig)
    return str(r.cookies[SESSION_COOKIE].value)


async def test_api_matrix(rig: AgentRig) -> None:
    secrets = Secrets(rig)
    lease = await lease_of_a(rig, secrets)
    gpu = lease["devices"][0]["gpu_id"]
    r = await rig.client.post(f"/v1/leases/{lease['id']}/heartbeat", headers=rig.auth("vm-a"), json={"samples": [
        {"ts": time.time(), "gpu": gpu, "util_pct": 61.8125, "mem_used_bytes": 987654321, "work_rate": 31337.75}]})
    assert r.status == 200
    sid = await operator_session(rig)
    failures = []
    for (method, route), (body, expected) in API.items():
        for who in WHO:
            target = lease
            if method == "DELETE" and who in ("own", "operator"):
                target = await lease_of_a(rig, secrets)  # each release on a lease of its own
            path = route.format(gpu_id=gpu, lease_id=target["id"])
            payload = ({"samples": [{"ts": time.time(), "gpu": gpu, "util_pct": 50, "mem_used_bytes": 1}]}
                       if body == "samples" else body)
            kw: dict[str, Any] = {"headers": api_headers(rig, who)}
            if who == "session":
                kw["cookies"] = {SESSION_COOKIE: sid}
            if payload is not None:
                kw["json"] = payload
            for verb in (method, "HEAD") if method == "GET" else (method,):
                resp = await rig.client.request(verb, path, **kw)
                text = await resp.text()
                if resp.status != expected[who]:
                    failures.append(f"{verb} {path} as {who}: {resp.status}, expected {expected[who]}: {text[:200]}")
                if who != "own" and who != "operator" and secrets.leaked(text, path):
                    failures.append(f"{verb} {path} as {who} leaks {secrets.leaked(text, path)}")
                if resp.status >= 400 and verb != "HEAD" and route != "/metrics":
                    err = (await resp.json())["error"]
                    assert err["code"] and err["message"]
                if route == "/v1/leases" and method == "POST" and resp.status == 201:
                    made = await resp.json()
                    await rig.client.delete(f"/v1/leases/{made['id']}", headers=api_headers(rig, who))
    r = await rig.client.get(f"/v1/leases/{lease['id']}", headers=rig.auth("vm-a"))
    assert (await r.json())["state"] == "ACTIVE", "a refused DELETE released the lease"
    assert not failures, "\n".join(failures)


async def test_dashboard_matrix(rig: AgentRig) -> None:
    secrets = Secrets(rig)
    lease = await lease_of_a(rig, secrets)
    gpu = lease["devices"][0]["gpu_id"]
    failures = []
    for who in DASH_WHO:
        rig.client.session.cookie_jar.clear()
        headers: dict[str, str] = {}
        if who == "operator":
            await operator_session(rig)
        elif who == "bad":
            rig.client.session.cookie_jar.update_cookies({SESSION_COOKIE: "not-a-session"})
        elif who == "vm":
            headers = rig.auth("vm-a")
        csrf = ""
        if who == "operator":
            csrf = CSRF.search(await (await rig.client.get("/")).text()).group(1)  # type: ignore[union-attr]
        routes = sorted(DASHBOARD_ROUTES.items(), key=lambda kv: kv[0][1] == "/ui/logout")  # logout last
        for (method, route), (form, expected) in routes:
            target = lease
            if route.endswith("/release") and who == "operator":
                target = await lease_of_a(rig, secrets)
            path = route.format(gpu_id=gpu, lease_id=target["id"])
            if route == "/ui/static":
                path = "/ui/static/dashboard.js"
            if who == "operator" and method == "POST" and route != "/ui/login":
                r = await rig.client.post(path, data={**(form or {}), "csrf": "forged"}, allow_redirects=False)
                if r.status != 403:
                    failures.append(f"POST {path} with a forged CSRF token: {r.status}, expected 403")
                form = {**(form or {}), "csrf": csrf}
            for verb in (method, "HEAD") if method == "GET" else (method,):
                resp = await rig.client.request(verb, path, headers=headers, data=form, allow_redirects=False)
                text = await resp.text()
                if resp.status != expected[who]:
                    failures.append(f"{verb} {path} as {who}: {resp.status}, expected {expected[who]}: {text[:200]}")
                if resp.status == 303 and expected[who] == 303 and who != "operator" and method == "GET" \
                        and route not in ("/ui", "/ui/"):
                    assert resp.headers["Location"].startswith("/ui/login"), (path, who, resp.headers)
                if who != "operator" and secrets.leaked(text, path):
                    failures.append(f"{verb} {path} as {who} leaks {secrets.leaked(text, path)}")
                if who == "vm" and any(c.key == SESSION_COOKIE for c in resp.cookies.values()):
                    failures.append(f"{verb} {path} with a VM's bearer token set a session cookie")
    r = await rig.client.get(f"/v1/leases/{lease['id']}", headers=rig.auth("vm-a"))
    assert (await r.json())["state"] == "ACTIVE", "a refused dashboard action released the lease"
    assert not failures, "\n".join(failures)


def test_issued_tokens_are_stored_hashed(tmp_path: Path) -> None:
    rig = make_rig(tmp_path)
    db = (rig.settings.state_dir / "journal.sqlite3").read_bytes()
    assert all(tok.encode() not in db for tok in rig.tokens.values())


class Recorder:
    """hmac.compare_digest that records what it compared."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, Any]] = []
        self.real = hmac.compare_digest

    def __call__(self, a: Any, b: Any) -> bool:
        self.calls.append((a, b))
        return self.real(a, b)


async def test_operator_token_and_csrf_are_compared_in_constant_time(rig: AgentRig,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The operator token's digest, the login form's token and the session's CSRF token all go through
    hmac.compare_digest (seen by recording its calls, not by reading the source)."""
    from hostagent.web.auth import hash_token

    recorder = Recorder()
    monkeypatch.setattr(hmac, "compare_digest", recorder)
    assert (await rig.client.get("/v1/reaper", headers=rig.auth("operator"))).status == 200
    operator_digest = rig.runtime.settings.auth.operator_token_sha256.lower()
    assert (hash_token(rig.operator), operator_digest) in recorder.calls
    recorder.calls.clear()
    await operator_session(rig)
    assert recorder.calls, "the login form's CSRF token was not compared with compare_digest"
    page = await (await rig.client.get("/")).text()
    csrf = CSRF.search(page).group(1)  # type: ignore[union-attr]
    recorder.calls.clear()
    r = await rig.client.post("/ui/logout", data={"csrf": csrf + "x"}, allow_redirects=False)
    assert r.status == 403 and (csrf, csrf + "x") in recorder.calls


async def test_session_store_holds_no_session_id(rig: AgentRig) -> None:
    """The server keeps only the SHA-256 of a session id: a dump of the store (or a timing probe of its dict
    lookup) gives nothing that opens the dashboard."""
    sid = await operator_session(rig)
    book = rig.client.app[DASHBOARD].sessions
    assert len(book) == 1
    stored = repr(vars(book)) + repr(list(book._sessions.items()))
    assert sid not in stored
    assert book.get(sid) is not None and book.get(next(iter(book._sessions))) is None  # the key is no cookie
