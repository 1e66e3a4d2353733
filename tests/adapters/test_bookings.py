"""Bookings through the API (issue #22): a lease request with `start_at` holds GPUs in the calendar for its window,
leases granted meanwhile stay clear of it (backfilling a gap they fit in), a booking that does not fit is offered the
earliest window, a booking of higher priority displaces lower ones, cancelling frees the calendar, and at its start
(less the lead time) the booking binds and attaches its GPUs. dgx8 (8 GPUs) over the fake kernel and the simulated
hypervisor, on a controlled clock."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from hostagent.domain.calendar import utc_text
from hostagent.domain.lease import Lease, LeaseState
from tests.support.agent import AgentRig, Clock, make_rig, start_rig

HOUR = 3600


async def booking_rig(tmp_path: Path, aiohttp_client: Any, **leases: Any) -> tuple[AgentRig, Clock]:
    clock = Clock()
    rig = make_rig(tmp_path, clock=clock, leases={"guest_max_priority": 10, "booking_lead_s": 60.0, **leases})
    return await start_rig(rig, aiohttp_client), clock


async def post(rig: AgentRig, who: str, status: int, **body: Any) -> dict[str, Any]:
    r = await rig.client.post("/v1/leases", json=body, headers=rig.auth(who))
    data = await r.json()
    assert r.status == status, data
    return data


async def get(rig: AgentRig, lease_id: str) -> dict[str, Any]:
    return await (await rig.client.get(f"/v1/leases/{lease_id}", headers=rig.auth("operator"))).json()


async def test_a_booking_holds_its_gpus_and_leases_stay_clear_of_them(tmp_path: Path, aiohttp_client: Any) -> None:
    rig, clock = await booking_rig(tmp_path, aiohttp_client)
    start = clock.now + 2 * HOUR
    b = await post(rig, "vm-a", 201, gpus=2, start_at=start, duration_s=HOUR, task_type="training")
    assert b["state"] == "BOOKED" and b["devices"] == []
    booked = set(b["booking"]["gpus"])
    assert len(booked) == 2 and b["booking"]["start_at"] == start and b["booking"]["end_at"] == start + HOUR
    assert b["booking"]["binds_at"] == start - 60.0
    assert b["expires_at"] == start + HOUR
    # nothing is bound ahead of time: the GPUs are free on the host and in the inventory
    gpus = {g["id"]: g for g in (await (await rig.client.get("/v1/gpus", headers=rig.auth("operator"))).json())["gpus"]}
    assert all(gpus[g]["state"] == "free" for g in booked)
    # a lease of the default 8 hours never takes a booked GPU: all 8 asked, 6 may be had
    refused = await post(rig, "vm-b", 409, gpus=8)
    assert "6 of 8" in refused["error"]["message"]
    six = await post(rig, "vm-b", 201, gpus=6)
    assert not booked & {d["gpu_id"] for d in six["devices"]}
    # a lease that ends before the booking's lead time backfills the gap; one that would overrun it is refused
    await post(rig, "vm-c", 409, gpus=1, duration_s=2 * HOUR)
    gap = await post(rig, "vm-c", 201, gpus=1, duration_s=HOUR)
    assert {d["gpu_id"] for d in gap["devices"]} <= booked
    # a renewal of it is cut at the booking
    r = await rig.client.post(f"/v1/leases/{gap['id']}/renew", json={"duration_s": 3 * HOUR},
                              headers=rig.auth("vm-c"))
    renewed = await r.json()
    assert r.status == 200 and renewed["expires_at"] == start - 60.0, renewed
    said = [e.detail for e in rig.runtime.journal.events(lease_id=gap["id"]) if (e.detail or "").startswith("renewed")]
    assert said == [f"renewed for {start - 60.0 - clock.now:g} s (renewed only until {utc_text(start - 60.0)}: "
                     "a booking of its GPU(s) starts then)"], said
    assert utc_text(start - 60.0).endswith(" UTC") and len(utc_text(start - 60.0)) == 23  # 2027-01-15 08:59:00 UTC
    # renewed to the booking's lead time already: nothing is left, so a further renewal is refused (and says why)
    r = await rig.client.post(f"/v1/leases/{gap['id']}/renew", json={"duration_s": 3 * HOUR},
                              headers=rig.auth("vm-c"))
    refused_renewal = (await r.json())["error"]
    assert r.status == 409 and refused_renewal["field"] == "duration_s", refused_renewal
    assert refused_renewal["message"].startswith("cannot renew: "), refused_renewal
    assert rig.runtime.manager.leases[gap["id"]].expires_at == start - 60.0


async def test_a_booking_that_does_not_fit_is_offered_the_earliest_window(tmp_path: Path, aiohttp_client: Any) -> None:
    rig, clock = await booking_rig(tmp_path, aiohttp_client)
    t0 = clock.now
    await post(rig, "vm-a", 201, gpus=6, start_at=t0 + HOUR, duration_s=2 * HOUR)
    await post(rig, "vm-b", 201, gpus=2, duration_s=4 * HOUR)  # the other two, running until t0 + 4 h
    refused = await post(rig, "vm-c", 409, gpus=4, start_at=t0 + 2 * HOUR, duration_s=HOUR)
    err = refused["error"]
    # the six booked GPUs free at t0 + 3 h (the booking's end): the offer starts there, plus the lead time the
    # agent binds a booking ahead by (60 s here)
    assert err["field"] == "start_at" and err["earliest_start"] == pytest.approx(t0 + 3 * HOUR + 60)
    assert err["available_in_s"] == pytest.approx(3 * HOUR + 60, abs=1)
    moved = await post(rig, "vm-c", 201, gpus=4, start_at=t0 + 2 * HOUR, duration_s=HOUR, accept_deferred=True)
    assert moved["booking"]["start_at"] == pytest.approx(t0 + 3 * HOUR + 60)
    assert any("earliest window" in r for r in moved["reasons"])
    part = await post(rig, "vm-d", 201, gpus=4, start_at=t0 + 5 * HOUR, duration_s=HOUR, accept_partial=True)
    assert len(part["booking"]["gpus"]) == 4  # everything is free by then


async def test_a_higher_priority_booking_displaces_lower_ones_and_says_so(tmp_path: Path, aiohttp_client: Any) -> None:
    rig, clock = await booking_rig(tmp_path, aiohttp_client)
    t0 = clock.now
    low = await post(rig, "vm-a", 201, gpus=4, start_at=t0 + HOUR, duration_s=HOUR, priority=1)
    mid = await post(rig, "vm-b", 201, gpus=4, start_at=t0 + HOUR, duration_s=HOUR, priority=5)
    equal = await post(rig, "vm-c", 409, gpus=2, start_at=t0 + HOUR, duration_s=HOUR, priority=1)
    assert "earliest window" in equal["error"]["message"]  # equal priority never displaces
    high = await post(rig, "vm-c", 201, gpus=2, start_at=t0 + HOUR, duration_s=HOUR, priority=9)
    assert any("displaced 1 booking" in r for r in high["reasons"])
    gone, kept = await get(rig, low["id"]), await get(rig, mid["id"])
    assert gone["state"] == "RELEASED" and kept["state"] == "BOOKED"
    assert f"displaced by booking {high['id']} of priority 9" in gone["end_reason"]
    # what it can have instead: its four GPUs for its hour from when mid's and high's bookings end, plus the lead
    assert f"the earliest window that fits starts at {utc_text(t0 + 2 * HOUR + 60)}" in gone["end_reason"], gone
    assert gone["ended_at"] == pytest.approx(t0)
    assert set(high["booking"]["gpus"]) <= set(low["booking"]["gpus"])


async def test_cancel_frees_the_calendar(tmp_path: Path, aiohttp_client: Any) -> None:
    rig, clock = await booking_rig(tmp_path, aiohttp_client)
    b = await post(rig, "vm-a", 201, gpus=8, start_at=clock.now + HOUR, duration_s=HOUR)
    await post(rig, "vm-b", 409, gpus=1)
    r = await rig.client.delete(f"/v1/leases/{b['id']}", headers=rig.auth("vm-a"))
    body = await r.json()
    assert r.status == 200 and body["state"] == "RELEASED" and body["end_reason"].startswith("booking cancelled")
    await post(rig, "vm-b", 201, gpus=8)


async def test_at_its_start_a_booking_binds_its_gpus_ready_on_time(tmp_path: Path, aiohttp_client: Any) -> None:
    rig, clock = await booking_rig(tmp_path, aiohttp_client)
    start = clock.now + HOUR
    b = await post(rig, "vm-a", 201, gpus=2, start_at=start, duration_s=HOUR, task_type="training")
    booked = b["booking"]["gpus"]
    m = rig.runtime.manager
    clock.now = start - 61.0
    await m.drain_queue()
    assert (await get(rig, b["id"]))["state"] == "BOOKED"  # not yet: binds at its start less the lead
    # one of its GPUs is quarantined meanwhile: another that fits takes its place
    await m._quarantine(booked[1], "test: a bad GPU", "test")
    clock.now = start - 59.0
    await m.drain_queue()
    live = await get(rig, b["id"])
    assert live["state"] == "ACTIVE", live
    got = [d["gpu_id"] for d in live["devices"]]
    assert booked[0] in got and booked[1] not in got and len(got) == 2
    assert live["expires_at"] == start + HOUR  # its window, not a default length
    assert any("replaced by others" in r for r in live["reasons"])
    for d in live["devices"]:
        for f in d["functions"]:
            assert rig.sysfs_driver(f) == "vfio-pci"
    # the booking's window ends it as any lease's expiry does
    clock.now = start + HOUR + 1
    await m.expire_due()
    assert (await get(rig, b["id"]))["state"] == "EXPIRED"


async def test_a_booking_whose_gpus_are_taken_waits_first_and_one_past_its_window_expires(
        tmp_path: Path, aiohttp_client: Any) -> None:
    rig, clock = await booking_rig(tmp_path, aiohttp_client)
    m = rig.runtime.manager
    first = await post(rig, "vm-a", 201, gpus=8, start_at=clock.now + HOUR, duration_s=HOUR)
    await m._quarantine(first["booking"]["gpus"][0], "test", "test")  # 7 left: too few at its start
    clock.now += HOUR
    await m.drain_queue()
    assert (await get(rig, first["id"]))["state"] == "QUEUED"
    late = await post(rig, "vm-b", 201, gpus=1, start_at=clock.now + 100, duration_s=10, accept_deferred=True)
    assert late["state"] == "BOOKED"
    clock.now += 200  # the agent was away past its whole window
    await m.drain_queue()
    gone = await get(rig, late["id"])
    assert gone["state"] == "EXPIRED" and gone["end_reason"] == "booking window passed"


@pytest.mark.parametrize(("body", "field"), [
    ({"gpus": 1, "start_at": 1.0, "duration_s": 60}, "start_at"),  # in the past
    ({"gpus": 1, "start_at": "soon", "duration_s": 60}, "start_at"),
    ({"gpus": 1, "start_at": "FUTURE"}, "start_at"),  # a booking states its length (duration_s)
    ({"gpus": 1, "start_at": "FAR", "duration_s": 60}, "start_at"),  # beyond leases.booking_horizon_s
])
async def test_bad_bookings_get_a_clear_400_and_change_nothing(tmp_path: Path, aiohttp_client: Any,
                                                              body: dict[str, Any], field: str) -> None:
    rig, clock = await booking_rig(tmp_path, aiohttp_client, booking_horizon_s=86400.0)
    body = {k: (clock.now + 60 if v == "FUTURE" else clock.now + 2 * 86400 if v == "FAR" else v)
            for k, v in body.items()}
    before = dict(rig.runtime.manager.leases)
    r = await rig.client.post("/v1/leases", json=body, headers=rig.auth("vm-a"))
    data = await r.json()
    assert r.status == 400 and data["error"]["field"] == field, data
    assert rig.runtime.manager.leases == before
    more = await rig.client.post("/v1/leases", json={"gpus": 9, "start_at": clock.now + 60, "duration_s": 60},
                                 headers=rig.auth("vm-a"))
    assert more.status == 409 and "only 8" in (await more.json())["error"]["message"]


def test_a_booking_survives_the_journal() -> None:
    from hostagent.domain.lease import LeaseRequest

    lease = Lease("l-1", "u", "vm", LeaseRequest(gpus=2, duration_s=60, start_at=2e9), LeaseState.BOOKED, 1.0,
                  booked_gpus=("g0", "g1"), expires_at=2e9 + 60)
    assert Lease.from_dict(lease.to_dict()) == lease


async def test_the_calendar_page_shows_leases_and_bookings_ahead(tmp_path: Path, aiohttp_client: Any) -> None:
    from tests.support.agent import operator_login

    rig, clock = await booking_rig(tmp_path, aiohttp_client)
    b = await post(rig, "vm-a", 201, gpus=2, start_at=clock.now + 2 * 86400, duration_s=86400, priority=3)
    lease = await post(rig, "vm-b", 201, gpus=1, duration_s=3600)
    await operator_login(rig)
    page = await (await rig.client.get("/ui/calendar")).text()
    assert 'href="/ui/calendar" class="active"' in page
    for gid in b["booking"]["gpus"]:  # each booked GPU's row carries the booking's bar and its bind mark
        row = page.split(f'data-gpu="{gid}"', 1)[1].split("</svg>", 1)[0]
        assert f'data-lease="{b["id"]}"' in row and 'class="bar b-booked"' in row and 'class="bind-mark"' in row
    held = lease["devices"][0]["gpu_id"]
    row = page.split(f'data-gpu="{held}"', 1)[1].split("</svg>", 1)[0]
    assert f'data-lease="{lease["id"]}"' in row and "b-live" in row
    table = page.split('id="bookings"', 1)[1]
    assert f'data-lease="{b["id"]}"' in table and "data-cancel" in table  # the operator can cancel it here
    # out of the 24 h range the booking is listed but draws no bar
    short = await (await rig.client.get("/ui/calendar?range=24h")).text()
    assert 'class="bar b-booked"' not in short and f'data-lease="{b["id"]}"' in short.split('id="bookings"', 1)[1]
    bad = await rig.client.get("/ui/calendar?range=1y")
    assert bad.status == 400
    # cancelling from the dashboard frees the calendar
    csrf = re.search(r'name="csrf" value="([^"]+)"', page).group(1)  # type: ignore[union-attr]
    r = await rig.client.post(f"/ui/leases/{b['id']}/release", data={"csrf": csrf, "next": "/ui/calendar"})
    assert r.status == 200 and f"booking {b['id']} cancelled" in await r.text()
    assert (await get(rig, b["id"]))["state"] == "RELEASED"


async def test_a_due_booking_waits_for_its_gpu_to_come_back_until_its_start(tmp_path: Path,
                                                                            aiohttp_client: Any) -> None:
    rig, clock = await booking_rig(tmp_path, aiohttp_client)
    m = rig.runtime.manager
    await post(rig, "vm-a", 201, gpus=7)  # 8 hours on seven GPUs
    start = clock.now + 2 * HOUR
    b = await post(rig, "vm-b", 201, gpus=1, start_at=start, duration_s=HOUR)
    gid = b["booking"]["gpus"][0]
    gap = await post(rig, "vm-c", 201, gpus=1, duration_s=2 * HOUR - 60)  # ends as the booking binds
    assert gap["devices"][0]["gpu_id"] == gid
    clock.now = start - 59.0  # due, but the lease before it has not been ended yet (its expiry runs periodically)
    await m.drain_queue()
    assert (await get(rig, b["id"]))["state"] == "BOOKED", "it waits for its own GPU rather than the queue"
    await m.expire_due()
    await m.drain_queue()
    live = await get(rig, b["id"])
    assert live["state"] == "ACTIVE" and [d["gpu_id"] for d in live["devices"]] == [gid]
    assert (await get(rig, gap["id"]))["state"] == "EXPIRED"


def test_the_leases_cli_shows_a_booking_s_gpus_and_start() -> None:
    from hostagent.cli.leases import lease_rows

    row = lease_rows([{"id": "l-1", "state": "BOOKED", "domain": {"name": "vm-a"}, "devices": [],
                       "request": {"task_type": "training", "priority": 3}, "expires_at": 2e9 + 60, "warnings": [],
                       "booking": {"gpus": ["g0", "g1"], "start_at": 2e9, "end_at": 2e9 + 60}}])[0]
    assert row["gpus"] == "g0,g1" and row["note"].startswith("starts ") and row["prio"] == 3


async def test_a_queued_request_s_eta_keeps_clear_of_the_bookings(tmp_path: Path, aiohttp_client: Any) -> None:
    """Every GPU is leased for an hour, and booked from the third hour for four. A queued request of one hour fits in
    the gap and is told so; one of five hours cannot start before the booking ends, and its ETA says that, not the
    hour at which the GPUs first free (which is what it said before bookings were counted)."""
    rig, clock = await booking_rig(tmp_path, aiohttp_client)
    t0 = clock.now
    await post(rig, "vm-b", 201, gpus=8, duration_s=HOUR)
    start = t0 + 3 * HOUR
    await post(rig, "vm-a", 201, gpus=8, start_at=start, duration_s=4 * HOUR)
    short = await post(rig, "vm-c", 202, gpus=1, duration_s=HOUR, accept_deferred=True)
    long = await post(rig, "vm-c", 202, gpus=1, duration_s=5 * HOUR, accept_deferred=True)
    assert (await get(rig, short["id"]))["queue"]["eta"] == t0 + HOUR  # ends before the booking's lead time
    assert (await get(rig, long["id"]))["queue"]["eta"] == start + 4 * HOUR  # after the booking's end
    assert (await get(rig, long["id"]))["queue"]["position"] == 2
