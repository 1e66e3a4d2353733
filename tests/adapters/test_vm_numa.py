"""Placement knows where the VM lives: its NUMA node read from the domain XML at each request (the simulated
hypervisor binds a domain's memory as `virsh numatune` does), weighed against each GPU's node, and said in the
lease's reasons; an unpinned VM is said to be unknown. Driven through the API on the dgx8 host (two nodes, four
GPUs on each)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.support.agent import AgentRig, make_rig, start_rig


async def _lease(rig: AgentRig, vm: str, status: int = 201, **body: Any) -> dict[str, Any]:
    r = await rig.client.post("/v1/leases", json=body, headers=rig.auth(vm))
    data = await r.json()
    assert r.status == status, data
    return data


def nodes_of(rig: AgentRig, body: dict[str, Any]) -> set[int | None]:
    return {rig.runtime.manager.gpus[d["gpu_id"]].numa_node for d in body["devices"]}


async def test_a_pinned_vm_gets_gpus_on_its_own_node(tmp_path: Path, aiohttp_client: Any) -> None:
    rig = await start_rig(make_rig(tmp_path), aiohttp_client)
    assert sorted(rig.runtime.manager.numa_cells) == [0, 1]
    rig.hv.set_numa_node("vm-a", 1)
    first = await _lease(rig, "vm-a", gpus=2, numa_policy="required")
    assert nodes_of(rig, first) == {1}
    assert "VM on NUMA node 1 (its memory on node 1: numatune strict nodeset=1)" in first["reasons"], first
    # Pinning changed at run time is what the next request sees.
    rig.hv.set_numa_node("vm-a", 0)
    second = await _lease(rig, "vm-a", gpus=1, numa_policy="required")
    assert nodes_of(rig, second) == {0} and any("VM on NUMA node 0" in r for r in second["reasons"])


async def test_required_refuses_the_other_node_and_preferred_says_where_it_went(tmp_path: Path,
                                                                                aiohttp_client: Any) -> None:
    rig = await start_rig(make_rig(tmp_path), aiohttp_client)
    rig.hv.set_numa_node("vm-b", 1)
    rig.hv.set_numa_node("vm-a", 1)
    await _lease(rig, "vm-b", gpus=4, numa_policy="required")  # node 1 is full now
    r = await rig.client.post("/v1/leases", json={"gpus": 1, "numa_policy": "required"}, headers=rig.auth("vm-a"))
    body = await r.json()
    assert r.status == 409 and body["error"]["field"] == "numa_policy", body
    assert body["error"]["message"].startswith("0 free eligible GPU(s) on the VM's NUMA node 1, 1 needed"), body
    elsewhere = await _lease(rig, "vm-a", gpus=1, numa_policy="preferred")
    assert nodes_of(rig, elsewhere) == {0}
    assert any("VM on NUMA node 1" in x for x in elsewhere["reasons"]), elsewhere["reasons"]


async def test_an_unpinned_vm_is_unknown_and_placement_says_so(tmp_path: Path, aiohttp_client: Any) -> None:
    rig = await start_rig(make_rig(tmp_path), aiohttp_client)
    body = await _lease(rig, "vm-c", gpus=1, numa_policy="required")
    assert "VM's NUMA node unknown (not pinned: no numatune nodeset, no vCPU pinning)" in body["reasons"], body
    assert rig.runtime.manager.vm_numa[rig.uuids["vm-c"]].node is None
