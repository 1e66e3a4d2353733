"""A throughput target in the tenant's terms (#29): `target_work_rate` of a task type takes the fewest GPUs the
active model predicts reach it, says so with the figures, and says what the GPUs granted are predicted to do."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import pytest

from hostagent.domain.errors import Conflict, InvalidInput
from hostagent.domain.lease import MAX_GPUS_PER_REQUEST, LeaseRequest, parse_lease_request
from hostagent.domain.terms import Scaling, resolve_throughput
from hostagent.learn.model import LearnedScorer, fit
from hostagent.learn.records import examples_from_records
from tests.support.agent import make_rig, start_rig
from tests.support.placement import gpu_rows, store_records

RATE = {"GA100": 1000.0, "GV100": 600.0, "TU102": 300.0, "TU104": 200.0}  # resnet images/s per GPU, by chip


def test_the_fewest_fastest_that_sum_to_the_target_and_no_more_than_scaling_allows() -> None:
    req = LeaseRequest(task_type="resnet", target_work_rate=2500.0)
    got, note = resolve_throughput(req, [200.0, 1000.0, 600.0, 1000.0, 1000.0], "v7", None)
    assert got.gpus == 3 and note == ("target_work_rate 2500/s of resnet: 3 GPU(s), the fewest that model v7 "
                                      "predicts reach it (3000/s on the fastest 3 here)")
    assert resolve_throughput(req, [2600.0, 10.0], "v7", None)[0].gpus == 1
    with pytest.raises(Conflict) as e:
        resolve_throughput(req, [1000.0, 1000.0, 1000.0], "v7", Scaling("resnet", {1: 1000.0, 2: 1900.0, 4: 1950.0}))
    assert e.value.field == "target_work_rate" and "at most 2000/s, with 2 GPU(s)" in e.value.message
    assert "gains less than 10% past 2 GPU(s)" in e.value.message
    with pytest.raises(Conflict):
        resolve_throughput(req, [], "v7", None)
    with pytest.raises(Conflict) as e:  # no scaling known: the message ends with the figures
        resolve_throughput(req, [1000.0, 500.0, 400.0], "v7", None)
    assert e.value.message.endswith("model v7 predicts at most 1900/s, with 3 GPU(s)"), e.value.message
    with pytest.raises(Conflict) as e:  # the scaling limit is all the GPUs here anyway: it explains nothing
        resolve_throughput(req, [1000.0, 1000.0], "v7", Scaling("resnet", {1: 1000.0, 2: 1900.0, 4: 1950.0}))
    assert e.value.message.endswith("at most 2000/s, with 2 GPU(s)"), e.value.message
    with pytest.raises(Conflict) as e:  # never more GPUs than one request may have
        resolve_throughput(dataclasses.replace(req, target_work_rate=float(MAX_GPUS_PER_REQUEST + 2)),
                           [1.0] * (MAX_GPUS_PER_REQUEST + 4), "v7", None)
    assert f"with {MAX_GPUS_PER_REQUEST} GPU(s)" in e.value.message


@pytest.mark.parametrize("body,field", [
    ({"target_work_rate": 100, "gpus": 2, "task_type": "resnet"}, "target_work_rate"),
    ({"target_work_rate": 100, "total_memory_gib": 10, "task_type": "resnet"}, "target_work_rate"),
    ({"target_work_rate": 100}, "task_type"),
    ({"target_work_rate": 0, "task_type": "resnet"}, "target_work_rate"),
    ({"target_work_rate": "fast", "task_type": "resnet"}, "target_work_rate"),
    ({"target_work_rate": float("inf"), "task_type": "resnet"}, "target_work_rate"),
])
def test_bad_targets_are_refused_with_the_field(body: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidInput) as e:
        parse_lease_request(body, now=1.7e9, max_duration_s=86400)
    assert e.value.field == field, e.value.message


def test_a_target_without_its_task_type_says_which_unit_is_missing() -> None:
    with pytest.raises(InvalidInput) as e:
        parse_lease_request({"target_work_rate": 100}, now=1.7e9, max_duration_s=86400)
    assert e.value.message == ("target_work_rate needs the task_type whose work rate it is (the unit the guest agent "
                               "reports as work_rate)")


async def test_a_target_takes_the_fewest_gpus_predicted_to_reach_it(tmp_path: Path, aiohttp_client: Any) -> None:
    rig = make_rig(tmp_path, scenario="demo16")
    gpus = [(g.id, g.model) for g in rig.runtime.manager.gpus.values()]
    truth = {("resnet", model): RATE[model.split(" ")[0][:5]] for _, model in gpus}
    bundle = fit(examples_from_records(store_records(400, truth=truth, gpus=gpus), gpu_rows(gpus)))
    rig.runtime.placer.use(LearnedScorer(bundle), "v-resnet")
    rig = await start_rig(rig, aiohttp_client)
    model_of = dict(gpus)

    async def post(vm: str, **body: Any) -> tuple[int, dict[str, Any]]:
        r = await rig.client.post("/v1/leases", json=body, headers=rig.auth(vm))
        return r.status, await r.json()

    status, lease = await post("vm-a", task_type="resnet", target_work_rate=2500)
    assert status == 201, lease
    assert [model_of[d["gpu_id"]][:5] for d in lease["devices"]] == ["GA100"] * 3
    assert lease["request"]["gpus"] == 3 and lease["request"]["target_work_rate"] == 2500
    said = " | ".join(lease["reasons"])
    assert "target_work_rate 2500/s of resnet: 3 GPU(s), the fewest that model v-resnet predicts reach it" in said
    assert "meets the target of 2500/s" in said, said
    # one A100 left: the same target still resolves to 3 GPUs, and the reply says the grant falls short
    status, short = await post("vm-b", task_type="resnet", target_work_rate=2500)
    assert status == 201, short
    chips = [model_of[d["gpu_id"]][:5] for d in short["devices"]]
    assert len(chips) == 3 and set(chips) <= {"GA100", "GV100"}, chips  # the placer weighs locality too
    forecast = next(x for x in short["reasons"] if "on the GPUs granted" in x)
    assert forecast.endswith("short of the target of 2500/s (the faster GPUs are taken)"), forecast
    predicted = float(re.search(r"predicts ([0-9.]+)/s on the GPUs granted", forecast).group(1))  # type: ignore[union-attr]
    assert predicted == pytest.approx(sum(RATE[c] for c in chips), rel=0.05)
    status, body = await post("vm-c", task_type="resnet", target_work_rate=1e6)
    assert status == 409 and body["error"]["field"] == "target_work_rate" and "predicts at most" in body["error"]["message"]
    status, body = await post("vm-c", task_type="bert", target_work_rate=10)
    assert status == 409 and "no model predicts the work rate of bert yet" in body["error"]["message"], body
    status, body = await post("vm-c", task_type="resnet", target_work_rate=500, requires=["fp64"])
    assert status == 201 and body["request"]["gpus"] == 1, body  # one V100 (600/s) or A100 is enough
    assert model_of[body["devices"][0]["gpu_id"]][:5] in ("GA100", "GV100"), body  # the fp64 chips


async def test_the_learned_scorer_places_on_probed_gpus(tmp_path: Path, aiohttp_client: Any) -> None:
    """Probed GPUs carry measured figures in their placement views; the learned scorer (which caches each view's
    feature row by the view) must place on them, and a target request still resolves (a view with figures once
    could not be hashed: every placement by a model on a probed host failed)."""
    rig = make_rig(tmp_path, scenario="demo16")
    gpus = [(g.id, g.model) for g in rig.runtime.manager.gpus.values()]
    truth = {("resnet", model): RATE[model.split(" ")[0][:5]] for _, model in gpus}
    rig.runtime.placer.use(LearnedScorer(fit(examples_from_records(store_records(300, truth=truth, gpus=gpus),
                                                                   gpu_rows(gpus)))), "v-probed")
    rig = await start_rig(rig, aiohttp_client)
    op = rig.auth("operator")
    for gid, _ in gpus[:8]:
        assert (await rig.client.post(f"/v1/gpus/{gid}/probe", headers=op)).status == 200
    assert sum(1 for m in rig.runtime.manager.measured.values() if m.figures) == 8
    r = await rig.client.post("/v1/leases", json={"task_type": "resnet", "gpus": 2}, headers=rig.auth("vm-a"))
    lease = await r.json()
    assert r.status == 201 and lease["placement"]["rule"] == "model", lease
    r = await rig.client.post("/v1/leases", json={"task_type": "resnet", "target_work_rate": 900},
                              headers=rig.auth("vm-b"))
    assert r.status == 201, await r.json()
