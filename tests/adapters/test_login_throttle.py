"""The dashboard's login throttle: per-source exponential backoff, device cookies that exempt a browser which has
logged in before, and bounded memory that address churn cannot reset. Unit tests drive LoginThrottle with a fake
clock; the app tests go through the real dashboard over aiohttp's test client."""

from __future__ import annotations

import logging
import re
import stat
from pathlib import Path
from typing import Any

import pytest

from hostagent.web.dashboard_auth import (
    DEVICE_COOKIE,
    DEVICE_KEY_FILE,
    LoginThrottle,
    load_device_key,
    source_key,
)
from hostagent.web.dashboard_plumbing import DASHBOARD, Dashboard
from tests.support.agent import AgentRig, Clock, make_rig, start_rig

CSRF = re.compile(r'name="csrf" value="([^"]+)"')
OPERATOR = "operator(config)"


def throttle(clock: Clock, **kwargs: Any) -> LoginThrottle:
    return LoginThrottle(clock=clock, **kwargs)


def fail(t: LoginThrottle, source: str, times: int = 1, device: Any = None) -> None:
    for _ in range(times):
        t.failed(source, device)


def lock_out(t: LoginThrottle, source: str) -> None:
    """Six failures: the five free ones and the first that makes the source wait."""
    fail(t, source, 6)
    assert t.wait(source) == 1.0


# -- sources -----------------------------------------------------------------------------------------------------

def test_source_key_groups_ipv6_by_its_64() -> None:
    assert source_key("192.0.2.7") == "192.0.2.7"
    assert source_key("2001:db8:1:2:aaaa::1") == source_key("2001:db8:1:2:ffff:1:2:3") == "2001:db8:1:2::/64"
    assert source_key("2001:db8:1:3::1") != source_key("2001:db8:1:2::1")
    assert source_key("::ffff:192.0.2.7") == "192.0.2.7"  # an IPv4 peer on a dual-stack socket
    assert source_key("not an address") == "not an address"
    assert source_key(None) == "?"


def test_rotating_inside_a_64_buys_no_fresh_attempts() -> None:
    t = throttle(Clock())
    for i in range(6):
        t.failed(source_key(f"2001:db8:0:7::{i + 1:x}"))
    assert t.wait(source_key("2001:db8:0:7:dead:beef::1")) == 1.0
    assert t.wait(source_key("2001:db8:0:8::1")) == 0.0


# -- backoff -----------------------------------------------------------------------------------------------------

def test_five_failures_are_free_then_each_failure_doubles_the_wait_up_to_the_cap() -> None:
    clock = Clock()
    t = throttle(clock)
    for _ in range(5):
        t.failed("192.0.2.1")
        assert t.wait("192.0.2.1") == 0.0
    waits = []
    for _ in range(12):
        t.failed("192.0.2.1")
        waits.append(t.wait("192.0.2.1"))
        clock.advance(waits[-1])  # the earliest the source may try again
        assert t.wait("192.0.2.1") == 0.0
    assert waits == [1, 2, 4, 8, 16, 32, 64, 128, 256, 300, 300, 300]


def test_the_wait_counts_down() -> None:
    clock = Clock()
    t = throttle(clock)
    fail(t, "192.0.2.1", 8)
    assert t.wait("192.0.2.1") == 4.0
    clock.advance(2.5)
    assert t.wait("192.0.2.1") == 1.5


def test_a_quiet_window_after_the_wait_forgets_the_failures() -> None:
    clock = Clock()
    t = throttle(clock, window_s=300.0)
    lock_out(t, "192.0.2.1")
    clock.advance(1 + 299)  # the wait, then not quite a whole window
    t.failed("192.0.2.1")
    assert t.wait("192.0.2.1") == 2.0  # still the same run: the backoff goes on
    clock.advance(2 + 300)
    fail(t, "192.0.2.1", 5)
    assert t.wait("192.0.2.1") == 0.0  # a new run: five free failures again
    assert len(t) == 1


def test_success_clears_the_source() -> None:
    t = throttle(Clock())
    fail(t, "192.0.2.1", 5)
    t.succeeded("192.0.2.1")
    t.failed("192.0.2.1")
    assert t.wait("192.0.2.1") == 0.0 and len(t) == 1
    fail(t, "192.0.2.1", 4)
    assert t.wait("192.0.2.1") == 0.0  # the count started again from the success
    t.failed("192.0.2.1")
    assert t.wait("192.0.2.1") == 1.0


def test_a_waiting_source_is_logged_once_per_backoff_step(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    t = throttle(clock)
    with caplog.at_level(logging.WARNING, logger="hostagent.dashboard"):
        fail(t, "192.0.2.1", 5)
        assert not caplog.records
        t.failed("192.0.2.1")
        for _ in range(20):  # refused attempts while it waits are not logged
            assert t.wait("192.0.2.1") > 0
        clock.advance(1)
        t.failed("192.0.2.1")
    assert [r.getMessage() for r in caplog.records] == [
        "dashboard login throttle: source 192.0.2.1 waits 1 s after 6 failed logins",
        "dashboard login throttle: source 192.0.2.1 waits 2 s after 7 failed logins",
    ]


# -- device cookies ----------------------------------------------------------------------------------------------

def test_a_device_cookie_exempts_from_the_source_and_backs_off_on_its_own() -> None:
    clock = Clock()
    t = throttle(clock)
    device = t.device(t.device_cookie(OPERATOR))
    assert device is not None and device.subject == OPERATOR
    fail(t, "192.0.2.1", 30)
    assert t.wait("192.0.2.1") == 300.0
    assert t.wait("192.0.2.1", device) == 0.0  # the attacker's failures do not hold the operator's browser back
    fail(t, "192.0.2.1", 6, device)
    assert t.wait("192.0.2.1", device) == 1.0  # the device's own failures do
    assert t.wait("198.51.100.9", device) == 1.0  # wherever it goes
    assert t.wait("198.51.100.9") == 0.0  # and they never count against a source
    clock.advance(1)
    t.succeeded("192.0.2.1", device)
    fail(t, "192.0.2.1", 5, device)
    assert t.wait("192.0.2.1", device) == 32.0  # its account's run (11 failures) survives the device's success ...
    assert t.wait("192.0.2.1") > 0  # ... and so does the source's: others behind that address keep waiting


def test_devices_of_one_account_share_its_backoff_but_not_other_accounts() -> None:
    t = throttle(Clock())
    mine = t.device(t.device_cookie("reader:ro-1"))
    minted = [t.device(t.device_cookie("reader:ro-1")) for _ in range(3)]
    operator = t.device(t.device_cookie(OPERATOR))
    assert mine is not None and operator is not None and len({d.id for d in minted if d} | {mine.id}) == 4
    for d in minted:
        fail(t, "192.0.2.1", 2, d)  # a credential holder minting devices to spread guesses over them
    assert t.wait("192.0.2.1", mine) == 1.0  # buys nothing: six failures on the account
    assert t.wait("192.0.2.1", operator) == 0.0


def test_device_cookies_keep_their_id_for_the_same_subject_only() -> None:
    t = throttle(Clock())
    device = t.device(t.device_cookie(OPERATOR))
    assert device is not None
    again = t.device(t.device_cookie(OPERATOR, device))
    other = t.device(t.device_cookie("reader:ro-1", device))
    assert again == device
    assert other is not None and other.id != device.id and other.subject == "reader:ro-1"


def test_forged_or_tampered_device_cookies_are_not_devices() -> None:
    t = throttle(Clock())
    cookie = t.device_cookie(OPERATOR)
    device_id, subject, mac = cookie.split(".")
    flipped = mac[:-1] + ("0" if mac[-1] != "0" else "1")
    other_agent = LoginThrottle(clock=Clock()).device_cookie(OPERATOR)
    reader_subject = t.device_cookie("reader:ro-1").split(".")[1]
    for bad in (None, "", "x", f"{device_id}.{subject}.{flipped}", f"{device_id}x.{subject}.{mac}",
                f"{device_id}.{reader_subject}.{mac}", other_agent, cookie + ".x", "é" + cookie):
        assert t.device(bad) is None, bad


# -- bounded memory ----------------------------------------------------------------------------------------------

def test_eviction_never_drops_a_waiting_record() -> None:
    clock = Clock()
    t = throttle(clock, max_sources=100)
    waiting = [f"10.0.0.{i}" for i in range(50)]
    for source in waiting:
        lock_out(t, source)
    for i in range(1000):  # churn: one failure each, never waiting
        t.failed(f"10.1.{i // 256}.{i % 256}")
    assert all(t.wait(source) == 1.0 for source in waiting)
    assert len(t) <= 100
    assert t.wait("10.1.3.231") == 0.0  # the newest churners keep a record, but none of them waits


def test_churn_past_a_full_table_only_lengthens_the_overflow_wait(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    t = throttle(clock, max_sources=100)
    operator = t.device(t.device_cookie(OPERATOR))
    for i in range(100):
        lock_out(t, f"10.0.0.{i}")
    churners = [f"10.{1 + i // 65536}.{i // 256 % 256}.{i % 256}" for i in range(20_000)]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="hostagent.dashboard"):
        for source in churners:
            assert t.wait(source) == 0.0  # a source that never failed is not held back by the overflow
            t.failed(source)
    assert 100 < len(t) <= 2 * 100  # records plus the sources remembered as sharing the overflow
    assert all(t.wait(f"10.0.0.{i}") == 1.0 for i in range(100))  # nothing that waited was let go
    assert t.wait(churners[-1]) == 300.0  # a churner's next attempt waits on the overflow, now at the cap
    assert t.wait("172.16.0.1") == 0.0
    assert t.wait("10.0.0.1", operator) == 0.0  # nor does the overflow hold a known device back
    assert len(caplog.records) <= 12  # once per backoff step of the overflow, not once per churner
    assert "source overflow" in caplog.records[-1].getMessage()


def test_the_table_takes_new_sources_again_once_the_waits_run_out() -> None:
    clock = Clock()
    t = throttle(clock, max_sources=100)
    for i in range(100):
        lock_out(t, f"10.0.0.{i}")
    fail(t, "172.16.0.1", 6)  # into the overflow: it waits with everyone else who came while the table was full
    assert t.wait("172.16.0.1") == 1.0
    clock.advance(1 + 300)  # every wait ran out and a quiet window passed
    assert t.wait("172.16.0.1") == 0.0
    fail(t, "172.16.0.2", 5)
    assert t.wait("172.16.0.2") == 0.0  # its own record again, with its free failures
    t.failed("172.16.0.2")
    assert t.wait("172.16.0.2") == 1.0
    assert len(t) <= 100


# -- the device-cookie key ---------------------------------------------------------------------------------------

def test_the_device_key_is_kept_0600_and_reused(tmp_path: Path) -> None:
    path = tmp_path / DEVICE_KEY_FILE
    key = load_device_key(path)
    assert len(key) == 32 and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert load_device_key(path) == key
    path.write_bytes(b"short")
    assert load_device_key(path) not in (key, b"short") and len(path.read_bytes()) == 32


@pytest.mark.parametrize("parent", ["file", "missing"])  # cannot be read; cannot be written
def test_an_unusable_device_key_file_leaves_the_key_in_memory(tmp_path: Path, parent: str,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "file").write_text("not a directory")
    with caplog.at_level(logging.WARNING, logger="hostagent.dashboard"):
        key = load_device_key(tmp_path / parent / DEVICE_KEY_FILE)
    assert len(key) == 32
    assert len(caplog.records) == 1 and "until the agent restarts" in caplog.records[0].getMessage()


# -- through the dashboard ---------------------------------------------------------------------------------------

@pytest.fixture
async def rig(tmp_path: Path, aiohttp_client: Any) -> AgentRig:
    rig = await start_rig(make_rig(tmp_path), aiohttp_client)
    rig.client.server.app[DASHBOARD].throttle.clock = Clock()  # frozen: waits never run out mid-test
    return rig


async def login(rig: AgentRig, token: str, *, device: str | None = None) -> Any:
    """The login form, then its POST (with a device cookie when given); the session cookie is dropped first."""
    rig.client.session.cookie_jar.clear(lambda c: c.key != DEVICE_COOKIE)
    page = await (await rig.client.get("/ui/login")).text()
    csrf = CSRF.search(page).group(1)  # type: ignore[union-attr]
    return await rig.client.post("/ui/login", data={"token": token, "csrf": csrf}, allow_redirects=False,
                                 cookies={DEVICE_COOKIE: device} if device else None)


def forget_device(rig: AgentRig) -> None:
    rig.client.session.cookie_jar.clear(lambda c: c.key == DEVICE_COOKIE)


async def device_cookie_of_a_login(rig: AgentRig) -> str:
    r = await login(rig, rig.operator)
    assert r.status == 303
    forget_device(rig)
    return str(r.cookies[DEVICE_COOKIE].value)


async def test_login_sets_a_long_lived_strict_httponly_device_cookie(rig: AgentRig, tmp_path: Path) -> None:
    r = await login(rig, rig.operator)
    assert r.status == 303
    cookie = next(v for k, v in r.headers.items() if k == "Set-Cookie" and v.startswith(DEVICE_COOKIE + "="))
    assert "HttpOnly" in cookie and "SameSite=Strict" in cookie and "Path=/ui/login" in cookie
    assert "Max-Age=34560000" in cookie and "Secure" not in cookie  # plain HTTP here
    assert rig.operator not in cookie
    key = tmp_path / "state" / DEVICE_KEY_FILE
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    # a restart reads the same key, so the browser is still known
    assert Dashboard(rig.runtime).throttle.device(r.cookies[DEVICE_COOKIE].value) is not None


async def test_a_known_browser_logs_in_while_its_address_is_locked_out(rig: AgentRig) -> None:
    device = await device_cookie_of_a_login(rig)
    for _ in range(6):
        assert (await login(rig, "op_wrong")).status == 401
    r = await login(rig, rig.operator)
    assert r.status == 429 and "too many failed logins; try again in 1 s" in await r.text()
    assert r.headers["Retry-After"] == "1"
    r = await login(rig, rig.operator, device=device)
    assert r.status == 303
    assert (await rig.client.get("/", allow_redirects=False)).status == 200
    forget_device(rig)
    assert (await login(rig, rig.operator)).status == 429  # the address still waits for everyone else


async def test_a_known_browser_backs_off_on_its_own_failures(rig: AgentRig) -> None:
    device = await device_cookie_of_a_login(rig)
    for _ in range(6):
        assert (await login(rig, "op_wrong", device=device)).status == 401
    assert (await login(rig, rig.operator, device=device)).status == 429
    assert (await login(rig, rig.operator)).status == 303  # those failures never counted against the address


async def test_forged_or_tampered_device_cookies_give_no_exemption(rig: AgentRig) -> None:
    device = await device_cookie_of_a_login(rig)
    for _ in range(6):
        assert (await login(rig, "op_wrong")).status == 401
    forged = LoginThrottle().device_cookie("operator(config)")  # signed with another key
    tampered = device[:-1] + ("0" if device[-1] != "0" else "1")
    for bad in (forged, tampered, "garbage"):
        r = await login(rig, rig.operator, device=bad)
        assert r.status == 429, bad


async def test_a_vm_token_never_gets_a_device_cookie(rig: AgentRig) -> None:
    device = await device_cookie_of_a_login(rig)
    for sent in (None, device):
        r = await login(rig, rig.tokens["vm-a"], device=sent)
        assert r.status == 403
        assert DEVICE_COOKIE not in r.cookies
        assert not [c for c in rig.client.session.cookie_jar if c.key == DEVICE_COOKIE]
