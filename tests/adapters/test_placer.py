"""The lease driver's placer as the runtime wires it (filters and scores once, the topology placer picks the set,
exploration may swap a single GPU), on the fake dgx8 host: switches A,B on NUMA node 0, C,D on node 1."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

import pytest

from hostagent.domain.errors import Conflict
from hostagent.domain.inventory import Gpu
from hostagent.domain.lease import LeaseRequest
from hostagent.domain.capabilities import Measured
from hostagent.domain.placement import DeviceView, DeviceViews, Exploration, PlacementRequest
from hostagent.runtime import make_app
from hostagent.services.placement import Placer
from hostagent.web.topology import TOPOLOGY, TopologyParts
from tests.support.agent import AgentRig, make_rig
from tests.support.topology import ALL, NODE0, NODE1, SWITCH_A, SWITCH_C


class CountingScorer:
    """A learned scorer stand-in: fixed scores per GPU (0.5 unless told), every call counted."""

    name = "counting"

    def __init__(self, scores: dict[str, float]) -> None:
        self.scores = scores
        self.calls: list[tuple[str, ...]] = []

    def covers(self, request: PlacementRequest) -> bool:
        return True

    def score(self, request: PlacementRequest, devices: Sequence[DeviceView]) -> list[float]:
        self.calls.append(tuple(d.gpu_id for d in devices))
        return [self.scores.get(d.gpu_id, 0.5) for d in devices]


@pytest.fixture
def wired(tmp_path: Path) -> tuple[AgentRig, Placer, TopologyParts]:
    rig = make_rig(tmp_path)
    app = make_app(rig.runtime)  # wires the topology placer into the runtime's placer
    placer = rig.runtime.placer
    assert placer.topology_place is app[TOPOLOGY].placer
    placer.exploration = placer.cold_exploration = None  # deterministic unless a test explores on purpose
    return rig, placer, app[TOPOLOGY]


def free_gpus(rig: AgentRig, ids: Sequence[str] = ALL) -> list[Gpu]:
    return [rig.runtime.manager.gpus[g] for g in ids]


def test_scores_once_and_the_topology_placer_picks_the_set(wired: tuple[AgentRig, Placer, TopologyParts]) -> None:
    rig, placer, _ = wired
    scorer = CountingScorer({g: 0.9 for g in SWITCH_C})
    placer.use(scorer, "v-test")
    got = placer(LeaseRequest(gpus=2), free_gpus(rig), 2, rig.uuids["vm-a"])
    assert len(scorer.calls) == 1 and sorted(scorer.calls[0]) == sorted(ALL)  # one batched prediction, all free
    assert set(got.gpu_ids) == set(SWITCH_C) and got.distance == 1  # the best pair, behind one switch
    assert got.rule == "model" and got.reasons[0].startswith("rule=model: scored by counting")
    assert any(r.startswith("topology: 2 GPUs within") for r in got.reasons)
    assert {c["gpu_id"] for c in got.candidates[:2]} == set(SWITCH_C)  # ranked best first
    assert placer.last_decisions[-1]["chosen"] == list(got.gpu_ids)
    assert placer.last_decisions[-1]["model_version"] == "v-test"


def test_every_gpu_not_placed_on_is_dropped_with_its_reason(wired: tuple[AgentRig, Placer, TopologyParts]) -> None:
    rig, placer, _ = wired
    manager = rig.runtime.manager
    manager.quarantined[NODE1[0]] = "test: quarantined"
    free = [g for g in ALL[:6] if g != NODE1[0]]  # 88 and 87 are busy (not among the candidates)
    got = placer(LeaseRequest(gpus=1), free_gpus(rig, free), 1, rig.uuids["vm-a"])
    reasons = {d["gpu_id"]: d["reason"] for d in got.dropped}
    assert set(reasons) == set(ALL) - set(free)
    assert "quarantine" in reasons[NODE1[0]]
    assert all(reasons[g] for g in ALL[6:])
    assert got.gpu_ids[0] in free


def test_probe_scores_steer_the_choice(wired: tuple[AgentRig, Placer, TopologyParts]) -> None:
    rig, placer, parts = wired
    fast = NODE1[1]
    parts.probes.scores[fast] = 1.8  # measured 80 % faster than its peers
    got = placer(LeaseRequest(gpus=1, numa_policy="any"), free_gpus(rig), 1, rig.uuids["vm-a"])
    assert got.gpu_ids == (fast,) and got.rule == "cold-start"
    parts.probes.scores[fast] = 0.2  # and now slow: anything else first
    got = placer(LeaseRequest(gpus=1, numa_policy="any"), free_gpus(rig), 1, rig.uuids["vm-a"])
    assert got.gpu_ids != (fast,)


def test_exploration_swaps_a_single_gpu_for_a_near_best_one(wired: tuple[AgentRig, Placer, TopologyParts]) -> None:
    rig, placer, parts = wired
    request = LeaseRequest(gpus=1)
    plain = placer(request, free_gpus(rig), 1, rig.uuids["vm-a"])
    placer.exploration = Exploration(epsilon=1.0, max_loss=0.2)
    got = placer(request, free_gpus(rig), 1, rig.uuids["vm-a"])
    assert got.rule == "explore" and got.gpu_ids != plain.gpu_ids
    assert any(r.startswith(f"rule=explore: tried {got.gpu_ids[0]} at random") for r in got.reasons)
    # under the model never beyond max_loss: only the one near-best GPU qualifies
    scorer = CountingScorer({g: 0.1 for g in ALL} | {SWITCH_A[0]: 1.0, SWITCH_A[1]: 0.85})
    placer.use(scorer, "v-test")
    for _ in range(5):
        got = placer(request, free_gpus(rig), 1, rig.uuids["vm-a"])
        assert got.rule == "explore" and got.gpu_ids == (SWITCH_A[1],)
    # multi-GPU sets and requests above the priority bound never explore
    assert placer(LeaseRequest(gpus=2), free_gpus(rig), 2, rig.uuids["vm-a"]).rule == "model"
    assert placer(LeaseRequest(gpus=1, priority=5), free_gpus(rig), 1, rig.uuids["vm-a"]).rule == "model"


@pytest.mark.parametrize(("cold", "warm"), [(1.0, 0.0), (0.0, 0.5)])
def test_before_its_first_model_placement_explores_at_its_own_rate(tmp_path: Path, cold: float, warm: float) -> None:
    # `placement.cold_explore_epsilon` until a model is in use (the cold-start rule predicts nothing: a random GPU
    # this often, so the first model learns more than the pairs the rule favours), `placement.explore_epsilon` after
    rig = make_rig(tmp_path, placement={"cold_explore_epsilon": cold, "explore_epsilon": warm})
    make_app(rig.runtime)
    placer = rig.runtime.placer
    placer.rng.seed(7)

    def explored(n: int) -> int:
        return sum(placer(LeaseRequest(gpus=1), free_gpus(rig), 1, rig.uuids["vm-a"]).rule == "explore"
                   for _ in range(n))
    before = explored(20)
    placer.use(CountingScorer({g: 1.0 for g in ALL}), "v-test")  # every GPU alike: each within max_loss
    after = explored(20)
    if cold:
        assert (before, after) == (20, 0)
    else:
        assert before == 0 and 5 <= after <= 15, after


def test_a_refusal_is_remembered_and_explained(wired: tuple[AgentRig, Placer, TopologyParts]) -> None:
    rig, placer, _ = wired
    free = NODE0[2:] + NODE1[1:]  # node 0 has 2 free, node 1 has 3
    with pytest.raises(Conflict) as err:
        placer(LeaseRequest(gpus=4, numa_policy="required"), free_gpus(rig, free), 4, rig.uuids["vm-c"])
    assert err.value.field == "numa_policy"
    last = placer.last_decisions[-1]
    assert last["chosen"] == [] and last["rule"] == "none" and "numa_policy=required" in last["reasons"][0]
    with pytest.raises(Conflict) as err:
        placer(LeaseRequest(gpus=2, min_memory_gib=10_000), free_gpus(rig), 2, rig.uuids["vm-c"])
    assert err.value.field == "gpus" and "pass the filters" in err.value.message
    assert len(placer.last_decisions[-1]["dropped"]) == len(ALL)


def test_device_views_follow_a_replaced_gpu_object(wired: tuple[AgentRig, Placer, TopologyParts]) -> None:
    rig, _, _ = wired
    gpu = rig.runtime.manager.gpus[ALL[0]]
    views = DeviceViews()
    first = views.view(gpu, free=True)
    assert first == DeviceView.from_gpu(gpu, free=True)
    assert views.view(gpu, free=False, quarantined=True, probe_score=0.5) == DeviceView.from_gpu(
        gpu, free=False, quarantined=True, probe_score=0.5)
    rescanned = dataclasses.replace(gpu, memory_bytes=(gpu.memory_bytes or 0) + 2**30)  # same id, a new object
    assert views.view(rescanned, free=True).memory_bytes == rescanned.memory_bytes
    # a view is immutable: the same one serves each decision that sees the GPU alike, a new one where anything differs
    again = views.view(rescanned, free=True)
    assert views.view(rescanned, free=True) is again
    for other in (dict(free=False), dict(free=True, quarantined=True), dict(free=True, probe_score=0.9),
                  dict(free=True, nvlink=True), dict(free=True, measured=Measured(compute_capability="8.0"))):
        got = views.view(rescanned, **other)  # type: ignore[arg-type]
        assert got is not again and (got.free, got.quarantined, got.probe_score) == (
            other["free"], other.get("quarantined", False), other.get("probe_score")), other
        assert views.view(rescanned, **other) is got  # type: ignore[arg-type]
    for score in range(20):  # probe scores drift: a few are kept, never a stale one
        assert views.view(rescanned, free=True, probe_score=score / 10).probe_score == score / 10
