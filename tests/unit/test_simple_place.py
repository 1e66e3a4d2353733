"""The lease driver's fallback placement (services.lease_types.simple_place), used when no placer is composed: the
GPUs with the most memory first, then address order, and a reason naming what it chose."""

from __future__ import annotations

from pathlib import Path

from hostagent.domain.lease import LeaseRequest
from hostagent.host.discovery import discover
from hostagent.host.fakesysfs import build_tree
from hostagent.host.sysfs import Sysfs
from hostagent.services.lease_types import simple_place


def test_most_memory_first_then_address(tmp_path: Path) -> None:
    tree = build_tree(tmp_path, "demo16")  # A100 40 GB, V100 32 GB, T4 16 GB, Quadro RTX 6000 24 GB
    gpus = list(discover(Sysfs(tree.sys_root), vendors=("10de",)).gpus)
    picked = simple_place(LeaseRequest(gpus=6), list(reversed(gpus)), 6, "uuid")
    a100 = sorted((g for g in gpus if g.model.startswith("GA100")), key=lambda g: g.address)
    v100 = sorted((g for g in gpus if g.model.startswith("GV100")), key=lambda g: g.address)
    assert picked.gpu_ids == tuple(g.id for g in a100 + v100[:2]) and picked.rule == "simple"
    assert picked.reasons == (f"simple rule: largest memory first, chose {', '.join(picked.gpu_ids)}",)


def test_the_topology_placer_as_a_place_function(tmp_path: Path) -> None:
    """TopologyPlacer is a PlaceFn by itself (filters and scores, then the set): two GPUs of dgx8 come from one
    switch, and a request for what the A100 lacks finds nothing."""
    import pytest

    from hostagent.domain.errors import Conflict
    from hostagent.services.topology import TopologyPlacer, load_topology

    tree = build_tree(tmp_path, "dgx8")
    gpus = list(discover(Sysfs(tree.sys_root), vendors=("10de",)).gpus)
    placer = TopologyPlacer(load_topology(gpus))
    pair = placer(LeaseRequest(gpus=2), gpus, 2, "uuid")
    assert pair.distance == 1 and len(pair.gpu_ids) == 2 and pair.gpu_ids == tuple(g.id for g in gpus[:2]), pair
    with pytest.raises(Conflict):
        placer(LeaseRequest(gpus=1, requires=("fp8",)), gpus, 1, "uuid")
