"""The inventory tells the truth (#25): GET /v1/gpus, a GPU's page and the dashboard show each function's driver
as sysfs has it now (vfio-pci while leased, back on its host driver after, none when a give-back left it bare), not
the driver discovery found at start."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from hostagent import runtime as runtime_module
from tests.adapters.test_dashboard_auth import login
from tests.support.agent import AgentRig, make_rig, start_rig


async def drivers_listed(rig: AgentRig, gpu_id: str) -> set[str | None]:
    gpus = (await (await rig.client.get("/v1/gpus", headers=rig.auth("operator"))).json())["gpus"]
    return {f["driver"] for g in gpus if g["id"] == gpu_id for f in g["functions"]}


async def test_listed_drivers_follow_leases_and_changes_made_outside_the_agent(
        tmp_path: Path, aiohttp_client: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    rig = await start_rig(make_rig(tmp_path), aiohttp_client)
    r = await rig.client.post("/v1/leases", json={"gpus": 1}, headers=rig.auth("vm-a"))
    lease = await r.json()
    gpu_id = lease["devices"][0]["gpu_id"]
    address = lease["devices"][0]["functions"][0]
    assert await drivers_listed(rig, gpu_id) == {"vfio-pci"}
    detail = await (await rig.client.get(f"/v1/gpus/{gpu_id}", headers=rig.auth("operator"))).json()
    assert {f["driver"] for f in detail["functions"]} == {"vfio-pci"}
    await login(rig, rig.operator)
    page = await (await rig.client.get(f"/ui/gpus/{gpu_id}")).text()
    assert "vfio-pci" in page and "nvidia" not in page.split("functions", 1)[-1].split("</table>", 1)[0]
    await rig.client.delete(f"/v1/leases/{lease['id']}", headers=rig.auth("vm-a"))
    assert await drivers_listed(rig, gpu_id) == {"nvidia"}

    # someone unbinds a free GPU by hand: the listing shows it once its reading is DRIVERS_MAX_AGE_S old
    other = next(g for g in rig.runtime.manager.gpus if g != gpu_id)
    other_addr = str(rig.runtime.manager.gpus[other].address)
    rig.runtime.host.sysfs.write("bus/pci/drivers/nvidia/unbind", other_addr)
    assert rig.sysfs_driver(other_addr) is None
    monkeypatch.setattr(runtime_module, "DRIVERS_MAX_AGE_S", 0.0)
    assert await drivers_listed(rig, other) == {None}
    assert address != other_addr
