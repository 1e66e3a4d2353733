"""The OpenAPI document validates, matches the registered routes exactly, and says what the server accepts."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from openapi_spec_validator import validate

from hostagent.runtime import make_app
from hostagent.web.openapi import document
from tests.support.agent import make_rig, start_rig

UNDOCUMENTED = {"/metrics"}  # Prometheus text, not JSON API


def routes(app: Any) -> set[tuple[str, str]]:
    out = set()
    for route in app.router.routes():
        info = route.resource.get_info() if route.resource else {}
        path = info.get("path") or info.get("formatter")
        if path and route.method not in ("HEAD", "OPTIONS") and path not in UNDOCUMENTED \
                and not path.startswith("/static") and not path.startswith("/ui") and path != "/":
            out.add((route.method.lower(), path))
    return out


def test_document_validates() -> None:
    validate(document())


def test_document_matches_routes(tmp_path: Path) -> None:
    app = make_app(make_rig(tmp_path).runtime)
    documented = {(m, p) for p, ops in document()["paths"].items() for m in ops}
    served = {r for r in routes(app) if r[1].startswith("/v1") or r[1] in ("/healthz", "/readyz")}
    assert served == documented, f"served only: {served - documented}; documented only: {documented - served}"


async def test_served_document_is_the_same(tmp_path: Path, aiohttp_client: Any) -> None:
    rig = make_rig(tmp_path)
    client = await aiohttp_client(make_app(rig.runtime))
    r = await client.get("/v1/openapi.json", headers=rig.auth("vm-a"))
    assert r.status == 200 and await r.json() == document()


# Clients generated from the document name their methods after these: renaming one breaks every such client, so a
# rename is a deliberate change made here too.
OPERATIONS = {
    "healthz": ("GET", "/healthz"), "readyz": ("GET", "/readyz"), "openapi": ("GET", "/v1/openapi.json"),
    "listGpus": ("GET", "/v1/gpus"), "getGpu": ("GET", "/v1/gpus/{gpu_id}"),
    "clearQuarantine": ("POST", "/v1/gpus/{gpu_id}/clear-quarantine"), "probeGpu": ("POST", "/v1/gpus/{gpu_id}/probe"),
    "createLease": ("POST", "/v1/leases"), "listLeases": ("GET", "/v1/leases"),
    "getLease": ("GET", "/v1/leases/{lease_id}"), "releaseLease": ("DELETE", "/v1/leases/{lease_id}"),
    "heartbeat": ("POST", "/v1/leases/{lease_id}/heartbeat"), "renewLease": ("POST", "/v1/leases/{lease_id}/renew"),
    "reclaimControl": ("POST", "/v1/leases/{lease_id}/reclaim"), "listEvents": ("GET", "/v1/events"),
    "moveLease": ("POST", "/v1/leases/{lease_id}/move"), "moveDone": ("POST", "/v1/leases/{lease_id}/move/done"),
    "reaperStatus": ("GET", "/v1/reaper"), "getTopology": ("GET", "/v1/topology"), "probeStatus": ("GET", "/v1/probes"),
    "getFleet": ("GET", "/v1/fleet"),
}


async def test_every_operation_keeps_its_id(tmp_path: Path, aiohttp_client: Any) -> None:
    rig = make_rig(tmp_path)
    client = await aiohttp_client(make_app(rig.runtime))
    doc = await (await client.get("/v1/openapi.json", headers=rig.auth("vm-a"))).json()
    served = {op["operationId"]: (m.upper(), p) for p, ops in doc["paths"].items() for m, op in ops.items()}
    assert served == OPERATIONS


async def test_served_document_carries_the_configured_maximum(tmp_path: Path, aiohttp_client: Any) -> None:
    """duration_s's maximum is the agent's [leases] max_duration_s, in the request schema and in renew's."""
    rig = make_rig(tmp_path, leases={"max_duration_s": 3600, "default_duration_s": 600})
    doc = await (await (await aiohttp_client(make_app(rig.runtime))).get("/v1/openapi.json", headers=rig.auth("vm-a"))).json()
    assert doc["components"]["schemas"]["LeaseRequest"]["properties"]["duration_s"]["maximum"] == 3600
    renew = doc["paths"]["/v1/leases/{lease_id}/renew"]["post"]["requestBody"]["content"]["application/json"]
    assert renew["schema"]["properties"]["duration_s"]["maximum"] == 3600


async def test_what_the_document_allows_the_server_accepts(tmp_path: Path, aiohttp_client: Any) -> None:
    """The cases the audit found refused although the document allowed them: an empty renew body (requestBody
    optional), a guest naming its own VM, the state filter in any letter case; and what it forbids is refused."""
    rig = await start_rig(make_rig(tmp_path), aiohttp_client)
    r = await rig.client.post("/v1/leases", json={"gpus": 1, "domain": "vm-a", "task_type": "train resnet-50"},
                              headers=rig.auth("vm-a"))
    assert r.status == 201, await r.text()
    lease = await r.json()
    r = await rig.client.post("/v1/leases", json={"gpus": 1, "domain": "vm-b"}, headers=rig.auth("vm-a"))
    assert r.status == 403 and (await r.json())["error"]["field"] == "domain"
    r = await rig.client.post(f"/v1/leases/{lease['id']}/renew", headers=rig.auth("vm-a"))
    assert r.status == 200, await r.text()
    r = await rig.client.get("/v1/leases?state= active ,Queued", headers=rig.auth("vm-a"))
    assert r.status == 200 and [x["id"] for x in (await r.json())["leases"]] == [lease["id"]]
    for state in ("ACTIVE\t", "act\u0131ve"):  # a tab; a dotless i, which str.upper() turns into I
        r = await rig.client.get("/v1/leases", params={"state": state}, headers=rig.auth("vm-a"))
        assert r.status == 400, state
    r = await rig.client.post("/v1/leases", json={"gpus": 1, "task_type": "caf\u00e9", "project": "\u6771\u4eac"},
                              headers=rig.auth("vm-b"))
    assert r.status == 201 and (await r.json())["request"]["project"] == "\u6771\u4eac", await r.text()
    for field, value in (("task_type", "a\tb"), ("project", "a\u202eb"), ("data_scale", 2e18),
                         ("duration_s", 604801), ("not_after", 2e11)):
        r = await rig.client.post("/v1/leases", json={"gpus": 1, field: value}, headers=rig.auth("vm-b"))
        assert r.status == 400 and (await r.json())["error"]["field"] == field, (field, await r.text())


def test_label_pattern_is_the_parsers_rule() -> None:
    """The document's pattern for labels and the request parser agree on every character class; beyond the pattern
    the parser refuses only lone surrogates (no Unicode scalar value, so no schema regex names them) and a trailing
    newline (which Python's $ lets through, a JSON Schema validator's does not)."""
    from hostagent.domain.errors import InvalidInput
    from hostagent.domain.lease import LABEL_PATTERN, parse_lease_request

    def accepted(text: str) -> bool:
        try:
            parse_lease_request({"task_type": text}, now=0.0, max_duration_s=3600)
        except InvalidInput:
            return False
        return True

    rule = re.compile(LABEL_PATTERN)
    invisible = [0x34F, 0x61C, 0x115F, 0x1160, 0x17B4, 0x200B, 0x2028, 0x202E, 0x2066, 0x3164, 0xFEFF, 0xFFA0]
    for ch in map(chr, [*range(0, 0x250), *invisible, 0x6771, 0x1F600, 0x2764, 0xFE0F]):
        text = f"a{ch}b"
        assert accepted(text) == bool(rule.match(text)), repr(ch)
        assert not accepted(text + "\n"), repr(ch)
    assert not any(accepted(f"a{chr(c)}b") for c in invisible)  # fillers that render as nothing among them
    assert accepted("\u2764\ufe0f") and accepted("\U0001f3f4")  # an emoji and its variation selector are text
    assert not accepted("a\ud800b") and not accepted("\udfff")
    # Tag characters: invisible, outside the BMP, refused by the parser and declared a runtime check in the document
    assert not accepted("a\U000e0041b") and not accepted("\U000e007f")
    declared = document()["paths"]["/v1/leases"]["post"]["x-runtime-checks"]
    assert {"task_type", "project", "idempotency_key", "vendor", "model"} <= set(declared)


def test_every_operation_is_secured_by_a_defined_scheme_and_every_required_field_is_a_property() -> None:
    doc = document()
    schemes = set(doc["components"]["securitySchemes"])
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            for requirement in op.get("security", []):
                assert set(requirement) <= schemes, (method, path, requirement)

    def walk(node: Any, where: str) -> None:
        if isinstance(node, dict):
            if "required" in node and isinstance(node["required"], list) and "properties" in node:
                assert set(node["required"]) <= set(node["properties"]), (where, node["required"])
            for k, v in node.items():
                walk(v, f"{where}/{k}")
        elif isinstance(node, list):
            for i, v in enumerate(node):
                walk(v, f"{where}/{i}")

    walk(doc, "#")
