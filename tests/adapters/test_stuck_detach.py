"""A detach the guest never acknowledges, as the operator sees it: the GPU's state holds still at detach-pending
through every retry (it used to flap to "leased" and back with each one), the retries read as one event with a
count, and the lease and GPU pages carry one banner saying how long it has been stuck and what to do."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from hostagent.domain.inventory import GpuState
from hostagent.domain.lease import LeaseState
from tests.support.agent import AgentRig, make_rig, start_rig

CSRF = re.compile(r'name="csrf" value="([^"]+)"')


@pytest.fixture
async def rig(tmp_path: Path, aiohttp_client: Any) -> AgentRig:
    r = await start_rig(make_rig(tmp_path, libvirt={"detach_retries": 3}), aiohttp_client)
    r.hv.set_refuse_detach("vm-a")
    page = await (await r.client.get("/ui/login")).text()
    csrf = CSRF.search(page).group(1)  # type: ignore[union-attr]
    resp = await r.client.post("/ui/login", data={"token": r.operator, "csrf": csrf}, allow_redirects=False)
    assert resp.status == 303
    return r


async def test_a_stuck_detach_holds_still_reads_as_one_event_and_shows_one_banner(rig: AgentRig) -> None:
    m = rig.runtime.manager
    r = await rig.client.post("/v1/leases", json={"gpus": 1}, headers=rig.auth("vm-a"))
    body = await r.json()
    gid, lid = body["devices"][0]["gpu_id"], body["id"]
    r = await rig.client.delete(f"/v1/leases/{lid}", headers=rig.auth("vm-a"))
    assert r.status == 202 and (await r.json())["state"] == "DETACH_PENDING"
    seen: list[GpuState] = []
    m.listeners.append(lambda _lease, _detail: seen.append(m.gpu_state(gid)))
    for _ in range(3):
        await m.retry_pending()
    assert seen and set(seen) == {GpuState.DETACH_PENDING}, f"the GPU's state flapped: {seen}"
    assert m.leases[lid].state is LeaseState.DETACH_PENDING and m.leases[lid].detach_attempts == 4
    assert rig.sysfs_driver(body["devices"][0]["functions"][0]) == "vfio-pci"

    for url in (f"/ui/leases/{lid}", f"/ui/gpus/{gid}"):
        page = await (await rig.client.get(url)).text()
        assert page.count('class="flash warn stuck-banner"') == 1, url
        banner = page[page.index("stuck-banner"):]
        banner = banner[:banner.index("</div>")]
        assert re.search(r"Detach stuck for <span class=\"stuck-for\">[0-9]", banner), banner
        assert "4 attempts" in banner and "automatic retries stopped, operator alerted" in banner, banner
        assert "shut the VM" in banner and "Release again" in banner
        assert page.count("detach retried 3 times over") == 1, url  # three retries, one line
        assert "detach retry 1:" not in page

    rig.hv.acknowledge_detaches("vm-a")  # the guest lets go at last: the banner goes with the lease
    await rig.client.delete(f"/v1/leases/{lid}", headers=rig.auth("operator"))
    assert lid not in m.leases and m.gpu_state(gid) is GpuState.FREE
    page = await (await rig.client.get(f"/ui/leases/{lid}")).text()
    assert "stuck-banner" not in page


async def test_retries_left_are_counted_down(rig: AgentRig) -> None:
    m = rig.runtime.manager
    body = await (await rig.client.post("/v1/leases", json={"gpus": 1}, headers=rig.auth("vm-a"))).json()
    await rig.client.delete(f"/v1/leases/{body['id']}", headers=rig.auth("vm-a"))
    page = await (await rig.client.get(f"/ui/leases/{body['id']}")).text()
    assert "1 attempt;" in page and "tries again by itself 3 more times" in page
    await m.retry_pending()
    page = await (await rig.client.get(f"/ui/leases/{body['id']}")).text()
    assert "2 attempts;" in page and "tries again by itself 2 more times" in page
    assert "detach retry 1: still not acknowledged" in page  # a single retry is shown as itself
