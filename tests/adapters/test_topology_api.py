"""Topology-aware multi-GPU leases through the API on the fake dgx8 host (8 GPUs, 4 switches, 2 NUMA nodes).

Every expected set below is computed by hand from the tree: switches A,B on node 0 (root bus 00), C,D on node 1
(root bus 80); distance 1 inside a switch, 2 across switches of one root complex, 4 across sockets.

The rig is the production wiring (``make_app`` over ``build_runtime``): the lease driver places through the
runtime's ``Placer`` (filters, scores, exploration), which hands the set choice to the topology placer that
``make_app`` installs. Fakes only at the edges: the fake kernel's sysfs tree and the simulated hypervisor.
Exploration is turned off through its setting (``placement.explore_epsilon = 0``): it would swap a one-GPU
answer for a near-best one at random, and the answers here are computed by hand.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from hostagent.domain.errors import Conflict
from hostagent.domain.lease import LeaseRequest
from hostagent.services.placement import Placer
from hostagent.services.topology import TopologyPlacer
from tests.support.agent import AgentRig, make_rig, start_rig
from tests.support.topology import NODE0, NODE1, SWITCH_A, SWITCH_B, SWITCH_C

ADDR = {g: f"0000:{g[9:11]}:00.0" for g in NODE0 + NODE1}


NO_EXPLORATION = {"explore_epsilon": 0.0, "cold_explore_epsilon": 0.0}


async def production_rig(tmp_path: Path, aiohttp_client: Any, **kw: Any) -> AgentRig:
    """The agent as `hostagent serve` composes it, over dgx8; fails if the lease driver places any other way."""
    rig = await start_rig(make_rig(tmp_path, placement=NO_EXPLORATION, **kw), aiohttp_client)
    place = rig.runtime.manager.place
    assert place is rig.runtime.placer and type(place) is Placer, place
    assert isinstance(place.topology_place, TopologyPlacer), "make_app wires the topology placer into the Placer"
    return rig


@pytest.fixture
async def rig(tmp_path: Path, aiohttp_client: Any) -> AgentRig:
    return await production_rig(tmp_path, aiohttp_client)


async def lease(rig: AgentRig, who: str, status: int = 201, **body: Any) -> dict[str, Any]:
    r = await rig.client.post("/v1/leases", json=body, headers=rig.auth(who))
    data = await r.json()
    assert r.status == status, data
    return data


def gpus_of(body: dict[str, Any]) -> tuple[str, ...]:
    return tuple(sorted(d["gpu_id"] for d in body["devices"]))


async def test_sets_match_hand_computed_answers(rig: AgentRig) -> None:
    a = await lease(rig, "vm-a", gpus=2)
    assert gpus_of(a) == SWITCH_A and a["distance"] == 1  # every switch intact: the first one
    assert any("pcie-switch" in r for r in a["reasons"])
    # one GPU: every free switch is intact (loss 3 each); node 0 has 2 free, node 1 has 4: breaking node 0 costs less
    b = await lease(rig, "vm-b", gpus=1)
    assert gpus_of(b) == (SWITCH_B[0],) and b["distance"] is None
    # two GPUs: only C and D still hold a pair; equal losses, address order
    c = await lease(rig, "vm-c", gpus=2)
    assert gpus_of(c) == SWITCH_C and c["distance"] == 1
    # one GPU again: B's last GPU sits in a partly used switch, D is intact: take B's
    d = await lease(rig, "vm-d", gpus=1)
    assert gpus_of(d) == (SWITCH_B[1],)


async def test_four_and_eight_gpu_sets(rig: AgentRig) -> None:
    four = await lease(rig, "vm-a", gpus=4)
    assert gpus_of(four) == NODE0 and four["distance"] == 2
    other = await lease(rig, "vm-b", gpus=4, numa_policy="required")
    assert gpus_of(other) == NODE1 and other["distance"] == 2
    for body in (four, other):
        r = await rig.client.delete(f"/v1/leases/{body['id']}", headers=rig.auth("vm-a" if body is four else "vm-b"))
        assert r.status == 200
    eight = await lease(rig, "vm-c", gpus=8)
    assert gpus_of(eight) == tuple(sorted(NODE0 + NODE1)) and eight["distance"] == 4


async def test_topology_view_reports_free_blocks(rig: AgentRig) -> None:
    body = await (await rig.client.get("/v1/topology", headers=rig.auth("operator"))).json()
    assert [g["id"] for g in body["gpus"]] == list(NODE0 + NODE1)
    assert body["free"]["count"] == 8 and body["free"]["capacity"] == 1.0
    assert body["free"]["best_sets"]["2"] == {"gpus": list(SWITCH_A), "distance": 1, "distance_name": "pcie-switch"}
    tree = body["tree"]
    assert tree["kind"] == "host" and [n["id"] for n in tree["children"]] == ["node0", "node1"]
    assert [len(n["children"][0]["children"]) for n in tree["children"]] == [2, 2]  # two switches per root complex
    assert body["distances"][SWITCH_A[0]][SWITCH_A[1]] == 1
    assert body["distances"][SWITCH_A[0]][SWITCH_B[0]] == 2
    assert body["distances"][SWITCH_A[0]][SWITCH_C[0]] == 4

    await lease(rig, "vm-a", gpus=4)
    body = await (await rig.client.get("/v1/topology", headers=rig.auth("operator"))).json()
    assert body["free"]["count"] == 4 and 0 < body["free"]["capacity"] < 1
    assert body["free"]["best_sets"]["4"]["gpus"] == list(NODE1)
    assert body["free"]["best_sets"]["8"] is None
    node0 = body["tree"]["children"][0]
    assert node0["free"] == 0 and not node0["intact"]
    assert {g["id"]: g["state"] for g in body["gpus"]}[SWITCH_A[0]] == "leased"


async def test_failed_attach_of_third_device_rolls_back_all_four(tmp_path: Path, aiohttp_client: Any) -> None:
    rig = await production_rig(tmp_path, aiohttp_client, hv_kwargs={"fail_attach_after": 2})
    r = await rig.client.post("/v1/leases", json={"gpus": 4}, headers=rig.auth("vm-a"))
    body = await r.json()
    assert r.status == 500 and body["error"]["code"] == "lease_failed"
    lease_body = body["lease"]
    assert lease_body["state"] == "FAILED" and gpus_of(lease_body) == NODE0  # the set chosen: node 0
    assert "simulated failure attaching 0000:07:00.0" in lease_body["error"]  # the third of the four
    # every function of all four GPUs is back on its host driver in the fake tree; nothing left on vfio-pci
    for gpu in NODE0:
        assert rig.sysfs_driver(ADDR[gpu]) == "nvidia"
    vfio = rig.tree.sys_root / "bus/pci/drivers/vfio-pci"
    assert not vfio.exists() or not [p for p in vfio.iterdir() if p.is_symlink() and p.name.startswith("0000:")]
    assert await rig.hv.attached_hostdevs(rig.uuids["vm-a"]) == ()
    gpus = {g["id"]: g["state"] for g in (await (await rig.client.get("/v1/gpus", headers=rig.auth("operator"))).json())["gpus"]}
    assert all(gpus[g] == "free" for g in NODE0)


async def test_required_policy_refuses_when_no_node_has_room(rig: AgentRig) -> None:
    """Placer level (the lease driver's own PlaceFn, the production Placer): with 3 free on each node a 4-GPU
    request under `required` has no set; `preferred` spans."""
    await lease(rig, "vm-a", gpus=1)  # 03
    await lease(rig, "vm-b", gpus=1, numa_policy="required")  # packing: 04 (switch A partly used)
    manager = rig.runtime.manager
    placer = manager.place
    free = [manager.gpus[g] for g in NODE0[2:] + NODE1[1:]]  # 07 08 | 84 87 88 : node 0 has 2, node 1 has 3
    with pytest.raises(Conflict) as err:
        placer(LeaseRequest(gpus=4, numa_policy="required"), free, 4, rig.uuids["vm-c"])
    assert err.value.field == "numa_policy"
    spread = placer(LeaseRequest(gpus=4, numa_policy="preferred"), free, 4, rig.uuids["vm-c"])
    assert spread.distance == 4 and len(spread.gpu_ids) == 4
    same_node = placer(LeaseRequest(gpus=3, numa_policy="required"), free, 3, rig.uuids["vm-c"])
    assert set(same_node.gpu_ids) == set(NODE1[1:]) and same_node.distance == 2
