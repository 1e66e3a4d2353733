"""The dashboard in a real browser: Debian's Chromium driven by Playwright against `hostagent demo`.

Leases and heartbeats are created through the JSON API with the demo VMs' tokens; then an operator logs in,
sees the GPUs, opens a GPU's timeline with its chart drawn, filters leases, releases one and sees it go.
Screenshots of the main pages land in artifacts/screenshots/.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any
import pytest
from playwright.sync_api import Browser, expect

from tests.support.dashboard import Demo, login, screenshot, start_demo
from tests.support.waits import wait_until

pytestmark = [pytest.mark.browser, pytest.mark.timeout(300)]


def release(d: Demo, lease: dict[str, Any], token: str) -> None:
    """Release a lease and wait until it has ended, its GPUs have had the probe the agent runs on a GPU back from a
    lease (`probes.after_lease_delay_s` later; the GPU reads `probing` meanwhile) and they read free in the
    inventory: every test reads the host as it stays, not mid-detach or mid-probe (a GPU being probed once read
    "leased" and a clean-clone CI run counted it)."""
    gone = {x["gpu_id"] for x in lease["devices"]}
    before = {g: p["last_probe"] for g, p in d.api("GET", "/v1/probes", d.operator)[1]["gpus"].items() if g in gone}
    status, body = d.api("DELETE", f"/v1/leases/{lease['id']}", token)
    assert status == 200, body

    def settled() -> bool:
        if d.api("GET", f"/v1/leases/{lease['id']}", d.operator)[1]["state"] != "RELEASED":
            return False
        probed = d.api("GET", "/v1/probes", d.operator)[1]["gpus"]
        if any(probed[g]["last_probe"] == before[g] for g in gone):
            return False
        return all(g["state"] == "free" for g in d.api("GET", "/v1/gpus", d.operator)[1]["gpus"] if g["id"] in gone)
    assert wait_until(settled, timeout=30.0), f"the release of {lease['id']}"


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Demo]:
    d = start_demo(tmp_path_factory.mktemp("demo") / "state")
    try:
        vms = d.vm_names
        a = d.lease(vms[0], gpus=2, task_type="training", priority=5)
        b = d.lease(vms[1], gpus=1, task_type="inference")
        c = d.lease(vms[2], gpus=1, task_type="notebook")
        ended = d.lease(vms[3], gpus=1, task_type="batch")
        d.heartbeat(vms[0], a, [80, 85, 90, 95, 70, 88, 92, 60, 75, 99])
        d.heartbeat(vms[1], b, [20, 30, 25, 40, 35])
        d.heartbeat(vms[2], c, [2, 1, 0, 3])
        d.heartbeat(vms[3], ended, [50, 55])
        release(d, ended, d.vm_token(vms[3]))
        d.extra = {"a": a, "b": b, "c": c, "ended": ended}  # type: ignore[attr-defined]
        yield d
    finally:
        d.stop()


def test_login_refuses_bad_and_vm_credentials(browser: Browser, demo: Demo) -> None:
    ctx = browser.new_context()
    page = ctx.new_page()
    page.goto(demo.url + "/ui/leases")
    expect(page).to_have_url(re.compile(r"/ui/login"))
    assert page.get_attribute("input[name=token]", "type") == "password"
    page.fill("input[name=token]", "op_not-the-token")
    page.click("button[type=submit]")
    expect(page.locator(".flash.error")).to_contain_text("not valid")
    page.fill("input[name=token]", demo.vm_token(demo.vm_names[0]))
    page.click("button[type=submit]")
    expect(page.locator(".flash.error")).to_contain_text("operator credential")
    screenshot(page, "login")
    page.fill("input[name=token]", demo.operator)
    page.click("button[type=submit]")
    expect(page).to_have_url(demo.url + "/ui/leases")  # back where the redirect started
    cookie = next(c for c in ctx.cookies() if c["name"] == "hostagent_session")
    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict"
    ctx.close()


def test_overview_shows_every_gpu_and_counts(browser: Browser, demo: Demo) -> None:
    page = login(browser, demo)
    _, body = demo.api("GET", "/v1/gpus", demo.operator)
    gpus = body["gpus"]
    rows = page.locator("table.gpus tbody tr")
    expect(rows).to_have_count(len(gpus))
    leased = sum(1 for g in gpus if g["state"] == "leased")
    assert leased == 4
    # the tiles are the page's own refresh (every dashboard.refresh_s, 5 s): given three of them to agree with the API
    expect(page.locator("[data-count=leased] .n")).to_have_text(str(leased), timeout=15_000)
    expect(page.locator("[data-count=free] .n")).to_have_text(str(sum(1 for g in gpus if g["state"] == "free")),
                                                              timeout=15_000)
    gid = demo.extra["a"]["devices"][0]["gpu_id"]  # type: ignore[attr-defined]
    row = page.locator(f"tr[data-gpu='{gid}']")
    expect(row).to_contain_text(demo.vm_names[0])
    expect(row.locator(".badge")).to_have_text("leased")
    assert row.locator("svg.spark polyline").count() >= 1  # its sparkline has data
    # times are localised in the browser's zone (the server sends UTC)
    t = row.locator("time").first
    assert "UTC" not in t.inner_text() and "America/New_York" in (t.get_attribute("title") or "")
    screenshot(page, "overview")
    page.context.close()


def test_gpu_page_draws_timeline_and_chart(browser: Browser, demo: Demo) -> None:
    page = login(browser, demo)
    gid = demo.extra["a"]["devices"][0]["gpu_id"]  # type: ignore[attr-defined]
    page.click(f"tr[data-gpu='{gid}'] a.gpu-link")
    expect(page).to_have_url(re.compile(f"/ui/gpus/{gid}$"))
    expect(page.locator("svg.timeline rect.bar")).to_have_count(1)
    expect(page.locator("#chart-util.drawn canvas")).to_have_count(1)
    expect(page.locator("#chart-mem.drawn canvas")).to_have_count(1)
    # the chart really has points: uPlot's legend shows a value under the cursor; hover the plot's middle
    box = page.locator("#chart-util canvas").bounding_box()
    assert box and box["width"] > 500
    page.click("nav.ranges a:text-is('1h')")
    expect(page).to_have_url(re.compile(r"range=1h$"))
    expect(page.locator("#chart-util.drawn canvas")).to_have_count(1)
    series = page.evaluate("JSON.parse(document.getElementById('series-data').textContent)")
    values = [v for v in series[gid]["util"] if v is not None]
    assert len(values) >= 5 and max(values) >= 90
    screenshot(page, "gpu")
    page.context.close()


def test_leases_filter_sort_and_csv(browser: Browser, demo: Demo) -> None:
    page = login(browser, demo)
    page.click("header nav a:text-is('Leases')")
    expect(page.locator("tr.lease-row")).to_have_count(4)
    page.select_option("select[name=state]", "live")
    page.click("#lease-filters button[type=submit]")
    expect(page.locator("tr.lease-row")).to_have_count(3)
    page.fill("input[name=vm]", demo.vm_names[1])
    page.click("#lease-filters button[type=submit]")
    expect(page.locator("tr.lease-row")).to_have_count(1)
    expect(page.locator("tr.lease-row")).to_contain_text("inference")
    page.goto(demo.url + "/ui/leases?window=all")
    page.click("th a:text('Mean util')")
    utils = [x.strip() for x in page.locator("tr.lease-row td:nth-child(9)").all_inner_texts()]
    nums = [int(u.rstrip("%")) for u in utils if u.endswith("%")]
    assert nums == sorted(nums, reverse=True) and len(nums) == 4
    screenshot(page, "leases")
    with page.expect_download() as dl:
        page.click("#csv-link")
    text = Path(dl.value.path()).read_text()
    lines = text.strip().splitlines()
    assert lines[0].startswith("lease_id,vm,") and len(lines) == 5
    page.context.close()


def test_release_a_lease_and_see_it_go(browser: Browser, demo: Demo) -> None:
    page = login(browser, demo)
    lease = demo.extra["c"]  # type: ignore[attr-defined]
    page.goto(demo.url + "/ui/leases?state=live")
    row = page.locator(f"tr[data-lease='{lease['id']}']")
    expect(row).to_have_count(1)
    page.once("dialog", lambda d: d.accept())
    row.locator("button[data-release]").click()
    expect(page.locator(".flash.ok")).to_contain_text(f"lease {lease['id']} released")
    expect(page.locator(f"tr[data-lease='{lease['id']}']")).to_have_count(0)  # gone from the live list
    status, body = demo.api("GET", f"/v1/leases/{lease['id']}", demo.operator)
    assert status == 200 and body["state"] == "RELEASED"
    page.goto(demo.url + "/ui/leases/" + lease["id"])
    expect(page.locator("h1 .badge")).to_have_text("released")
    expect(page.locator("table.events")).to_contain_text("released by operator")
    screenshot(page, "lease")
    page.context.close()


def test_overview_refreshes_without_reload(browser: Browser, demo: Demo) -> None:
    page = login(browser, demo)
    page.evaluate("window.__no_reload = 42")
    before = int(page.locator("[data-count=leased] .n").inner_text())
    new = demo.lease(demo.vm_names[4], gpus=1, task_type="live-refresh")
    try:
        gid = new["devices"][0]["gpu_id"]
        expect(page.locator(f"tr[data-gpu='{gid}']")).to_contain_text(demo.vm_names[4], timeout=20_000)
        expect(page.locator("[data-count=leased] .n")).to_have_text(str(before + 1))
        assert page.evaluate("window.__no_reload") == 42  # same document: fetched, not reloaded
    finally:
        release(demo, new, demo.operator)  # the next test reads the host as the fixture left it
    page.context.close()


def test_pause_reclaim_and_pages_render(browser: Browser, demo: Demo) -> None:
    page = login(browser, demo)
    lease = demo.extra["b"]  # type: ignore[attr-defined]
    page.goto(demo.url + "/ui/reclaim")
    row = page.locator("tr", has=page.locator(f"a:text-is('{lease['id']}')"))
    row.locator("button:text-is('Pause reclaim')").click()
    expect(page.locator(".flash.ok")).to_contain_text("paused")
    status, body = demo.api("GET", f"/v1/leases/{lease['id']}", demo.operator)
    assert body["reclaim"]["paused"] is True
    screenshot(page, "reclaim")
    page.click("header nav a:text-is('Placement')")
    # five placements (four in the fixture, one in the refresh test): the store takes them through its ingestor,
    # so a page rendered just before the last one landed is loaded again until it shows all five
    rows = page.locator("table.decisions tbody tr")

    def all_five() -> bool:
        if rows.count() == 5:
            return True
        page.reload()
        return False

    assert wait_until(all_five, timeout=20, interval=0.5), rows.count()
    screenshot(page, "model")
    page.context.close()


def test_tables_work_without_javascript(browser: Browser, demo: Demo) -> None:
    page = login(browser, demo, javascript=False)
    expect(page.locator("table.gpus tbody tr").first).to_be_visible()
    page.goto(demo.url + "/ui/leases?window=all&sort=vm&dir=asc")
    vms = page.locator("tr.lease-row td:nth-child(2)").all_inner_texts()
    assert vms == sorted(vms) and len(vms) >= 4
    gid = demo.extra["a"]["devices"][0]["gpu_id"]  # type: ignore[attr-defined]
    page.goto(demo.url + f"/ui/gpus/{gid}")
    assert page.locator("noscript").count() >= 1  # the server-rendered chart is there for script-less browsers
    expect(page.locator("svg.timeline rect.bar")).to_have_count(1)
    page.context.close()
