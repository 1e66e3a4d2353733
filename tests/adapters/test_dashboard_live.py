"""The dashboard's live facts, server side (issue #25): one time format with the zone and seconds, figures with
their age and stale ones marked, heartbeat warnings, countdowns, queue position and ETA with Cancel, the reclaim
page's refresh, series windows that end at the agent's now, and the HTML error page for unknown /ui paths. The
browser half (ticking, sliding charts, the 390 px layout) is tests/browser/test_dashboard_live.py."""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import pytest

from hostagent.web.dashboard_format import (age_view, countdown_tag, countdown_text, duration, group_note,
                                            heartbeat_view, time_tag)
from tests.support.agent import AgentRig, Clock, make_rig, start_rig

CSRF = re.compile(r'name="csrf" value="([^"]+)"')
FULL_TIME = re.compile(r">\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2} UTC</time>")


# ---- pure formatting -------------------------------------------------------------------------------------------


def test_a_gpu_with_functions_beside_it_says_the_lease_takes_its_whole_group() -> None:
    turing = [{"class": "0x030000"}, {"class": "0x040300"}, {"class": "0x0c0330"}, {"class": "0x0c8000"}]
    assert group_note(turing) == "whole group: 4 functions (GPU, audio, USB, USB-C controller)"
    assert group_note([{"class": "0x030200"}, {"class": "0x0b4000"}]) == "whole group: 2 functions (GPU, 0b40)"
    assert group_note([{"class": "0x030200"}]) is None  # alone in its group: nothing to say


def test_one_time_format_to_the_second_with_the_zone() -> None:
    ts = 1_800_000_007.0  # 2027-01-15 08:00:07 UTC
    assert str(time_tag(ts)) == ('<time datetime="2027-01-15T08:00:07Z" data-style="datetime">'
                                 '2027-01-15 08:00:07 UTC</time>')
    assert ">08:00:07 UTC<" in str(time_tag(ts, "time"))
    assert ">08:00<" in str(time_tag(ts, "hm")) and ">01-15 08:00<" in str(time_tag(ts, "short"))
    assert "2027-01-15 08:00:07 UTC" in str(time_tag(ts, "no-such-style"))  # unknown styles get the full format
    assert "—" in str(time_tag(None))


def test_countdowns_ages_and_heartbeats_read_as_the_browser_ticks_them() -> None:
    assert countdown_text(1000.0, 750.0) == "in 4m 10s"
    assert countdown_text(1000.0, 1000.4) == "now" and countdown_text(1000.0, 1012.0) == "12s overdue"
    tag = str(countdown_tag(1_800_000_000.0, 1_800_000_000.0 - 3725))
    assert 'data-countdown="1800000000.000"' in tag and "(in 1h 02m)" in tag and "UTC</time>" in tag
    assert age_view(100.0, 130.0, 60.0) == {"ts": 100.0, "age": 30.0, "stale": False, "text": "30s ago"}
    assert age_view(100.0, 161.0, 60.0)["stale"] and age_view(None, 0.0, 60.0)["text"] == ""
    assert age_view(200.0, 100.0, 60.0)["age"] == 0.0  # a guest clock ahead never makes a negative age
    fresh = heartbeat_view(100.0, 50.0, 112.0, 60.0)
    assert fresh["state"] == "ok" and fresh["text"] == "heartbeat 12s ago" and not fresh["warn"]
    dead = heartbeat_view(100.0, 50.0, 100.0 + 190, 60.0)
    assert dead["state"] == "stale" and dead["text"] == "no heartbeat for 3m 10s" and dead["warn"]
    assert heartbeat_view(None, 50.0, 80.0, 60.0)["state"] == "waiting"  # a new lease: its guest may not be up yet
    never = heartbeat_view(None, 50.0, 200.0, 60.0)
    assert never["state"] == "never" and never["text"] == "no heartbeat yet" and never["warn"]
    assert duration(59) == "59s" and duration(3725) == "1h 02m"


# ---- pages over an agent ---------------------------------------------------------------------------------------


async def login(r: AgentRig) -> AgentRig:
    page = await (await r.client.get("/ui/login")).text()
    csrf = CSRF.search(page).group(1)  # type: ignore[union-attr]
    resp = await r.client.post("/ui/login", data={"token": r.operator, "csrf": csrf}, allow_redirects=False)
    assert resp.status == 303
    return r


@pytest.fixture
def clock() -> Clock:
    return Clock(now=time.time())  # samples are checked against the real time: the agent's clock starts there


@pytest.fixture
async def rig(tmp_path: Path, aiohttp_client: Any, clock: Clock) -> AgentRig:
    r = make_rig(tmp_path, clock=clock, dashboard={"stale_after_s": 90.0, "refresh_s": 2.0},
                 reclaim={"enabled": True})
    return await login(await start_rig(r, aiohttp_client))


async def grant(rig: AgentRig, vm: str, gpus: int = 1, **body: Any) -> dict[str, Any]:
    r = await rig.client.post("/v1/leases", json={"gpus": gpus, **body}, headers=rig.auth(vm))
    data = await r.json()
    assert r.status in (201, 202), data
    return dict(data)


async def beat(rig: AgentRig, vm: str, lease: dict[str, Any], util: float, ts: float) -> None:
    samples = [{"ts": ts, "gpu": d["gpu_id"], "util_pct": util, "mem_used_bytes": 2**30} for d in lease["devices"]]
    r = await rig.client.post(f"/v1/leases/{lease['id']}/heartbeat", json={"samples": samples}, headers=rig.auth(vm))
    assert r.status == 200, await r.text()


def gpu_row(html: str, gpu_id: str) -> str:
    m = re.search(rf'<tr class="row-[a-z-]+" data-gpu="{gpu_id}">.*?</tr>', html, re.S)
    assert m, gpu_id
    return m.group(0)


async def test_a_dead_guest_looks_dead_and_a_silent_one_is_flagged(rig: AgentRig, clock: Clock) -> None:
    alive = await grant(rig, "vm-a")
    silent = await grant(rig, "vm-b")
    await beat(rig, "vm-a", alive, 97.0, clock.now)
    a_gpu, b_gpu = alive["devices"][0]["gpu_id"], silent["devices"][0]["gpu_id"]

    html = (await (await rig.client.get("/ui/api/overview")).json())["html"]
    row = gpu_row(html, a_gpu)
    assert "97%" in row and 'class="util-now"' in row and "0s ago" in row and "hb hb-ok" in row
    assert f'data-age-from="{clock.now}"' in row  # the browser ticks the age on from the sample's time
    row = gpu_row(html, b_gpu)
    assert "hb hb-waiting" in row and "no heartbeat yet" in row  # just granted: not a warning yet

    clock.advance(75)  # past the default 60 s, within the configured dashboard.stale_after_s (90 s)
    html = (await (await rig.client.get("/ui/api/overview")).json())["html"]
    assert 'class="util-now"' in gpu_row(html, a_gpu) and "hb hb-ok" in gpu_row(html, a_gpu)
    assert "hb hb-waiting" in gpu_row(html, b_gpu)
    clock.advance(110)  # the guest of vm-a stopped; vm-b's never started
    html = (await (await rig.client.get("/ui/api/overview")).json())["html"]
    row = gpu_row(html, a_gpu)
    assert 'class="util-now stale"' in row and "3m 05s ago" in row and "97%" in row
    assert "hb hb-stale" in row and "no heartbeat for 3m 05s" in row
    row = gpu_row(html, b_gpu)
    assert "hb hb-never" in row and "no heartbeat yet" in row

    page = await (await rig.client.get(f"/ui/leases/{alive['id']}")).text()
    # (once seen without the banner on a loaded CI worker: the message shows what the page said instead)
    said = re.findall(r'<[^>]*class="[^"]*(?:hb|util-now|state)[^"]*"[^>]*>[^<]*', page)
    assert "hb-banner" in page and "no heartbeat for 3m 05s" in page and 'class="util-now stale"' in page, said
    page = await (await rig.client.get(f"/ui/gpus/{b_gpu}")).text()
    assert "Utilization now" in page and "hb hb-never" in page
    page = await (await rig.client.get("/ui/reclaim")).text()
    assert "no heartbeat for 3m 05s" in page and "hb hb-never" in page

    await beat(rig, "vm-a", alive, 12.0, clock.now)  # it comes back
    html = (await (await rig.client.get("/ui/api/overview")).json())["html"]
    row = gpu_row(html, a_gpu)
    assert 'class="util-now"' in row and "12%" in row and "hb hb-ok" in row


async def test_queue_position_eta_and_cancel_not_release(rig: AgentRig) -> None:
    big = await grant(rig, "vm-a", gpus=8, duration_s=3600)
    queued = await grant(rig, "vm-b", gpus=2, accept_deferred=True)
    assert queued["state"] == "QUEUED" and queued["queue"]["position"] == 1

    html = (await (await rig.client.get("/ui/api/overview")).json())["html"]
    api = await (await rig.client.get(f"/v1/leases/{queued['id']}", headers=rig.auth("operator"))).json()
    eta = api["queue"]["eta"]  # the API's figure, as the page shows it
    assert eta is not None and big["expires_at"] <= eta
    row = re.search(rf'<tr data-lease="{queued["id"]}">.*?</tr>', html, re.S)
    assert row, html
    assert '<td class="r" data-position>1</td>' in row.group(0)
    assert f'data-countdown="{eta:.3f}"' in row.group(0) and re.search(r"\(in (59m|1h 0)", row.group(0))
    assert f'data-cancel="{queued["id"]}">Cancel</button>' in row.group(0) and "data-release" not in row.group(0)
    assert 'name="next" value="/"' in row.group(0)  # the fragment's form goes back to the page, not to the JSON

    page = await (await rig.client.get(f"/ui/leases/{queued['id']}")).text()
    assert "Queued: position <b data-queue-position>1</b> of 1" in page and "expected grant" in page
    assert ">Cancel request</button>" in page and "Release lease" not in page
    head = (await (await rig.client.get(f"/ui/api/leases/{queued['id']}")).json())["head"]
    assert "data-queue-position" in head and "Cancel request" in head
    rows = (await (await rig.client.get("/ui/api/leases?state=live")).json())["html"]
    queued_row = re.search(rf'<tr class="lease-row[^"]*" data-lease="{queued["id"]}".*?</tr>', rows, re.S)
    assert queued_row and ">Cancel</button>" in queued_row.group(0) and "data-release" not in queued_row.group(0)
    big_row = re.search(rf'<tr class="lease-row[^"]*" data-lease="{big["id"]}".*?</tr>', rows, re.S)
    assert big_row and ">Release</button>" in big_row.group(0)

    csrf = CSRF.search(page).group(1)  # type: ignore[union-attr]
    resp = await rig.client.post(f"/ui/leases/{queued['id']}/release", data={"csrf": csrf, "next": "/"})
    assert resp.status == 200 and f"queued request {queued['id']} cancelled" in await resp.text()
    body = await (await rig.client.get(f"/v1/leases/{queued['id']}", headers=rig.auth("operator"))).json()
    assert body["state"] == "RELEASED" and body["end_reason"] == "cancelled by operator"


async def test_reclaim_page_refreshes_and_counts_down(rig: AgentRig, clock: Clock) -> None:
    lease = await grant(rig, "vm-a")
    page = await (await rig.client.get("/ui/reclaim")).text()
    assert 'id="reclaim-body" data-refresh="/ui/api/reclaim"' in page
    body = await (await rig.client.get("/ui/api/reclaim")).json()
    assert body["now"] == clock.now
    row = re.search(rf'<tr data-lease="{lease["id"]}">.*?</tr>', body["html"], re.S)
    assert row and 'class="nowrap next-check"' in row.group(0) and "data-countdown=" in row.group(0)
    assert re.search(r"\(in (\d+m \d+s|\d+h \d+m)\)", row.group(0))
    assert 'name="next" value="/ui/reclaim"' in row.group(0)  # Pause reclaim comes back to the page
    assert FULL_TIME.search(body["html"])


async def test_series_windows_end_at_the_agents_now(rig: AgentRig, clock: Clock) -> None:
    lease = await grant(rig, "vm-a")
    gid = lease["devices"][0]["gpu_id"]
    first = await (await rig.client.get(f"/ui/api/gpus/{gid}?range=1h")).json()
    assert first["series"]["until"] == clock.now and first["now"] == clock.now
    assert "Utilization now" in first["head"]  # the head comes with each refresh, heartbeat age included
    clock.advance(30)
    await beat(rig, "vm-a", lease, 55.0, clock.now - 1)
    second = await (await rig.client.get(f"/ui/api/gpus/{gid}?range=1h")).json()
    assert second["series"]["until"] == first["series"]["until"] + 30
    assert second["series"]["since"] == first["series"]["since"] + 30
    assert second["series"]["util"][-1] == 55.0
    one = await (await rig.client.get(f"/ui/api/leases/{lease['id']}")).json()
    assert one["series"][gid]["until"] == clock.now and "55%" in one["head"]


async def test_page_times_carry_seconds_and_zone(rig: AgentRig) -> None:
    lease = await grant(rig, "vm-a")
    page = await (await rig.client.get(f"/ui/leases/{lease['id']}")).text()
    assert FULL_TIME.search(page) and "data-style=\"datetime\"" in page
    assert not re.search(r">\d{4}-\d{2}-\d{2} \d{2}:\d{2} UTC<", page)  # no minute-only time anywhere
    assert 'data-refresh-ms="2000"' in page and 'data-stale-after="90.0"' in page  # the [dashboard] settings


async def test_unknown_ui_paths_get_the_html_error_page(tmp_path: Path, aiohttp_client: Any) -> None:
    r = await start_rig(make_rig(tmp_path), aiohttp_client)
    resp = await r.client.get("/ui/nope")  # no session: still the page, not JSON and not a login redirect
    text = await resp.text()
    assert resp.status == 404 and resp.content_type == "text/html"
    assert "404 · not_found" in text and "no page at /ui/nope" in text and "Log out" not in text
    assert resp.headers["Content-Security-Policy"].startswith("default-src 'self'")
    await login(r)
    for path in ("/ui/nope", "/ui/leases/x/y/z", "/ui/static/nope.css", "/ui"):
        resp = await r.client.get(path + ("/deeper" if path == "/ui" else ""))
        text = await resp.text()
        assert resp.status == 404 and resp.content_type == "text/html", path
        assert "Log out" in text and "Back to the overview" in text  # the header of a logged-in page
    resp = await r.client.get("/ui/leases/l-1/release")  # POST only
    assert resp.status == 405 and resp.content_type == "text/html" and "POST" in resp.headers["Allow"]
    resp = await r.client.post("/ui/nope", data={})
    assert resp.status == 404 and resp.content_type == "text/html"
    # the JSON API keeps JSON
    for path in ("/ui/api/nope", "/v1/nope"):
        resp = await r.client.get(path)
        assert resp.status == 404 and resp.content_type == "application/json", path
        assert (await resp.json())["error"]["code"] == "not_found"
    resp = await r.client.get("/ui/gpus/no-such-gpu")
    assert resp.status == 404 and resp.content_type == "text/html"
