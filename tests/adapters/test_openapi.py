"""The OpenAPI document validates and matches the registered routes exactly."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from openapi_spec_validator import validate

from hostagent.runtime import make_app
from hostagent.web.openapi import document
from tests.support.agent import make_rig

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
    client = await aiohttp_client(make_app(make_rig(tmp_path).runtime))
    r = await client.get("/v1/openapi.json")
    assert r.status == 200 and await r.json() == document()
