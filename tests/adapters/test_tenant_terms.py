"""Requests in the tenant's terms (#29): `requires` (features every GPU must have) on the mixed `demo16` host
(A100, V100, T4, Quadro RTX 6000), `total_memory_gib` (the fewest GPUs that hold it) on `dgx8` (eight A100 40GB),
through the API as a guest sends them: what is granted, what is refused and why, and that a queued request is
never granted on a GPU without what it requires.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from hostagent.domain.capabilities import FEATURES, capabilities
from tests.support.agent import AgentRig, make_rig, start_rig

A100 = "GA100"


async def post(rig: AgentRig, vm: str, **body: Any) -> tuple[int, dict[str, Any]]:
    r = await rig.client.post("/v1/leases", json=body, headers=rig.auth(vm))
    return r.status, await r.json()


async def models_of(rig: AgentRig, lease: dict[str, Any]) -> list[str]:
    gpus = (await (await rig.client.get("/v1/gpus", headers=rig.auth("operator"))).json())["gpus"]
    model = {g["id"]: g["model"] for g in gpus}
    return [model[d["gpu_id"]] for d in lease["devices"]]


@pytest.mark.parametrize("vendor,name,has,lacks", [
    (0x10DE, "GA100 [A100 PCIe 40GB]", {"fp64", "bf16", "tf32", "fp16", "int8"}, {"fp8", "nvlink"}),
    (0x10DE, "GV100GL [Tesla V100 PCIe 32GB]", {"fp64", "fp16"}, {"bf16", "tf32", "int8"}),
    (0x10DE, "TU104GL [Tesla T4]", {"fp16", "int8"}, {"fp64", "bf16"}),
    (0x10DE, "AD102 [GeForce RTX 4090]", {"bf16", "fp8"}, {"fp64"}),
    (0x10DE, "GH100 [H100 SXM5 80GB]", {"fp64", "fp8", "bf16"}, {"nvlink"}),
    (0x10DE, "GP102 [TITAN Xp]", {"int8"}, {"fp16", "fp64"}),
    (0x1002, "Aldebaran/MI200 [Instinct MI250X]", {"fp64", "bf16", "int8"}, {"fp8"}),
])
def test_features_from_the_chip(vendor: int, name: str, has: set[str], lacks: set[str]) -> None:
    caps = capabilities(vendor, name)
    assert caps.features is not None and has <= caps.features and not lacks & caps.features, caps
    assert caps.lacks(tuple(sorted(has))) == ()
    assert set(caps.lacks(tuple(sorted(lacks)))) == lacks


def test_an_unknown_chip_has_no_known_features_and_nvlink_comes_from_the_hints() -> None:
    assert capabilities(0x10DE, "GV100GL [Tesla V100 PCIe 32GB]").chip == "GV100"
    assert capabilities(0x1002, "Aldebaran/MI200 [Instinct MI250X]").chip == "MI200"
    unknown = capabilities(0x10DE, "Some Future Thing")
    assert unknown.chip is None and unknown.features is None and unknown.lacks(("fp16",)) == ("fp16",) and "unknown chip" in unknown.source
    assert capabilities(0x8086, "Data Center GPU Max 1550").features is None
    linked = capabilities(0x10DE, "GA100 [A100 SXM4 40GB]", nvlink=True)
    assert linked.features is not None and "nvlink" in linked.features and "nvlink_hints" in linked.source


async def test_requires_places_only_on_gpus_that_have_it(tmp_path: Path, aiohttp_client: Any) -> None:
    rig = await start_rig(make_rig(tmp_path, scenario="demo16"), aiohttp_client)
    status, lease = await post(rig, "vm-a", gpus=2, requires=["bf16"])
    assert status == 201, lease
    assert all(m.startswith(A100) for m in await models_of(rig, lease)), await models_of(rig, lease)
    assert lease["request"]["requires"] == ["bf16"]
    dropped = {d["reason"] for d in lease["placement"]["dropped"]}
    assert any(r.startswith("lacks bf16 (TU10") and "Turing" in r for r in dropped), dropped
    assert any(r.startswith("lacks bf16 (GV100") for r in dropped), dropped
    status, fp64 = await post(rig, "vm-b", gpus=4, requires=["fp64", "fp16"])  # two A100s left and four V100s
    assert status == 201, fp64
    assert {m[:5] for m in await models_of(rig, fp64)} <= {"GA100", "GV100"}


async def test_requires_nothing_here_has_is_refused_saying_what_there_is(tmp_path: Path, aiohttp_client: Any) -> None:
    rig = await start_rig(make_rig(tmp_path, scenario="demo16"), aiohttp_client)
    for need in (["fp8"], ["nvlink"], ["bf16", "int8", "fp64", "fp8"]):
        status, body = await post(rig, "vm-a", requires=need, accept_deferred=True)
        assert status == 409 and body["error"]["field"] == "requires", body
        msg = body["error"]["message"]
        assert "no GPU on this host has" in msg and "Turing" not in msg and "TU104GL" in msg, msg
    for bad in (["fp7"], "bf16", [1], ["bf16"] * 20):
        status, body = await post(rig, "vm-a", requires=bad)
        assert status == 400 and body["error"]["field"] == "requires", (bad, body)
    leases = (await (await rig.client.get("/v1/leases", headers=rig.auth("operator"))).json())["leases"]
    assert leases == []  # nothing was changed by any of them


async def test_a_queued_request_waits_for_a_gpu_that_has_what_it_requires(tmp_path: Path,
                                                                           aiohttp_client: Any) -> None:
    rig = await start_rig(make_rig(tmp_path, scenario="demo16"), aiohttp_client)
    status, held = await post(rig, "vm-a", gpus=4, requires=["bf16"])  # every A100
    assert status == 201
    status, waiting = await post(rig, "vm-b", requires=["bf16"], accept_deferred=True)
    assert status == 202 and waiting["state"] == "QUEUED", waiting  # twelve GPUs free, none with bf16
    status, other = await post(rig, "vm-c", gpus=2)  # the free T4s and V100s still serve others
    assert status == 201, other
    r = await rig.client.delete(f"/v1/leases/{held['id']}", headers=rig.auth("vm-a"))
    assert r.status == 200
    for _ in range(200):
        now = await (await rig.client.get(f"/v1/leases/{waiting['id']}", headers=rig.auth("vm-b"))).json()
        if now["state"] == "ACTIVE":
            break
        await rig.runtime.manager.drain_queue()
    assert now["state"] == "ACTIVE", now
    assert (await models_of(rig, now))[0].startswith(A100)


async def test_total_memory_takes_the_fewest_gpus_that_hold_it(tmp_path: Path, aiohttp_client: Any) -> None:
    rig = await start_rig(make_rig(tmp_path), aiohttp_client)  # dgx8: eight A100 40GB
    status, lease = await post(rig, "vm-a", total_memory_gib=100)
    assert status == 201, lease
    assert len(lease["devices"]) == 3 and lease["request"]["gpus"] == 3
    assert lease["request"]["total_memory_gib"] == 100 and lease["request"]["min_memory_gib"] == pytest.approx(100 / 3)
    assert any("total_memory_gib 100: 3 GPU(s) of at least 33.3 GiB each" in r for r in lease["reasons"]), lease
    status, one = await post(rig, "vm-b", total_memory_gib=40)
    assert status == 201 and len(one["devices"]) == 1, one
    status, two = await post(rig, "vm-c", total_memory_gib=40.5, min_memory_gib=30)
    assert status == 201 and len(two["devices"]) == 2 and two["request"]["min_memory_gib"] == 30, two
    status, body = await post(rig, "vm-d", total_memory_gib=400)
    assert status == 409 and body["error"]["field"] == "total_memory_gib", body
    assert "hold 320.0 GiB in all" in body["error"]["message"], body
    status, body = await post(rig, "vm-d", gpus=2, total_memory_gib=80)
    assert status == 400 and body["error"]["field"] == "total_memory_gib", body
    for bad in (0, -1, "80", 1e9):
        status, body = await post(rig, "vm-d", total_memory_gib=bad)
        assert status == 400 and body["error"]["field"] == "total_memory_gib", (bad, body)


async def test_total_memory_with_an_idempotency_key_answers_the_same_lease(tmp_path: Path,
                                                                          aiohttp_client: Any) -> None:
    rig = await start_rig(make_rig(tmp_path), aiohttp_client)
    first = await post(rig, "vm-a", total_memory_gib=70, idempotency_key="k1", requires=["bf16", "tf32"])
    again = await post(rig, "vm-a", total_memory_gib=70, idempotency_key="k1", requires=["tf32", "bf16"])
    assert first[0] == 201 and again[0] in (200, 201) and again[1]["id"] == first[1]["id"], (first, again)
    changed = await post(rig, "vm-a", total_memory_gib=90, idempotency_key="k1")
    assert changed[0] == 409 and changed[1]["error"]["field"] == "idempotency_key", changed


def test_every_feature_is_documented() -> None:
    doc = (Path(__file__).parents[2] / "docs" / "placement.md").read_text()
    assert all(f"`{f}`" in doc for f in FEATURES), [f for f in FEATURES if f"`{f}`" not in doc]


async def test_total_memory_resolves_against_the_whole_inventory(tmp_path: Path, aiohttp_client: Any) -> None:
    """A quarantine comes and goes: the request resolves the same way either side of one, so its retry with the
    same idempotency key finds the lease it made (rather than a refusal, or a 409 for a 'different' request)."""
    rig = await start_rig(make_rig(tmp_path), aiohttp_client)
    status, other = await post(rig, "vm-b", gpus=4)
    assert status == 201
    status, lease = await post(rig, "vm-a", total_memory_gib=200, idempotency_key="k", accept_deferred=True)
    assert status == 202 and lease["request"]["gpus"] == 5, lease  # 5 of 40 GiB; 4 free: it waits
    held = {d["gpu_id"] for d in other["devices"]}
    for gid in [g for g in rig.runtime.manager.gpus if g not in held]:
        await rig.runtime.manager._quarantine(gid, "test: out of service", "test")
    status, again = await post(rig, "vm-a", total_memory_gib=200, idempotency_key="k", accept_deferred=True)
    assert again.get("id") == lease["id"] and again["request"]["gpus"] == 5, (status, again)
