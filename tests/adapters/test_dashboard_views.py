"""Dashboard view models and rendering: SVG geometry (pure), and pages over the fake host with real data."""

from __future__ import annotations

import csv
import io
import re
import time
from pathlib import Path
from typing import Any

import pytest

from hostagent.domain.lease import Lease, LeaseRequest, LeaseState
from hostagent.web.dashboard import duration, gib
from hostagent.web.dashboard_data import (
    bucket_series,
    csv_cell,
    downsample,
    line_path,
    spark_segments,
    state_css,
    time_ticks,
    timeline_bars,
    with_gaps,
)
from tests.support.agent import AgentRig, make_rig, start_rig

CSRF = re.compile(r'name="csrf" value="([^"]+)"')
EVIL = 'vm-<img src=x onerror="alert(1)">'


# ---- pure geometry ---------------------------------------------------------------------------------------------


def mk(lid: str, start: float, end: float | None, state: LeaseState = LeaseState.RELEASED, reason: str | None = None
       ) -> Lease:
    return Lease(id=lid, domain_uuid="u", domain_name="vm", request=LeaseRequest(), state=state, created_at=start,
                 granted_at=start, ended_at=end, end_reason=reason)


def test_timeline_bars_clip_to_the_window_and_live_leases_run_to_now() -> None:
    bars = timeline_bars([mk("a", 0, 50), mk("b", 100, 300), mk("c", 800, None, LeaseState.ACTIVE),
                          mk("d", 400, 500, reason="reclaimed: idle"), mk("e", 1200, 1300)], 200, 1000, width=800)
    assert [b.lease_id for b in bars] == ["b", "d", "c"]
    b, d, c = bars
    assert b.x == 0 and b.w == pytest.approx(100)  # 200..300 of an 800 s window on 800 units
    assert d.x == pytest.approx(200) and d.css == "reclaimed"
    assert c.x == pytest.approx(600) and c.w == pytest.approx(200) and c.css == "live" and c.end is None


def test_state_colours() -> None:
    assert state_css(mk("x", 0, None, LeaseState.DETACH_PENDING)) == "pending"
    assert state_css(mk("x", 0, 1, LeaseState.FAILED)) == "failed"
    assert state_css(mk("x", 0, 1, LeaseState.EXPIRED)) == "expired"
    assert state_css(mk("x", 0, 1)) == "ended"


def test_sparkline_breaks_at_missing_data_and_scales_to_100() -> None:
    segs = spark_segments([0, 100, None, 50, None, None, 25], width=60, height=28)
    assert len(segs) == 3
    first = [tuple(map(float, p.split(","))) for p in segs[0].split()]
    assert first == [(0.0, 27.0), (10.0, 1.0)]
    assert segs[2].count(",") == 2  # a lone point is drawn as a tiny segment
    assert spark_segments([]) == [] and spark_segments([None, None]) == []


def test_buckets_downsampling_and_gaps() -> None:
    assert bucket_series([(0, 10), (30, 20), (70, 50), (500, 1)], 0, 180, 60) == [15.0, 50.0, None]
    pts = [(float(i), float(i % 100), 1.0) for i in range(5000)]
    small = downsample(pts, 100)
    assert len(small) == 100 and small[0][0] == 0.0
    assert sum(p[1] for p in small) / 100 == pytest.approx(sum(p[1] for p in pts) / 5000, rel=0.01)
    gapped = with_gaps([(0, 1, 1), (10, 1, 1), (20, 1, 1), (200, 1, 1), (210, 1, 1)])
    assert [p[1] for p in gapped] == [1, 1, 1, None, 1, 1]


def test_ticks_and_fallback_lines() -> None:
    ticks = time_ticks(1000, 1000 + 86400, width=1000)
    assert 3 <= len(ticks) <= 6 and all(t % 3600 == 0 for _, t in ticks)
    segs = line_path([0, 50, 100], [0, None, 100], 0, 100, width=100, height=100, vmax=100)
    assert segs == ["0.0,98.0", "100.0,2.0"]


def test_formatting_and_csv_cells() -> None:
    assert duration(59) == "59s" and duration(3725) == "1h 02m" and duration(90000) == "1d 1h"
    assert gib(80 * 1024**3) == "80 GiB" and gib(11.5 * 1024**3) == "11.5 GiB" and gib(None) == "—"
    assert csv_cell("=HYPERLINK(1)") == "'=HYPERLINK(1)" and csv_cell("vm-a") == "vm-a" and csv_cell(None) == ""


# ---- pages with data -------------------------------------------------------------------------------------------


@pytest.fixture
async def rig(tmp_path: Path, aiohttp_client: Any) -> AgentRig:
    r = await start_rig(make_rig(tmp_path, vms=("vm-a", "vm-b", EVIL)), aiohttp_client)
    page = await (await r.client.get("/ui/login")).text()
    csrf = CSRF.search(page).group(1)  # type: ignore[union-attr]
    resp = await r.client.post("/ui/login", data={"token": r.operator, "csrf": csrf}, allow_redirects=False)
    assert resp.status == 303
    return r


async def lease(rig: AgentRig, vm: str, utils: list[float], **body: Any) -> dict[str, Any]:
    r = await rig.client.post("/v1/leases", json={"gpus": 1, **body}, headers=rig.auth(vm))
    data = await r.json()
    assert r.status == 201, data
    now = time.time()
    samples = [{"ts": now - (len(utils) - i) * 30, "gpu": d["gpu_id"], "util_pct": u, "mem_used_bytes": 3 * 2**30}
               for i, u in enumerate(utils) for d in data["devices"]]
    r = await rig.client.post(f"/v1/leases/{data['id']}/heartbeat", json={"samples": samples}, headers=rig.auth(vm))
    assert r.status == 200
    return dict(data)


async def test_overview_and_live_json_show_states_and_usage(rig: AgentRig) -> None:
    a = await lease(rig, "vm-a", [90, 95, 100], task_type="training")
    await lease(rig, EVIL, [1, 2])
    page = await (await rig.client.get("/")).text()
    assert EVIL not in page and "vm-&lt;img src=x onerror=&#34;alert(1)&#34;&gt;" in page  # escaped
    body = await (await rig.client.get("/ui/api/overview")).json()
    assert body["counts"]["leased"] == 2 and body["counts"]["free"] == body["total"] - 2
    gid = a["devices"][0]["gpu_id"]
    row = re.search(rf'<tr class="row-leased" data-gpu="{gid}">.*?</tr>', body["html"], re.S)
    assert row and "vm-a" in row.group(0) and "<polyline" in row.group(0) and "100%" in row.group(0)


async def test_gpu_series_carry_the_heartbeats(rig: AgentRig) -> None:
    a = await lease(rig, "vm-a", [10, 20, 30, 40])
    gid = a["devices"][0]["gpu_id"]
    body = await (await rig.client.get(f"/ui/api/gpus/{gid}?range=1h")).json()
    assert [v for v in body["series"]["util"] if v is not None] == [10, 20, 30, 40]
    assert body["state"] == "leased" and a["id"] in body["timeline"]
    page = await (await rig.client.get(f"/ui/gpus/{gid}?range=6h")).text()
    assert 'class="bar b-live"' in page and "series-data" in page


async def test_leases_filter_sort_and_csv(rig: AgentRig) -> None:
    a = await lease(rig, "vm-a", [80, 90], task_type="training")
    b = await lease(rig, "vm-b", [5, 5], task_type="inference")
    e = await lease(rig, EVIL, [50], task_type="=cmd")
    r = await rig.client.delete(f"/v1/leases/{b['id']}", headers=rig.auth("vm-b"))
    assert r.status == 200
    page = await (await rig.client.get("/ui/leases?state=live")).text()
    assert a["id"] in page and e["id"] in page and b["id"] not in page
    page = await (await rig.client.get("/ui/leases?task=inference")).text()
    assert b["id"] in page and a["id"] not in page
    body = await (await rig.client.get("/ui/api/leases?sort=util&dir=desc")).json()
    order = re.findall(r'data-lease="(l-[0-9a-f]+)"', body["html"])
    assert order == [a["id"], e["id"], b["id"]] and body["total"] == 3
    # sorted by VM name, a total order here (three distinct names; "<" sorts before "a"): the exact order both ways
    text = await (await rig.client.get("/ui/leases.csv?sort=vm&dir=asc")).text()
    rows = list(csv.DictReader(io.StringIO(text)))
    assert [x["lease_id"] for x in rows] == [e["id"], a["id"], b["id"]]
    assert [x["vm"] for x in rows] == sorted([EVIL, "vm-a", "vm-b"])
    text = await (await rig.client.get("/ui/leases.csv?sort=vm&dir=desc")).text()
    assert [x["lease_id"] for x in csv.DictReader(io.StringIO(text))] == [b["id"], a["id"], e["id"]]
    evil_row = next(x for x in rows if x["lease_id"] == e["id"])
    assert evil_row["task_type"] == "'=cmd" and float(evil_row["mean_util_pct"]) == 50.0
    assert next(x for x in rows if x["lease_id"] == b["id"])["end_reason"] == "released by guest"


async def test_lease_reclaim_and_model_pages(rig: AgentRig) -> None:
    a = await lease(rig, "vm-a", [70, 80], task_type="training")
    page = await (await rig.client.get(f"/ui/leases/{a['id']}")).text()
    assert "Placement reasons" in page and "REQUESTED" in page and "Release lease" in page
    page = await (await rig.client.get("/ui/reclaim")).text()
    assert a["id"] in page and "Pause reclaim" in page
    page = await (await rig.client.get("/ui/model")).text()
    assert a["id"] in page and all(why in page for why in a["reasons"][:1])
