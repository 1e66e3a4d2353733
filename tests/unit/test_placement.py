"""Placement: hard filters, the cold-start rule, exploration bounds and set choice (pure)."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hostagent.domain.errors import InvalidInput
from hostagent.domain.inventory import Gpu, IommuGroup, PciFunction
from hostagent.domain.lease import LeaseRequest
from hostagent.domain.pci import PciAddress
from hostagent.domain.placement import (
    DeviceView,
    Exploration,
    PlacementRequest,
    choose_set,
    cold_start_scores,
    filter_devices,
    link_gen_from_speed,
    place,
)
from tests.support.placement import dev


class FixedScorer:
    """A scorer with given scores by gpu id."""

    def __init__(self, scores: dict[str, float], covers: bool = True) -> None:
        self.name = "fixed"
        self._scores = scores
        self._covers = covers

    def covers(self, request: PlacementRequest) -> bool:
        return self._covers

    def score(self, request: PlacementRequest, devices: Sequence[DeviceView]) -> list[float]:
        return [self._scores[d.gpu_id] for d in devices]


def test_each_filter_drops_with_its_reason() -> None:
    devices = [
        dev("busy", free=False), dev("quar", quarantined=True), dev("unviable", viable=False),
        dev("sick", health_flags=("xid-79",)), dev("small", mem_gib=8), dev("amd", vendor="Advanced Micro Devices"),
        dev("t4", model="Tesla T4"), dev("ok", model="A100 40GB"),
    ]
    survivors, dropped = filter_devices(
        PlacementRequest(min_memory_gib=12, vendor="nvidia", model="a100"), devices)
    assert [d.gpu_id for d in survivors] == ["ok"]
    reasons = dict(dropped)
    assert reasons["busy"].startswith("not free")
    assert reasons["quar"] == "quarantined"
    assert "IOMMU group not viable" in reasons["unviable"]
    assert "xid-79" in reasons["sick"]
    assert "memory 8.0 GiB < 12.0 GiB" in reasons["small"]
    assert "vendor" in reasons["amd"]
    assert "model 'Tesla T4'" in reasons["t4"]


def test_first_failing_filter_is_the_reason_and_unknown_memory_is_dropped() -> None:
    d = DeviceView("x", "X", free=False, quarantined=True)
    _, dropped = filter_devices(PlacementRequest(min_memory_gib=1), [d, DeviceView("nomem", "X")])
    # quarantine comes first: it outlasts the lease, so "not free" would tell an operator the wrong thing
    assert dict(dropped) == {"x": "quarantined", "nomem": "memory unknown, request needs 1.0 GiB"}
    _, dropped = filter_devices(PlacementRequest(), [DeviceView("busy", "X", free=False)])
    assert dict(dropped) == {"busy": "not free: leased or being released"}
    survivors, _ = filter_devices(PlacementRequest(), [DeviceView("nomem", "X")])
    assert len(survivors) == 1  # no memory asked: unknown memory is fine


def test_numa_required_single_gpu_uses_the_vm_node() -> None:
    devices = [dev("n0", numa=0), dev("n1", numa=1), dev("none", numa=None)]
    survivors, dropped = filter_devices(PlacementRequest(numa_policy="required", vm_numa_node=1), devices)
    assert {d.gpu_id for d in survivors} == {"n1", "none"}
    assert "NUMA node 0 != VM's node 1" in dict(dropped)["n0"]
    survivors, _ = filter_devices(PlacementRequest(numa_policy="preferred", vm_numa_node=1), devices)
    assert len(survivors) == 3  # preferred never drops


def test_numa_required_multi_gpu_drops_nodes_without_enough_devices() -> None:
    devices = [dev("a0", numa=0), dev("b1", numa=1), dev("c1", numa=1), dev("d1", numa=1, free=False)]
    survivors, dropped = filter_devices(PlacementRequest(count=2, numa_policy="required"), devices)
    assert [d.gpu_id for d in survivors] == ["b1", "c1"]
    assert "NUMA node 0 has 1 eligible device(s), 2 needed" in dict(dropped)["a0"]
    decision = place(PlacementRequest(count=2, numa_policy="required"), devices)
    assert set(decision.chosen) == {"b1", "c1"}


def test_cold_start_prefers_tight_memory_fit_probe_and_numa() -> None:
    r = PlacementRequest(min_memory_gib=15)
    s = cold_start_scores(r, [dev("big", mem_gib=80), dev("fit", mem_gib=16)])
    assert s[1] > s[0]
    s = cold_start_scores(PlacementRequest(), [dev("slow", probe_score=0.7), dev("fast", probe_score=1.0)])
    assert s[1] > s[0]
    s = cold_start_scores(PlacementRequest(vm_numa_node=1, numa_policy="preferred"),
                          [dev("far", numa=0), dev("near", numa=1)])
    assert s[1] > s[0]
    s = cold_start_scores(PlacementRequest(), [dev("flaky", recent_errors=2), dev("clean")])
    assert s[1] > s[0]


def test_without_a_memory_floor_memory_size_neither_helps_nor_hurts_cold_start() -> None:
    """Best fit is a rule for requests that name memory: without one, an 80 GiB device, a 16 GiB one and one of
    unknown size score alike (nothing else tells them apart)."""
    a, b, c = cold_start_scores(PlacementRequest(), [dev("big", mem_gib=80), dev("small", mem_gib=16),
                                                     DeviceView("unknown", "X", numa_node=0)])
    assert a == b == c


def test_place_says_which_rule_decided() -> None:
    devices = [dev("g0", mem_gib=80), dev("g1", mem_gib=16)]
    r = PlacementRequest(min_memory_gib=15)
    cold = place(r, devices)
    assert cold.rule == "cold-start" and cold.chosen == ("g1",)
    assert any("no active model" in x for x in cold.reasons)
    model = place(r, devices, scorer=FixedScorer({"g0": 2.0, "g1": 1.0}))
    assert model.rule == "model" and model.chosen == ("g0",)
    assert model.candidates == (("g0", 2.0), ("g1", 1.0))
    uncovered = place(r, devices, scorer=FixedScorer({"g0": 2.0, "g1": 1.0}, covers=False))
    assert uncovered.rule == "cold-start" and "too few records" in uncovered.reasons[0]


def test_place_with_too_few_survivors_chooses_nothing_and_explains() -> None:
    d = place(PlacementRequest(count=2), [dev("a"), dev("b", free=False)])
    assert d.chosen == () and d.rule == "none"
    assert d.dropped[0].gpu_id == "b"
    assert "1 of 2 device(s) passed the filters, 2 needed" in d.reasons[0]
    assert [(x.gpu_id, x.reason) for x in d.dropped] == [("b", "not free: leased or being released")]


def test_place_lists_its_top_candidates_best_first() -> None:
    devices = [dev(f"g{i}", mem_gib=16 + i) for i in range(7)]
    scorer = FixedScorer({f"g{i}": float(i) for i in range(7)})
    assert [g for g, _ in place(PlacementRequest(), devices, scorer=scorer).candidates] == ["g6", "g5", "g4", "g3",
                                                                                             "g2"]
    assert [g for g, _ in place(PlacementRequest(), devices, scorer=scorer, top_k=2).candidates] == ["g6", "g5"]


def test_exploration_is_bounded_and_off_for_high_priority() -> None:
    devices = [dev("best"), dev("near"), dev("far")]
    scorer = FixedScorer({"best": 1.0, "near": 0.9, "far": 0.1})
    ex = Exploration(epsilon=1.0, max_loss=0.2, max_priority=0)
    picks = {place(PlacementRequest(), devices, scorer=scorer, exploration=ex, rng=random.Random(i)).chosen[0]
             for i in range(50)}
    assert picks == {"near"}  # "far" is predicted 90 % slower: never explored
    d = place(PlacementRequest(), devices, scorer=scorer, exploration=ex, rng=random.Random(0))
    assert d.rule == "explore" and any("rule=explore" in x for x in d.reasons)
    hi = place(PlacementRequest(priority=5), devices, scorer=scorer, exploration=ex, rng=random.Random(0))
    assert hi.rule == "model" and hi.chosen == ("best",)
    off = place(PlacementRequest(), devices, scorer=scorer, exploration=Exploration(epsilon=0.0),
                rng=random.Random(0))
    assert off.rule == "model"


def test_choose_set_greedy_prefers_close_devices_and_required_picks_best_node() -> None:
    devices = [dev("a", numa=0, switch_id="s0"), dev("b", numa=1, switch_id="s1"), dev("c", numa=0, switch_id="s0")]
    chosen, spread = choose_set(devices, [1.0, 0.99, 0.98], 2, numa_policy="preferred")
    assert [devices[i].gpu_id for i in chosen] == ["a", "c"] and spread == 0.0
    chosen, _ = choose_set(devices, [1.0, 0.99, 0.98], 2, distance=lambda x, y: 0.0)
    assert [devices[i].gpu_id for i in chosen] == ["a", "b"]
    devices = [dev("a", numa=0), dev("b", numa=1), dev("c", numa=1), dev("d", numa=0)]
    chosen, _ = choose_set(devices, [1.0, 0.9, 0.9, 0.1], 2, numa_policy="required")
    assert sorted(devices[i].gpu_id for i in chosen) == ["b", "c"]
    with pytest.raises(InvalidInput):
        choose_set(devices, [1, 1, 1, 1], 5)


def test_request_and_device_views_from_domain_objects() -> None:
    r = PlacementRequest.from_lease(LeaseRequest(gpus=4, task_type="train", min_memory_gib=20, model="A100",
                                                 priority=3), count=2, vm_numa_node=1)
    assert (r.count, r.task_type, r.min_memory_gib, r.model, r.priority, r.numa_policy, r.vm_numa_node) == (
        2, "train", 20.0, "A100", 3, "preferred", 1)
    with pytest.raises(InvalidInput):
        PlacementRequest(numa_policy="sometimes")
    addr = PciAddress.parse("0000:3b:00.0")
    chain = (PciAddress.parse("0000:3a:08.0"), PciAddress.parse("0000:39:00.0"), PciAddress.parse("0000:00:01.0"))
    fn = PciFunction(addr, 0x10DE, 0x20B0, 0x030200, vendor_name="NVIDIA Corporation", device_name="GA100",
                     numa_node=1, link_speed="16.0 GT/s PCIe", link_width=16, parent_chain=chain)
    gpu = Gpu("gpu-0000-3b-00-0", fn, (fn,), IommuGroup(7, (fn,)), memory_bytes=40 * 1024**3)
    v = DeviceView.from_gpu(gpu, free=True, probe_score=0.95)
    assert (v.model, v.numa_node, v.link_gen, v.link_width, v.switch_id, v.root_port, v.memory_gib) == (
        "GA100", 1, 4, 16, "0000:39:00.0", "0000:00:01.0", 40.0)
    assert link_gen_from_speed("8.0 GT/s PCIe") == 3 and link_gen_from_speed(None) is None


_devices = st.lists(st.builds(
    DeviceView, gpu_id=st.uuids().map(str), model=st.sampled_from(["X", "Y"]),
    memory_bytes=st.one_of(st.none(), st.integers(0, 80).map(lambda g: g * 1024**3)),
    numa_node=st.one_of(st.none(), st.integers(0, 1)), free=st.booleans(), quarantined=st.booleans(),
    viable=st.booleans(), probe_score=st.one_of(st.none(), st.floats(0, 2)),
), max_size=10, unique_by=lambda d: d.gpu_id)


@settings(max_examples=150, deadline=None)
@given(devices=_devices, count=st.integers(1, 3), mem=st.floats(0, 64), policy=st.sampled_from(["required", "any"]),
       seed=st.integers(0, 100))
def test_every_choice_passes_every_filter(devices: list[DeviceView], count: int, mem: float, policy: str,
                                          seed: int) -> None:
    r = PlacementRequest(count=count, min_memory_gib=mem, numa_policy=policy)
    d = place(r, devices, exploration=Exploration(epsilon=0.5), rng=random.Random(seed))
    survivors, dropped = filter_devices(r, devices)
    assert len(dropped) + len(survivors) == len(devices)
    ok = {s.gpu_id for s in survivors}
    if d.chosen:
        assert len(d.chosen) == count == len(set(d.chosen)) and set(d.chosen) <= ok
        if policy == "required":
            nodes = {x.numa_node for x in devices if x.gpu_id in d.chosen}
            assert len(nodes - {None}) <= 1
    else:
        assert len(survivors) < count
