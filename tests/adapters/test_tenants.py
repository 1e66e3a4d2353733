"""Tenants who cannot hurt each other: admission that holds under concurrency (quotas counting held, queued and
in-flight GPUs; one lease per idempotency key), the operator's priority policy, each VM's share of the queue, the
queue's default wait, and EASY backfilling behind a head that must wait. Every test drives the real API on the
simulated host (dgx8: 8 GPUs)."""

from __future__ import annotations

import asyncio
import time
import random
from pathlib import Path
from typing import Any

from hostagent.domain.lease import LeaseState
from tests.support.agent import AgentRig, Clock, make_rig, start_rig

S = LeaseState


async def _rig(tmp_path: Path, aiohttp_client: Any, *, clock: Clock | None = None, agent: dict[str, Any] | None = None,
               **leases: Any) -> AgentRig:
    return await start_rig(make_rig(tmp_path, clock=clock, leases=leases, agent=agent or {}), aiohttp_client)


async def post(rig: AgentRig, who: str, **body: Any) -> tuple[int, dict[str, Any], Any]:
    r = await rig.client.post("/v1/leases", json=body, headers=rig.auth(who))
    return r.status, await r.json(), r.headers


async def lease(rig: AgentRig, who: str, status: int = 201, **body: Any) -> dict[str, Any]:
    code, data, _ = await post(rig, who, **body)
    assert code == status, data
    return data


async def release(rig: AgentRig, who: str, lease_id: str) -> None:
    r = await rig.client.delete(f"/v1/leases/{lease_id}", headers=rig.auth(who))
    assert r.status == 200, await r.text()


def held(rig: AgentRig, vm: str) -> int:
    m = rig.runtime.manager
    return sum(len(x.devices) for x in m.leases.values() if x.domain_name == vm and x.state.holds_devices)


async def settle(rig: AgentRig, timeout: float = 30.0) -> None:
    """Let the queue drain and every grant finish (a grant of 8 GPUs can take seconds on a loaded machine: the
    bound is generous, and reached only when something is wrong)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        await rig.runtime.manager.drain_queue()
        if not any(x.state in (S.BINDING, S.ATTACHING) for x in rig.runtime.manager.leases.values()):
            return
        await asyncio.sleep(0.01)


# -- quotas -------------------------------------------------------------------------------------------------------
async def test_a_partial_grant_is_capped_to_what_the_quota_leaves(tmp_path: Path, aiohttp_client: Any) -> None:
    rig = await _rig(tmp_path, aiohttp_client, max_gpus_per_vm=3)
    first = await lease(rig, "vm-a", gpus=2)
    body = await lease(rig, "vm-a", gpus=8, accept_partial=True, top_up=False)  # it keeps its one GPU
    assert body["granted_gpus"] == 1 and held(rig, "vm-a") == 3
    assert any("the quota leaves 1" in r for r in body["reasons"]), body["reasons"]
    code, refused, _ = await post(rig, "vm-a", gpus=1, accept_partial=True)
    assert code == 409 and "may hold at most 3" in refused["error"]["message"]
    await release(rig, "vm-a", first["id"])
    assert (await lease(rig, "vm-a", gpus=4, accept_partial=True))["granted_gpus"] == 2


async def test_a_request_the_quota_can_never_allow_is_refused_at_once(tmp_path: Path, aiohttp_client: Any) -> None:
    rig = await _rig(tmp_path, aiohttp_client, max_gpus_per_vm=2)
    code, body, _ = await post(rig, "vm-a", gpus=3, accept_deferred=True)
    assert code == 409 and "can never be granted" in body["error"]["message"]
    assert not rig.runtime.manager.leases  # nothing queued, nothing journaled
    code, body, _ = await post(rig, "vm-a", gpus=9, accept_deferred=True)  # more than the host has
    assert code == 409 and not rig.runtime.manager.leases


async def test_queued_requests_count_against_the_quota(tmp_path: Path, aiohttp_client: Any) -> None:
    rig = await _rig(tmp_path, aiohttp_client, projects={"small": {"domains": ["vm-a"], "max_gpus": 1}})
    hog = await lease(rig, "vm-b", gpus=8)
    await lease(rig, "vm-a", 202, gpus=1, accept_deferred=True)
    for _ in range(2):
        code, body, _ = await post(rig, "vm-a", gpus=1, accept_deferred=True)
        assert code == 409 and "project small" in body["error"]["message"], body
        assert "1 more queued" in body["error"]["message"], body
    await release(rig, "vm-b", hog["id"])
    await settle(rig)
    assert held(rig, "vm-a") == 1


async def test_a_queued_grant_is_rechecked_against_the_quota(tmp_path: Path, aiohttp_client: Any) -> None:
    """A request queued within its quota is granted only if it still fits when GPUs free: here its VM used up its
    GPU-hours while it waited. It stays queued, and the request behind it is not held up."""
    clock = Clock()
    rig = await _rig(tmp_path, aiohttp_client, clock=clock,
                     projects={"small": {"domains": ["vm-a"], "max_gpu_hours_per_day": 1.0}})
    m = rig.runtime.manager
    await lease(rig, "vm-a", gpus=1, duration_s=7200)
    hog = await lease(rig, "vm-b", gpus=7, duration_s=7200)
    queued = await lease(rig, "vm-a", 202, gpus=1, accept_deferred=True)
    behind = await lease(rig, "vm-c", 202, gpus=1, accept_deferred=True)
    clock.advance(3601)  # vm-a's running lease has now used its GPU-hour
    await release(rig, "vm-b", hog["id"])
    await settle(rig)
    assert m.leases[queued["id"]].state is S.QUEUED
    assert m.leases[behind["id"]].state is S.ACTIVE
    # the queued one was not granted; its running lease, cut to the GPU-hour, may have expired by now
    assert held(rig, "vm-a") <= 1


async def test_requests_a_quota_holds_back_never_hold_up_anyone(tmp_path: Path, aiohttp_client: Any) -> None:
    """Queued requests whose own tenant is out of GPU-hours wait without holding anyone up: with GPUs free, another
    VM's request that does not accept a deferral is granted at once (it used to be refused, "requests of equal or
    higher priority are waiting"), and more such requests than a decision looks at (BACKFILL_DEPTH) in front of a
    request that can start do not stall the queue."""
    clock = Clock()
    rig = await _rig(tmp_path, aiohttp_client, clock=clock, queue_max_per_vm=0,
                     projects={"spent": {"domains": ["vm-a", "vm-b"], "max_gpu_hours_per_day": 1.0}})
    m = rig.runtime.manager
    first = await lease(rig, "vm-a", gpus=1, duration_s=7200)
    hog = await lease(rig, "vm-c", gpus=7, duration_s=7200)
    blocked = [await lease(rig, "vm-a" if i % 2 else "vm-b", 202, gpus=1, priority=0, accept_deferred=True)
               for i in range(70)]
    waiter = await lease(rig, "vm-d", 202, gpus=1, accept_deferred=True)
    clock.advance(3601)  # the project has now used its GPU-hour: its 70 queued requests cannot start
    await release(rig, "vm-a", first["id"])
    await settle(rig)
    assert m.leases[waiter["id"]].state is S.ACTIVE, "70 held-back requests in front stalled the queue"
    assert all(m.leases[b["id"]].state is S.QUEUED for b in blocked)
    await release(rig, "vm-c", hog["id"])
    now = await lease(rig, "vm-c", gpus=2)  # no accept_deferred: granted, the held-back requests are not ahead
    assert now["state"] == "ACTIVE" and held(rig, "vm-c") == 2
    assert held(rig, "vm-a") + held(rig, "vm-b") == 0


async def test_gpu_hours_count_ended_leases_over_a_sliding_day(tmp_path: Path, aiohttp_client: Any) -> None:
    clock = Clock()
    rig = await _rig(tmp_path, aiohttp_client, clock=clock, max_gpu_hours_per_day_per_vm=2.0)
    a = await lease(rig, "vm-a", gpus=2)
    clock.advance(3600)  # 2 GPU-hours
    await release(rig, "vm-a", a["id"])
    code, body, _ = await post(rig, "vm-a", gpus=1)
    assert code == 409 and "GPU-hours" in body["error"]["message"], "releasing must not reset the day's use"
    await lease(rig, "vm-b", gpus=1)  # another VM has its own budget
    clock.advance(86400)
    await lease(rig, "vm-a", gpus=1)  # the window slid past it


async def test_a_lease_cannot_outrun_its_gpu_hours(tmp_path: Path, aiohttp_client: Any) -> None:
    """A GPU-hours quota holds while leases run, not only when they are asked for: a lease's length is cut to what
    the quota leaves for its GPUs (and the reasons say so), the time its running leases have ahead is spoken for,
    a renewal is cut the same way (refused once nothing is left), and a release gives back what was not used."""
    clock = Clock()
    rig = await _rig(tmp_path, aiohttp_client, clock=clock, max_gpu_hours_per_day_per_vm=2.0)
    big = await lease(rig, "vm-a", gpus=4, duration_s=86400)
    assert big["expires_at"] == clock() + 1800, "2 GPU-hours on 4 GPUs: half an hour"
    assert any("length capped to 1800 s" in r for r in big["reasons"]), big["reasons"]
    code, body, _ = await post(rig, "vm-a", gpus=1)
    assert code == 409 and "committed to its running leases" in body["error"]["message"], body
    clock.advance(450)  # half a GPU-hour used, the rest spoken for by the running lease
    r = await rig.client.post(f"/v1/leases/{big['id']}/renew", json={"duration_s": 7200}, headers=rig.auth("vm-a"))
    assert r.status == 200 and (await r.json())["expires_at"] == clock() + 1350, "cut to the 1.5 GPU-hours left"
    await release(rig, "vm-a", big["id"])  # gives back the time it did not use
    small = await lease(rig, "vm-a", gpus=1, duration_s=86400)
    assert small["expires_at"] == clock() + 5400, "1.5 GPU-hours on one GPU"
    clock.advance(5400)  # both GPU-hours used: the lease cannot run a second more
    r = await rig.client.post(f"/v1/leases/{small['id']}/renew", json={"duration_s": 60}, headers=rig.auth("vm-a"))
    assert r.status == 409 and "GPU-hours" in (await r.json())["error"]["message"]
    other = await lease(rig, "vm-b", gpus=4, duration_s=3600)  # another VM has its own budget
    assert other["expires_at"] == clock() + 1800


async def test_a_refusal_says_when_the_gpus_are_expected(tmp_path: Path, aiohttp_client: Any) -> None:
    """A request refused for want of free GPUs is told when as many are expected free (the leases' ends, the
    requests of equal or higher priority queued ahead taking theirs first); a request the host can never meet is
    not given a time."""
    clock = Clock()
    rig = await _rig(tmp_path, aiohttp_client, clock=clock)
    await lease(rig, "vm-b", gpus=6, duration_s=600)
    await lease(rig, "vm-c", gpus=2, duration_s=1200)
    code, body, _ = await post(rig, "vm-a", gpus=2)
    assert code == 409 and body["error"]["available_in_s"] == 600, body
    assert body["error"]["message"].endswith("expected to be available in about 600 s"), body
    await lease(rig, "vm-d", 202, gpus=6, accept_deferred=True)  # queued ahead: takes the six freed at 600 s
    clock.advance(100)
    code, body, _ = await post(rig, "vm-a", gpus=2)
    assert code == 409 and body["error"]["available_in_s"] == 1100, body  # then the two freed at 1200 s
    code, body, _ = await post(rig, "vm-a", gpus=9, accept_partial=False)
    assert code == 409 and "available_in_s" not in body["error"], body


async def test_quotas_hold_under_concurrent_requests(tmp_path: Path, aiohttp_client: Any) -> None:
    """Property: whatever mix of concurrent requests three VMs send (sizes, partial, deferred), no VM ever holds
    more than its quota and the project never more than its own, at any journaled step."""
    rig = await _rig(tmp_path, aiohttp_client, max_gpus_per_vm=3,
                     projects={"team": {"domains": ["vm-a", "vm-b"], "max_gpus": 4}})
    m = rig.runtime.manager
    worst: dict[str, int] = {}

    def watch(_lease: Any, _detail: Any) -> None:
        for vm in ("vm-a", "vm-b", "vm-c"):
            worst[vm] = max(worst.get(vm, 0), held(rig, vm))
        worst["team"] = max(worst.get("team", 0), held(rig, "vm-a") + held(rig, "vm-b"))

    m.listeners.append(watch)
    rng = random.Random(27)
    for _round in range(12):
        bodies = [(rng.choice(("vm-a", "vm-b", "vm-c")),
                   {"gpus": rng.randint(1, 4), "accept_partial": rng.random() < 0.5,
                    "accept_deferred": rng.random() < 0.5, "duration_s": rng.choice((60, 3600))})
                  for _ in range(rng.randint(4, 10))]
        results = await asyncio.gather(*(post(rig, vm, **b) for vm, b in bodies))
        assert all(code in (201, 202, 409) for code, _, _ in results), results
        for lid in [x.id for x in m.leases.values() if x.state is S.ACTIVE and rng.random() < 0.5]:
            await release(rig, m.leases[lid].domain_name, lid)
        await settle(rig)
    assert worst["vm-a"] <= 3 and worst["vm-b"] <= 3 and worst["vm-c"] <= 3, worst
    assert worst["team"] <= 4, worst
    assert max(worst.values()) > 0


# -- idempotency --------------------------------------------------------------------------------------------------
async def test_fifty_concurrent_duplicates_make_one_lease(tmp_path: Path, aiohttp_client: Any) -> None:
    """(The VM's in-flight cap is raised so that all fifty reach the decision; the next test keeps it.)"""
    rig = await _rig(tmp_path, aiohttp_client, agent={"max_inflight_per_token": 64})
    body = {"gpus": 1, "idempotency_key": "job-42", "accept_deferred": True}
    results = await asyncio.gather(*(post(rig, "vm-a", **body) for _ in range(50)))
    ids = {data["id"] for _, data, _ in results}
    assert len(ids) == 1, ids
    assert {code for code, _, _ in results} == {201}
    assert {data["state"] for _, data, _ in results} == {"ACTIVE"}
    assert held(rig, "vm-a") == 1
    assert len(rig.runtime.journal.leases(domain_uuid=rig.uuids["vm-a"])) == 1
    # another VM may use the same key for its own request
    assert (await lease(rig, "vm-b", **body))["id"] not in ids


async def test_duplicates_past_the_in_flight_cap_are_told_to_retry_and_make_no_second_lease(
        tmp_path: Path, aiohttp_client: Any) -> None:
    rig = await _rig(tmp_path, aiohttp_client)  # agent.max_inflight_per_token = 8
    body = {"gpus": 1, "idempotency_key": "job-7"}
    results = await asyncio.gather(*(post(rig, "vm-a", **body) for _ in range(50)))
    codes = [code for code, _, _ in results]
    assert set(codes) <= {201, 429} and 201 in codes, codes
    assert all(h["Retry-After"] == "1" for code, _, h in results if code == 429)
    assert len({data["id"] for code, data, _ in results if code == 201}) == 1
    again = await lease(rig, "vm-a", **body)  # the retry gets the same lease
    assert {again["id"]} == {data["id"] for code, data, _ in results if code == 201}
    assert len(rig.runtime.journal.leases(domain_uuid=rig.uuids["vm-a"])) == 1


async def test_concurrent_duplicates_of_a_refused_request_share_the_refusal(tmp_path: Path,
                                                                             aiohttp_client: Any) -> None:
    rig = await _rig(tmp_path, aiohttp_client, agent={"max_inflight_per_token": 64})
    await lease(rig, "vm-b", gpus=8)
    results = await asyncio.gather(*(post(rig, "vm-a", gpus=1, idempotency_key="k") for _ in range(10)))
    assert {code for code, _, _ in results} == {409}
    assert not [x for x in rig.runtime.manager.leases.values() if x.domain_name == "vm-a"]


def test_the_journal_refuses_a_second_lease_with_the_same_key(tmp_path: Path) -> None:
    """The constraint is the journal's own, and a journal written before it keeps its rows (the later duplicates
    lose only the key)."""
    import sqlite3

    import pytest

    from hostagent.domain.lease import LeaseRequest, new_lease
    from hostagent.store.journal import Journal

    path = tmp_path / "journal.sqlite3"
    j = Journal(path)
    req = LeaseRequest(idempotency_key="k")
    j.record(new_lease("l-1", "u", "vm", req, 1.0), from_state=None, actor="t")
    with pytest.raises(sqlite3.IntegrityError):
        j.record(new_lease("l-2", "u", "vm", req, 2.0), from_state=None, actor="t")
    j.record(new_lease("l-3", "other", "vm2", req, 2.0), from_state=None, actor="t")
    j._db.execute("DROP INDEX leases_idem")  # as an older journal had it, with duplicates made before the fix
    j.record(new_lease("l-4", "u", "vm", req, 3.0), from_state=None, actor="t")
    j.close()
    again = Journal(path)
    assert again.by_idempotency_key("u", "k").id == "l-1"
    assert again.get("l-4") is not None
    with pytest.raises(sqlite3.IntegrityError):
        again.record(new_lease("l-5", "u", "vm", req, 4.0), from_state=None, actor="t")


# -- priority policy, queue share, queue wait -----------------------------------------------------------------------
async def test_a_guest_cannot_raise_its_priority_past_the_policy(tmp_path: Path, aiohttp_client: Any) -> None:
    rig = await _rig(tmp_path, aiohttp_client, projects={"gold": {"domains": ["vm-c"], "max_priority": 50}})
    hog = await lease(rig, "vm-d", gpus=8)
    first = await lease(rig, "vm-a", 202, gpus=1, accept_deferred=True)
    high = await lease(rig, "vm-b", 202, gpus=1, accept_deferred=True, priority=1000)
    assert high["request"]["priority"] == 0 and high["queue"]["position"] == 2
    assert any("capped to 0" in r for r in high["reasons"]), high["reasons"]
    gold = await lease(rig, "vm-c", 202, gpus=1, accept_deferred=True, priority=1000)
    assert gold["request"]["priority"] == 50 and gold["queue"]["position"] == 1
    op = await lease(rig, "operator", 202, domain="vm-b", gpus=1, accept_deferred=True, priority=900)
    assert op["request"]["priority"] == 900 and op["queue"]["position"] == 1
    await release(rig, "vm-d", hog["id"])
    await settle(rig)
    assert all(rig.runtime.manager.leases[x["id"]].state is S.ACTIVE for x in (first, high, gold, op))


async def test_one_vm_cannot_fill_the_queue(tmp_path: Path, aiohttp_client: Any) -> None:
    rig = await _rig(tmp_path, aiohttp_client, queue_max_per_vm=3)
    await lease(rig, "vm-d", gpus=8)
    for _ in range(3):
        await lease(rig, "vm-a", 202, gpus=1, accept_deferred=True)
    code, body, headers = await post(rig, "vm-a", gpus=1, accept_deferred=True)
    assert code == 429 and body["error"]["code"] == "rate_limited" and int(headers["Retry-After"]) > 0
    assert "queue_max_per_vm" in body["error"]["message"]
    await lease(rig, "vm-b", 202, gpus=1, accept_deferred=True)  # the others still queue


async def test_a_queued_request_expires_after_the_default_wait(tmp_path: Path, aiohttp_client: Any) -> None:
    clock = Clock()
    rig = await _rig(tmp_path, aiohttp_client, clock=clock, queue_max_wait_s=600)
    await lease(rig, "vm-d", gpus=8)
    q = await lease(rig, "vm-a", 202, gpus=1, accept_deferred=True)
    assert q["queue"]["deadline"] == clock.now + 600
    soon = await lease(rig, "vm-b", 202, gpus=1, accept_deferred=True, not_after=clock.now + 60)
    assert soon["queue"]["deadline"] == clock.now + 60
    clock.advance(601)
    await rig.runtime.manager.expire_due()
    got = await (await rig.client.get(f"/v1/leases/{q['id']}", headers=rig.auth("vm-a"))).json()
    assert got["state"] == "EXPIRED" and "queue_max_wait_s" in got["end_reason"], got
    early = await (await rig.client.get(f"/v1/leases/{soon['id']}", headers=rig.auth("vm-b"))).json()
    assert early["state"] == "EXPIRED" and early["end_reason"] == "not granted before not_after", early
    for lid in (q["id"], soon["id"]):  # the expiry's own steps, by its own name
        steps = rig.runtime.journal.events(lease_id=lid, kinds=["transition"])
        assert [e.actor for e in steps if e.to_state == "EXPIRED"] == ["expiry"], steps


async def test_requests_queued_at_the_same_instant_keep_their_order_across_a_restart(
        tmp_path: Path, aiohttp_client: Any) -> None:
    """With a clock that does not move, the queue's order is the order of the requests (not of their random ids),
    and the journal gives the same order back after a restart."""
    rig = await _rig(tmp_path, aiohttp_client, clock=Clock(), queue_max_per_vm=0)
    m = rig.runtime.manager
    await lease(rig, "vm-d", gpus=8)
    ids = [(await lease(rig, ("vm-a", "vm-b", "vm-c")[i % 3], 202, gpus=1, accept_deferred=True))["id"]
           for i in range(12)]
    assert [x.id for x in m.queue()] == ids
    await m.load()  # what a restarted agent reads back from the journal
    assert [x.id for x in m.queue()] == ids


# -- backfilling --------------------------------------------------------------------------------------------------
async def test_backfill_starts_what_cannot_delay_the_head(tmp_path: Path, aiohttp_client: Any) -> None:
    """The head (8 GPUs) must wait for vm-a's lease to end in an hour: a 10-minute job starts now on the free
    GPUs (it ends first), an 8-hour one would delay the head and waits."""
    clock = Clock()
    rig = await _rig(tmp_path, aiohttp_client, clock=clock)
    a = await lease(rig, "vm-a", gpus=1, duration_s=3600)
    head = await lease(rig, "vm-b", 202, gpus=8, accept_deferred=True)
    short = await lease(rig, "vm-c", gpus=2, duration_s=600)
    assert any("backfilled: ends before the head" in r for r in short["reasons"]), short["reasons"]
    code, body, _ = await post(rig, "vm-d", gpus=1, duration_s=8 * 3600)
    assert code == 409, body
    long = await lease(rig, "vm-d", 202, gpus=1, duration_s=8 * 3600, accept_deferred=True)
    await settle(rig)
    assert rig.runtime.manager.leases[long["id"]].state is S.QUEUED
    await release(rig, "vm-c", short["id"])
    await release(rig, "vm-a", a["id"])
    await settle(rig)
    assert rig.runtime.manager.leases[head["id"]].state is S.ACTIVE, "the head starts as soon as its GPUs free"
    assert rig.runtime.manager.leases[long["id"]].state is S.QUEUED


async def test_backfill_dates_a_gpu_claimed_by_no_lease(tmp_path: Path, aiohttp_client: Any) -> None:
    """A GPU claimed outside any lease (a probe runs on it) is dated too: the head still has a predicted start,
    and a short request still backfills (it once made every request behind the head wait)."""
    rig = await _rig(tmp_path, aiohttp_client)
    m = rig.runtime.manager
    await lease(rig, "vm-a", gpus=1, duration_s=3600)
    probed = next(g for g in sorted(m.gpus) if g not in m.claims)
    m.claims[probed] = "probe:test"
    try:
        await lease(rig, "vm-b", 202, gpus=8, accept_deferred=True)
        short = await lease(rig, "vm-c", gpus=1, duration_s=600)
        assert any("backfilled" in r for r in short["reasons"]), short["reasons"]
    finally:
        del m.claims[probed]


async def test_backfill_uses_gpus_the_head_will_not_need(tmp_path: Path, aiohttp_client: Any) -> None:
    """The head needs 4; 6 GPUs free in an hour and 2 are free now, so at its start 4 are spare: a long job for
    2 may start now, from the queue too, and a third cannot."""
    rig = await _rig(tmp_path, aiohttp_client)
    await lease(rig, "vm-a", gpus=6, duration_s=3600)
    head = await lease(rig, "vm-b", 202, gpus=4, accept_deferred=True)
    queued = await lease(rig, "vm-c", 202, gpus=3, accept_deferred=True, duration_s=8 * 3600)
    await settle(rig)
    assert rig.runtime.manager.leases[queued["id"]].state is S.QUEUED  # 3 > 2 free
    side = await lease(rig, "vm-d", gpus=2, duration_s=8 * 3600)
    assert any("will not need" in r for r in side["reasons"]), side["reasons"]
    assert rig.runtime.manager.leases[head["id"]].state is S.QUEUED


async def test_listing_a_long_queue_sorts_it_once(tmp_path: Path, aiohttp_client: Any, monkeypatch: Any) -> None:
    """Positions and ETAs come from one computation per change of the leases, not one per queued lease."""
    from hostagent.services import lease_queue

    rig = await _rig(tmp_path, aiohttp_client, queue_max_per_vm=0)
    await lease(rig, "vm-d", gpus=8)
    for i in range(60):
        await lease(rig, ("vm-a", "vm-b", "vm-c")[i % 3], 202, gpus=1 + i % 2, accept_deferred=True)
    calls = []
    real = lease_queue.in_order
    monkeypatch.setattr(lease_queue, "in_order", lambda m: calls.append(1) or real(m))
    r = await rig.client.get("/v1/leases?state=QUEUED&limit=1000", headers=rig.auth("operator"))
    body = await r.json()
    assert r.status == 200 and len(body["leases"]) == 60
    assert len(calls) <= 1, f"the queue was sorted {len(calls)} times for one listing"
    positions = sorted(x["queue"]["position"] for x in body["leases"])
    assert positions == list(range(1, 61))
    etas = {x["queue"]["position"]: x["queue"]["eta"] for x in body["leases"]}
    assert all(etas[i] <= etas[i + 1] for i in range(1, 60) if etas[i] and etas[i + 1]), etas


async def test_a_duplicate_decides_itself_when_the_first_request_was_cancelled(
        tmp_path: Path, aiohttp_client: Any, monkeypatch: Any) -> None:
    from hostagent.services import grant_path

    rig = await _rig(tmp_path, aiohttp_client)
    m = rig.runtime.manager
    real = grant_path._decide_and_grant
    entered, hold = asyncio.Event(), asyncio.Event()

    async def slow_first(*args: Any, **kwargs: Any) -> Any:
        if not entered.is_set():
            entered.set()
            await hold.wait()  # the first request is cancelled while it waits here, before deciding anything
        return await real(*args, **kwargs)

    monkeypatch.setattr(grant_path, "_decide_and_grant", slow_first)
    from hostagent.domain.lease import LeaseRequest

    req = LeaseRequest(gpus=1, idempotency_key="k")
    first = asyncio.create_task(m.request(rig.uuids["vm-a"], req, actor="t"))
    await entered.wait()
    second = asyncio.create_task(m.request(rig.uuids["vm-a"], req, actor="t"))
    await asyncio.sleep(0.05)
    first.cancel()
    got = await asyncio.wait_for(second, 10)
    assert got.state is S.ACTIVE and held(rig, "vm-a") == 1
    assert first.cancelled()
