"""The living demo (issue #20), as a newcomer meets it: `hostagent demo` with no option and no user action.

Its simulated guests lease, heartbeat and release through the guest agent's code; before serving it writes past
usage on a fast clock and trains the placement model. Checked through the API (what must be there, and how long
after the start it was) and in Debian's Chromium (charts with data points, the model in use, an idle reclaim in the
leases list). The overview's screenshot is the README's (`HOSTAGENT_README_SCREENSHOT=1` copies it to
docs/images/dashboard.png).
"""

from __future__ import annotations

import os
import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import Browser, expect

from hostagent.demo import DEMO_VMS
from tests.support.dashboard import ROOT, Demo, login, screenshot, start_demo
from tests.support.waits import wait_until

pytestmark = [pytest.mark.browser, pytest.mark.timeout(420)]


@pytest.fixture(scope="module")
def living(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Demo]:
    started = time.monotonic()
    d = start_demo(tmp_path_factory.mktemp("living") / "state", "--seed", "7", living=True, timeout=240.0)
    d.started = started  # type: ignore[attr-defined]
    try:
        yield d
    finally:
        d.stop()


def _leases(d: Demo, state: str) -> list[dict[str, Any]]:
    status, body = d.api("GET", f"/v1/leases?state={state}&limit=200", d.operator)
    assert status == 200, body
    return list(body["leases"])


def test_the_demo_shows_the_product_without_any_user_action(living: Demo) -> None:
    d = living
    found: dict[str, float] = {}

    def seen(name: str, ok: bool) -> bool:
        if ok and name not in found:
            found[name] = time.monotonic() - d.started  # type: ignore[attr-defined]
        return ok

    def everything() -> bool:
        gpus = d.api("GET", "/v1/gpus", d.operator)[1]["gpus"]
        seen("whole-group GPU", any(len(g["functions"]) >= 2 for g in gpus))
        active = [x for x in _leases(d, "ACTIVE") if x["domain"]["name"] in DEMO_VMS]
        seen("active lease of a simulated guest", bool(active))
        ended = _leases(d, "RELEASED")
        seen("idle reclaim in the leases", any("idle" in (x.get("end_reason") or "") for x in ended))
        seen("lease placed by the trained model",
             any((x.get("placement") or {}).get("model_version") for x in active + ended))
        return len(found) == 4

    assert wait_until(everything, timeout=180.0, interval=1.0), f"only {sorted(found)} came: {d.log[-30:]}"
    print("time from start:", {k: f"{v:.0f} s" for k, v in found.items()})
    # the leases are the guests' own, through the API: each sent heartbeats with samples
    ended = [x for x in _leases(d, "RELEASED") if x.get("granted_at")]
    assert len(ended) >= 20, "days of history: many leases, not a handful"
    gpus = {g["id"]: g for g in d.api("GET", "/v1/gpus", d.operator)[1]["gpus"]}
    multi = [g for g in gpus.values() if len(g["functions"]) >= 2]
    assert {f["class"][:4] for g in multi for f in g["functions"]} >= {"0x03", "0x04", "0x0c"}, \
        "consumer cards lease with their audio and USB-C functions"


def test_charts_draw_data_points_and_the_model_is_in_use(browser: Browser, living: Demo) -> None:
    d = living
    assert wait_until(lambda: [x for x in _leases(d, "ACTIVE") if x["domain"]["name"] in DEMO_VMS], timeout=120.0,
                      interval=1.0)
    page = login(browser, d)
    expect(page.locator("svg.spark polyline").first).to_be_visible()  # sparklines drawn from usage
    expect(page.locator(".group-note", has_text="whole group: 4 functions (GPU, audio, USB, USB-C controller)")
           ).to_have_count(4)  # the Turing boards: each lease of one takes all four
    # the picture: once a simulated guest's heartbeat has reached the overview (it refreshes itself)
    expect(page.locator("td.util-cell .util-value", has_text="%").first).to_be_visible(timeout=60_000)
    shot = screenshot(page, "living-demo")
    if os.environ.get("HOSTAGENT_README_SCREENSHOT") == "1":
        target = ROOT / "docs/images/dashboard.png"
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(shot, target)
    # a GPU that has worked: its chart has points, not only axes
    gid = next(g["id"] for g in d.api("GET", "/v1/gpus", d.operator)[1]["gpus"] if g["state"] == "leased")
    page.goto(f"{d.url}/ui/gpus/{gid}?range=24h")
    expect(page.locator("#chart-util.drawn canvas")).to_have_count(1)
    series = page.evaluate("JSON.parse(document.getElementById('series-data').textContent)")
    points = [v for v in series[gid]["util"] if v is not None]
    assert len(points) >= 10 and max(points) > 20, points
    # the placement page: a trained model in use, with its evaluation figures
    page.goto(f"{d.url}/ui/model")
    expect(page.locator("dd.mono").first).to_contain_text(re.compile(r"placement-\d{8}T"))
    expect(page.locator("h2", has_text="Evaluation of the active model")).to_have_count(1)
    # the leases list carries the reclaim history
    page.goto(f"{d.url}/ui/leases?state=ended")
    expect(page.locator("tr.lease-row", has_text="idle").first).to_be_visible()
    page.context.close()


def test_quiet_keeps_an_idle_host(tmp_path: Path) -> None:
    d = start_demo(tmp_path / "state")  # --quiet: no guests, no history
    try:
        time.sleep(3.0)
        assert _leases(d, "ACTIVE") == [] and _leases(d, "RELEASED") == []
        assert not (tmp_path / "state" / "demo-history.json").exists()
    finally:
        d.stop()
