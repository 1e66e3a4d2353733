"""The dashboard stays true while left open (issue #25), in Debian's Chromium against `hostagent demo`.

One demo for the module, configured through the documented [dashboard] keys so that the pages refresh every second
(`dashboard.refresh_s`) and a guest is stale after 8 s (`dashboard.stale_after_s`) instead of a minute. Leases
and heartbeats come through the JSON API with the demo VMs' tokens; then the operator watches: a chart that gains
points and slides without a reload, a dead guest marked stale beside a silent one warned, countdowns ticking down,
a queued request with its position, ETA and Cancel, times to the second with the zone, every page at 390 px without
a horizontal scroll, and the HTML error page for an unknown /ui path.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from typing import Any

import pytest
from playwright.sync_api import Browser, Page, expect

from tests.support.dashboard import Demo, login, screenshot, start_demo

pytestmark = [pytest.mark.browser, pytest.mark.timeout(300)]

STALE_AFTER_S = 8.0
FULL_TIME = re.compile(r"^\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2} (EST|EDT)$")


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Demo]:
    base = tmp_path_factory.mktemp("live")
    config = base / "hostagent.toml"
    config.write_text(f"[dashboard]\nrefresh_s = 1.0\nstale_after_s = {STALE_AFTER_S}\n")
    d = start_demo(base / "state", "--config", str(config))
    try:
        vms = d.vm_names
        busy = d.lease(vms[0], gpus=1, task_type="training")
        dead = d.lease(vms[1], gpus=1, task_type="notebook")
        silent = d.lease(vms[2], gpus=1, task_type="inference")
        d.heartbeat(vms[0], busy, [60, 70, 80, 90])
        d.heartbeat(vms[1], dead, [40, 45, 50])  # its last word: it stops here
        d.extra = {"busy": busy, "dead": dead, "silent": silent, "since": time.time()}  # type: ignore[attr-defined]
        yield d
    finally:
        d.stop()


def extra(demo: Demo) -> dict[str, Any]:
    return demo.extra  # type: ignore[attr-defined,no-any-return]


def seconds(text: str) -> int:
    """'(in 4m 10s)' / '(in 1h 02m)' / '(12s overdue)' as signed seconds left."""
    units = {"d": 86400, "h": 3600, "m": 60, "s": 1}
    total = sum(int(n) * units[u] for n, u in re.findall(r"(\d+)([dhms])", text))
    return -total if "overdue" in text else total


def beat_now(demo: Demo, vm: str, lease: dict[str, Any], utils: list[float]) -> None:
    """Samples one second apart ending now (new points on every chart of the lease's GPUs)."""
    now = time.time()
    samples = [{"ts": now - (len(utils) - 1 - i), "gpu": d["gpu_id"], "util_pct": u, "mem_used_bytes": 2**31}
               for i, u in enumerate(utils) for d in lease["devices"]]
    status, body = demo.api("POST", f"/v1/leases/{lease['id']}/heartbeat", demo.vm_token(vm), {"samples": samples})
    assert status == 200, body


def chart_state(page: Page, selector: str) -> tuple[int, int]:
    el = page.locator(selector)
    return int(el.get_attribute("data-points") or 0), int(el.get_attribute("data-x-max") or 0)


def test_charts_gain_points_and_slide_without_reload(browser: Browser, demo: Demo) -> None:
    """dashboard.refresh_s = 1.0: the GPU page refreshes every 2 s, the lease page every second."""
    page = login(browser, demo)
    busy = extra(demo)["busy"]
    gid = busy["devices"][0]["gpu_id"]
    page.goto(demo.url + f"/ui/gpus/{gid}?range=1h")
    expect(page.locator("#chart-util.drawn canvas")).to_have_count(1)
    page.evaluate("window.__no_reload = 42")
    points, x_max = chart_state(page, "#chart-util")
    assert points >= 4 and abs(x_max - time.time()) < 10  # the window ends at the agent's now
    beat_now(demo, demo.vm_names[0], busy, [11, 22, 33])
    page.wait_for_function("([p, x]) => { const el = document.getElementById('chart-util');"
                           " return +el.dataset.points > p && +el.dataset.xMax > x; }", arg=[points, x_max],
                           timeout=10_000)
    assert page.evaluate("window.__no_reload") == 42  # same document: fetched, not reloaded
    mem_points, mem_x_max = chart_state(page, "#chart-mem")
    assert mem_points > points and mem_x_max > x_max
    # the x axis reads 24-hour (a day's window has afternoon hours whatever the time now)
    page.goto(demo.url + f"/ui/gpus/{gid}?range=24h")
    expect(page.locator("#chart-util.drawn canvas")).to_have_count(1)
    ticks = (page.locator("#chart-util").get_attribute("data-x-ticks") or "").split("|")
    assert len(ticks) >= 3 and all(re.fullmatch(r"\d{2}:\d{2}", t) for t in ticks), ticks
    assert any(int(t[:2]) >= 13 for t in ticks), ticks  # 12-hour labels would read 1pm.., never 13:00
    # the lease page too
    page.goto(demo.url + f"/ui/leases/{busy['id']}")
    sel = f"#chart-{gid}"
    expect(page.locator(f"{sel}.drawn canvas")).to_have_count(1)
    page.evaluate("window.__no_reload = 43")
    points, x_max = chart_state(page, sel)
    beat_now(demo, demo.vm_names[0], busy, [44, 55])
    page.wait_for_function("([sel, p, x]) => { const el = document.querySelector(sel);"
                           " return +el.dataset.points > p && +el.dataset.xMax > x; }", arg=[sel, points, x_max],
                           timeout=10_000)
    expect(page.locator("#lease-head .util-now .util-value")).to_have_text("55%")  # the head refreshed as well
    assert page.evaluate("window.__no_reload") == 43
    screenshot(page, "lease-live")
    page.context.close()


def test_a_dead_guest_is_stale_and_a_silent_one_warned(browser: Browser, demo: Demo) -> None:
    """dashboard.stale_after_s = 8.0: the guest that stopped is stale 8 s after its last sample."""
    page = login(browser, demo)
    busy, dead, silent = (extra(demo)[k] for k in ("busy", "dead", "silent"))
    dead_row = page.locator(f"tr[data-gpu='{dead['devices'][0]['gpu_id']}']")
    expect(dead_row.locator(".util-now")).to_have_class(re.compile(r"\bstale\b"), timeout=20_000)
    expect(dead_row.locator(".util-value")).to_have_text("50%")  # its last figure, marked, not passed off as now
    expect(dead_row.locator(".hb")).to_have_text(re.compile(r"^no heartbeat for \d+s$"))
    expect(dead_row.locator(".util-now .stale-mark")).to_be_visible()
    silent_row = page.locator(f"tr[data-gpu='{silent['devices'][0]['gpu_id']}']")
    expect(silent_row.locator(".hb")).to_have_text("no heartbeat yet")
    expect(silent_row.locator(".hb")).to_have_class("hb hb-never")
    beat_now(demo, demo.vm_names[0], busy, [77])  # a live guest right beside them is not stale
    busy_row = page.locator(f"tr[data-gpu='{busy['devices'][0]['gpu_id']}']")
    expect(busy_row.locator(".util-value")).to_have_text("77%", timeout=5_000)
    expect(busy_row.locator(".util-now")).not_to_have_class(re.compile(r"\bstale\b"))
    expect(busy_row.locator(".util-now .age")).to_have_text(re.compile(r"^\d+s ago$"))
    # the dead guest's lease page says so in a banner
    page.goto(demo.url + f"/ui/leases/{dead['id']}")
    expect(page.locator(".hb-banner")).to_contain_text("no heartbeat for")
    screenshot(page, "lease-dead-guest")
    page.context.close()


def test_countdowns_tick_down_and_reclaim_refreshes(browser: Browser, demo: Demo) -> None:
    page = login(browser, demo)
    busy = extra(demo)["busy"]
    page.goto(demo.url + "/ui/reclaim")
    page.evaluate("window.__no_reload = 44")
    cell = page.locator(f"#reclaim-body tr[data-lease='{busy['id']}'] .next-check .countdown")
    expect(cell).to_have_text(re.compile(r"^\(in \d+m \d+s\)$"))
    first = seconds(cell.inner_text())
    updated = page.locator("#reclaim-body p.muted time").inner_text()
    page.wait_for_timeout(2_200)
    second = seconds(cell.inner_text())
    assert 1 <= first - second <= 4, (first, second)
    expect(page.locator("#reclaim-body p.muted time")).not_to_have_text(updated)  # the body was fetched again
    assert page.evaluate("window.__no_reload") == 44
    page.context.close()


def test_queued_request_shows_position_eta_and_cancel(browser: Browser, demo: Demo) -> None:
    vm = demo.vm_names[3]
    status, queued = demo.api("POST", "/v1/leases", demo.vm_token(vm), {"gpus": 16, "accept_deferred": True})
    assert status == 202 and queued["state"] == "QUEUED", queued
    try:
        page = login(browser, demo)
        row = page.locator(f"table.queue tr[data-lease='{queued['id']}']")
        expect(row.locator("[data-position]")).to_have_text("1")
        eta = row.locator(".eta .countdown")
        expect(eta).to_have_text(re.compile(r"^\(in \d+h \d{2}m\)$"))  # when the leases ahead of it end
        expect(row.locator("button")).to_have_text("Cancel")
        page.goto(demo.url + "/ui/leases?state=live")
        lease_row = page.locator(f"tr[data-lease='{queued['id']}']")
        expect(lease_row.locator("button")).to_have_text("Cancel")
        page.goto(demo.url + f"/ui/leases/{queued['id']}")
        expect(page.locator(".queue-line")).to_contain_text("Queued: position 1 of 1")
        expect(page.locator(".queue-line .countdown").first).to_have_text(re.compile(r"^\(in \d+h \d{2}m\)$"))
        expect(page.locator("#lease-head button[data-release]")).to_have_count(0)
        page.once("dialog", lambda d: d.accept())
        page.locator("#lease-head button:text-is('Cancel request')").click()
        expect(page.locator(".flash.ok")).to_contain_text(f"queued request {queued['id']} cancelled")
        expect(page.locator("#lease-head h1 .badge")).to_have_text("released")
        page.context.close()
    finally:
        demo.api("DELETE", f"/v1/leases/{queued['id']}", demo.operator)


def test_times_to_the_second_with_the_zone(browser: Browser, demo: Demo) -> None:
    page = login(browser, demo)
    busy = extra(demo)["busy"]
    page.goto(demo.url + f"/ui/leases/{busy['id']}")
    first = page.locator("table.events time").first
    assert FULL_TIME.match(first.inner_text()), first.inner_text()
    assert "America/New_York" in (first.get_attribute("title") or "")
    assert FULL_TIME.match(page.locator("#lease-head time").first.inner_text())
    expect(page.locator(".tz-note .tz-name")).to_have_text(re.compile(r"^E[SD]T \(America/New_York\)$"))
    page.goto(demo.url + "/")
    expect(page.locator(".status-line time")).to_have_text(re.compile(r"^\d{2}:\d{2}:\d{2} E[SD]T$"))
    page.context.close()


def test_every_page_fits_a_390px_phone(browser: Browser, demo: Demo) -> None:
    page = login(browser, demo, width=390)
    busy = extra(demo)["busy"]
    gid = busy["devices"][0]["gpu_id"]
    pages = {"overview": "/", "leases": "/ui/leases?window=all", "gpu": f"/ui/gpus/{gid}",
             "lease": f"/ui/leases/{busy['id']}", "reclaim": "/ui/reclaim"}
    for name, path in pages.items():
        page.goto(demo.url + path)
        if name in ("gpu", "lease"):
            expect(page.locator(".chart.drawn canvas").first).to_be_visible()
        width = page.evaluate("document.scrollingElement.scrollWidth")
        assert width <= 390, f"{name}: the page is {width} px wide"
        for link in page.locator("header nav a").all():  # the navigation wraps instead of running off
            box = link.bounding_box()
            assert box and box["x"] + box["width"] <= 390, name
        screenshot(page, f"phone-{name}")
    # an action is reachable: the lease's Release button lies within the screen
    page.goto(demo.url + f"/ui/leases/{busy['id']}")
    box = page.locator("#lease-head button[data-release]").bounding_box()
    assert box and box["x"] >= 0 and box["x"] + box["width"] <= 390
    page.context.close()


def test_unknown_ui_path_is_the_html_error_page(browser: Browser, demo: Demo) -> None:
    page = login(browser, demo)
    resp = page.goto(demo.url + "/ui/nope")
    assert resp is not None and resp.status == 404 and resp.headers["content-type"].startswith("text/html")
    expect(page.locator("main h1")).to_have_text("404 · not_found")
    expect(page.locator("main")).to_contain_text("no page at /ui/nope")
    expect(page.locator("header nav a")).to_have_count(6)  # the dashboard around it, logged in
    resp = page.goto(demo.url + "/ui/api/nope")
    assert resp is not None and resp.status == 404 and resp.headers["content-type"].startswith("application/json")
    page.context.close()
