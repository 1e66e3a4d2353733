"""Complete lists (issue #25): the leases table pages through every row exactly once, in order, with its filters
and sort kept from page to page by links alone (no JavaScript), and its CSV streams every matching row with
GPU-hours and project.

325 leases are in the default 7-day window: 321 written through the journal's own write path (`Journal.record`,
once per module into a template file that each test copies, so a test costs one copy, not 321 fsyncs), and 4 live
ones granted through the API with a heartbeat each. Three more ended ten days ago (outside the window). The
agent's clock is frozen, so every expected duration and GPU-hours figure is exact.
"""

from __future__ import annotations

import csv
import datetime
import html
import io
import math
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from hostagent.domain.lease import Lease, LeaseDevice, LeaseRequest, LeaseState, Step
from hostagent.store.journal import Journal
from hostagent.web import dashboard_data
from hostagent.web.dashboard_csv import CSV_COLUMNS
from tests.support.agent import AgentRig, Clock, make_rig, start_rig

S = LeaseState
# The rig's frozen clock at start, an hour ago (heartbeats are checked against the real time); the test moves it on
# by LIVE_FOR_S once the live leases run.
T_NOW = float(int(time.time()) - 3600)
LIVE_FOR_S = 1800.0
VMS = ("vm-a", "vm-b", "vm-c", "vm-d")
GPUS = ("gpu-0000-03-00-0", "gpu-0000-04-00-0", "gpu-0000-07-00-0", "gpu-0000-08-00-0", "gpu-0000-83-00-0",
        "gpu-0000-84-00-0", "gpu-0000-87-00-0", "gpu-0000-88-00-0")  # the dgx8 scenario's
TASKS = ("training", "inference", "notebook", "batch", "eval")
PROJECTS = ("atlas", "borealis", "=cmd", None)  # "=cmd": a cell a spreadsheet would run, quoted in the CSV
ODD_VM = "Büro-ÄÖ"  # a VM filter matches any case, beyond ASCII too
N_SEEDED, N_OLD = 321, 3
LIVE = (("vm-a", 1, 90.0, "atlas"), ("vm-b", 2, 60.0, None), ("vm-c", 1, 30.0, "borealis"), ("vm-d", 2, 10.0, "atlas"))
CSRF = re.compile(r'name="csrf" value="([^"]+)"')
ROW = re.compile(r'data-lease="([^"]+)"')
SHOWN = re.compile(r'Rows <span data-shown>([^<]*)</span> of <span data-total>(\d+)</span>')


@dataclass
class Row:
    """What the test knows of a lease, in the order the journal first wrote it (`seq`)."""

    id: str
    seq: int
    vm: str
    created: float
    start: float
    gpus: int
    task: str
    project: str | None
    state: str
    end: float | None
    gpu_hours: float
    gpu_ids: tuple[str, ...]
    util: float | None = None


def seeded_lease(i: int) -> Lease:
    """The i-th seeded lease: pairs share a creation time (ties for every order), grants come 0-30 s after the
    request (so the start order is not the creation order), and one in ten failed, one in ten expired queued."""
    created = T_NOW - 600 - (i // 2) * 1200
    n = (1, 2, 4)[i % 3]
    vm = ODD_VM if i % 50 == 0 else VMS[i % 4]
    req = LeaseRequest(gpus=n, task_type=TASKS[i % 5], project=PROJECTS[i % 4], priority=i % 3)
    lease = Lease(id=f"l-5eed{i:04x}", domain_uuid=f"00000000-0000-4000-8000-{i % 4:012d}", domain_name=vm,
                  request=req, state=S.REQUESTED, created_at=created)
    devices = tuple(LeaseDevice(GPUS[(i + k) % 8], (f"0000:0{k}:00.0",), ("nvidia",), k) for k in range(n))
    if i % 10 == 7:
        queued = lease.transition(S.QUEUED, queued_at=created)
        return queued.transition(S.EXPIRED, ended_at=created + 900, end_reason="expired in the queue")
    binding = lease.transition(S.BINDING, devices=devices)
    if i % 10 == 3:
        return binding.transition(S.FAILED, ended_at=created + 5, end_reason="failed: bind refused")
    granted = created + (i % 7) * 5
    active = binding.transition(S.ATTACHING).transition(S.ACTIVE, granted_at=granted)
    ended = granted + 300 + (i * 97) % 5000 - (i % 20 == 1) * 200  # some equal GPU-hours: ties in that order too
    return (active.transition(S.RELEASING).transition(S.DETACHING).transition(S.REBINDING)
            .transition(S.RELEASED, ended_at=ended,
                        end_reason="reclaimed: idle" if i % 6 == 0 else "released by guest"))


def old_lease(k: int) -> Lease:
    """An ended lease from ten days ago: outside the default 7-day window."""
    created = T_NOW - 10 * 86400 - k * 3600
    lease = Lease(id=f"l-01d{k:05x}", domain_uuid="00000000-0000-4000-8000-000000000009", domain_name="vm-old",
                  request=LeaseRequest(task_type="training", project="atlas"), state=S.REQUESTED, created_at=created)
    active = (lease.transition(S.BINDING, devices=(LeaseDevice(GPUS[k], ("0000:01:00.0",), ("nvidia",), 1),))
              .transition(S.ATTACHING).transition(S.ACTIVE, granted_at=created + 1))
    return (active.transition(S.RELEASING).transition(S.DETACHING).transition(S.REBINDING)
            .transition(S.RELEASED, ended_at=created + 1 + 7200, end_reason="released by guest"))


def row_of(x: Lease, seq: int) -> Row:
    held = (x.ended_at - x.granted_at) if x.granted_at is not None and x.ended_at is not None else 0.0
    return Row(x.id, seq, x.domain_name, x.created_at, x.granted_at or x.created_at, len(x.devices),
               x.request.task_type, x.request.project, x.state.value, x.ended_at, len(x.devices) * held / 3600.0,
               x.gpu_ids)


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Row]]:
    """A journal file holding the seeded and the old leases, written once through Journal.record."""
    path = tmp_path_factory.mktemp("journal") / "journal.sqlite3"
    journal = Journal(path, clock=lambda: T_NOW)
    rows = []
    for seq, lease in enumerate([seeded_lease(i) for i in range(N_SEEDED)] + [old_lease(k) for k in range(N_OLD)]):
        journal.record(lease, from_state=None, actor="test", earlier=[Step(None, S.REQUESTED)])
        rows.append(row_of(lease, seq))
    journal.close()  # checkpoints the WAL: the one file is the whole journal
    return path, rows


@dataclass
class Listed:
    rig: AgentRig
    clock: Clock
    rows: list[Row]  # every lease, old ones included, in the journal's first-write order

    def window(self) -> list[Row]:
        since = self.clock.now - 7 * 86400  # the default window: created, ended or still running since
        return [r for r in self.rows if r.created >= since or (r.end if r.end is not None else math.inf) >= since]

    async def get(self, url: str) -> str:
        resp = await self.rig.client.get(url)
        text = await resp.text()
        assert resp.status == 200, text[:2000]
        return text


@pytest.fixture
async def listed(tmp_path: Path, aiohttp_client: Any, template: tuple[Path, list[Row]]) -> Listed:
    (tmp_path / "state").mkdir()
    shutil.copy(template[0], tmp_path / "state" / "journal.sqlite3")
    clock = Clock(T_NOW)
    rig = await start_rig(make_rig(tmp_path, clock=clock, vms=VMS), aiohttp_client)
    assert set(GPUS) == set(rig.runtime.manager.gpus)
    page = await (await rig.client.get("/ui/login")).text()
    csrf = CSRF.search(page).group(1)  # type: ignore[union-attr]
    resp = await rig.client.post("/ui/login", data={"token": rig.operator, "csrf": csrf}, allow_redirects=False)
    assert resp.status == 303
    rows = list(template[1])
    live = []
    for k, (vm, n, _, project) in enumerate(LIVE):
        body = {"gpus": n, "task_type": "training", **({"project": project} if project else {})}
        resp = await rig.client.post("/v1/leases", json=body, headers=rig.auth(vm))
        data = await resp.json()
        assert resp.status == 201, data
        live.append(data)
        rows.append(Row(data["id"], len(rows), vm, T_NOW, T_NOW, n, "training", project, "ACTIVE", None,
                        n * LIVE_FOR_S / 3600.0, tuple(d["gpu_id"] for d in data["devices"])))
    clock.advance(LIVE_FOR_S)
    for (vm, _, util, _), data, row in zip(LIVE, live, rows[-len(LIVE):]):
        samples = [{"ts": clock.now, "gpu": d["gpu_id"], "util_pct": util} for d in data["devices"]]
        resp = await rig.client.post(f"/v1/leases/{data['id']}/heartbeat", json={"samples": samples},
                                     headers=rig.auth(vm))
        assert resp.status == 200, await resp.text()
        row.util = util
    return Listed(rig, clock, rows)


KEYS: dict[str, Callable[[Row], Any]] = {
    "start": lambda r: r.start, "vm": lambda r: r.vm, "gpu_hours": lambda r: r.gpu_hours,
    "util": lambda r: (r.util is not None, r.util or 0.0), "project": lambda r: r.project or "",
    "duration": lambda r: max(0.0, (r.end if r.end is not None else T_NOW + LIVE_FOR_S) - r.start),
}


def expected(rows: list[Row], sort: str, desc: bool) -> list[str]:
    """The table's order, worked out here: by the key, then newest first (creation time, then first write)."""
    out = sorted(rows, key=lambda r: (r.created, r.seq), reverse=True)
    out.sort(key=KEYS[sort], reverse=desc)  # stable, reversed or not: ties keep the newest-first order
    return [r.id for r in out]


def utc(ts: float | None) -> str:
    """A time as the CSV writes it: ISO-8601 UTC to the second (empty for none)."""
    return "" if ts is None else datetime.datetime.fromtimestamp(ts, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def link(page: str, rel: str) -> str | None:
    m = re.search(rf'<a href="([^"]+)" rel="{rel}">', page)
    return html.unescape(m.group(1)) if m else None


def shown(page: str) -> tuple[str, int]:
    m = SHOWN.search(page)
    assert m, "no row count on the page"
    return m.group(1), int(m.group(2))


async def walk(listed: Listed, url: str, rel: str = "next", *, between: Callable[[], None] | None = None
               ) -> tuple[list[list[str]], list[str], list[str]]:
    """Follow one kind of page link from `url` to the end: each page's rows, its "Rows a–b" text, and its URL."""
    pages, labels, urls = [], [], []
    next_url: str | None = url
    while next_url is not None:
        page = await listed.get(next_url)
        pages.append(ROW.findall(page))
        labels.append(shown(page)[0])
        urls.append(next_url)
        if between is not None and len(pages) == 1:
            between()
        next_url = link(page, rel)
        assert len(pages) < 100, "the links go round in circles"
    return pages, labels, urls


def ranges(total: int, size: int, shift: int = 0) -> list[str]:
    """The "Rows a–b" texts of the pages of `total` rows, the later ones `shift` rows further down."""
    return [f"{a + 1 + (a and shift)}–{min(a + size, total) + (a and shift)}" for a in range(0, total, size)]


async def test_325_leases_page_through_once_each_in_order_and_back(listed: Listed) -> None:
    window = listed.window()
    assert len(window) == 325 and len(listed.rows) == 328
    want = expected(window, "start", True)
    first = await listed.get("/ui/leases?limit=50")
    assert shown(first) == ("1–50", 325) and "page <span data-page>1</span> of 7" in first
    assert link(first, "prev") is None and link(first, "first") is None

    newcomer = Lease(id="l-0newc0me", domain_uuid="00000000-0000-4000-8000-000000000001", domain_name="vm-b",
                     request=LeaseRequest(), state=S.REQUESTED, created_at=listed.clock.now)

    def journal_newcomer() -> None:  # journaled while the operator pages: it goes on top and shifts nothing after
        listed.rig.runtime.journal.record(newcomer.transition(S.FAILED, ended_at=listed.clock.now, end_reason="x"),
                                          from_state=None, actor="test")

    pages, labels, urls = await walk(listed, "/ui/leases?limit=50", between=journal_newcomer)
    seen = [lid for page in pages for lid in page]
    assert seen == want  # every row once, in order: none repeated, none skipped, the newcomer not in between
    assert labels == ranges(325, 50, shift=1) and [len(p) for p in pages] == [50] * 6 + [25]
    assert all("limit=50" in u and "sort=start" in u and "window=7d" in u for u in urls[1:])

    # backwards from the last page, the newcomer on top now: 26 rows, then whole pages of 50 back to the first
    last = link(await listed.get(urls[2]), "last")
    assert last is not None
    back, back_labels, _ = await walk(listed, last, "prev")
    assert [lid for page in reversed(back) for lid in page] == [newcomer.id, *want]
    assert back_labels == list(reversed(ranges(326, 50)))

    # live refresh of a page fetches that same page
    page3 = await listed.get(urls[2])
    refresh = html.unescape(re.search(r'data-refresh="([^"]+)"', page3).group(1))  # type: ignore[union-attr]
    body = await (await listed.rig.client.get(refresh)).json()
    assert ROW.findall(body["html"]) == pages[2] and body["shown"] == "102–151" and body["total"] == 326


async def test_pages_keep_filters_and_every_sort(listed: Listed) -> None:
    everything = listed.rows
    cases = [
        ("window=all&sort=gpu_hours&dir=asc&limit=40", everything, "gpu_hours", False),
        ("window=all&sort=gpu_hours&dir=desc&limit=40", everything, "gpu_hours", True),
        ("sort=util&dir=desc&limit=30", listed.window(), "util", True),
        ("sort=util&dir=asc&limit=100", listed.window(), "util", False),
        ("sort=duration&dir=desc&limit=60", listed.window(), "duration", True),
        ("window=all&project=atlas&task=training&sort=vm&dir=asc&limit=7",
         [r for r in everything if r.project == "atlas" and r.task == "training"], "vm", False),
        ("window=all&vm=%C3%BCRO-%C3%A4&sort=project&dir=desc&limit=2",
         [r for r in everything if "üro-ä" in r.vm.lower()], "project", True),
        (f"state=ended&gpu={GPUS[3]}&limit=25",
         [r for r in listed.window() if r.state != "ACTIVE" and GPUS[3] in r.gpu_ids], "start", True),
    ]
    for query, rows, sort, desc in cases:
        want = expected(rows, sort, desc)
        assert len(want) >= 3, query
        size = int(re.search(r"limit=(\d+)", query).group(1))  # type: ignore[union-attr]
        # Five hours pass after the first page (the live leases run for 8): their GPU-hours and durations grow past
        # most ended ones', but the pages after the first keep the order at the first page's time (the cursor's).
        start = listed.clock.now
        pages, labels, urls = await walk(listed, f"/ui/leases?{query}", between=lambda: listed.clock.advance(5 * 3600))
        listed.clock.now = start
        assert [lid for page in pages for lid in page] == want, query
        assert labels == ranges(len(want), size), query
        for part in query.split("&"):  # every page's link carries the filters and the order
            assert all(part in u for u in urls), (query, part)
        back, _, _ = await walk(listed, link(await listed.get(urls[0]), "last") or urls[0], "prev")
        assert [lid for page in reversed(back) for lid in page] == want, query


async def test_csv_streams_every_row_with_gpu_hours_and_project(listed: Listed, monkeypatch: pytest.MonkeyPatch
                                                                ) -> None:
    monkeypatch.setattr(dashboard_data, "CSV_PAGE_ROWS", 60)
    journal = listed.rig.runtime.journal
    reads: list[int] = []
    for name in ("sorted_page", "leases_by_id"):
        real = getattr(journal, name)

        def spy(*args: Any, real: Any = real, name: str = name, **kwargs: Any) -> Any:
            out = real(*args, **kwargs)
            reads.append(len(out))
            assert len(out) <= 60, f"{name} read {len(out)} rows at once"
            return out

        monkeypatch.setattr(journal, name, spy)

    async def export(query: str) -> tuple[list[dict[str, str]], aiohttp.ClientResponse]:
        reads.clear()
        resp = await listed.rig.client.get(f"/ui/leases.csv?{query}")
        text = await resp.text()
        assert resp.status == 200, text[:2000]
        lines = list(csv.reader(io.StringIO(text)))
        assert tuple(lines[0]) == CSV_COLUMNS
        return [dict(zip(CSV_COLUMNS, line)) for line in lines[1:]], resp

    head = await listed.rig.client.head("/ui/leases.csv")  # the headers alone, and the connection still good
    assert head.status == 200 and head.headers["Content-Type"].startswith("text/csv") and await head.read() == b""
    assert reads == []
    rows, resp = await export("limit=50&after=ignored-by-the-export")
    assert resp.headers.get("Transfer-Encoding") == "chunked" and "Content-Length" not in resp.headers
    assert resp.headers["Content-Disposition"] == 'attachment; filename="hostagent-leases-test-host.csv"'
    window = listed.window()
    assert len(rows) == 325 and [r["lease_id"] for r in rows] == expected(window, "start", True)
    assert reads == [60] * 5 + [25]  # read in batches, each written before the next is read
    by_id = {r.id: r for r in listed.rows}
    for line in rows:
        want = by_id[line["lease_id"]]
        assert float(line["gpu_hours"]) == pytest.approx(want.gpu_hours, abs=5e-5), line
        assert line["project"] == ("'" + want.project if want.project == "=cmd" else want.project or ""), line
        assert line["vm"] == want.vm and line["state"] == want.state and len(line["gpus"].split()) == want.gpus
        assert line["end"] == utc(want.end) and line["start"] == utc(want.start), line
    live = [line for line in rows if line["state"] == "ACTIVE"]
    assert sorted(float(x["gpu_hours"]) for x in live) == [0.5, 0.5, 1.0, 1.0]  # GPUs x 30 min so far
    assert {x["mean_util_pct"] for x in live} == {"90.0", "60.0", "30.0", "10.0"}
    assert sum(float(x["gpu_hours"]) for x in rows) == pytest.approx(sum(r.gpu_hours for r in window), abs=0.02)

    rows, _ = await export("window=all&sort=gpu_hours&dir=asc")
    assert [r["lease_id"] for r in rows] == expected(listed.rows, "gpu_hours", False) and len(rows) == 328
    rows, _ = await export("sort=util&dir=desc")  # ordered outside the journal: documents still read by batch
    assert [r["lease_id"] for r in rows] == expected(window, "util", True) and max(reads) == 60 and len(reads) == 6
    rows, _ = await export("window=all&project=atlas&task=training&sort=vm&dir=asc")
    assert [r["lease_id"] for r in rows] == expected(
        [r for r in listed.rows if r.project == "atlas" and r.task == "training"], "vm", False)


async def test_an_export_that_fails_part_way_is_cut_short(listed: Listed, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dashboard_data, "CSV_PAGE_ROWS", 60)
    journal = listed.rig.runtime.journal
    real = journal.sorted_page
    calls = [0]

    def failing(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == 3:
            raise OSError("disk I/O error")
        return real(*args, **kwargs)

    monkeypatch.setattr(journal, "sorted_page", failing)
    resp = await listed.rig.client.get("/ui/leases.csv")
    assert resp.status == 200  # the header was out before the failure
    with pytest.raises(aiohttp.ClientPayloadError):  # not a shorter file that looks complete
        await resp.read()


async def test_bad_pages_are_refused_and_empty_lists_say_so(listed: Listed) -> None:
    first = await listed.get("/ui/leases?limit=25&sort=vm&dir=asc")
    after = link(first, "next")
    assert after is not None
    cursor = re.search(r"after=([^&]+)", after).group(1)  # type: ignore[union-attr]
    for query, field in [("after=not-a-cursor", "after"), (f"after={cursor}&sort=vm&dir=desc", "another sort"),
                         (f"before={cursor}&sort=task&dir=asc", "another sort"), (f"after={cursor[:-2]}", "after"),
                         ("limit=0", "limit"), ("limit=501", "limit"), ("limit=ten", "limit"),
                         (f"after={cursor}&last=1&sort=vm&dir=asc", "one page"), ("dir=up", "dir"),
                         ("sort=colour", "sort")]:
        resp = await listed.rig.client.get(f"/ui/leases?{query}")
        assert resp.status == 400 and field in await resp.text(), query
        resp = await listed.rig.client.get(f"/ui/api/leases?{query}")
        assert resp.status == 400, query
    resp = await listed.rig.client.get("/ui/leases.csv?sort=colour")
    assert resp.status == 400 and "text/html" in resp.headers["Content-Type"]
    empty = await listed.get("/ui/leases?vm=no-such-vm")
    assert shown(empty) == ("0", 0) and "No leases match these filters." in empty
    assert all(link(empty, rel) is None for rel in ("first", "prev", "next", "last"))


def test_template_holds_ties_in_every_order(template: tuple[Path, list[Row]]) -> None:
    """The seed is what the paging tests need: ties of creation time, start and GPU-hours across the pages."""
    rows = template[1]
    assert len({r.created for r in rows}) < len(rows)
    assert len({round(r.gpu_hours, 9) for r in rows if r.gpu_hours}) < sum(1 for r in rows if r.gpu_hours)
    assert any(r.start != r.created for r in rows) and any(r.vm == ODD_VM for r in rows)

