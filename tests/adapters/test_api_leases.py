"""The lease API over the simulated hypervisor + fake kernel, through aiohttp's test client."""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path
from typing import Any

import pytest

from hostagent.domain.hostdev import parse_domain_hostdevs
from hostagent.domain.hostops import HostOpResult
from hostagent.domain.lease import LeaseState
from hostagent.services.reconcile import Reconciler
from tests.support.agent import AgentRig, Clock, make_rig, start_rig

ADDRESS = re.compile(r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")


@pytest.fixture
async def rig(tmp_path: Path, aiohttp_client: Any) -> AgentRig:
    return await start_rig(make_rig(tmp_path), aiohttp_client)


async def lease(rig: AgentRig, who: str = "vm-a", status: int = 201, **body: Any) -> dict[str, Any]:
    r = await rig.client.post("/v1/leases", json=body, headers=rig.auth(who))
    data = await r.json()
    assert r.status == status, data
    return data


async def wait_state(rig: AgentRig, lease_id: str, who: str, state: str, timeout: float = 5.0) -> dict[str, Any]:
    """Poll a lease until it reaches `state` (background jobs act on their own schedule)."""
    deadline = time.monotonic() + timeout
    while True:
        body = await (await rig.client.get(f"/v1/leases/{lease_id}", headers=rig.auth(who))).json()
        if body["state"] == state or time.monotonic() > deadline:
            return body
        await asyncio.sleep(0.02)


def count_hops(rig: AgentRig, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """From now on, the name of every worker-thread hop the lease driver makes."""
    m = rig.runtime.manager
    hops: list[str] = []
    run_blocking = m._run

    async def counted(fn: Any, *args: Any, **kwargs: Any) -> Any:
        hops.append(getattr(fn, "__name__", repr(fn)))
        return await run_blocking(fn, *args, **kwargs)

    monkeypatch.setattr(m, "_run", counted)
    return hops


def journal_steps(rig: AgentRig, lease_id: str) -> list[tuple[str | None, str | None]]:
    """The lease's state transitions in the journal, oldest first."""
    return [(e.from_state, e.to_state) for e in rig.runtime.journal.events(lease_id=lease_id) if e.to_state]


def vfio_functions(rig: AgentRig) -> set[str]:
    d = rig.tree.sys_root / "bus/pci/drivers/vfio-pci"
    return {p.name for p in d.iterdir() if p.is_symlink() and ADDRESS.match(p.name)} if d.exists() else set()


async def test_health_and_ready(rig: AgentRig) -> None:
    assert (await (await rig.client.get("/healthz")).json()) == {"status": "ok"}
    r = await rig.client.get("/readyz")
    body = await r.json()
    assert r.status == 200 and body["ready"] is True and body["checks"]["hypervisor"]["ok"]


async def test_gpus_list_every_group_function(rig: AgentRig) -> None:
    body = await (await rig.client.get("/v1/gpus", headers=rig.auth("operator"))).json()
    assert len(body["gpus"]) == 8
    for g in body["gpus"]:
        for key in ("id", "address", "vendor", "model", "memory_bytes", "numa_node", "iommu_group", "functions", "state"):
            assert key in g
        assert g["state"] == "free" and g["functions"][0]["driver"] == "nvidia"
    one = await rig.client.get(f"/v1/gpus/{body['gpus'][0]['id']}", headers=rig.auth("operator"))
    assert one.status == 200 and (await one.json())["history"]["leases"] == 0
    missing = await rig.client.get("/v1/gpus/gpu-nope", headers=rig.auth("operator"))
    assert missing.status == 404 and (await missing.json())["error"]["field"] == "gpu_id"


async def test_grant_binds_attaches_and_release_gives_back(rig: AgentRig) -> None:
    body = await lease(rig, gpus=2, task_type="training", precision="bf16", duration_s=600)
    assert body["state"] == "ACTIVE" and body["granted_gpus"] == 2
    funcs = {f for d in body["devices"] for f in d["functions"]}
    assert funcs <= vfio_functions(rig)
    assert all(d["guest_addresses"] for d in body["devices"])
    attached = {str(h.source) for h in await rig.hv.attached_hostdevs(rig.uuids["vm-a"])}
    assert attached == funcs
    assert body["expires_at"] == pytest.approx(time.time() + 600, abs=30)
    gpus = {g["id"]: g for g in (await (await rig.client.get("/v1/gpus", headers=rig.auth("operator"))).json())["gpus"]}
    assert all(gpus[d["gpu_id"]]["state"] == "leased" for d in body["devices"])

    r = await rig.client.delete(f"/v1/leases/{body['id']}", headers=rig.auth("vm-a"))
    done = await r.json()
    assert r.status == 200 and done["state"] == "RELEASED"
    assert not funcs & vfio_functions(rig)
    assert all(rig.sysfs_driver(f) == "nvidia" for f in funcs)
    assert await rig.hv.attached_hostdevs(rig.uuids["vm-a"]) == ()


async def test_auth_errors(rig: AgentRig) -> None:
    r = await rig.client.post("/v1/leases", json={})
    assert r.status == 401 and (await r.json())["error"]["code"] == "unauthorized"
    r = await rig.client.post("/v1/leases", json={}, headers={"Authorization": "Bearer nope"})
    assert r.status == 401
    r = await rig.client.post("/v1/leases", json={}, headers={"Authorization": "Basic abc"})
    assert r.status == 401 and (await r.json())["error"]["field"] == "Authorization"
    r = await rig.client.get("/v1/events", headers=rig.auth("vm-a"))
    assert r.status == 403


async def test_operator_leases_for_a_named_vm_and_unknown_vm_is_404(rig: AgentRig) -> None:
    r = await rig.client.post("/v1/leases", json={"gpus": 1}, headers=rig.auth("operator"))
    assert r.status == 400 and (await r.json())["error"]["field"] == "domain"
    r = await rig.client.post("/v1/leases", json={"gpus": 1, "domain": "vm-zzz"}, headers=rig.auth("operator"))
    assert r.status == 404
    body = await lease(rig, "operator", domain="vm-b", gpus=1)
    assert body["domain"]["name"] == "vm-b"


async def test_guests_see_only_their_own(rig: AgentRig) -> None:
    mine = await lease(rig, "vm-a")
    other = await rig.client.get(f"/v1/leases/{mine['id']}", headers=rig.auth("vm-b"))
    assert other.status == 404
    r = await rig.client.delete(f"/v1/leases/{mine['id']}", headers=rig.auth("vm-b"))
    assert r.status == 404
    assert (await (await rig.client.get("/v1/leases", headers=rig.auth("vm-b"))).json())["leases"] == []
    ops = (await (await rig.client.get("/v1/leases", headers=rig.auth("operator"))).json())["leases"]
    assert [x["id"] for x in ops] == [mine["id"]]
    gpu = (await (await rig.client.get(f"/v1/gpus/{mine['devices'][0]['gpu_id']}", headers=rig.auth("vm-b"))).json())
    assert "id" not in gpu["lease"] and "domain" not in gpu["lease"]


async def test_list_filters(rig: AgentRig) -> None:
    a = await lease(rig)
    await rig.client.delete(f"/v1/leases/{a['id']}", headers=rig.auth("vm-a"))
    b = await lease(rig)
    h = rig.auth("vm-a")
    ids = [x["id"] for x in (await (await rig.client.get("/v1/leases", headers=h)).json())["leases"]]
    assert ids == [b["id"], a["id"]]  # newest first, ended included
    act = (await (await rig.client.get("/v1/leases?state=ACTIVE", headers=h)).json())["leases"]
    assert [x["id"] for x in act] == [b["id"]]
    r = await rig.client.get("/v1/leases?state=SLEEPING", headers=h)
    assert r.status == 400 and (await r.json())["error"]["field"] == "state"
    r = await rig.client.get("/v1/leases?since=yesterday", headers=h)
    assert r.status == 400 and (await r.json())["error"]["field"] == "since"
    # since= keeps leases that overlap [since, now]: the running one, not the one that ended before
    later = (await (await rig.client.get(f"/v1/leases?since={time.time() + 3600}", headers=h)).json())["leases"]
    assert [x["id"] for x in later] == [b["id"]]


async def test_heartbeat_validation_writes_nothing_partial(rig: AgentRig) -> None:
    body = await lease(rig)
    gpu = body["devices"][0]["gpu_id"]
    url = f"/v1/leases/{body['id']}/heartbeat"
    h = rig.auth("vm-a")
    now = time.time()
    good = {"ts": now, "gpu": gpu, "util_pct": 50, "mem_used_bytes": 10}
    for bad, field in [
        ({**good, "util_pct": 150}, "samples[1].util_pct"),
        ({**good, "ts": now + 3600}, "samples[1].ts"),
        ({**good, "gpu": "gpu-other"}, "samples[1].gpu"),
        ({**good, "mem_used_bytes": -1}, "samples[1].mem_used_bytes"),
        ({**good, "extra": 1}, "samples[1].extra"),
    ]:
        r = await rig.client.post(url, json={"samples": [good, bad]}, headers=h)
        assert r.status == 400, await r.text()
        assert (await r.json())["error"]["field"] == field
    assert body["id"] not in rig.runtime.recent_samples
    r = await rig.client.post(url, json={"samples": [good]}, headers=h)
    reply = await r.json()
    assert r.status == 200 and reply["accepted"] == 1 and reply["state"] == "ACTIVE"
    detail = await (await rig.client.get(f"/v1/leases/{body['id']}", headers=h)).json()
    assert detail["usage"]["samples"] >= 1
    r = await rig.client.post("/v1/leases/nope/heartbeat", json={"samples": []}, headers=h)
    assert r.status == 404


async def test_detach_never_acknowledged_stays_on_vfio(rig: AgentRig) -> None:
    body = await lease(rig)
    funcs = set(body["devices"][0]["functions"])
    rig.hv.set_refuse_detach("vm-a")
    r = await rig.client.delete(f"/v1/leases/{body['id']}", headers=rig.auth("vm-a"))
    pending = await r.json()
    assert r.status == 202 and pending["state"] == "DETACH_PENDING"
    assert any(w["code"] == "detach_pending" for w in pending["warnings"])
    assert funcs <= vfio_functions(rig)  # never rebound under a live guest
    gpu = (await (await rig.client.get(f"/v1/gpus/{body['devices'][0]['gpu_id']}", headers=rig.auth("operator"))).json())
    assert gpu["state"] == "detach-pending"
    await rig.runtime.manager.retry_pending()
    assert rig.runtime.manager.leases[body["id"]].state is LeaseState.DETACH_PENDING
    assert funcs <= vfio_functions(rig)
    rig.hv.acknowledge_detaches("vm-a")  # the guest finally lets go: DEVICE_REMOVED arrives late
    for _ in range(100):
        await asyncio.sleep(0.02)
        if body["id"] not in rig.runtime.manager.leases:
            break
    done = await (await rig.client.get(f"/v1/leases/{body['id']}", headers=rig.auth("vm-a"))).json()
    assert done["state"] == "RELEASED" and not funcs & vfio_functions(rig)


async def test_a_rejected_unplug_is_journaled_and_the_retry_asks_again(rig: AgentRig) -> None:
    """A guest that rejects the unplug (libvirt's DEVICE_REMOVAL_FAILED) keeps the device: the lease stays
    DETACH_PENDING on vfio-pci, its history says the guest rejected it, and a retry once the guest accepts ends it."""
    body = await lease(rig)
    funcs = set(body["devices"][0]["functions"])
    rig.hv.set_fail_detach("vm-a")
    r = await rig.client.delete(f"/v1/leases/{body['id']}", headers=rig.auth("vm-a"))
    assert r.status == 202 and (await r.json())["state"] == "DETACH_PENDING"
    assert funcs <= vfio_functions(rig)
    op = rig.auth("operator")
    for _ in range(100):
        events = (await (await rig.client.get("/v1/events?kind=detach-rejected", headers=op)).json())["events"]
        if events:
            break
        await asyncio.sleep(0.02)
    assert events and all(e["lease_id"] == body["id"] for e in events)
    assert "rejected the unplug" in events[0]["detail"] and "DEVICE_REMOVAL_FAILED" in events[0]["detail"]
    rig.hv.set_fail_detach("vm-a", False)
    await rig.runtime.manager.retry_pending()
    done = await wait_state(rig, body["id"], "vm-a", "RELEASED")
    assert not funcs & vfio_functions(rig) and done["state"] == "RELEASED"


async def test_a_hypervisor_that_does_not_answer_leaves_the_lease_detach_pending_on_time(
        rig: AgentRig, monkeypatch: pytest.MonkeyPatch) -> None:
    """libvirt.detach_timeout_s bounds the whole detach, the read of what the domain holds included: a hypervisor
    that hangs there moves the lease to DETACH_PENDING (GPU on vfio-pci) within the timeout, not when it answers."""
    body = await lease(rig)
    funcs = set(body["devices"][0]["functions"])

    async def hangs(_uuid: str) -> tuple[Any, ...]:
        await asyncio.sleep(30)
        return ()

    monkeypatch.setattr(rig.hv, "attached_hostdevs", hangs)
    started = time.monotonic()
    r = await rig.client.delete(f"/v1/leases/{body['id']}", headers=rig.auth("vm-a"))
    took = time.monotonic() - started
    assert r.status == 202 and (await r.json())["state"] == "DETACH_PENDING", await r.text()
    assert took < rig.settings.libvirt.detach_timeout_s + 2.0, took
    assert funcs <= vfio_functions(rig)


async def test_a_device_the_guest_ejects_by_itself_ends_the_lease(rig: AgentRig) -> None:
    """DEVICE_REMOVED for an ACTIVE lease's device, with no detach asked for (the guest ejected it): the lease ends
    and every function of its GPU goes back to the host, instead of the lease staying ACTIVE without its device."""
    body = await lease(rig)
    funcs = sorted(body["devices"][0]["functions"])
    assert set(funcs) <= vfio_functions(rig)
    rig.hv.eject("vm-a", funcs[0])
    done = await wait_state(rig, body["id"], "vm-a", "RELEASED")
    assert "without a detach asked for" in done["end_reason"], done
    assert not set(funcs) & vfio_functions(rig)
    assert await rig.hv.attached_hostdevs(rig.uuids["vm-a"]) == ()
    # Nor is any left in the persistent definition, where the next boot would take a GPU the host has back.
    assert parse_domain_hostdevs(await rig.hv.domain_xml(rig.uuids["vm-a"], live=False)) == ()


async def test_renew(rig: AgentRig) -> None:
    body = await lease(rig, duration_s=60)
    r = await rig.client.post(f"/v1/leases/{body['id']}/renew", json={"duration_s": 3600}, headers=rig.auth("vm-a"))
    renewed = await r.json()
    assert r.status == 200 and renewed["expires_at"] > body["expires_at"] + 3000
    r = await rig.client.post(f"/v1/leases/{body['id']}/renew", json={"duration_s": 10**9}, headers=rig.auth("vm-a"))
    assert r.status == 400 and (await r.json())["error"]["field"] == "duration_s"
    top = rig.runtime.manager.policy.max_duration_s
    for bad in (0, top + 1, True, 1.5, "60"):  # 1..max_duration_s, an integer (not a boolean, a float or a string)
        r = await rig.client.post(f"/v1/leases/{body['id']}/renew", json={"duration_s": bad}, headers=rig.auth("vm-a"))
        assert r.status == 400 and (await r.json())["error"] == {
            **(await r.json())["error"], "field": "duration_s",
            "message": f"duration_s must be an integer 1..{top}"}, (bad, await r.text())
    for good in (1, top):  # both ends of the range
        before = rig.runtime.manager.clock()
        r = await rig.client.post(f"/v1/leases/{body['id']}/renew", json={"duration_s": good}, headers=rig.auth("vm-a"))
        assert r.status == 200 and (await r.json())["expires_at"] == pytest.approx(before + good, abs=5), good
    await rig.client.delete(f"/v1/leases/{body['id']}", headers=rig.auth("vm-a"))
    r = await rig.client.post(f"/v1/leases/{body['id']}/renew", json={}, headers=rig.auth("vm-a"))
    assert r.status == 409 and (await r.json())["error"] == {
        **(await r.json())["error"], "field": "id",
        "message": "only ACTIVE or QUEUED leases can be renewed; this one is RELEASED"}, await r.text()


async def test_expiry_releases(tmp_path: Path, aiohttp_client: Any) -> None:
    clock = Clock(time.time())
    rig = await start_rig(make_rig(tmp_path, clock=clock), aiohttp_client)
    body = await lease(rig, duration_s=60)
    await rig.runtime.manager.expire_due()
    assert rig.runtime.manager.leases[body["id"]].state is LeaseState.ACTIVE
    clock.advance(61)
    await rig.runtime.manager.expire_due()
    done = await (await rig.client.get(f"/v1/leases/{body['id']}", headers=rig.auth("vm-a"))).json()
    assert done["state"] == "EXPIRED" and vfio_functions(rig) == set()


async def test_full_host_refuses_defers_partials_and_serves_queue_by_priority(tmp_path: Path,
                                                                              aiohttp_client: Any) -> None:
    # guests may ask up to priority 10 here (the default policy caps them at 0: see tests/adapters/test_tenants.py)
    rig = await start_rig(make_rig(tmp_path, leases={"guest_max_priority": 10}), aiohttp_client)
    big = await lease(rig, "vm-a", gpus=7)
    refused = await lease(rig, "vm-b", status=409, gpus=2)
    assert "accept_deferred" in refused["error"]["message"]
    partial = await lease(rig, "vm-b", gpus=2, accept_partial=True)
    assert partial["granted_gpus"] == 1
    low = await lease(rig, "vm-c", status=202, gpus=1, accept_deferred=True, priority=1)
    high = await lease(rig, "vm-d", status=202, gpus=1, accept_deferred=True, priority=9)
    assert high["queue"]["position"] == 1
    low_now = await (await rig.client.get(f"/v1/leases/{low['id']}", headers=rig.auth("vm-c"))).json()
    assert low_now["queue"]["position"] == 2 and low_now["queue"]["eta"] is not None
    await rig.client.delete(f"/v1/leases/{partial['id']}", headers=rig.auth("vm-b"))
    h = await wait_state(rig, high["id"], "vm-d", "ACTIVE")
    lw = await (await rig.client.get(f"/v1/leases/{low['id']}", headers=rig.auth("vm-c"))).json()
    assert h["state"] == "ACTIVE" and lw["state"] == "QUEUED"
    await rig.client.delete(f"/v1/leases/{big['id']}", headers=rig.auth("vm-a"))
    lw = await wait_state(rig, low["id"], "vm-c", "ACTIVE")
    assert lw["state"] == "ACTIVE"


async def test_queued_request_is_cancelled_by_release_and_expires_after_not_after(rig: AgentRig) -> None:
    await lease(rig, "vm-a", gpus=8)
    q1 = await lease(rig, "vm-b", status=202, accept_deferred=True)
    r = await rig.client.delete(f"/v1/leases/{q1['id']}", headers=rig.auth("vm-b"))
    assert (await r.json())["state"] == "RELEASED"
    q2 = await lease(rig, "vm-c", status=202, accept_deferred=True, not_after=time.time() + 0.5)
    await asyncio.sleep(0.6)
    await rig.runtime.manager.expire_due()
    assert (await (await rig.client.get(f"/v1/leases/{q2['id']}", headers=rig.auth("vm-c"))).json())["state"] == "EXPIRED"


async def test_idempotency_key(rig: AgentRig) -> None:
    a = await lease(rig, gpus=1, idempotency_key="job-42")
    b = await lease(rig, gpus=1, idempotency_key="job-42")
    assert a["id"] == b["id"]
    c = await lease(rig, status=409, gpus=2, idempotency_key="job-42")
    assert c["error"]["field"] == "idempotency_key"


async def test_domain_stop_ends_its_leases(rig: AgentRig) -> None:
    body = await lease(rig, "vm-a")
    rig.hv.shutdown("vm-a")
    for _ in range(100):
        await asyncio.sleep(0.02)
        if body["id"] not in rig.runtime.manager.leases:
            break
    done = await (await rig.client.get(f"/v1/leases/{body['id']}", headers=rig.auth("vm-a"))).json()
    assert done["state"] == "RELEASED" and "domain stopped" in done["end_reason"]
    assert vfio_functions(rig) == set()


async def test_quarantine_clear_is_operator_only(rig: AgentRig) -> None:
    gid = (await (await rig.client.get("/v1/gpus", headers=rig.auth("operator"))).json())["gpus"][0]["id"]
    r = await rig.client.post(f"/v1/gpus/{gid}/clear-quarantine", json={}, headers=rig.auth("vm-a"))
    assert r.status == 403
    r = await rig.client.post(f"/v1/gpus/{gid}/clear-quarantine", json={}, headers=rig.auth("operator"))
    assert r.status == 409 and (await r.json())["error"]["field"] == "gpu_id"
    await rig.runtime.manager._quarantine(gid, "test", "test")
    gpu = await (await rig.client.get(f"/v1/gpus/{gid}", headers=rig.auth("operator"))).json()
    assert gpu["state"] == "quarantined"
    # two operators clear it at once: one clears it, the other hears it is no longer quarantined
    both = await asyncio.gather(*(rig.client.post(f"/v1/gpus/{gid}/clear-quarantine", json={},
                                                  headers=rig.auth("operator")) for _ in range(2)))
    assert sorted(r.status for r in both) == [200, 409], [r.status for r in both]
    (lost,) = [r for r in both if r.status == 409]
    err = (await lost.json())["error"]
    assert err["field"] == "gpu_id" and "is not quarantined" in err["message"], err
    (won,) = [r for r in both if r.status == 200]
    assert (await won.json())["state"] == "free"


async def test_a_clear_that_finishes_while_another_gives_the_gpu_back_leaves_that_one_refused(
        rig: AgentRig, monkeypatch: pytest.MonkeyPatch) -> None:
    """The order the test above meets only by chance: the first clear is still giving the GPU back (its awaits)
    when a second one clears it; the first must then hear that it is no longer quarantined, not answer 200."""
    from hostagent.services import quarantine

    gid = sorted(rig.runtime.manager.gpus)[0]
    await rig.runtime.manager._quarantine(gid, "test", "test")
    real, hold, held = quarantine.give_back_unleased, asyncio.Event(), asyncio.Event()

    async def slow_first(m: Any, gpu: Any, actor: str) -> None:
        if not held.is_set():
            held.set()
            await hold.wait()
        await real(m, gpu, actor)

    monkeypatch.setattr(quarantine, "give_back_unleased", slow_first)
    first = asyncio.ensure_future(rig.client.post(f"/v1/gpus/{gid}/clear-quarantine", json={},
                                                  headers=rig.auth("operator")))
    await asyncio.wait_for(held.wait(), 5)
    second = await rig.client.post(f"/v1/gpus/{gid}/clear-quarantine", json={}, headers=rig.auth("operator"))
    assert second.status == 200
    hold.set()
    late = await first
    err = (await late.json())["error"]
    assert late.status == 409 and err["field"] == "gpu_id" and "is not quarantined" in err["message"], err
    assert gid not in rig.runtime.manager.quarantined


async def test_events_page_back_through_next_cursor_to_the_first(rig: AgentRig) -> None:
    body = await lease(rig)
    await rig.client.delete(f"/v1/leases/{body['id']}", headers=rig.auth("vm-a"))
    op, base = rig.auth("operator"), f"/v1/events?lease_id={body['id']}&kind=transition"
    every = (await (await rig.client.get(base, headers=op)).json())
    assert every["next_cursor"] is None and len(every["events"]) == 8
    pages, url = [], f"{base}&limit=3"
    while url:
        page = await (await rig.client.get(url, headers=op)).json()
        assert len(page["events"]) <= 3
        pages.append([e["to_state"] for e in page["events"]])
        url = f"{base}&limit=3&cursor={page['next_cursor']}" if page["next_cursor"] else ""
    # newest page first, each page oldest first; together every event once
    assert [s for p in reversed(pages) for s in p] == [e["to_state"] for e in every["events"]]
    assert len(pages) == 3 and len(pages[-1]) == 2
    r = await rig.client.get(f"{base}&cursor=abc", headers=op)
    assert r.status == 400 and (await r.json())["error"]["field"] == "cursor"


async def test_events_record_every_transition(rig: AgentRig) -> None:
    journal = rig.runtime.manager.journal
    commits: list[str] = []  # one durable transaction (one fsync) per journal.record call
    record = journal.record

    def counted(lease: Any, **kw: Any) -> None:
        record(lease, **kw)
        commits.append(lease.state.value)

    journal.record = counted  # type: ignore[method-assign]
    body = await lease(rig)
    await rig.client.delete(f"/v1/leases/{body['id']}", headers=rig.auth("vm-a"))
    events = (await (await rig.client.get(f"/v1/events?lease_id={body['id']}", headers=rig.auth("operator"))).json())
    moves = [(e["from_state"], e["to_state"]) for e in events["events"] if e["kind"] == "transition"]
    states = [to for _, to in moves]
    assert states == ["REQUESTED", "BINDING", "ATTACHING", "ACTIVE", "RELEASING", "DETACHING", "REBINDING", "RELEASED"]
    assert [frm for frm, _ in moves] == [None, *states[:-1]]  # an unbroken chain, in order
    # Steps that change nothing outside the agent share a transaction with the next one: REQUESTED with
    # BINDING, RELEASING with DETACHING (and the guest addresses with ATTACHING).
    assert commits == ["BINDING", "ATTACHING", "ACTIVE", "DETACHING", "REBINDING", "RELEASED"]


async def test_metrics_exposed(rig: AgentRig) -> None:
    await lease(rig)
    text = await (await rig.client.get("/metrics", headers=rig.auth("operator"))).text()
    assert 'hostagent_gpus{state="leased"} 1.0' in text
    assert 'hostagent_leases{state="ACTIVE"} 1.0' in text
    assert "hostagent_http_request_duration_seconds_bucket" in text
    assert 'hostagent_step_duration_seconds_count{step="bind"}' in text
    parts = dict(re.findall(r'^hostagent_memory_bytes\{part="(\w+)"\} (\S+)$', text, re.M))
    assert set(parts) == {"rss", "malloc_in_use", "malloc_free", "sqlite"}
    assert float(parts["rss"]) > float(parts["sqlite"]) > 0  # the journal and the store are open
    assert re.search(r"^hostagent_python_allocated_blocks \d", text, re.M)


async def test_200_clients_race_for_8_gpus(tmp_path: Path, aiohttp_client: Any) -> None:
    vms = tuple(f"vm-{i:03d}" for i in range(200))
    rig = await start_rig(make_rig(tmp_path, vms=vms), aiohttp_client)

    async def one(i: int) -> tuple[int, dict[str, Any]]:
        r = await rig.client.post("/v1/leases", json={"gpus": 1, "accept_deferred": i % 2 == 0},
                                  headers=rig.auth(vms[i]))
        return r.status, await r.json()

    results = await asyncio.gather(*(one(i) for i in range(200)))
    granted = [b for s, b in results if s == 201]
    queued = [(i, b) for i, (s, b) in enumerate(results) if s == 202]
    refused = [(i, b) for i, (s, b) in enumerate(results) if s == 409]
    assert len(granted) == 8
    assert len({d["gpu_id"] for b in granted for d in b["devices"]}) == 8  # never the same GPU twice
    assert len(granted) + len(queued) + len(refused) == 200
    assert all(i % 2 == 0 for i, _ in queued) and all(i % 2 == 1 for i, _ in refused)
    assert all(b["state"] == "QUEUED" for _, b in queued)
    assert len(vfio_functions(rig)) == 8


@pytest.mark.parametrize("layout", ["auto", "per-function", "multifunction"])
async def test_multi_function_gpu_layouts_on_a_running_vm(tmp_path: Path, aiohttp_client: Any, layout: str) -> None:
    # The simulator behaves like libvirt 9: no live attach of function != 0, no live unplug of a multifunction slot.
    rig = await start_rig(make_rig(tmp_path, scenario="workstation", host={"guest_layout": layout},
                                   hv_kwargs={"refuse_multifunction_unplug": True,
                                              "refuse_nonzero_function_hotplug": True}), aiohttp_client)
    r = await rig.client.post("/v1/leases", json={"model": "2080 Ti"}, headers=rig.auth("vm-a"))
    body = await r.json()
    if layout == "multifunction":
        # cannot be hot-plugged: the grant fails and rolls back completely
        assert r.status == 500 and body["lease"]["state"] == "FAILED"
        assert "function=0" in body["lease"]["error"]
        assert vfio_functions(rig) == set()
        assert await rig.hv.attached_hostdevs(rig.uuids["vm-a"]) == ()
        return
    assert r.status == 201, body
    dev = body["devices"][0]
    assert len(dev["functions"]) == 4 and all(dev["guest_addresses"])
    assert len(set(dev["guest_addresses"])) == 4  # each function on its own hot-pluggable slot
    attached = {str(h.source): h for h in await rig.hv.attached_hostdevs(rig.uuids["vm-a"])}
    assert set(attached) == set(dev["functions"])
    r = await rig.client.delete(f"/v1/leases/{body['id']}", headers=rig.auth("vm-a"))
    assert r.status == 200 and (await r.json())["state"] == "RELEASED"
    assert not set(dev["functions"]) & vfio_functions(rig)
    assert {rig.sysfs_driver(f) for f in dev["functions"]} == {"nvidia", "snd_hda_intel", "xhci_hcd", "nvidia-gpu"}


async def test_multifunction_layout_for_a_shut_off_vm(tmp_path: Path, aiohttp_client: Any) -> None:
    rig = await start_rig(make_rig(tmp_path, scenario="workstation", host={"guest_layout": "multifunction"},
                                   hv_kwargs={"refuse_nonzero_function_hotplug": True}), aiohttp_client)
    rig.hv.shutdown("vm-a")
    r = await rig.client.post("/v1/leases", json={"model": "2080 Ti"}, headers=rig.auth("vm-a"))
    body = await r.json()
    assert r.status == 201, body
    slots = {a.rsplit(":", 1)[1].split(".")[0] for a in body["devices"][0]["guest_addresses"]}
    assert len(slots) == 1  # one guest slot, functions together
    xml = await rig.hv.domain_xml(rig.uuids["vm-a"], live=False)
    assert "multifunction='on'" in xml or 'multifunction="on"' in xml


async def test_original_drivers_are_read_with_the_binding_write_and_a_failed_read_writes_nothing(
        rig: AgentRig, monkeypatch: pytest.MonkeyPatch) -> None:
    """The drivers a GPU had are read in the BINDING write's own worker hop: recorded with the lease, and when the
    read fails nothing is journaled, no GPU is claimed or moved, and the next lease goes through."""
    m = rig.runtime.manager
    body = await lease(rig, gpus=1)
    doc = rig.runtime.journal.get(body["id"])
    assert doc is not None and all(d.original_drivers == ("nvidia",) * len(d.functions) for d in doc.devices)
    await rig.client.delete(f"/v1/leases/{body['id']}", headers=rig.auth("vm-a"))

    def unreadable(gpu: Any) -> dict[str, str | None]:
        raise OSError(5, "Input/output error", f"/sys/bus/pci/devices/{gpu.address}/driver")

    monkeypatch.setattr(m.host, "current_drivers", unreadable)
    r = await rig.client.post("/v1/leases", json={"gpus": 1}, headers=rig.auth("vm-a"))
    assert r.status >= 500 and "Input/output error" not in await r.text()  # no internals in the answer
    assert rig.runtime.journal.live_leases() == []  # nothing journaled for it
    assert not m.claims and not m.leases and not vfio_functions(rig)
    monkeypatch.undo()
    assert (await lease(rig, gpus=1))["state"] == "ACTIVE"


async def test_release_rebinds_gives_back_and_ends_in_one_worker_hop(rig: AgentRig,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """After the confirmed detach, REBINDING, every give-back and RELEASED run in their order in one worker hop:
    the journal shows each step, every function is back on its host driver."""
    m = rig.runtime.manager
    body = await lease(rig, gpus=2)
    hops = count_hops(rig, monkeypatch)
    r = await rig.client.delete(f"/v1/leases/{body['id']}", headers=rig.auth("vm-a"))
    assert r.status == 200 and (await r.json())["state"] == "RELEASED"
    assert len(hops) == 2, hops  # the DETACHING write; then REBINDING, two give-backs and RELEASED
    steps = journal_steps(rig, body["id"])
    assert steps[-4:] == [("ACTIVE", "RELEASING"), ("RELEASING", "DETACHING"), ("DETACHING", "REBINDING"),
                          ("REBINDING", "RELEASED")]
    funcs = [f for d in body["devices"] for f in d["functions"]]
    assert all(rig.sysfs_driver(f) == "nvidia" for f in funcs) and not vfio_functions(rig)
    assert not m.claims and body["id"] not in m.leases


async def test_a_failed_give_back_quarantines_that_gpu_and_still_ends_the_lease(
        rig: AgentRig, monkeypatch: pytest.MonkeyPatch) -> None:
    m = rig.runtime.manager
    body = await lease(rig, gpus=2)
    stuck = body["devices"][0]["gpu_id"]
    give_back = m.host.give_back

    def flaky(gpu: Any, drivers: Any, on_step: Any = None) -> HostOpResult:
        return HostOpResult(False, error="write to driver/unbind hung") if gpu.id == stuck else give_back(
            gpu, drivers, on_step)

    monkeypatch.setattr(m.host, "give_back", flaky)
    r = await rig.client.delete(f"/v1/leases/{body['id']}", headers=rig.auth("vm-a"))
    assert r.status == 200 and (await r.json())["state"] == "RELEASED"
    assert stuck in m.quarantined and "did not return to its host driver" in m.quarantined[stuck]
    other = body["devices"][1]
    assert all(rig.sysfs_driver(f) == "nvidia" for f in other["functions"])
    last = [e for e in rig.runtime.journal.events(lease_id=body["id"]) if e.to_state][-1]
    assert (last.from_state, last.to_state) == ("REBINDING", "RELEASED") and stuck in (last.detail or "")


async def test_a_give_back_that_raises_leaves_memory_and_journal_agreeing_on_rebinding(
        rig: AgentRig, monkeypatch: pytest.MonkeyPatch) -> None:
    """The REBINDING write and the give-back share a hop: when the give-back raises, the step already journaled is
    published too (memory never lags the journal), and a restart's reconcile finishes the lease."""
    m = rig.runtime.manager
    body = await lease(rig, gpus=1)

    def broken(gpu: Any, drivers: Any, on_step: Any = None) -> HostOpResult:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(m.host, "give_back", broken)
    r = await rig.client.delete(f"/v1/leases/{body['id']}", headers=rig.auth("vm-a"))
    assert r.status >= 500
    assert m.leases[body["id"]].state is LeaseState.REBINDING
    assert [x.state for x in rig.runtime.journal.live_leases()] == [LeaseState.REBINDING]
    monkeypatch.undo()
    await Reconciler(m).run()
    assert body["id"] not in m.leases and not vfio_functions(rig)
    assert rig.runtime.journal.live_leases() == []


async def test_a_grant_binds_and_journals_attaching_in_one_worker_hop(rig: AgentRig,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Three worker hops per grant: BINDING (with the drivers read), the binds with the ATTACHING write, ACTIVE."""
    hops = count_hops(rig, monkeypatch)
    body = await lease(rig, gpus=2)
    assert len(hops) == 3, hops
    steps = journal_steps(rig, body["id"])
    assert steps == [(None, "REQUESTED"), ("REQUESTED", "BINDING"), ("BINDING", "ATTACHING"), ("ATTACHING", "ACTIVE")]
    assert {f for d in body["devices"] for f in d["functions"]} <= vfio_functions(rig)


async def test_a_bind_that_fails_midway_rolls_back_the_devices_already_bound(
        rig: AgentRig, monkeypatch: pytest.MonkeyPatch) -> None:
    m = rig.runtime.manager
    bind = m.host.bind
    calls: list[str] = []

    def second_fails(gpu: Any, on_step: Any = None) -> HostOpResult:
        calls.append(gpu.id)
        if len(calls) == 2:
            return HostOpResult(False, error="vfio-pci refused the device", needs_attention=True)
        return bind(gpu, on_step)

    monkeypatch.setattr(m.host, "bind", second_fails)
    r = await rig.client.post("/v1/leases", json={"gpus": 2}, headers=rig.auth("vm-a"))
    assert r.status >= 400
    first, second = calls
    assert not vfio_functions(rig)  # the first GPU went back to its host driver
    assert all(rig.sysfs_driver(str(f.address)) == "nvidia" for f in m.gpus[first].functions)
    assert second in m.quarantined and first not in m.quarantined
    assert not m.claims and rig.runtime.journal.live_leases() == []
    states = [e.to_state for e in rig.runtime.journal.events() if e.to_state]
    assert "ATTACHING" not in states and states[-1] == "FAILED"


async def test_a_full_queue_refuses_saying_so_and_a_grant_says_how_it_was_verified(tmp_path: Path,
                                                                                   aiohttp_client: Any) -> None:
    rig = await start_rig(make_rig(tmp_path, leases={"queue_max": 1}), aiohttp_client)
    held = await lease(rig, "vm-a", gpus=8)
    steps = rig.runtime.journal.events(lease_id=held["id"], kinds=["transition"])
    assert [(e.to_state, e.detail) for e in steps if e.to_state == "ACTIVE"] == [
        ("ACTIVE", "attached and verified in the domain XML")]
    await lease(rig, "vm-b", status=202, accept_deferred=True)
    full = await lease(rig, "vm-c", status=409, accept_deferred=True)
    assert full["error"] == {**full["error"], "field": "accept_deferred",
                             "message": "the lease queue is full; retry later"}, full


async def test_renew_names_an_unknown_field_and_events_filter_by_several_kinds(rig: AgentRig) -> None:
    body = await lease(rig, "vm-a")
    for sent, field in (({"bogus": 1}, "bogus"), ({"duration_s": 60, "zzz": 1, "aaa": 2}, "aaa")):
        r = await rig.client.post(f"/v1/leases/{body['id']}/renew", json=sent, headers=rig.auth("vm-a"))
        assert r.status == 400 and (await r.json())["error"]["field"] == field, (sent, await r.text())
    r = await rig.client.delete(f"/v1/leases/{body['id']}", headers=rig.auth("vm-a"))
    assert r.status == 200
    op = rig.auth("operator")
    every = (await (await rig.client.get(f"/v1/events?lease_id={body['id']}", headers=op)).json())["events"]
    assert every and {e["kind"] for e in every} == {"transition"}
    got = (await (await rig.client.get(f"/v1/events?lease_id={body['id']}&kind=repair,transition",
                                       headers=op)).json())["events"]
    assert got == every  # a list of kinds: any of them
    # a write that keeps the state (a renewal) is an "update" event, told apart from the transitions
    other = await lease(rig, "vm-b")
    r = await rig.client.post(f"/v1/leases/{other['id']}/renew", json={"duration_s": 600}, headers=rig.auth("vm-b"))
    assert r.status == 200, await r.text()
    updates = (await (await rig.client.get(f"/v1/events?lease_id={other['id']}&kind=update",
                                           headers=op)).json())["events"]
    assert [(e["from_state"], e["to_state"]) for e in updates] == [("ACTIVE", "ACTIVE")], updates
