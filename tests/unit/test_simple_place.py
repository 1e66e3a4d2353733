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


def test_the_learned_placer_without_topology_picks_greedily_and_remembers_why(tmp_path: Path) -> None:
    """Placer's own set choice, when no topology placer is wired (build_runtime without the web app): the distance
    callable decides the spread, candidates carry their ids and scores, each decision is remembered with its
    reasons, and a request nothing passes is refused with the filters' reason."""
    import pytest

    from hostagent.domain.errors import Conflict
    from hostagent.services.placement import Placer

    tree = build_tree(tmp_path, "dgx8")
    gpus = list(discover(Sysfs(tree.sys_root), vendors=("10de",)).gpus)
    asked: list[tuple[str, str]] = []

    def distance(a: object, b: object) -> float:
        asked.append((getattr(a, "gpu_id"), getattr(b, "gpu_id")))
        return 0.0

    placer = Placer(lambda: gpus, quarantined=lambda: {}, distance=distance)
    got = placer(LeaseRequest(gpus=2), gpus, 2, "uuid")
    assert len(got.gpu_ids) == 2 and asked, "the distance callable chose the second GPU"
    ids = {g.id for g in gpus}
    assert got.candidates and all(c["gpu_id"] in ids and c["score"] > 0 for c in got.candidates), got.candidates
    assert placer.last_decisions[-1]["reasons"] == list(got.reasons) and got.reasons
    with pytest.raises(Conflict) as err:
        placer(LeaseRequest(gpus=1, min_memory_gib=100), gpus, 1, "uuid")
    assert err.value.field == "gpus" and err.value.message == "0 of 8 device(s) passed the filters, 1 needed"
    assert placer.last_decisions[-1]["reasons"] == [err.value.message]
    assert all(d["reason"].startswith("memory") for d in placer.last_decisions[-1]["dropped"])
