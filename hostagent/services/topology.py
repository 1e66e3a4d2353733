"""Topology-aware placement for the lease driver (a `PlaceFn`), the NVLink hint file, and the topology view.

`TopologyPlacer` applies placement's hard filters and scores (the learned scorer when it covers the request, the
cold-start rule otherwise), then lets `hostagent.domain.topology.choose` pick the set: NUMA policy, distance,
quality, packing. Wire it with `make_topology_place(manager, topology, ...)`.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

from hostagent.domain.capabilities import Measured
from hostagent.domain.errors import ConfigError, Conflict
from hostagent.domain.inventory import Gpu, GpuState
from hostagent.domain.lease import LeaseRequest
from hostagent.domain.placement import RULE_NONE, DeviceViews, PlacementRequest, Scored, Scorer, score_devices
from hostagent.domain.topology import BLOCK_KINDS, Block, Level, Topology, capacity, choose, free_blocks, parse_nvlink_hints
from hostagent.services.lease_types import Placement

log = logging.getLogger("hostagent.topology")


def load_topology(gpus: Sequence[Gpu], nvlink_hints: str = "") -> Topology:
    """The host's topology; NVLink cliques from the hint file named by `host.nvlink_hints` (empty: none)."""
    cliques: tuple[frozenset[str], ...] = ()
    if nvlink_hints:
        try:
            text = Path(nvlink_hints).read_text()
        except OSError as exc:
            raise ConfigError(f"host.nvlink_hints: cannot read {nvlink_hints}: {exc.strerror}",
                              field="host.nvlink_hints") from exc
        cliques = parse_nvlink_hints(text, gpus, source=nvlink_hints)
    return Topology.from_gpus(gpus, cliques)


class TopologyPlacer:
    """A PlaceFn: filters and scores from `domain.placement`, the set from `domain.topology.choose`."""

    def __init__(self, topology: Topology, *, free_ids: Callable[[], Collection[str]] | None = None,
                 scorer: Callable[[], Scorer | None] = lambda: None,
                 probe_score: Callable[[str], float | None] = lambda gpu_id: None,
                 probe_measured: Callable[[str], Measured | None] = lambda gpu_id: None,
                 vm_numa_node: Callable[[str], int | None] = lambda domain_uuid: None,
                 default_policy: str = "preferred", objective: str = "pack",
                 objective_per_task: Mapping[str, str] | None = None, tolerance: float = 0.02,
                 top_k: int = 5) -> None:
        self.topology = topology
        self.free_ids = free_ids
        self.scorer = scorer
        self.probe_score = probe_score
        # what each GPU's latest probe measured: capabilities, the capability vector (the cold-start speed term)
        self.probe_measured = probe_measured
        self.vm_numa_node = vm_numa_node
        self.default_policy = default_policy
        self.objective = objective  # [placement] objective, or objective_per_task for the request's task type
        self.objective_per_task = dict(objective_per_task or {})
        self.tolerance = tolerance  # relative: scores within this fraction of the best count as equally good
        self.top_k = top_k
        self._views = DeviceViews()

    def __call__(self, request: LeaseRequest, candidates: Sequence[Gpu], count: int, domain_uuid: str) -> Placement:
        """Choose `count` of the free candidates; Conflict when the NUMA policy cannot be met."""
        preq = self.request_for(request, count, domain_uuid)
        views = [self._views.view(g, free=True, probe_score=self.probe_score(g.id),
                                  nvlink=g.id in self.topology.nvlinked, measured=self.probe_measured(g.id))
                 for g in candidates]
        return self.pick(preq, score_devices(preq, views, self.scorer()), [g.id for g in candidates])

    def request_for(self, request: LeaseRequest, count: int, domain_uuid: str) -> PlacementRequest:
        """The placement request: the VM's NUMA node when known, the host's default policy when none is asked."""
        preq = PlacementRequest.from_lease(request, count=count, vm_numa_node=self.vm_numa_node(domain_uuid))
        policy = request.numa_policy or self.default_policy
        return preq if preq.numa_policy == policy else dataclasses.replace(preq, numa_policy=policy)

    def pick(self, preq: PlacementRequest, scored: Scored, free_ids: Collection[str]) -> Placement:
        """The set among `scored`'s survivors (filters and scores done once, by the caller); `free_ids` are the
        free candidates the survivors came from. Conflict when too few survived or the NUMA policy has no set."""
        count, policy, vm_node = preq.count, preq.numa_policy, preq.vm_numa_node
        dropped = tuple({"gpu_id": d.gpu_id, "reason": d.reason} for d in scored.dropped)
        if scored.rule == RULE_NONE:
            free_n = len(free_ids)
            survived = sum(1 for d in scored.survivors if d.gpu_id in free_ids)
            if policy == "required" and vm_node is not None and survived < count and any(
                    d.gpu_id in free_ids and "numa_policy=required" in d.reason for d in scored.dropped):
                raise Conflict(f"{survived} free eligible GPU(s) on the VM's NUMA node {vm_node}, {count} needed "
                               f"({free_n} free in all; numa_policy=required): wait, or use numa_policy=preferred",
                               field="numa_policy", dropped=dropped)
            if policy == "required" and count > 1:
                raise Conflict(f"no NUMA node has {count} free eligible GPU(s) ({free_n} free in all; "
                               "numa_policy=required): wait, or use numa_policy=preferred", field="numa_policy",
                               dropped=dropped)
            raise Conflict(f"{survived} of {free_n} free GPU(s) pass the filters, {count} needed", field="gpus",
                           dropped=dropped)
        by_id = {d.gpu_id: s for d, s in zip(scored.survivors, scored.scores)}
        top = max(abs(s) for s in scored.scores)
        host_free = set(self.free_ids()) if self.free_ids is not None else set(free_ids)
        choice = choose(self.topology, list(by_id), count, scores=by_id, policy=policy, vm_numa_node=vm_node,
                        host_free=host_free, objective=self.objective_per_task.get(preq.task_type, self.objective),
                        tolerance=max(1e-9, self.tolerance * top))
        if choice is None:
            raise Conflict(f"no {count} free GPU(s) on one NUMA node{'' if vm_node is None else f' ({vm_node})'} "
                           f"(numa_policy={policy}); wait or use numa_policy=preferred", field="numa_policy")
        return Placement(
            gpu_ids=choice.gpu_ids,
            reasons=(scored.reason, *choice.reasons),
            candidates=tuple({"gpu_id": g, "score": round(s, 6)} for g, s in scored.ranked(self.top_k)),
            dropped=dropped,
            distance=None if choice.distance is None else int(choice.distance),
            rule=scored.rule,
        )


def manager_free_ids(manager: Any) -> Callable[[], list[str]]:
    """Every GPU the lease driver would call free now (the packing picture counts all of them)."""
    return lambda: [g for g in manager.gpus if manager.gpu_state(g) is GpuState.FREE]


def make_topology_place(manager: Any, topology: Topology, **kwargs: Any) -> TopologyPlacer:
    """A TopologyPlacer that sees the manager's free GPUs and the VMs' NUMA nodes (as read at each request:
    grant_path.read_vm_numa); assign it to `manager.place`."""
    kwargs.setdefault("vm_numa_node", lambda domain_uuid: getattr(manager.vm_numa.get(domain_uuid), "node", None))
    return TopologyPlacer(topology, free_ids=manager_free_ids(manager), **kwargs)


# -- the view ----------------------------------------------------------------------------------------------------

def _block_json(b: Block, states: dict[str, str]) -> dict[str, Any]:
    free = [g for g in b.gpu_ids if states.get(g) == GpuState.FREE.value]
    body: dict[str, Any] = {"kind": b.kind, "id": b.id, "level": int(b.level), "size": len(b.gpu_ids),
                            "free": len(free), "intact": len(free) == len(b.gpu_ids), "gpus": list(b.gpu_ids)}
    if b.children:
        body["children"] = [_block_json(c, states) for c in b.children]
    return body


def topology_view(topology: Topology, states: dict[str, str], sizes: Sequence[int] = (1, 2, 4, 8)) -> dict[str, Any]:
    """The free-block picture: GPUs with their place and state, the block tree, the best set per request size now."""
    free = [g for g in topology.gpu_ids if states.get(g) == GpuState.FREE.value]
    best = free_blocks(topology, free, sizes)
    ids = topology.gpu_ids
    return {
        "levels": [{"distance": int(lv), "name": lv.label} for lv in Level],
        "gpus": [{"id": d.gpu_id, "address": str(d.address), "numa_node": d.numa_node, "root_complex": d.root_complex,
                  "root_port": d.root_port, "switch": d.switch, "nvlink_peers": list(topology.nvlink_peers(d.gpu_id)),
                  "state": states.get(d.gpu_id)} for d in topology.devices],
        "tree": _block_json(topology.tree(), states),
        "nvlink": [sorted(c) for c in topology.nvlink],
        "distances": {a: {b: int(topology.distance(a, b)) for b in ids} for a in ids},
        "free": {"count": len(free), "capacity": round(capacity(topology, free), 4),
                 "best_sets": {str(n): None if c is None else {"gpus": list(c.gpu_ids),
                                                               "distance": None if c.distance is None else int(c.distance),
                                                               "distance_name": None if c.distance is None else c.distance.label}
                               for n, c in best.items()}},
        "block_kinds": list(BLOCK_KINDS),
    }
