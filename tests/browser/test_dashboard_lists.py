"""Complete lists in a real browser (issue #25): 325 leases in `hostagent demo`, paged through in Chromium by the
table's own links, and every one of them in the CSV the Export button downloads, with GPU-hours and project.

One lease is granted through the API (live, so its GPU-hours run to now); the other 324 are written while the demo
runs through the journal's own write path (`Journal.record`, as the agent writes a lease's steps), which takes a
second or two where granting and releasing each through the simulated host would take minutes.
"""

from __future__ import annotations

import csv
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from playwright.sync_api import Browser, expect

from hostagent.domain.lease import Lease, LeaseDevice, LeaseRequest, LeaseState, Step
from hostagent.store.journal import Journal
from tests.support.dashboard import Demo, login, screenshot, start_demo

pytestmark = [pytest.mark.browser, pytest.mark.timeout(180)]

S = LeaseState
N = 325
PROJECTS = ("atlas", "borealis", None)


def ended_lease(i: int, now: float, vm: str, gpus: list[str]) -> Lease:
    """A lease that held 1 or 2 GPUs for 10 to 60 minutes and was released, created within the last day."""
    created = now - 600 - i * 240
    n = 1 + i % 2
    lease = Lease(id=f"l-b0a{i:05x}", domain_uuid=f"00000000-0000-4000-8000-{i % 6:012d}", domain_name=vm,
                  request=LeaseRequest(gpus=n, task_type=("training", "inference")[i % 2], project=PROJECTS[i % 3]),
                  state=S.REQUESTED, created_at=created)
    devices = tuple(LeaseDevice(gpus[(i + k) % len(gpus)], ("0000:01:00.0",), ("nvidia",), k) for k in range(n))
    active = (lease.transition(S.BINDING, devices=devices).transition(S.ATTACHING)
              .transition(S.ACTIVE, granted_at=created + 2))
    return (active.transition(S.RELEASING).transition(S.DETACHING).transition(S.REBINDING)
            .transition(S.RELEASED, ended_at=created + 2 + 600 * (1 + i % 6), end_reason="released by guest"))


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Demo]:
    d = start_demo(tmp_path_factory.mktemp("demo") / "state")
    try:
        live = d.lease(d.vm_names[0], gpus=2, task_type="training", project="atlas")
        status, body = d.api("GET", "/v1/gpus", d.operator)
        assert status == 200, body
        gpus = [g["id"] for g in body["gpus"]]
        journal = Journal(d.state_dir / "journal.sqlite3")  # the demo's own journal, beside the running agent
        try:
            now = time.time()
            seeded = [ended_lease(i, now, d.vm_names[i % 6], gpus) for i in range(N - 1)]
            for lease in seeded:
                journal.record(lease, from_state=None, actor="test", earlier=[Step(None, S.REQUESTED)])
        finally:
            journal.close()
        d.extra = {"live": live, "seeded": {x.id: x for x in seeded}}  # type: ignore[attr-defined]
        yield d
    finally:
        d.stop()


def test_325_leases_page_through_and_all_reach_the_csv(browser: Browser, demo: Demo) -> None:
    started = time.monotonic()
    page = login(browser, demo, path="/ui/leases", downloads=True, timezone=None)
    count = page.locator("#lease-count")
    expect(count).to_contain_text(f"Rows 1–100 of {N} leases · page 1 of 4")
    page.select_option("#lease-filters select[name=limit]", "50")
    page.click("#lease-filters button[type=submit]")
    expect(count).to_contain_text(f"Rows 1–50 of {N} leases · page 1 of 7")
    expect(page.locator("#lease-pager a[rel=prev]")).to_have_count(0)  # nothing before the first page

    seen: list[str] = []
    while True:
        rows = page.locator("tr.lease-row")
        expect(rows.first).to_be_visible()
        seen += rows.evaluate_all("rows => rows.map(r => r.dataset.lease)")
        following = page.locator("#lease-pager a[rel=next]")
        if following.count() == 0:
            break
        following.click()
        expect(count).to_contain_text(f"Rows {len(seen) + 1}–{min(len(seen) + 50, N)} of {N} leases")
        assert "limit=50" in page.url and "sort=start" in page.url  # the page's links keep size and order
    assert len(seen) == N and len(set(seen)) == N  # every lease, each once
    assert demo.extra["live"]["id"] == seen[0]  # type: ignore[attr-defined]  # the newest on top
    expect(count).to_contain_text(f"Rows 301–{N} of {N} leases · page 7 of 7")
    page.click("#lease-pager a[rel=prev]")
    expect(count).to_contain_text(f"Rows 251–300 of {N}")
    screenshot(page, "leases-paged")

    with page.expect_download() as download:
        page.click("#csv-link")
    assert download.value.suggested_filename == "hostagent-leases-demo-host.csv"
    with Path(download.value.path()).open(newline="") as fh:
        lines = list(csv.DictReader(fh))
    assert len(lines) == N and [x["lease_id"] for x in lines] == seen  # all of them, in the table's order
    seeded = demo.extra["seeded"]  # type: ignore[attr-defined]
    for line in lines:
        lease = seeded.get(line["lease_id"])
        if lease is None:  # the live one: 2 GPUs since it was granted, so far
            assert line["project"] == "atlas" and line["end"] == "" and float(line["gpu_hours"]) > 0
            continue
        held_h = (lease.ended_at - lease.granted_at) / 3600.0
        assert float(line["gpu_hours"]) == pytest.approx(len(lease.devices) * held_h, abs=5e-5), line
        assert line["project"] == (lease.request.project or "") and line["state"] == "RELEASED"
    page.context.close()
    assert time.monotonic() - started < 40
