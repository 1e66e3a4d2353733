"""The reaper over the simulated hypervisor and the fake kernel, with a controllable clock."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

from hostagent.domain.lease import LeaseState
from hostagent.domain.reclaim import Action
from hostagent.host.fakesysfs import record_interrupts
from tests.support.agent import AgentRig, Clock, make_rig, start_rig

S = LeaseState
RECLAIM = {"enabled": True, "check_interval_s": 60.0, "grace_s": 120.0, "min_lease_age_s": 0.0,
           "notice_window_s": 30.0, "idle_util_pct": 5.0}


@pytest.fixture
async def rig(tmp_path: Path, aiohttp_client: Any) -> AgentRig:
    clock = Clock(time.time())
    r = make_rig(tmp_path, clock=clock, reclaim=dict(RECLAIM, check_interval_s=3600.0))
    r.extra["clock"] = clock
    r.runtime.use_store = False  # samples carry the test clock's times, which the store would call future
    # the scheduler's own tick is far away (1 h); the test drives the checks with the clock
    return await start_rig(r, aiohttp_client)


async def lease(rig: AgentRig, vm: str = "vm-a") -> dict[str, Any]:
    r = await rig.client.post("/v1/leases", json={"gpus": 1}, headers=rig.auth(vm))
    assert r.status == 201
    return await r.json()


async def check(rig: AgentRig, lease_id: str, advance: float, util: float | None = None) -> Action | None:
    """Advance the clock; with `util`, the guest reported 3 samples of it during that time; then one check."""
    clock: Clock = rig.extra["clock"]
    clock.advance(advance)
    if util is not None:
        lz = rig.runtime.manager.leases[lease_id]
        gpu = lz.devices[0].gpu_id
        await rig.runtime.accept_samples(lz, [{"ts": clock.now - i * advance / 4, "gpu_id": gpu, "util_pct": util,
                                               "mem_used_bytes": 0, "work_rate": None} for i in range(3)])
    irq = rig.runtime.host.vfio_interrupts()
    return await rig.runtime.reaper.check(lease_id, clock.now, irq)


async def test_busy_lease_is_never_touched(rig: AgentRig) -> None:
    body = await lease(rig)
    for _ in range(5):
        assert await check(rig, body["id"], 200, util=85.0) in (Action.NONE, Action.CLEAR)
    current = rig.runtime.manager.leases[body["id"]]
    assert current.state is S.ACTIVE and current.strike_at is None and current.notice is None


async def test_idle_lease_is_warned_then_reclaimed_and_given_back(rig: AgentRig) -> None:
    body = await lease(rig)
    gpu, fn = body["devices"][0]["gpu_id"], body["devices"][0]["functions"][0]
    h = rig.auth("vm-a")
    assert await check(rig, body["id"], 61, util=1.0) is Action.STRIKE_ONE
    view = await (await rig.client.get(f"/v1/leases/{body['id']}", headers=h)).json()
    assert view["warnings"][0]["code"] == "idle_strike_one" and view["reclaim"]["recheck_at"]
    hb = await rig.client.post(f"/v1/leases/{body['id']}/heartbeat", json={"samples": []}, headers=h)
    assert (await hb.json())["warnings"][0]["code"] == "idle_strike_one"  # the guest hears it in the reply
    assert await check(rig, body["id"], 60, util=0.0) is Action.NONE  # grace not over: no early reclaim
    assert await check(rig, body["id"], 61, util=0.0) is Action.RECLAIM  # strike two: the notice
    view = await (await rig.client.get(f"/v1/leases/{body['id']}", headers=h)).json()
    assert view["state"] == "ACTIVE" and view["reclaim"]["notice"] == "reclaim"
    (notice,) = [w for w in view["warnings"] if w["code"] == "reclaim_notice"]
    assert notice == {"code": "reclaim_notice", "reason": "idle", "deadline": view["reclaim"]["notice_deadline"],
                      "message": "GPU is being reclaimed for idleness; release it now"}, notice
    assert await check(rig, body["id"], 31) is Action.RECLAIM  # the guest did not release in the window
    done = await (await rig.client.get(f"/v1/leases/{body['id']}", headers=h)).json()
    assert done["state"] == "RELEASED" and done["end_reason"] == "reclaimed: idle"
    assert rig.sysfs_driver(fn) == "nvidia"
    gpu_view = await (await rig.client.get(f"/v1/gpus/{gpu}", headers=rig.auth("operator"))).json()
    assert gpu_view["state"] == "free"
    kinds = [e["kind"] for e in (await (await rig.client.get(f"/v1/events?lease_id={body['id']}",
                                                               headers=rig.auth("operator"))).json())["events"]]
    assert {"strike-one", "strike-two", "reclaim", "reclaim-outcome"} <= set(kinds)


async def test_activity_between_strikes_clears(rig: AgentRig) -> None:
    body = await lease(rig)
    gpu = body["devices"][0]["gpu_id"]
    assert await check(rig, body["id"], 61, util=0.0) is Action.STRIKE_ONE
    # a busy heartbeat between the strikes clears strike one at once
    r = await rig.client.post(f"/v1/leases/{body['id']}/heartbeat", headers=rig.auth("vm-a"), json={
        "samples": [{"ts": time.time(), "gpu": gpu, "util_pct": 70, "mem_used_bytes": 0}]})
    assert r.status == 200
    assert rig.runtime.manager.leases[body["id"]].strike_at is None


async def test_host_interrupts_count_as_activity_without_heartbeats(rig: AgentRig) -> None:
    body = await lease(rig)
    fn = body["devices"][0]["functions"][0]
    assert await check(rig, body["id"], 61) is Action.NONE  # first reading: no baseline, not judged idle
    record_interrupts(rig.settings.proc_root, fn, 1000)
    assert await check(rig, body["id"], 61) is Action.NONE  # rising vfio interrupts: busy
    verdict = rig.runtime.reaper.last_verdicts[body["id"]]
    assert verdict[1] == "busy" and "vfio interrupts" in verdict[2]
    assert await check(rig, body["id"], 61) is Action.STRIKE_ONE  # quiet host, no heartbeats: idle, said so
    assert "host interrupts alone" in rig.runtime.reaper.last_verdicts[body["id"]][2]


async def test_refused_detach_leaves_detach_pending(rig: AgentRig) -> None:
    body = await lease(rig)
    fn = body["devices"][0]["functions"][0]
    rig.hv.set_refuse_detach("vm-a")
    assert await check(rig, body["id"], 61, util=0.0) is Action.STRIKE_ONE
    assert await check(rig, body["id"], 121, util=0.0) is Action.RECLAIM
    assert await check(rig, body["id"], 31) is Action.RECLAIM
    lz = rig.runtime.manager.leases[body["id"]]
    assert lz.state is S.DETACH_PENDING and rig.sysfs_driver(fn) == "vfio-pci"  # never rebound under the guest
    status = await (await rig.client.get("/v1/reaper", headers=rig.auth("operator"))).json()
    assert [x["state"] for x in status["leases"]] == ["DETACH_PENDING"]


async def test_operator_pause_exempts_a_lease(rig: AgentRig) -> None:
    body = await lease(rig)
    r = await rig.client.post(f"/v1/leases/{body['id']}/reclaim", json={"paused": True}, headers=rig.auth("operator"))
    assert r.status == 200 and (await r.json())["reclaim"]["paused"] is True
    for _ in range(3):
        assert await check(rig, body["id"], 200, util=0.0) is Action.NONE
    assert rig.runtime.manager.leases[body["id"]].state is S.ACTIVE


async def test_reaper_status_cli(rig: AgentRig, capsys: pytest.CaptureFixture[str]) -> None:
    from hostagent.cli.parser import main

    body = await lease(rig)
    await check(rig, body["id"], 61, util=0.0)
    url = str(rig.client.make_url("")).rstrip("/")
    code = await asyncio.to_thread(main, ["reaper", "status", "--url", url, "--token", rig.operator])
    out = capsys.readouterr().out
    assert code == 0 and body["id"] in out and "one" in out and "guest: all 3 samples" in out


async def test_a_busy_guest_on_a_quiet_host_is_flagged_with_both_figures(rig: AgentRig) -> None:
    """reclaim.guest_busy_host_idle = flag (the default): the guest's word keeps the lease; the operator sees the
    dispute in the reaper's status, the journal (once) and the metrics, until the host sees activity again."""
    body = await lease(rig)
    fn, lid = body["devices"][0]["functions"][0], body["id"]
    record_interrupts(rig.settings.proc_root, fn, 5)
    assert await check(rig, lid, 61, util=90.0) is Action.NONE  # the first reading sets the host's baseline
    assert lid not in rig.runtime.reaper.disputed
    for _ in range(3):
        assert await check(rig, lid, 61, util=90.0) is Action.NONE  # busy guest, flat host: kept, flagged
    op = rig.auth("operator")
    status = {x["lease_id"]: x for x in (await (await rig.client.get("/v1/reaper", headers=op)).json())["leases"]}
    assert "3 of 3 samples above 5 %" in status[lid]["disputed"] and "0 vfio interrupts" in status[lid]["disputed"]
    events = (await (await rig.client.get(f"/v1/events?lease_id={lid}", headers=op)).json())["events"]
    assert [e["kind"] for e in events].count("guest-host-disagree") == 1
    assert "hostagent_leases_disputed 1.0" in await (await rig.client.get("/metrics", headers=op)).text()
    assert rig.runtime.manager.leases[lid].strike_at is None
    record_interrupts(rig.settings.proc_root, fn, 500)
    assert await check(rig, lid, 61, util=90.0) is Action.NONE
    assert lid not in rig.runtime.reaper.disputed, "the host saw activity: no dispute any more"


async def test_a_policy_that_believes_the_host_reclaims_a_busy_guest_on_a_quiet_host(
        tmp_path: Path, aiohttp_client: Any) -> None:
    clock = Clock(time.time())
    r = make_rig(tmp_path, clock=clock, reclaim=dict(RECLAIM, check_interval_s=3600.0, guest_busy_host_idle="reclaim"))
    r.extra["clock"] = clock
    r.runtime.use_store = False
    rig = await start_rig(r, aiohttp_client)
    body = await lease(rig)
    fn, gpu, lid = body["devices"][0]["functions"][0], body["devices"][0]["gpu_id"], body["id"]
    record_interrupts(rig.settings.proc_root, fn, 5)
    assert await check(rig, lid, 61, util=90.0) is Action.NONE
    assert await check(rig, lid, 61, util=90.0) is Action.STRIKE_ONE
    assert "guest_busy_host_idle = reclaim" in rig.runtime.reaper.last_verdicts[lid][2]
    r2 = await rig.client.post(f"/v1/leases/{lid}/heartbeat", headers=rig.auth("vm-a"), json={
        "samples": [{"ts": time.time(), "gpu": gpu, "util_pct": 99, "mem_used_bytes": 0}]})
    assert r2.status == 200 and rig.runtime.manager.leases[lid].strike_at is not None, "the guest's word alone"
    assert await check(rig, lid, 121, util=90.0) is Action.RECLAIM


# -- the reaper's own schedule ----------------------------------------------------------------------------------
# The tests above call Reaper.check() themselves; the one below never does. The agent runs as `hostagent serve`
# composes it, with short intervals set through [reclaim], and the reaper's scheduled job must find the idle
# lease by itself while the test only moves the clock: a reaper that never schedules its check fails here, not
# only in the slow crash matrix.
SCHEDULED = dict(RECLAIM, check_interval_s=1.0, grace_s=1.0, notice_window_s=1.0)  # tick: every 0.25 s


async def advance_until(rig: AgentRig, cond: Any, what: str, *, step: float = 0.5, timeout: float = 15.0) -> None:
    """Move the clock on by `step` every 0.05 s (real time) until `cond()` holds; fail after `timeout` s."""
    clock: Clock = rig.extra["clock"]
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"{what}: not reached within {timeout:g} s; the reaper never checked?"
        clock.advance(step)
        await asyncio.sleep(0.05)


async def test_the_running_agent_reclaims_an_idle_lease_on_its_own_schedule(tmp_path: Path,
                                                                            aiohttp_client: Any) -> None:
    clock = Clock(time.time())
    r = make_rig(tmp_path, clock=clock, reclaim=SCHEDULED)
    r.extra["clock"] = clock
    r.runtime.use_store = False
    rig = await start_rig(r, aiohttp_client)
    reaper, m = rig.runtime.reaper, rig.runtime.manager
    assert (reaper.settings.check_interval_s, reaper.settings.grace_s, reaper.settings.tick_s) == (1.0, 1.0, 0.25)
    body = await lease(rig)
    lid, gpu, fn = body["id"], body["devices"][0]["gpu_id"], body["devices"][0]["functions"][0]
    h = rig.auth("vm-a")

    # no heartbeats and flat vfio interrupts: the first check reads the host's baseline, the next one strikes
    await advance_until(rig, lambda: m.leases[lid].strike_at is not None, "strike one")
    assert "host interrupts alone" in reaper.last_verdicts[lid][2]
    view = await (await rig.client.get(f"/v1/leases/{lid}", headers=h)).json()
    assert view["state"] == "ACTIVE" and view["warnings"][0]["code"] == "idle_strike_one"

    await advance_until(rig, lambda: m.leases[lid].notice == "reclaim", "strike two (the reclaim notice)")
    view = await (await rig.client.get(f"/v1/leases/{lid}", headers=h)).json()
    assert view["state"] == "ACTIVE" and any(w["code"] == "reclaim_notice" for w in view["warnings"])

    await advance_until(rig, lambda: lid not in m.leases or m.leases[lid].state.terminal, "the reclaim")
    done = await (await rig.client.get(f"/v1/leases/{lid}", headers=h)).json()
    assert done["state"] == "RELEASED" and done["end_reason"] == "reclaimed: idle"
    assert rig.sysfs_driver(fn) == "nvidia"
    gpu_view = await (await rig.client.get(f"/v1/gpus/{gpu}", headers=rig.auth("operator"))).json()
    assert gpu_view["state"] == "free"
    events = (await (await rig.client.get(f"/v1/events?lease_id={lid}", headers=rig.auth("operator"))).json())["events"]
    kinds = [e["kind"] for e in events]
    assert {"strike-one", "strike-two", "reclaim", "reclaim-outcome"} <= set(kinds), kinds
    assert all(e["actor"] == "reaper" for e in events if e["kind"] in ("strike-one", "strike-two", "reclaim"))


async def test_the_agent_detects_posted_interrupts_and_stops_trusting_flat_counters(tmp_path: Path,
                                                                                    aiohttp_client: Any) -> None:
    """reclaim.host_signal = auto on a host whose IOMMU posts interrupts (VT-d PI, with APICv): GET /v1/reaper says
    the counters are not trusted and why, and a lease without heartbeats whose counters stay flat is never struck."""
    from hostagent.host.fakesysfs import build_tree
    from hostagent.runtime import build_runtime, make_app
    from hostagent.virt.sim import SimulatedHypervisor
    from hostagent.web.auth import hash_token, new_token
    from tests.support.agent import rig_settings

    tree = build_tree(tmp_path / "host", "dgx8")
    (tree.sys_root / "class/iommu/dmar0/intel-iommu/cap").write_text("8d2078c106f0466\n")  # bit 59: PI
    hv = SimulatedHypervisor(path=tmp_path / "hv.json")
    hv.define("vm-a", running=True)
    hv.save()
    operator = new_token("op")
    settings = rig_settings(tmp_path, tree, tmp_path / "hv.json", operator,
                            reclaim={"enabled": True, "min_lease_age_s": 0.0})
    clock = Clock()
    runtime = build_runtime(settings, hypervisor=hv, clock=clock)
    token = new_token("vm")
    (dom,) = hv.domains_sync()
    runtime.journal.add_token(hash_token(token), role="guest", domain_uuid=dom.uuid, domain_name=dom.name)
    client = await aiohttp_client(make_app(runtime))
    op = {"Authorization": f"Bearer {operator}"}
    status = await (await client.get("/v1/reaper", headers=op)).json()
    assert status["host_signal"]["trusted"] is False and "dmar0" in status["host_signal"]["why_not"]
    body = await (await client.post("/v1/leases", json={"gpus": 1},
                                    headers={"Authorization": f"Bearer {token}"})).json()
    reaper = runtime.reaper
    for _ in range(3):  # flat counters, no heartbeats, hours apart
        clock.advance(2 * 3600)
        await reaper.check(body["id"], clock(), {a: 5 for a in body["devices"][0]["functions"]})
    row = next(x for x in reaper.status() if x["lease_id"] == body["id"])
    assert row["strike"] == "none" and "not trusted" in row["last_verdict"]["reason"], row


async def test_a_busy_heartbeat_with_no_strike_to_clear_changes_nothing(rig: AgentRig) -> None:
    body = await lease(rig)
    before = rig.runtime.journal.events(lease_id=body["id"])
    await rig.runtime.reaper.activity_seen(body["id"], "busy heartbeat")
    assert rig.runtime.journal.events(lease_id=body["id"]) == before  # no 'strike cleared' for a strike never made
