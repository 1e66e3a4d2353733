"""Probes that check the answer (#29): a GPU that multiplies fast but wrong is quarantined with the reason, never
scored, never a reference for its peers, and never leased. The real PyTorch runner runs on CPU tensors here
(torch's CPU wheel), the known-answer check and the capability vector included.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hostagent.domain.capabilities import WRONG_ANSWER
from hostagent.host import known_answer
from hostagent.host.probes import BANDWIDTH, MATMUL, TorchRunner, tflops_key
from hostagent.services.probes import ProbeSettings
from hostagent.runtime import make_app
from tests.support.agent import make_rig
from tests.support.topology import ALL, FakeComputeRunner, FakeHealthRunner, topology_rig

BAD = ALL[3]


@pytest.mark.parametrize("precision", known_answer.PRECISIONS)
def test_the_check_passes_the_product_as_the_device_rounds_it_and_nothing_else(precision: str) -> None:
    exact = known_answer.expected(precision)
    assert known_answer.check(precision, exact) is None
    assert known_answer.check(precision, known_answer.rounded(exact, precision)) is None  # output rounding
    off = exact.copy()
    off[3, 5] += 0.05 * float(np.max(np.abs(exact)))  # one entry 5 % of the scale off
    assert (known_answer.check(precision, off) or "").startswith(f"{WRONG_ANSWER}: {precision} matrix multiply off by")
    nan = exact.copy()
    nan[0, 0] = np.nan
    assert "1 NaN/inf" in (known_answer.check(precision, nan) or "")
    assert "shape" in (known_answer.check(precision, exact[:10]) or "")
    assert "not a matrix" in (known_answer.check(precision, object()) or "")
    other = known_answer.expected(precision).T  # the product of other numbers, same scale
    assert known_answer.check(precision, other) is not None
    with pytest.raises(ValueError):
        known_answer.inputs("fp4")


def test_the_torch_runner_on_cpu_measures_the_vector_and_checks_every_precision() -> None:
    res = TorchRunner("cpu").measure(None, 0.3)  # type: ignore[arg-type]  # the CPU needs no GPU's address
    assert res.error is None and res.problems == (), res
    assert res.health["known_answer"] == {p: "ok" for p in ("fp16", "bf16", "fp32", "fp64")}
    for p in ("fp16", "bf16", "fp32", "fp64"):
        assert res.metrics[tflops_key(p)] > 0, res.metrics
    assert res.metrics[MATMUL] == res.metrics[tflops_key("fp16")] and res.metrics[BANDWIDTH] > 0


def test_the_cuda_runners_are_checked_in_a_child_and_the_agent_never_imports_their_library() -> None:
    """In the agent `torch.cuda.is_available()` would import PyTorch (seconds at every start) and initialise CUDA,
    whose driver handles stay open for the agent's life (a GPU's host driver could not then be unbound): the check
    runs in `python -m hostagent.host.probes --check`. Here PyTorch is installed for the CPU and CuPy is not."""
    code = ("import sys, json; from hostagent.host.probes import TorchRunner, CupyRunner; "
            "print(json.dumps([TorchRunner().unavailable(), TorchRunner('cpu').unavailable(), "
            "CupyRunner().unavailable(), sorted(m for m in ('torch', 'cupy') if m in sys.modules)]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    cuda, cpu, cupy, imported = json.loads(out.stdout.strip().splitlines()[-1])
    assert (cuda, cpu, cupy, imported) == ("PyTorch sees no CUDA device", None, "CuPy is not installed", [])


def test_the_torch_runner_finds_a_wrong_bf16_product(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch  # the test extra installs torch's CPU wheel: a missing torch fails here, never skips

    real = torch.mm

    def faulty(a: Any, b: Any) -> Any:
        out = real(a, b)
        if a.dtype == torch.bfloat16 and tuple(a.shape) == (known_answer.N, known_answer.N):
            out = out.clone()
            out[1, 2] += 4.0  # a stuck bit in one lane
        return out

    monkeypatch.setattr(torch, "mm", faulty)
    res = TorchRunner("cpu").measure(None, 0.2)  # type: ignore[arg-type]
    assert res.health["known_answer"] == {"fp16": "ok", "bf16": "wrong", "fp32": "ok", "fp64": "ok"}
    (problem,) = res.problems
    assert problem.startswith(f"{WRONG_ANSWER}: bf16 matrix multiply off by"), problem


async def test_a_fast_wrong_gpu_is_quarantined_never_scored_and_never_leased(tmp_path: Path,
                                                                            aiohttp_client: Any) -> None:
    compute = FakeComputeRunner(speeds={BAD: 1.3}, wrong={BAD})  # the fastest of all, and wrong
    rig, app, parts = topology_rig(tmp_path, runners=[FakeHealthRunner(), compute],
                                   probe_settings=ProbeSettings(period_s=0, runs=3))
    client = await aiohttp_client(app)
    op = rig.auth("operator")
    first = await (await client.post(f"/v1/gpus/{ALL[0]}/probe", headers=op)).json()
    assert first["ok"] and first["score"] == 1.0
    bad = await (await client.post(f"/v1/gpus/{BAD}/probe", headers=op)).json()
    assert not bad["ok"] and bad["score"] is None and "known-answer check failed" in bad["note"], bad
    assert (bad["score_basis"], bad["peers"], bad["reference"]) == ("none", 0, {}), bad  # compared with nothing
    assert bad["quarantined"].startswith(f"probe: {WRONG_ANSWER}: fp16 matrix multiply"), bad
    assert BAD not in parts.probes.latest and BAD not in parts.probes.history_best  # nobody's reference
    peer = await (await client.post(f"/v1/gpus/{ALL[1]}/probe", headers=op)).json()
    assert peer["score"] == pytest.approx(1.0) and peer["reference"]["matmul_tflops"] == pytest.approx(100.0)
    gpus = {g["id"]: g for g in (await (await client.get("/v1/gpus", headers=op)).json())["gpus"]}
    assert gpus[BAD]["state"] == "quarantined"
    leases = [await (await client.post("/v1/leases", json={"gpus": 1}, headers=rig.auth(vm))).json()
              for vm in ("vm-a", "vm-b", "vm-c", "vm-d")]
    taken = {d["gpu_id"] for x in leases for d in x.get("devices", [])}
    assert len(taken) == 4 and BAD not in taken
    r = await client.post("/v1/leases", json={"gpus": 8, "domain": "vm-a"}, headers=op)
    assert r.status == 409  # seven GPUs in service, never the eighth


async def test_the_fake_hosts_gpus_probe_with_per_model_figures_and_can_be_told_to_answer_wrong(
        tmp_path: Path, aiohttp_client: Any) -> None:
    """The composition of a fake host (host.kernel = fake: the demo, the rigs) adds the simulated compute runner:
    a probe on demo16 shows each model's capability vector and verdict; a GPU whose `sim_compute` file says
    `wrong` is quarantined by the known-answer check, one that says `throttle 0.5` by its peers' score."""
    rig = make_rig(tmp_path, scenario="demo16")
    client = await aiohttp_client(make_app(rig.runtime, probe_settings=ProbeSettings(period_s=0, runs=3)))
    op = rig.auth("operator")
    gpus = (await (await client.get("/v1/gpus", headers=op)).json())["gpus"]
    by_model: dict[str, list[dict[str, Any]]] = {}
    for g in gpus:
        by_model.setdefault(g["model"].split(" ", 1)[0], []).append(g)
    a100, t4 = by_model["GA100"], by_model["TU104GL"]
    first = await (await client.post(f"/v1/gpus/{a100[0]['id']}/probe", headers=op)).json()
    assert first["ok"] and first["metrics"][tflops_key("bf16")] == pytest.approx(312.0, rel=0.02), first
    assert first["health"]["sim-compute"]["known_answer"] == {p: "ok" for p in ("fp16", "bf16", "fp32", "fp64")}
    slow = await (await client.post(f"/v1/gpus/{t4[0]['id']}/probe", headers=op)).json()
    assert slow["ok"] and tflops_key("bf16") not in slow["metrics"] and slow["metrics"][tflops_key("fp64")] < 1
    assert first["metrics"][tflops_key("fp16")] > 4 * slow["metrics"][tflops_key("fp16")]  # comparable across models
    sysfs = tmp_path / "host" / "sys" / "bus" / "pci" / "devices"
    (sysfs / a100[1]["address"] / "sim_compute").write_text("wrong\n")
    (sysfs / a100[2]["address"] / "sim_compute").write_text("throttle 0.5\n")
    wrong = await (await client.post(f"/v1/gpus/{a100[1]['id']}/probe", headers=op)).json()
    assert wrong["quarantined"].startswith(f"probe: {WRONG_ANSWER}: fp16"), wrong
    assert len(wrong["problems"]) == 1 and len(wrong["runs"]) == 3  # three runs, one problem said once
    await client.post(f"/v1/gpus/{a100[3]['id']}/probe", headers=op)  # a second healthy peer
    throttled = await (await client.post(f"/v1/gpus/{a100[2]['id']}/probe", headers=op)).json()
    assert throttled["score"] == pytest.approx(0.5, abs=0.03) and "below 0.70" in throttled["quarantined"], throttled


async def test_measured_speed_is_the_prior_for_a_request_that_names_its_precision(tmp_path: Path,
                                                                                   aiohttp_client: Any) -> None:
    """No model has records here (the cold-start rule decides). With the A100s and V100s taken, an fp64 request
    goes to the Quadro RTX 6000 (0.51 TFLOP/s fp64 measured) over the T4 (0.25) once the probes have measured
    them, and by address (the T4 first) before any probe."""

    async def third_lease(rig_dir: Path, probed: bool, **body: Any) -> str:
        rig = make_rig(rig_dir, scenario="demo16", placement={"explore_epsilon": 0.0})  # no random tries
        client = await aiohttp_client(make_app(rig.runtime, probe_settings=ProbeSettings(enabled=False, period_s=0,
                                                                                        runs=3)))
        # three runs: every GPU's median is its model's figure, so the peer-relative scores tie at 1.0
        op = rig.auth("operator")
        if probed:
            for g in rig.runtime.manager.gpus:
                r = await client.post(f"/v1/gpus/{g}/probe", headers=op)
                assert r.status == 200, await r.text()
        for vm, need in (("vm-a", ["bf16"]), ("vm-b", ["fp64"])):  # the four A100s, then the four V100s
            r = await client.post("/v1/leases", json={"gpus": 4, "requires": need}, headers=rig.auth(vm))
            assert r.status == 201, await r.text()
        r = await client.post("/v1/leases", json={"gpus": 1, **body}, headers=rig.auth("vm-c"))
        lease = await r.json()
        assert r.status == 201, lease
        gpus = (await (await client.get("/v1/gpus", headers=op)).json())["gpus"]
        model = {g["id"]: g["model"] for g in gpus}[lease["devices"][0]["gpu_id"]]
        speed_said = any("measured fp64 speed" in r for r in lease["reasons"])
        assert speed_said == (probed and body.get("precision") == "fp64"), lease["reasons"]
        return model.split(" ", 1)[0]

    assert await third_lease(tmp_path / "probed", True, precision="fp64") == "TU102GL"
    assert await third_lease(tmp_path / "unprobed", False, precision="fp64") == "TU104GL"


def test_the_speed_term_needs_a_named_precision_and_a_figure_for_it() -> None:
    from hostagent.domain.placement import DeviceView, PlacementRequest, measured_speed

    fast = DeviceView("a", "A", figures={"tflops_fp64": 10.0, "tflops_fp16": 100.0})
    slow = DeviceView("b", "B", figures={"tflops_fp64": 2.5})
    unmeasured = DeviceView("c", "C")
    devices = [fast, slow, unmeasured]
    assert measured_speed(PlacementRequest(precision="fp64"), devices) == [1.0, 0.25, 0.5]
    assert measured_speed(PlacementRequest(precision="fp16"), devices) == [1.0, 0.5, 0.5]
    assert measured_speed(PlacementRequest(), devices) is None  # no precision named: no speed term
    assert measured_speed(PlacementRequest(precision="int8"), devices) is None  # nothing measured it
