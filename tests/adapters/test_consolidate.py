"""Consolidation (issue #22): a multi-GPU request that waits only because the free GPUs are scattered gets the
fewest make-before-break moves that free a whole block, proposed on the queued lease, and performed with
`leases.consolidate = true`, only for leases whose guest said it can move. dgx8 (two NUMA nodes of four GPUs) over
the fake kernel and the simulated hypervisor, through the API."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from hostagent.domain.lease import LeaseState
from hostagent.host.fakekernel import FakeKernel
from hostagent.services import consolidate
from tests.support.agent import AgentRig, Clock, make_rig, operator_login, start_rig

S = LeaseState


async def call(rig: AgentRig, who: str, method: str, path: str, body: Any = None) -> tuple[int, dict[str, Any]]:
    r = await rig.client.request(method, path, json=body, headers=rig.auth(who))
    return r.status, await r.json()


def nodes(rig: AgentRig) -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    for g in sorted(rig.runtime.manager.gpus.values(), key=lambda g: str(g.address)):
        out.setdefault(g.numa_node, []).append(g.id)
    return out


async def scatter(rig: AgentRig, free: dict[int, int] | None = None) -> dict[str, str]:
    """Eight one-GPU leases, then the first `free[node]` (2) of each node released: each node keeps leases on its
    last GPUs. Returns each kept lease's id by its GPU."""
    by_gpu: dict[str, dict[str, Any]] = {}
    for i in range(8):
        status, lease = await call(rig, "vm-a" if i % 2 else "vm-b", "POST", "/v1/leases",
                                   {"gpus": 1, "task_type": "training", "movable": True})
        assert status == 201, lease
        by_gpu[lease["devices"][0]["gpu_id"]] = lease
    assert len(by_gpu) == 8
    kept = {}
    for node, ids in nodes(rig).items():
        n = (free or {}).get(node, 2)
        for gid in ids[:n]:
            lease = by_gpu[gid]
            status, _ = await call(rig, "operator", "DELETE", f"/v1/leases/{lease['id']}")
            assert status in (200, 202), _
        for gid in ids[n:]:
            kept[gid] = by_gpu[gid]["id"]
    return kept


async def test_a_request_waiting_on_scattered_gpus_is_proposed_the_fewest_moves(tmp_path: Path,
                                                                                aiohttp_client: Any) -> None:
    rig = await start_rig(make_rig(tmp_path), aiohttp_client)
    m = rig.runtime.manager
    # node 0's two leases can move, node 1's cannot
    kept = await scatter_by_node(rig, {0: True, 1: False})
    status, head = await call(rig, "vm-c", "POST", "/v1/leases",
                              {"gpus": 4, "numa_policy": "required", "accept_deferred": True})
    assert status == 202 and head["state"] == "QUEUED", head
    await m.drain_queue()
    body = (await call(rig, "vm-c", "GET", f"/v1/leases/{head['id']}"))[1]
    plan = body["queue"]["consolidation"]
    node0, node1 = nodes(rig)[0], nodes(rig)[1]
    # two moves free node 0: its two movable leases go to node 1's two free GPUs
    assert sorted(mv["from"] for mv in plan["moves"]) == node0[2:]
    assert sorted(mv["to"] for mv in plan["moves"]) == node1[:2]
    assert {mv["lease_id"] for mv in plan["moves"]} == {kept[g] for g in node0[2:]}
    assert plan["performed"] is False and "2 move(s) would free" in plan["message"] and "node0" in plan["block"]
    steps = ", ".join(f"{mv['lease_id']} {mv['from']} -> {mv['to']}" for mv in plan["moves"])
    assert plan["message"] == f"the free GPUs are scattered: 2 move(s) would free {plan['block']} for it ({steps})"
    # proposed only (leases.consolidate is off): nobody moved, and the journal says so once
    assert all(not m.leases[kept[g]].move for g in node0[2:])
    await m.drain_queue()
    events = [e for e in rig.runtime.journal.events(lease_id=head["id"]) if e.kind == "consolidate"]
    assert len(events) == 1 and events[0].detail == plan["message"] + "; proposed (leases.consolidate is off)"
    assert events[0].gpu_id == ",".join(plan["frees"]) and plan["proposed_at"] > 0
    assert m.leases[head["id"]].state is S.QUEUED
    # asked hypothetically: the placer's decisions (the dashboard's "why") hold only the real ones
    decisions = len(m.place.last_decisions)
    await consolidate.consider(m)
    assert len(m.place.last_decisions) == decisions
    await operator_login(rig)  # the overview's queue says it too
    page = await (await rig.client.get("/")).text()
    assert "2 move(s) would free" in page and "proposed (leases.consolidate is off" in page
    # the proposal follows the host: one of node 0's leases ends, and one move is enough now
    gone = plan["moves"][0]
    status, _ = await call(rig, "operator", "DELETE", f"/v1/leases/{gone['lease_id']}")
    assert status in (200, 202), _
    await m.drain_queue()
    plan = (await call(rig, "vm-c", "GET", f"/v1/leases/{head['id']}"))[1]["queue"]["consolidation"]
    left = {kept[g] for g in node0[2:]} - {gone["lease_id"]}
    assert [mv["lease_id"] for mv in plan["moves"]] == sorted(left) and "1 move(s)" in plan["message"], plan
    assert len([e for e in rig.runtime.journal.events(lease_id=head["id"]) if e.kind == "consolidate"]) == 2


async def test_the_block_that_needs_the_fewest_moves_is_chosen(tmp_path: Path, aiohttp_client: Any) -> None:
    """Node 1 has one free GPU and three movable leases, node 0 three free and one: one move (node 0's lease to
    node 1's free GPU) frees node 0, where freeing node 1 would take three."""
    rig = await start_rig(make_rig(tmp_path), aiohttp_client)
    m = rig.runtime.manager
    kept = await scatter_by_node(rig, {0: True, 1: True}, free={0: 3, 1: 1})
    status, head = await call(rig, "vm-c", "POST", "/v1/leases",
                              {"gpus": 4, "numa_policy": "required", "accept_deferred": True})
    assert status == 202, head
    await m.drain_queue()
    plan = (await call(rig, "vm-c", "GET", f"/v1/leases/{head['id']}"))[1]["queue"]["consolidation"]
    node0, node1 = nodes(rig)[0], nodes(rig)[1]
    assert plan["moves"] == [{"lease_id": kept[node0[3]], "from": node0[3], "to": node1[0]}], plan
    assert plan["frees"] == [node0[3]] and "1 move(s)" in plan["message"]


@pytest.mark.parametrize("order", ["priority", "age"])
async def test_of_leases_that_could_move_the_lowest_priority_then_the_youngest_moves(
        tmp_path: Path, aiohttp_client: Any, order: str) -> None:
    """A request for 3 on node 0 (two free, two movable leases) needs one move: the lease of lower priority moves,
    among equal priorities the one granted last."""
    rig = await start_rig(make_rig(tmp_path), aiohttp_client)
    m = rig.runtime.manager
    node0 = nodes(rig)[0]
    kept = await scatter_by_node(rig, {0: True, 1: False})
    older, younger = sorted((kept[g] for g in node0[2:]), key=lambda lid: m.leases[lid].granted_at or 0)
    if order == "priority":  # the younger lease has the higher priority: priority decides before age
        m.leases[younger] = dataclasses.replace(m.leases[younger], request=dataclasses.replace(
            m.leases[younger].request, priority=5))
    status, head = await call(rig, "vm-c", "POST", "/v1/leases",
                              {"gpus": 3, "numa_policy": "required", "accept_deferred": True})
    assert status == 202, head
    await m.drain_queue()
    plan = (await call(rig, "vm-c", "GET", f"/v1/leases/{head['id']}"))[1]["queue"]["consolidation"]
    assert [mv["lease_id"] for mv in plan["moves"]] == [older if order == "priority" else younger], plan


async def test_only_leases_that_said_they_can_move_are_moved(tmp_path: Path, aiohttp_client: Any) -> None:
    rig = await start_rig(make_rig(tmp_path, leases={"consolidate": True}), aiohttp_client)
    m = rig.runtime.manager
    await scatter_by_node(rig, {0: False, 1: False})
    status, head = await call(rig, "vm-c", "POST", "/v1/leases",
                              {"gpus": 4, "numa_policy": "required", "accept_deferred": True})
    assert status == 202, head
    await m.drain_queue()
    body = (await call(rig, "vm-c", "GET", f"/v1/leases/{head['id']}"))[1]
    assert body["queue"]["consolidation"] is None
    assert not any(x.move for x in m.leases.values())
    assert not [e for e in rig.runtime.journal.events(lease_id=head["id"]) if e.kind == "consolidate"]


async def test_with_consolidate_on_the_moves_run_and_the_request_gets_the_freed_block(tmp_path: Path,
                                                                                     aiohttp_client: Any) -> None:
    rig = await start_rig(make_rig(tmp_path, leases={"consolidate": True}), aiohttp_client)
    m = rig.runtime.manager
    kept = await scatter_by_node(rig, {0: False, 1: True})
    status, head = await call(rig, "vm-c", "POST", "/v1/leases",
                              {"gpus": 4, "numa_policy": "required", "accept_deferred": True})
    assert status == 202, head
    await m.drain_queue()
    node0, node1 = nodes(rig)[0], nodes(rig)[1]
    movers = [kept[g] for g in node1[2:]]
    await until(lambda: all(dict(m.leases[lid].move).get("phase") == "waiting" for lid in movers))
    for lid in movers:  # made before anything breaks: each mover has its old GPU and one on node 0
        mv = m.leases[lid].move
        assert dict(mv)["phase"] == "waiting" and dict(mv)["to"] in node0[:2], mv
    assert m.leases[head["id"]].state is S.QUEUED  # its block is not free until the guests let go
    events = [e for e in rig.runtime.journal.events(lease_id=head["id"]) if e.kind == "consolidate"]
    assert len(events) == 1 and (events[0].detail or "").endswith("; performing it"), events
    await m.drain_queue()  # moves under way: not planned again, and the plan stays shown as performed
    assert len([e for e in rig.runtime.journal.events(lease_id=head["id"]) if e.kind == "consolidate"]) == 1
    assert m.consolidation[head["id"]]["performed"] is True
    for lid in movers:  # each guest confirms: its old GPU goes back to the host
        owner = next(vm for vm, u in rig.uuids.items() if u == m.leases[lid].domain_uuid)
        status, done = await call(rig, owner, "POST", f"/v1/leases/{lid}/move/done")
        assert status == 200, done
    await m.drain_queue()
    await until(lambda: m.leases[head["id"]].state is S.ACTIVE)
    granted = m.leases[head["id"]]
    assert sorted(granted.gpu_ids) == node1, granted.gpu_ids
    assert all(set(m.leases[lid].gpu_ids) <= set(node0) for lid in movers)


async def until(cond: Callable[[], bool], timeout: float = 20.0) -> None:
    """Wait for the agent's own queue task (woken by each change) to get there."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not cond():
        assert loop.time() < end, "timed out"
        await asyncio.sleep(0.02)


async def scatter_by_node(rig: AgentRig, movable: dict[int, bool],
                          free: dict[int, int] | None = None) -> dict[str, str]:
    """`scatter`, then each kept lease's movable flag set per node (the API took `movable: true` from every guest;
    where a lease lands is the placement's choice, so the flag of those on a node is set here afterwards)."""
    kept = await scatter(rig, free)
    m = rig.runtime.manager
    for gid, lid in kept.items():
        lease = m.leases[lid]
        want = movable.get(m.gpus[gid].numa_node, False)
        m.leases[lid] = dataclasses.replace(lease, request=dataclasses.replace(lease.request, movable=want))
    return kept


def test_each_move_gets_a_destination_of_its_own_where_one_fits() -> None:
    """The matching behind a plan: occupants in preference order, each given a distinct destination it fits; an
    occupant whose only fitting destination is taken moves another one's elsewhere (an augmenting path)."""
    from types import SimpleNamespace

    from hostagent.services.consolidate import _match

    a, b, c = ("g-a", "L-a"), ("g-b", "L-b"), ("g-c", "L-c")
    d1, d2 = SimpleNamespace(id="d1"), SimpleNamespace(id="d2")
    fits = {("g-a", "d1"): True, ("g-a", "d2"): True, ("g-b", "d1"): True, ("g-b", "d2"): False,
            ("g-c", "d1"): False, ("g-c", "d2"): False}
    got = _match([a, b], [d1, d2], fits, 2)  # a took d1 first; b fits only d1: a moves on to d2
    assert got is not None and sorted((o, d) for o, _, d in got) == [("g-a", "d2"), ("g-b", "d1")]
    assert _match([c, a], [d1, d2], fits, 2) is None  # c fits nowhere: two moves cannot be had
    assert [o for o, _, _ in _match([c, a, b], [d1, d2], fits, 1) or []] == ["g-a"]  # the first that fits
    fits[("g-a", "d1")] = False  # an unfitting destination is passed over, not the end of the search
    assert [(o, d) for o, _, d in _match([a], [d1, d2], fits, 1) or []] == [("g-a", "d2")]


def test_without_a_topology_the_blocks_are_the_numa_nodes_smallest_first() -> None:
    from types import SimpleNamespace

    from hostagent.services.consolidate import _blocks

    gpus = {f"g{i}": SimpleNamespace(id=f"g{i}", numa_node=0 if i < 3 else 1) for i in range(5)}
    m = SimpleNamespace(place=lambda *a: None, gpus=gpus)
    assert _blocks(m) == [("NUMA node 1", frozenset({"g3", "g4"})), ("NUMA node 0", frozenset({"g0", "g1", "g2"}))]
    topo = SimpleNamespace(blocks=lambda: (SimpleNamespace(kind="host", id="host", gpu_ids=("g0", "g1", "g2")),
                                           SimpleNamespace(kind="switch", id="s1", gpu_ids=("g0", "g1"))))
    for place in (SimpleNamespace(topology=topo), SimpleNamespace(topology_place=SimpleNamespace(topology=topo))):
        m = SimpleNamespace(place=place, gpus=gpus)  # a topology placer, or the Placer that wraps one
        assert _blocks(m) == [("switch s1", frozenset({"g0", "g1"})), ("host host", frozenset({"g0", "g1", "g2"}))]


async def test_a_two_gpu_request_gets_one_move_and_one_short_of_gpus_gets_none(tmp_path: Path,
                                                                             aiohttp_client: Any) -> None:
    """Two GPUs wanted, one free on each node: one move frees a second on a node. Four wanted with three free in
    all: it waits for a GPU, not for where they are, and no move is proposed. A booking far ahead changes neither."""
    rig = await start_rig(make_rig(tmp_path), aiohttp_client)
    m = rig.runtime.manager
    await scatter_by_node(rig, {0: True, 1: True}, free={0: 1, 1: 1})
    status, booked = await call(rig, "vm-d", "POST", "/v1/leases", {
        "gpus": 1, "start_at": m.clock() + 2 * 86400, "duration_s": 3600})
    assert status == 201 and booked["state"] == "BOOKED", booked
    status, head = await call(rig, "vm-c", "POST", "/v1/leases",
                              {"gpus": 2, "numa_policy": "required", "accept_deferred": True, "duration_s": 3600})
    assert status == 202, head
    await m.drain_queue()
    plan = (await call(rig, "vm-c", "GET", f"/v1/leases/{head['id']}"))[1]["queue"]["consolidation"]
    assert plan is not None and len(plan["moves"]) == 1, plan
    status, _ = await call(rig, "vm-c", "DELETE", f"/v1/leases/{head['id']}")
    status, big = await call(rig, "vm-c", "POST", "/v1/leases",
                             {"gpus": 4, "numa_policy": "required", "accept_deferred": True, "duration_s": 3600})
    assert status == 202, big
    await m.drain_queue()
    assert (await call(rig, "vm-c", "GET", f"/v1/leases/{big['id']}"))[1]["queue"]["consolidation"] is None
    assert not m.consolidation


async def test_a_plan_whose_move_fails_is_not_tried_again_for_a_minute(tmp_path: Path, aiohttp_client: Any) -> None:
    clock = Clock()
    rig = await start_rig(make_rig(tmp_path, clock=clock, leases={"consolidate": True}), aiohttp_client)
    m = rig.runtime.manager
    await scatter_by_node(rig, {0: False, 1: True})
    node0 = nodes(rig)[0]
    kernel = FakeKernel(rig.tree.sys_root)
    for gid in node0[:2]:  # the destinations cannot be bound
        kernel.set_fault("fail_bind", str(m.gpus[gid].functions[0].address))
    status, head = await call(rig, "vm-c", "POST", "/v1/leases",
                              {"gpus": 4, "numa_policy": "required", "accept_deferred": True})
    assert status == 202, head

    def tries() -> int:
        return sum(1 for x in m.leases.values() for e in rig.runtime.journal.events(lease_id=x.id)
                   if "failed" in (e.detail or "") and (e.detail or "").startswith("move to "))

    await until(lambda: "failed" in m.consolidation.get(head["id"], {}))
    assert "to vfio-pci failed" in m.consolidation[head["id"]]["failed"]
    first = tries()
    assert first == 1
    clock.advance(30)
    await m.drain_queue()
    assert tries() == first  # within the minute: proposed, not performed again
    for gid in node0[:2]:
        kernel.clear_fault("fail_bind", str(m.gpus[gid].functions[0].address))
    clock.advance(31)
    await m.drain_queue()
    await until(lambda: all(dict(m.leases[mv["lease_id"]].move).get("phase") == "waiting"
                            for mv in m.consolidation[head["id"]]["moves"]))
    assert tries() == first


async def test_a_lease_is_never_moved_onto_a_gpu_booked_before_it_ends(tmp_path: Path, aiohttp_client: Any) -> None:
    """Node 0 has three free GPUs and one lease: one move would free it, but the only free GPU outside it is booked in
    an hour and the lease runs for eight: it cannot go there. Freeing node 1 instead (its free GPU is booked after
    the short request ends) takes three moves onto node 0's free GPUs: that is the plan."""
    rig = await start_rig(make_rig(tmp_path), aiohttp_client)
    m = rig.runtime.manager
    node0, node1 = nodes(rig)[0], nodes(rig)[1]
    by_gpu: dict[str, str] = {}
    for i in range(8):
        status, lease = await call(rig, "vm-a" if i % 2 else "vm-b", "POST", "/v1/leases",
                                   {"gpus": 1, "movable": True})
        assert status == 201, lease
        by_gpu[lease["devices"][0]["gpu_id"]] = lease["id"]
    assert (await call(rig, "operator", "DELETE", f"/v1/leases/{by_gpu[node1[0]]}"))[0] in (200, 202)
    status, booking = await call(rig, "vm-d", "POST", "/v1/leases",
                                 {"gpus": 1, "start_at": m.clock() + 3600, "duration_s": 3600})
    assert status == 201 and booking["booking"]["gpus"] == [node1[0]], booking  # the only GPU free then
    for gid in node0[:3]:
        assert (await call(rig, "operator", "DELETE", f"/v1/leases/{by_gpu[gid]}"))[0] in (200, 202)
    status, head = await call(rig, "vm-c", "POST", "/v1/leases",
                              {"gpus": 4, "numa_policy": "required", "accept_deferred": True, "duration_s": 600})
    assert status == 202, head
    await m.drain_queue()
    plan = (await call(rig, "vm-c", "GET", f"/v1/leases/{head['id']}"))[1]["queue"]["consolidation"]
    assert plan is not None and "node1" in plan["block"], plan
    assert sorted(mv["from"] for mv in plan["moves"]) == node1[1:] and node1[0] not in {mv["to"] for mv in plan["moves"]}
