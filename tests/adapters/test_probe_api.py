"""Probes through the API on the fake dgx8 host: fake runners, scoring vs peers, quarantine, scheduling, store."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import pytest

from hostagent.host.fakekernel import FakeKernel
from hostagent.host.probes import SysfsHealthRunner, default_runners
from hostagent.services.probes import ProbeSettings
from tests.support.topology import ALL, SWITCH_A, FakeComputeRunner, FakeHealthRunner, topology_rig

SLOW = ALL[5]


async def probe(client: Any, rig: Any, gpu: str, status: int = 200) -> dict[str, Any]:
    r = await client.post(f"/v1/gpus/{gpu}/probe", headers=rig.auth("operator"))
    body = await r.json()
    assert r.status == status, body
    return body


async def test_scores_against_peers_and_quarantines_a_slow_gpu(tmp_path: Path, aiohttp_client: Any) -> None:
    compute = FakeComputeRunner(speeds={SLOW: 0.5}, noise=[1.0, 0.96, 1.04])
    rig, app, parts = topology_rig(tmp_path, runners=[FakeHealthRunner(), compute],
                                   probe_settings=ProbeSettings(period_s=0, runs=3))
    client = await aiohttp_client(app)
    first = await probe(client, rig, ALL[0])
    assert first["score"] == 1.0 and first["score_basis"] == "first" and first["ok"]
    assert first["metrics"]["matmul_tflops"] == pytest.approx(100.0)  # median of 96, 100, 104
    assert len(first["runs"]) == 3 and compute.calls == [ALL[0]] * 3
    for g in ALL[1:5]:
        body = await probe(client, rig, g)
        assert body["score"] == pytest.approx(1.0) and body["score_basis"] == "peers"
    slow = await probe(client, rig, SLOW)
    assert slow["score"] == pytest.approx(0.5, abs=0.01) and slow["spread"] == pytest.approx(0.02, abs=0.005)
    assert slow["peers"] == 5 and not slow["ok"] and "below 0.70" in slow["quarantined"]
    gpus = {g["id"]: g for g in (await (await client.get("/v1/gpus", headers=rig.auth("operator"))).json())["gpus"]}
    assert gpus[SLOW]["state"] == "quarantined" and "probe: score 0.50" in gpus[SLOW]["quarantine_reason"]
    # placement feature and topology view see the scores
    assert parts.probes.score_of(SLOW) == pytest.approx(0.5, abs=0.01)
    topo = await (await client.get("/v1/topology", headers=rig.auth("operator"))).json()
    assert topo["probe_scores"][ALL[1]] == pytest.approx(1.0)
    # the usage store got one row per probe with the details
    await asyncio.sleep(0)
    rows = await rig.runtime.store.list_probe_results(gpu_id=SLOW)
    assert len(rows) == 1 and rows[0]["ok"] is False and rows[0]["score"] == pytest.approx(0.5, abs=0.01)
    assert rows[0]["details"]["metrics"]["mem_bandwidth_gbps"] == pytest.approx(750.0, rel=0.05)
    stored = {g["gpu_id"]: g for g in await rig.runtime.store.list_gpus()}
    assert stored[ALL[1]]["probe_score"] == pytest.approx(1.0)
    events = rig.runtime.journal.events(gpu_id=SLOW)
    assert [e.kind for e in events if e.kind in ("probe", "quarantine")] == ["quarantine", "probe"]


async def test_uncorrectable_error_quarantines(tmp_path: Path, aiohttp_client: Any) -> None:
    health = FakeHealthRunner(problems={ALL[2]: ("3 uncorrectable ECC error(s) since the driver loaded",)})
    rig, app, _ = topology_rig(tmp_path, runners=[health])
    client = await aiohttp_client(app)
    body = await probe(client, rig, ALL[2])
    assert not body["ok"] and "uncorrectable ECC" in body["quarantined"]
    assert body["score"] is None and "no throughput measured" in body["note"]
    ok = await probe(client, rig, ALL[3])
    assert ok["ok"] and ok["quarantined"] is None and ok["health"]["fake-health"]["temperature_c"] == 40


async def test_never_during_a_lease_and_operator_only(tmp_path: Path, aiohttp_client: Any) -> None:
    compute = FakeComputeRunner()
    rig, app, _ = topology_rig(tmp_path, runners=[compute])
    client = await aiohttp_client(app)
    lease = await (await client.post("/v1/leases", json={"gpus": 2}, headers=rig.auth("vm-a"))).json()
    held = lease["devices"][0]["gpu_id"]
    body = await probe(client, rig, held, status=409)
    assert "probes run only between leases" in body["error"]["message"] and body["error"]["field"] == "gpu_id"
    assert compute.calls == []
    r = await client.post(f"/v1/gpus/{ALL[7]}/probe", headers=rig.auth("vm-a"))
    assert r.status == 403
    r = await client.post(f"/v1/gpus/{ALL[7]}/probe")
    assert r.status == 401
    await probe(client, rig, "gpu-nope", status=404)


class GatedRunner(FakeComputeRunner):
    """A compute runner whose run says it started, then blocks (in the probe's worker thread) until `gate` opens."""

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.get_running_loop()
        self.started = asyncio.Event()
        self.gate = threading.Event()

    def run(self, gpu: Any, budget_s: float) -> Any:
        self.loop.call_soon_threadsafe(self.started.set)
        self.gate.wait()
        return super().run(gpu, budget_s)


async def test_gpu_is_claimed_while_probed(tmp_path: Path, aiohttp_client: Any) -> None:
    """While a probe runs the GPU cannot be placed: a lease for all 8 GPUs must wait for it."""
    runner = GatedRunner()
    rig, app, parts = topology_rig(tmp_path, runners=[runner], probe_settings=ProbeSettings(period_s=0, runs=1))
    client = await aiohttp_client(app)
    task = parts.probes.schedule(ALL[0], actor="test")
    await runner.started.wait()
    assert rig.runtime.manager.claims[ALL[0]] == f"probe:{ALL[0]}"
    gpus = (await (await client.get("/v1/gpus", headers=rig.auth("operator"))).json())["gpus"]
    states = {g["id"]: g["state"] for g in gpus}
    assert states[ALL[0]] == "probing", states  # not "leased": no lease holds it (it once read so)
    r = await client.post("/v1/leases", json={"gpus": 8, "accept_deferred": True}, headers=rig.auth("vm-a"))
    queued = await r.json()
    assert r.status == 202 and queued["state"] == "QUEUED"
    runner.gate.set()
    await task
    assert ALL[0] not in rig.runtime.manager.claims or not rig.runtime.manager.claims[ALL[0]].startswith("probe:")
    assert rig.runtime.manager.gpu_state(ALL[0]).value in ("free", "leased")  # back to free, or the queued lease has it
    for _ in range(200):
        body = await (await client.get(f"/v1/leases/{queued['id']}", headers=rig.auth("vm-a"))).json()
        if body["state"] == "ACTIVE":
            break
        await asyncio.sleep(0.02)
    assert body["state"] == "ACTIVE" and len(body["devices"]) == 8


async def test_scheduled_probes_coalesce_per_gpu(tmp_path: Path) -> None:
    """A busy host ends leases faster than probes run: one waiting task per GPU, however often it is scheduled."""
    runner = GatedRunner()
    rig, _app, parts = topology_rig(tmp_path, runners=[runner], probe_settings=ProbeSettings(period_s=0, runs=1))
    probes = parts.probes
    first = probes.schedule(ALL[0], actor="test")
    await runner.started.wait()  # ALL[0] is being probed
    again = [probes.schedule(ALL[0], actor="test") for _ in range(50)]  # scheduled while its probe runs
    others = [probes.schedule(ALL[1], delay_s=0.05 * (i % 3), actor="test") for i in range(50)]
    assert all(t is first for t in again) and all(t is others[0] for t in others)
    assert len(probes._pending) == 2  # noqa: SLF001 - the bound under test
    runner.gate.set()
    await asyncio.gather(first, others[0])
    # ALL[0]: the running probe, then one more for the schedules made meanwhile; ALL[1]: once, not 50 times
    assert sorted(runner.calls) == sorted([ALL[0], ALL[0], ALL[1]])
    assert not probes._pending and not probes._due  # noqa: SLF001
    assert rig.runtime.manager.claims == {}


async def test_probe_after_a_lease_ends(tmp_path: Path, aiohttp_client: Any) -> None:
    compute = FakeComputeRunner()
    rig, app, parts = topology_rig(tmp_path, runners=[compute],
                                   probe_settings=ProbeSettings(period_s=0, runs=1, after_lease_delay_s=0.0))
    client = await aiohttp_client(app)
    lease = await (await client.post("/v1/leases", json={"gpus": 2}, headers=rig.auth("vm-a"))).json()
    assert compute.calls == []
    r = await client.delete(f"/v1/leases/{lease['id']}", headers=rig.auth("vm-a"))
    assert r.status == 200
    for _ in range(200):
        if sorted(compute.calls) == list(SWITCH_A):
            break
        await asyncio.sleep(0.02)
    assert sorted(compute.calls) == list(SWITCH_A)


async def test_periodic_sweep_probes_only_free_stale_gpus(tmp_path: Path, aiohttp_client: Any) -> None:
    compute = FakeComputeRunner()
    rig, app, parts = topology_rig(tmp_path, runners=[compute], probe_settings=ProbeSettings(period_s=3600, runs=1))
    client = await aiohttp_client(app)
    await client.post("/v1/leases", json={"gpus": 2}, headers=rig.auth("vm-a"))
    done = await parts.probes.sweep()
    assert sorted(r.gpu_id for r in done) == sorted(set(ALL) - set(SWITCH_A))
    assert await parts.probes.sweep() == []  # nothing is stale an instant later


async def test_without_compute_runners_the_probe_says_so(tmp_path: Path, aiohttp_client: Any) -> None:
    """The real runner set on the fake host: sysfs only (no NVML library, no torch/cupy here)."""
    rig, app, parts = topology_rig(tmp_path, runners=default_runners(FakeKernel(tmp_path / "host" / "sys")))
    client = await aiohttp_client(app)
    status = await (await client.get("/v1/probes", headers=rig.auth("operator"))).json()
    runners = {r["name"]: r for r in status["runners"]}
    assert runners["sysfs"]["available"]
    body = await probe(client, rig, ALL[0])
    assert body["score"] is None and body["metrics"] == {} and body["ok"]
    if not runners["torch"]["available"] and not runners["cupy"]["available"]:
        assert "no throughput measured" in body["note"] and "torch" in body["note"]
    assert body["health"]["sysfs"]["link_width"] == 16


def test_sysfs_runner_reads_link_and_aer(tmp_path: Path) -> None:
    from hostagent.host.discovery import discover
    from hostagent.host.fakesysfs import build_tree

    tree = build_tree(tmp_path, "dgx8")
    dev = tree.sys_root / "bus/pci/devices/0000:03:00.0"
    (dev / "current_link_width").write_text("8\n")
    (dev / "aer_dev_fatal").write_text("Undefined 0\nDLP 1\nTOTAL_ERR_FATAL 1\n")
    (dev / "aer_dev_correctable").write_text("RxErr 4\nTOTAL_ERR_COR 4\n")
    sysfs = FakeKernel(tree.sys_root)
    gpu = discover(sysfs).gpu(ALL[0])
    assert gpu is not None
    res = SysfsHealthRunner(sysfs).run(gpu, 1.0)
    assert res.health["link_width"] == 8 and res.health["aer_fatal"] == 1 and res.health["aer_correctable"] == 4
    assert res.problems == ("PCIe AER reports 1 fatal error(s)",)
    assert "trained at x8, capable of x16" in res.warnings[0]


def test_compute_runners_measure_in_a_child_process(tmp_path: Path) -> None:
    """A CUDA context must not live in the agent: the child reports back as JSON, errors included, never numbers
    it did not measure."""
    from hostagent.domain.inventory import Gpu, PciFunction
    from hostagent.domain.pci import PciAddress
    from hostagent.host.probes import TorchRunner, run_in_child

    fn = PciFunction(address=PciAddress.parse("0000:ff:1f.7"), vendor_id=0x10DE, device_id=0x20B0,
                     class_code=0x030200)
    ghost = Gpu(id="gpu-0000-ff-1f-7", primary=fn, functions=(fn,), group=None)
    res = run_in_child("torch", ghost, 0.1)
    assert res.runner == "torch" and res.metrics == {} and "no GPU at 0000:ff:1f.7" in (res.error or "")
    assert TorchRunner().run(ghost, 0.1).error == res.error


async def test_what_a_probe_says_in_its_report_the_journal_and_the_status(tmp_path: Path, aiohttp_client: Any) -> None:
    """A clean probe has no note; its journal event gives the score; GET /v1/probes lists it per GPU. A runner
    that raises is said in the note by its exception's type, beside the other runners' results."""

    class Broken(FakeHealthRunner):
        def run(self, gpu: Any, budget_s: float) -> Any:
            raise RuntimeError("the library went away")

    rig, app, _ = topology_rig(tmp_path, runners=[FakeHealthRunner(), FakeComputeRunner()],
                               probe_settings=ProbeSettings(period_s=0, runs=1))
    client = await aiohttp_client(app)
    body = await probe(client, rig, ALL[0])
    assert body["ok"] and body["score"] == 1.0 and body["note"] is None, body
    (event,) = [e for e in rig.runtime.journal.events(gpu_id=ALL[0]) if e.kind == "probe"]
    assert event.detail == "score 1.00 ± 0.00 (first)", event.detail
    status = await (await client.get("/v1/probes", headers=rig.auth("operator"))).json()
    mine = status["gpus"][ALL[0]]
    assert mine["score"] == 1.0 and mine["ok"] is True and mine["last_probe"] == pytest.approx(body["ts"]), mine
    assert status["gpus"][ALL[1]] == {"score": None, "last_probe": None, "ok": None}

    rig2, app2, _ = topology_rig(tmp_path / "two", runners=[Broken(name="broken"), FakeComputeRunner()],
                                 probe_settings=ProbeSettings(period_s=0, runs=1))
    client2 = await aiohttp_client(app2)
    body = await probe(client2, rig2, ALL[1])
    assert body["score"] == 1.0 and body["note"] == "broken: RuntimeError: the library went away", body


async def test_a_probe_refuses_a_gpu_off_its_host_driver_or_not_leasable(tmp_path: Path, aiohttp_client: Any) -> None:
    compute = FakeComputeRunner()
    rig, app, _ = topology_rig(tmp_path, runners=[compute])
    client = await aiohttp_client(app)
    gpu = rig.runtime.manager.gpus[ALL[4]]
    assert (await rig.runtime.run(rig.runtime.host.bind, gpu, None)).ok  # on vfio-pci, with no lease
    body = await probe(client, rig, ALL[4], status=409)
    assert body["error"]["field"] == "gpu_id" and "is on vfio-pci, not its host driver" in body["error"]["message"]
    assert compute.calls == [] and ALL[4] not in rig.runtime.manager.claims  # nothing ran, nothing held

    rig2, app2, _ = topology_rig(tmp_path / "off", runners=[compute], scenario="iommu-off")
    client2 = await aiohttp_client(app2)
    unviable = next(iter(rig2.runtime.manager.gpus))
    body = await probe(client2, rig2, unviable, status=409)
    assert body["error"]["field"] == "gpu_id" and "is not leasable" in body["error"]["message"], body
