"""What a probe learns of the board reaches placement (#29): the driver's compute capability gives the features
where pci.ids is older than the card, the measured rates add or remove fast precisions, a wrong answer removes its
precision, and the driver's memory size replaces an estimate from the largest BAR; all of it survives a restart.

The service-level test runs `demo16` with a pci.ids that names the vendor but none of its cards, which is what a
Debian 12 host sees with H100 or H200 boards (measured on a real H200: discovery said `10de:2335`, 256 GiB from its
BAR1, capabilities unknown).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from hostagent.domain.capabilities import Measured, capabilities
from hostagent.runtime import build_runtime, make_app
from hostagent.services.probes import ProbeSettings
from hostagent.web.topology import TOPOLOGY
from tests.support.agent import make_rig

GIB = 1024**3
H200 = {"tflops_fp16": 619.3, "tflops_bf16": 644.0, "tflops_fp32": 50.4, "tflops_fp64": 57.2}  # the real figures


def test_the_drivers_compute_capability_gives_the_features_of_a_card_pci_ids_does_not_name() -> None:
    m = Measured.from_probe({"nvml": {"name": "NVIDIA H200", "memory_total_bytes": 150754820096,
                                      "compute_capability": "9.0"},
                             "torch": {"device_name": "NVIDIA H200", "known_answer": {"fp16": "ok"}}}, H200)
    assert (m.compute_capability, m.name, m.memory_bytes, m.wrong) == ("9.0", "NVIDIA H200", 150754820096, frozenset())
    caps = capabilities(0x10DE, None, measured=m)
    assert caps.features == frozenset({"fp16", "bf16", "tf32", "int8", "fp8", "fp64"}), caps
    assert caps.source.startswith("compute capability 9.0 as the driver reports it (Hopper)"), caps.source
    for cc, has, lacks in (("8.0", {"fp64", "bf16"}, {"fp8"}), ("8.6", {"bf16"}, {"fp64"}), ("7.5", {"fp16", "int8"},
                           {"bf16"}), ("8.9", {"fp8"}, {"fp64"}), ("6.1", {"int8"}, {"fp16"})):
        got = capabilities(0x10DE, "", measured=Measured(compute_capability=cc)).features
        assert got is not None and has <= got and not lacks & got, (cc, got)
    for unknown in (Measured(), Measured(compute_capability="99.1"), None):
        caps = capabilities(0x10DE, None, measured=unknown)
        assert caps.features is None and "no probe has read its compute capability" in caps.source
    assert capabilities(0x1002, None, measured=Measured(compute_capability="9.0")).features is None  # NVIDIA's scale


@pytest.mark.parametrize("name,figures,wrong,adds,removes", [
    # FP64 measured at 1/32 of FP32 on a card whose name says x100: removed (and said)
    ("GA100 [A100 PCIe 40GB]", {"tflops_fp32": 19.5, "tflops_fp64": 0.6}, (), set(), {"fp64"}),
    # FP64 at half the FP32 rate on a chip the name says lacks it: added
    ("TU104GL [Tesla T4]", {"tflops_fp32": 8.1, "tflops_fp64": 4.0}, (), {"fp64"}, set()),
    # BF16 measured fast (tensor cores) on a Turing name: added; FP16 below 1.5x FP32: removed
    ("TU104GL [Tesla T4]", {"tflops_fp32": 8.1, "tflops_bf16": 40.0, "tflops_fp16": 10.0}, (), {"bf16"}, {"fp16"}),
    # a wrong answer removes its precision whatever the rate
    ("GA100 [A100 PCIe 40GB]", {"tflops_fp32": 19.5, "tflops_bf16": 312.0}, ("bf16",), set(), {"bf16"}),
    # nothing measured against FP32: the name stands
    ("GA100 [A100 PCIe 40GB]", {"tflops_fp16": 300.0}, (), set(), set()),
])
def test_measured_rates_add_and_remove_fast_precisions(name: str, figures: dict[str, float], wrong: tuple[str, ...],
                                                       adds: set[str], removes: set[str]) -> None:
    by_name = capabilities(0x10DE, name)
    measured = capabilities(0x10DE, name, measured=Measured(figures=figures, wrong=frozenset(wrong)))
    assert by_name.features is not None and measured.features is not None
    assert measured.features - by_name.features == adds and by_name.features - measured.features == removes
    for f in adds:
        assert f"probe adds {f}" in measured.source, measured.source
    for f in removes:
        assert f"probe removes {f}" in measured.source, measured.source
    if not adds and not removes:
        assert measured.source == by_name.source


async def test_a_host_whose_pci_ids_is_older_than_its_cards_learns_them_from_the_probes(
        tmp_path: Path, aiohttp_client: Any) -> None:
    ids = tmp_path / "pci.ids"
    ids.write_text("10de  NVIDIA Corporation\n")  # the vendor, none of its cards
    rig = make_rig(tmp_path, scenario="demo16", host={"pci_ids_path": str(ids)})
    client = await aiohttp_client(make_app(rig.runtime, probe_settings=ProbeSettings(enabled=False, period_s=0,
                                                                                    runs=1)))
    op = rig.auth("operator")

    async def gpus() -> dict[str, dict[str, Any]]:
        return {g["id"]: g for g in (await (await client.get("/v1/gpus", headers=op)).json())["gpus"]}

    before = await gpus()
    a100 = [g for g in before.values() if g["model"] == "10de:20f1"]
    t4 = [g for g in before.values() if g["model"] == "10de:1eb8"]
    assert len(a100) == 4 and len(t4) == 4
    assert {g["memory_source"] for g in a100} == {"bar"} and a100[0]["memory_bytes"] == 64 * GIB  # BAR1, not 40 GB
    assert all(g["capabilities"]["features"] is None for g in before.values())
    r = await client.post("/v1/leases", json={"domain": "vm-a", "requires": ["fp64"]}, headers=op)
    assert r.status == 409 and (await r.json())["error"]["field"] == "requires"

    bad = t4[0]["id"]  # its fp16 product comes out wrong: quarantined, and fp16 is no longer among its features
    (tmp_path / "host" / "sys" / "bus" / "pci" / "devices" / t4[0]["address"] / "sim_compute").write_text("wrong\n")
    for gid in before:
        assert (await client.post(f"/v1/gpus/{gid}/probe", headers=op)).status == 200
    after = await gpus()
    for g in a100:
        got = after[g["id"]]
        assert (got["memory_bytes"], got["memory_source"]) == (40 * GIB, "probe"), got
        assert "fp64" in got["capabilities"]["features"] and "bf16" in got["capabilities"]["features"]
        assert got["capabilities"]["source"].startswith("compute capability 8.0"), got["capabilities"]
    assert after[bad]["state"] == "quarantined" and after[bad]["capabilities"]["features"] == ["int8"], after[bad]
    assert "probe removes fp16 (wrong answer)" in after[bad]["capabilities"]["source"]
    for g in t4[1:]:
        assert after[g["id"]]["capabilities"]["features"] == ["fp16", "int8"], after[g["id"]]
        assert after[g["id"]]["memory_bytes"] == 15 * GIB
    # placement reads the same: fp64 lands on an A100 or a V100, never a T4 or a Quadro; memory in the tenant's terms
    # counts 40 GB A100s (three for 100 GiB), not 64 GiB BARs (two)
    r = await client.post("/v1/leases", json={"domain": "vm-a", "gpus": 8, "requires": ["fp64"]}, headers=op)
    lease = await r.json()
    assert r.status == 201, lease
    assert {after[d["gpu_id"]]["model"] for d in lease["devices"]} == {"10de:20f1", "10de:1db6"}
    r = await client.post("/v1/leases", json={"domain": "vm-b", "total_memory_gib": 100, "requires": ["bf16"]},
                          headers=op)
    assert r.status == 409  # the A100s (the only bf16 cards) are taken
    await client.delete(f"/v1/leases/{lease['id']}", headers=op)
    r = await client.post("/v1/leases", json={"domain": "vm-b", "total_memory_gib": 100, "requires": ["bf16"]},
                          headers=op)
    mem = await r.json()
    assert r.status == 201 and len(mem["devices"]) == 3, mem

    # a later probe whose runners say nothing of the board (its compute runner failed) forgets none of it
    v100 = next(g["id"] for g in before.values() if g["model"] == "10de:1db6")  # free again
    before_fail = after[v100]
    assert before_fail["capabilities"]["features"] and "fp64" in before_fail["capabilities"]["features"]
    # the simulated runner fails for a board it has no figures for: take them away for one probe
    from hostagent.host import fakeprobes

    saved = dict(fakeprobes.BOARDS)
    fakeprobes.BOARDS.clear()
    try:
        report = await (await client.post(f"/v1/gpus/{v100}/probe", headers=op)).json()
    finally:
        fakeprobes.BOARDS.update(saved)
    assert not report["metrics"] and "no simulated figures" in (report["note"] or ""), report
    assert (await gpus())[v100]["capabilities"] == before_fail["capabilities"]

    # a restart learns it all again from the probe history in the store
    runtime = build_runtime(rig.settings, hypervisor=rig.hv)
    app = make_app(runtime, probe_settings=ProbeSettings(enabled=False, period_s=0))
    again = await aiohttp_client(app)
    restored = {g["id"]: g for g in (await (await again.get("/v1/gpus", headers=op)).json())["gpus"]}
    for g in a100:
        assert (restored[g["id"]]["memory_source"], restored[g["id"]]["memory_bytes"]) == ("probe", 40 * GIB)
        assert restored[g["id"]]["capabilities"] == after[g["id"]]["capabilities"]
    assert restored[bad]["capabilities"] == after[bad]["capabilities"]
    assert bad not in app[TOPOLOGY].probes.latest  # fast and wrong: still nobody's reference after the restart
