"""Where the records show a task type stops gaining past N GPUs (#29): the model's records hold each task type's
median total work rate by GPU count; a request for more than N says so in its reasons, and under
`placement.cap_at_scaling_limit` it is cut to N."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from hostagent.domain.terms import MIN_LEASES, Scaling, scaling_totals
from hostagent.learn.model import LearnedScorer, ModelBundle, fit
from hostagent.learn.records import examples_from_records
from tests.support.agent import make_rig, start_rig
from tests.support.placement import GIB, gpu_rows, store_records
from tests.support.waits import until

TOTALS = {1: 100.0, 2: 190.0, 4: 200.0}  # bert: 2 GPUs nearly double, 4 add 5 %


def scaling_records(totals: dict[int, float], task: str = "bert", per_count: int = 5,
                    failed: int = 0) -> list[dict[str, Any]]:
    """Finished leases of `task` on n GPUs whose per-GPU work rate is total / n (a little spread around it)."""
    out = []
    for n, total in totals.items():
        for k in range(per_count + failed):
            t = 1.7e9 + 1000.0 * len(out)
            rate = total / n * (1.0 + 0.01 * (k - (per_count - 1) / 2))  # spread evenly around it
            out.append({
                "id": f"S{n}-{k}", "host_id": "h1", "task_type": task, "data_scale": None, "precision": None,
                "min_memory_gib": 0.0, "duration_s": None, "priority": 0, "request": {"task_type": task},
                "created_at": t, "granted_at": t, "ended_at": t + 600.0, "held_s": 600.0,
                "outcome": "failed" if k >= per_count else "released",
                "devices": [{"gpu_id": f"g{i}", "model": "X" if i % 2 == 0 else "Y", "memory_bytes": 16 * GIB,
                             "numa_node": 0} for i in range(n)],
                "usage": {"n": 10, "work_mean": rate * (0.01 if k >= per_count else 1.0), "util_mean": 90.0},
            })
    return out


def bundle(**kw: Any) -> ModelBundle:
    return fit(examples_from_records(store_records(200) + scaling_records(TOTALS, **kw), gpu_rows()))


def test_the_limit_is_the_count_past_which_the_next_gains_less_than_ten_percent() -> None:
    assert Scaling("t", {1: 100, 2: 190, 4: 200}).limit == 2
    assert Scaling("t", {1: 100, 2: 108, 4: 300}).limit == 1  # the first count that stops gaining decides
    assert Scaling("t", {1: 100, 2: 190, 4: 380}).limit is None
    assert Scaling("t", {1: 100, 2: 110}).limit is None  # exactly 10 % is still a gain
    assert Scaling("t", {2: 100}).limit is None
    said = Scaling("bert", TOTALS).say()
    assert said == ("the records show bert gains less than 10% past 2 GPU(s) (median total work rate: "
                    "1 GPU(s) 100/s, 2 GPU(s) 190/s, 4 GPU(s) 200/s)"), said


def test_totals_are_medians_of_enough_leases_per_count() -> None:
    leases = [("a", 1, 10.0)] * MIN_LEASES + [("a", 2, 9.0), ("a", 2, 50.0), ("a", 2, 8.0)] + [("a", 8, 1.0)] * (MIN_LEASES - 1)
    assert scaling_totals(leases) == {"a": {1: 10.0, 2: 18.0}}  # 8 GPUs: too few leases; 2: median of 18, 100, 16
    assert scaling_totals([("b", 1, 1.0)] * 5) == {}  # one count says nothing of scaling


def test_the_model_learns_scaling_from_its_records_and_keeps_it() -> None:
    b = bundle(failed=3)  # failed leases (a hundredth of the rate) are left out
    assert b.scaling["bert"] == pytest.approx(TOTALS, rel=0.02) and "a" not in b.scaling  # "a" ran on 1 GPU only
    assert ModelBundle.from_bytes(b.to_bytes()).scaling == b.scaling


@pytest.mark.parametrize("cap", [False, True])
async def test_a_request_past_the_limit_is_told_and_cut_when_the_operator_caps(tmp_path: Path, aiohttp_client: Any,
                                                                               cap: bool) -> None:
    rig = make_rig(tmp_path, scenario="dgx8", placement={"cap_at_scaling_limit": cap})
    rig.runtime.placer.use(LearnedScorer(bundle()), "v-scaling")
    rig = await start_rig(rig, aiohttp_client)
    r = await rig.client.post("/v1/leases", json={"gpus": 4, "task_type": "bert"}, headers=rig.auth("vm-a"))
    lease = await r.json()
    assert r.status == 201, lease
    said = [x for x in lease["reasons"] if "gains less than 10% past 2 GPU(s)" in x]
    assert len(said) == 1 and "4 GPU(s) 200/s" in said[0], lease["reasons"]
    assert len(lease["devices"]) == (2 if cap else 4)
    assert ("cut from 4 to 2 GPU(s) (placement.cap_at_scaling_limit)" in said[0]) == cap
    for body in ({"gpus": 2, "task_type": "bert"}, {"gpus": 4, "task_type": "a"}):  # at the limit; no scaling known
        r = await rig.client.post("/v1/leases", json=body, headers=rig.auth("vm-b"))
        other = await r.json()
        assert r.status == 201 and not any("gains less" in x for x in other["reasons"]), other
        await rig.client.delete(f"/v1/leases/{other['id']}", headers=rig.auth("vm-b"))
        leases = rig.runtime.manager.leases  # the release ends when the guest lets go: wait for it, not a fixed time
        await until(lambda: other["id"] not in leases, 10, "the release")
