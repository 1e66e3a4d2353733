"""Dashboard login, sessions, CSRF and operator actions, through aiohttp's test client over the fake host."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from hostagent.web.auth import hash_token, new_token
from hostagent.web.dashboard import CSP
from hostagent.web.dashboard_auth import LOGIN_COOKIE, SESSION_COOKIE, safe_next
from hostagent.web.dashboard_plumbing import DASHBOARD
from tests.support.agent import AgentRig, Clock, make_rig, start_rig

CSRF = re.compile(r'name="csrf" value="([^"]+)"')


@pytest.fixture
async def rig(tmp_path: Path, aiohttp_client: Any) -> AgentRig:
    return await start_rig(make_rig(tmp_path), aiohttp_client)


async def login(rig: AgentRig, token: str, *, next_: str = "/") -> Any:
    page = await (await rig.client.get("/ui/login")).text()
    csrf = CSRF.search(page).group(1)  # type: ignore[union-attr]
    return await rig.client.post("/ui/login", data={"token": token, "csrf": csrf, "next": next_},
                                 allow_redirects=False)


async def page_csrf(rig: AgentRig, path: str = "/") -> str:
    r = await rig.client.get(path)
    assert r.status == 200
    return CSRF.search(await r.text()).group(1)  # type: ignore[union-attr]


async def grant(rig: AgentRig, vm: str = "vm-a") -> dict[str, Any]:
    r = await rig.client.post("/v1/leases", json={"gpus": 1}, headers=rig.auth(vm))
    assert r.status == 201
    return dict(await r.json())


async def test_pages_redirect_to_login_and_api_says_401(rig: AgentRig) -> None:
    for path in ("/", "/ui/leases?state=live", "/ui/gpus/x", "/ui/reclaim", "/ui/model", "/ui/leases.csv"):
        r = await rig.client.get(path, allow_redirects=False)
        assert r.status == 303, path
        assert r.headers["Location"].startswith("/ui/login?next=/"), r.headers["Location"]
    r = await rig.client.get("/ui/api/overview")
    assert r.status == 401 and (await r.json())["error"]["code"] == "unauthorized"
    r = await rig.client.post("/ui/leases/l-x/release", data={}, allow_redirects=False)
    assert r.status == 303 and r.headers["Location"].startswith("/ui/login")


async def test_login_sets_a_strict_httponly_session_and_goes_back(rig: AgentRig) -> None:
    r = await login(rig, rig.operator, next_="/ui/leases?state=live")
    assert r.status == 303 and r.headers["Location"] == "/ui/leases?state=live"
    cookie = next(v for k, v in r.headers.items() if k == "Set-Cookie" and v.startswith(SESSION_COOKIE))
    assert "HttpOnly" in cookie and "SameSite=Strict" in cookie and "Secure" not in cookie  # plain HTTP here
    assert rig.operator not in cookie  # only a random session id travels
    r = await rig.client.get("/")
    assert r.status == 200 and "GPUs on test-host" in await r.text()
    assert r.headers["Content-Security-Policy"] == CSP and r.headers["X-Frame-Options"] == "DENY"
    assert "Content-Security-Policy" not in (await rig.client.get("/v1/gpus", headers=rig.auth("operator"))).headers


async def test_login_refusals(rig: AgentRig, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("INFO", logger="hostagent.dashboard")
    assert (await login(rig, "op_wrong")).status == 401
    # for the operator's audit: each refused credential, with where it came from (the token itself never)
    (said,) = [r for r in caplog.records if r.name == "hostagent.dashboard" and "refused" in r.getMessage()]
    assert said.levelname == "INFO" and said.getMessage() == "dashboard login refused from 127.0.0.1", said
    r = await login(rig, rig.tokens["vm-a"])
    assert r.status == 403 and "operator credential" in await r.text()
    # no CSRF token bound to this browser's login cookie: refused
    r = await rig.client.post("/ui/login", data={"token": rig.operator, "csrf": "forged"}, allow_redirects=False)
    assert r.status == 403
    assert (await rig.client.get("/", allow_redirects=False)).status == 303


async def test_open_redirects_are_refused(rig: AgentRig) -> None:
    r = await login(rig, rig.operator, next_="//evil.example/x")
    assert r.headers["Location"] == "/"
    assert safe_next("https://evil.example/") == "/" and safe_next("/\\evil") == "/"
    assert safe_next("/v1/leases") == "/" and safe_next("/ui/gpus/g1?range=7d") == "/ui/gpus/g1?range=7d"


async def test_login_is_throttled_after_repeated_failures(rig: AgentRig) -> None:
    rig.client.server.app[DASHBOARD].throttle.clock = Clock()  # frozen: the 1 s wait cannot run out mid-test
    for _ in range(6):  # five free failures, then the sixth makes the address wait (see test_login_throttle.py)
        assert (await login(rig, "op_wrong")).status == 401
    r = await login(rig, rig.operator)
    assert r.status == 429 and "too many failed logins" in await r.text() and int(r.headers["Retry-After"]) >= 1


async def test_release_needs_the_session_csrf_token(rig: AgentRig) -> None:
    lease = await grant(rig)
    await login(rig, rig.operator)
    for bad in ({}, {"csrf": "nope"}):
        r = await rig.client.post(f"/ui/leases/{lease['id']}/release", data=bad, allow_redirects=False)
        assert r.status == 403
    body = await (await rig.client.get(f"/v1/leases/{lease['id']}", headers=rig.auth("operator"))).json()
    assert body["state"] == "ACTIVE"
    csrf = await page_csrf(rig)
    r = await rig.client.post(f"/ui/leases/{lease['id']}/release", data={"csrf": csrf, "next": "/ui/leases"},
                              allow_redirects=False)
    assert r.status == 303 and r.headers["Location"] == "/ui/leases"
    body = await (await rig.client.get(f"/v1/leases/{lease['id']}", headers=rig.auth("operator"))).json()
    assert body["state"] == "RELEASED"
    page = await (await rig.client.get("/ui/leases")).text()
    assert f"lease {lease['id']} released" in page  # the flash message
    events = await (await rig.client.get(f"/v1/events?lease_id={lease['id']}", headers=rig.auth("operator"))).json()
    assert any(e["actor"].startswith("dashboard:") for e in events["events"])


async def test_pause_and_resume_reclaim_and_errors_are_flashed(rig: AgentRig) -> None:
    lease = await grant(rig)
    await login(rig, rig.operator)
    csrf = await page_csrf(rig, f"/ui/leases/{lease['id']}")
    await rig.client.post(f"/ui/leases/{lease['id']}/reclaim", data={"csrf": csrf, "paused": "1"})
    body = await (await rig.client.get(f"/v1/leases/{lease['id']}", headers=rig.auth("operator"))).json()
    assert body["reclaim"]["paused"] is True
    await rig.client.post(f"/ui/leases/{lease['id']}/reclaim", data={"csrf": csrf, "paused": "0"})
    body = await (await rig.client.get(f"/v1/leases/{lease['id']}", headers=rig.auth("operator"))).json()
    assert body["reclaim"]["paused"] is False
    r = await rig.client.post("/ui/gpus/" + lease["devices"][0]["gpu_id"] + "/clear-quarantine",
                              data={"csrf": csrf, "next": "/"})
    assert r.status == 200 and "is not quarantined" in await r.text()


async def test_logout_ends_the_session(rig: AgentRig) -> None:
    await login(rig, rig.operator)
    csrf = await page_csrf(rig)
    assert (await rig.client.post("/ui/logout", data={"csrf": "x"}, allow_redirects=False)).status == 403
    r = await rig.client.post("/ui/logout", data={"csrf": csrf}, allow_redirects=False)
    assert r.status == 303
    assert (await rig.client.get("/", allow_redirects=False)).status == 303


async def test_reader_is_read_only_and_revocation_ends_the_session(rig: AgentRig) -> None:
    token = new_token("rd")
    rig.runtime.journal.add_token(hash_token(token), role="reader", domain_uuid="reader-1", domain_name=None)
    lease = await grant(rig)
    assert (await login(rig, token)).status == 303
    page = await (await rig.client.get("/")).text()
    assert "(read-only)" in page and "data-release" not in page
    csrf = CSRF.search(page).group(1)  # type: ignore[union-attr]
    r = await rig.client.post(f"/ui/leases/{lease['id']}/release", data={"csrf": csrf})
    assert "read-only" in await r.text()
    body = await (await rig.client.get(f"/v1/leases/{lease['id']}", headers=rig.auth("operator"))).json()
    assert body["state"] == "ACTIVE"
    rig.runtime.journal.revoke_tokens(domain_uuid="reader-1")
    assert (await rig.client.get("/", allow_redirects=False)).status == 303


async def test_unknown_things_render_an_html_404(rig: AgentRig) -> None:
    await login(rig, rig.operator)
    r = await rig.client.get("/ui/gpus/no-such-gpu")
    assert r.status == 404 and "no GPU" in await r.text() and r.content_type == "text/html"
    r = await rig.client.get("/ui/leases/l-nope")
    assert r.status == 404
    r = await rig.client.get("/ui/leases?sort=bogus")
    assert r.status == 400 and "sort must be one of" in await r.text()
    r = await rig.client.get("/ui/gpus/x?range=9y")
    assert r.status == 404  # the GPU check comes first


async def test_the_login_form_is_titled_and_its_nonce_cookie_is_httponly(rig: AgentRig) -> None:
    r = await rig.client.get("/ui/login")
    assert "<title>Log in" in await r.text()
    nonce = next(v for k, v in r.headers.items() if k == "Set-Cookie" and v.startswith(LOGIN_COOKIE))
    assert "HttpOnly" in nonce and "SameSite=Strict" in nonce and "Path=/ui/login" in nonce, nonce


async def test_a_new_login_ends_the_session_the_browser_had(rig: AgentRig) -> None:
    """Logging in again (another operator at the same browser, or a fixated id) drops the old session: its id no
    longer opens a page."""
    await login(rig, rig.operator)
    old = rig.client.session.cookie_jar.filter_cookies(rig.client.make_url("/"))[SESSION_COOKIE].value
    await login(rig, rig.operator)
    new = rig.client.session.cookie_jar.filter_cookies(rig.client.make_url("/"))[SESSION_COOKIE].value
    assert new != old
    rig.client.session.cookie_jar.clear()
    with_new = await rig.client.get("/", headers={"Cookie": f"{SESSION_COOKIE}={new}"}, allow_redirects=False)
    assert with_new.status == 200
    rig.client.session.cookie_jar.clear()
    with_old = await rig.client.get("/", headers={"Cookie": f"{SESSION_COOKIE}={old}"}, allow_redirects=False)
    assert with_old.status == 303  # the old id is gone
