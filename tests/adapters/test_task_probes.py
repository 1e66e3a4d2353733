"""A task type's own probe (#29): the operator registers a command per task type (`[probes] task_probes`); it runs
on one free GPU of each model, first when the task type is new, and its work rate is the cold-start rule's speed
term for that task type (over the capability vector), kept across restarts."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

from hostagent.runtime import build_runtime, make_app
from hostagent.services.probes import PROBE_CLAIM_PREFIX, ProbeSettings
from hostagent.web.topology import TOPOLOGY
from tests.support.agent import AgentRig, make_rig
from tests.support.waits import until as wait_for

# resnet per GPU model, reversed from their FP16 figures: only the task probe can make the T4 the fastest
RATES = {"GA100": 500.0, "GV100": 300.0, "TU104": 900.0, "TU102": 100.0}
PROBE = """import json, os, sys
rates = json.load(open(sys.argv[1]))
if rates.get("fail"):
    print("no CUDA here", file=sys.stderr)
    sys.exit(3)
print("warming up")
print(json.dumps({"work_rate": rates[os.environ["HOSTAGENT_PROBE_GPU"]],
                  "task": os.environ["HOSTAGENT_PROBE_TASK"], "budget": os.environ["HOSTAGENT_PROBE_BUDGET_S"]}))
"""


def rig_with_probes(tmp: Path, *, fail: bool = False) -> AgentRig:
    script, table = tmp / "probe.py", tmp / "rates.json"
    script.write_text(PROBE)
    rig = make_rig(tmp, scenario="demo16", placement={"cold_explore_epsilon": 0.0},  # the figure alone places
                   probes={"task_probes": {"resnet": f"{sys.executable} {script} {table}"}})
    table.write_text(json.dumps({"fail": fail} | {str(g.address): RATES[g.model[:5]]
                                                  for g in rig.runtime.manager.gpus.values()}))
    return rig


async def until(client: Any, op: dict[str, str], done: Any, timeout_s: float = 30.0) -> dict[str, Any]:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        body = (await (await client.get("/v1/probes", headers=op)).json())["task_probes"]["resnet"]
        if done(body) or asyncio.get_running_loop().time() > deadline:
            return body  # type: ignore[no-any-return]
        await asyncio.sleep(0.1)


async def test_a_new_task_type_is_probed_first_and_its_figure_places_the_next_request(
        tmp_path: Path, aiohttp_client: Any) -> None:
    rig = rig_with_probes(tmp_path)
    client = await aiohttp_client(make_app(rig.runtime, probe_settings=ProbeSettings(enabled=False, period_s=0)))
    op = rig.auth("operator")
    before = (await (await client.get("/v1/probes", headers=op)).json())["task_probes"]["resnet"]
    assert before["work_rate"] == {} and len(before["missing"]) == 4 and before["command"][0] == sys.executable
    # the first resnet request is placed as any new task type is, and sets off its probe on every model
    r = await client.post("/v1/leases", json={"task_type": "resnet"}, headers=rig.auth("vm-a"))
    first = await r.json()
    assert r.status == 201 and not any("task probe" in x for x in first["reasons"]), first
    body = await until(client, op, lambda b: len(b["work_rate"]) == 4)
    assert {m[:5]: v for m, v in body["work_rate"].items()} == RATES and body["missing"] == [], body
    # the figures are in once every probe has measured; the probes give their GPUs back just after: wait for that
    claims = rig.runtime.manager.claims
    await wait_for(lambda: not any(c.startswith(PROBE_CLAIM_PREFIX) for c in claims.values()), 10, "the probes' GPUs back")
    model = {g.id: g.model for g in rig.runtime.manager.gpus.values()}
    r = await client.post("/v1/leases", json={"task_type": "resnet"}, headers=rig.auth("vm-b"))
    second = await r.json()
    assert r.status == 201 and model[second["devices"][0]["gpu_id"]].startswith("TU104"), second
    assert any("measured resnet work rate (its task probe)" in x for x in second["reasons"]), second["reasons"]
    # another task type is not touched by it; nothing was quarantined or left claimed by a probe
    r = await client.post("/v1/leases", json={"task_type": "bert", "gpus": 1}, headers=rig.auth("vm-c"))
    assert not any("task probe" in x for x in (await r.json())["reasons"])
    assert not rig.runtime.manager.quarantined
    assert not [c for c in rig.runtime.manager.claims.values() if c.startswith("probe:")]
    events = (await (await client.get("/v1/events?kind=probe", headers=op)).json())["events"]
    assert sum("task probe resnet: 900/s on TU104" in (e.get("detail") or "") for e in events) == 1, events


async def test_probes_at_start_and_their_figures_survive_a_restart(tmp_path: Path, aiohttp_client: Any) -> None:
    rig = rig_with_probes(tmp_path)
    client = await aiohttp_client(make_app(rig.runtime, probe_settings=ProbeSettings(period_s=0)))
    op = rig.auth("operator")
    body = await until(client, op, lambda b: len(b["work_rate"]) == 4)  # no request needed: probed at start
    assert body["missing"] == [], body
    # a compute probe of every T4 afterwards keeps their task figure (it is the model's, not the probe's)
    t4 = [g.id for g in rig.runtime.manager.gpus.values() if g.model.startswith("TU104")]
    for gid in t4:
        assert (await client.post(f"/v1/gpus/{gid}/probe", headers=op)).status == 200
    assert all(rig.runtime.manager.measured[g].figures.get("work_rate:resnet") == 900.0 for g in t4)
    assert all(rig.runtime.manager.measured[g].figures.get("tflops_fp16") for g in t4)
    runtime = build_runtime(rig.settings, hypervisor=rig.hv)
    again = await aiohttp_client(make_app(runtime, probe_settings=ProbeSettings(enabled=False, period_s=0)))
    restored = (await (await again.get("/v1/probes", headers=op)).json())["task_probes"]["resnet"]
    assert restored["work_rate"] == body["work_rate"], restored
    r = await again.post("/v1/leases", json={"task_type": "resnet"}, headers=rig.auth("vm-a"))
    lease = await r.json()
    assert r.status == 201 and any("its task probe" in x for x in lease["reasons"]), lease


async def test_a_failing_task_probe_is_reported_and_blames_no_gpu(tmp_path: Path, aiohttp_client: Any) -> None:
    rig = rig_with_probes(tmp_path, fail=True)
    client = await aiohttp_client(make_app(rig.runtime, probe_settings=ProbeSettings(period_s=0)))
    op = rig.auth("operator")
    body = await until(client, op, lambda b: len(b["errors"]) == 4)
    assert body["work_rate"] == {} and all("exited 3" in e and "no CUDA here" in e for e in body["errors"].values())
    assert not rig.runtime.manager.quarantined and not rig.runtime.manager.attention
    assert not [c for c in rig.runtime.manager.claims.values() if c.startswith("probe:")]


async def test_a_model_whose_gpus_are_all_busy_is_probed_once_one_is_free_and_a_failure_is_retried(
        tmp_path: Path, aiohttp_client: Any) -> None:
    rig = rig_with_probes(tmp_path, fail=True)
    app = make_app(rig.runtime, probe_settings=ProbeSettings(enabled=False, period_s=0))
    client = await aiohttp_client(app)
    op = rig.auth("operator")
    # every A100 (the first model in order) is leased: the others are probed, the A100 is left for later
    r = await client.post("/v1/leases", json={"domain": "vm-a", "gpus": 4, "model": "A100", "task_type": "other"},
                          headers=op)
    a100s = await r.json()
    assert r.status == 201, a100s
    parts = app[TOPOLOGY].task_probes
    chosen = parts.schedule("resnet")
    model = {g.id: g.model[:5] for g in rig.runtime.manager.gpus.values()}
    assert sorted(model[g] for g in chosen) == ["GV100", "TU102", "TU104"], chosen
    body = await until(client, op, lambda b: len(b["errors"]) == 3)
    assert sorted(m[:5] for m in body["errors"]) == ["GV100", "TU102", "TU104"] and body["work_rate"] == {}
    busy = await parts.probe("resnet", a100s["devices"][0]["gpu_id"])  # a leased GPU is never probed
    assert busy.runner == "task:resnet" and "held by lease" in (busy.error or ""), busy
    # the command is fixed; the next resnet request probes every model still missing, the freed A100s included
    table = tmp_path / "rates.json"
    table.write_text(table.read_text().replace('"fail": true', '"fail": false'))
    await client.delete(f"/v1/leases/{a100s['id']}", headers=op)
    r = await client.post("/v1/leases", json={"task_type": "resnet"}, headers=rig.auth("vm-b"))
    assert r.status == 201
    body = await until(client, op, lambda b: len(b["work_rate"]) == 4)
    assert {m[:5]: v for m, v in body["work_rate"].items()} == RATES and body["errors"] == {}, body
    events = (await (await client.get("/v1/events?kind=probe", headers=op)).json())["events"]
    tasks = [e for e in events if "task probe resnet" in (e.get("detail") or "")]
    assert len(tasks) == 7 and {e["actor"] for e in tasks} == {"task-probe"}, tasks  # 3 failed, then 4
    assert all(e.get("gpu_id") in model or set(e.get("gpu_ids") or ()) <= set(model) for e in tasks), tasks
    assert all(e.get("gpu_id") or e.get("gpu_ids") for e in tasks), tasks
