"""Every endpoint x {no token, bad token, other VM's token, own token, operator}: the expected status, and no data
of another VM in any response."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from tests.support.agent import AgentRig, make_rig, start_rig

WHO = ("none", "bad", "other", "own", "operator")


def headers(rig: AgentRig, who: str) -> dict[str, str]:
    return {"none": {}, "bad": {"Authorization": "Bearer vm_not-a-real-token"}, "other": rig.auth("vm-b"),
            "own": rig.auth("vm-a"), "operator": rig.auth("operator")}[who]


# (method, path template, body, {who: expected status})
MATRIX: list[tuple[str, str, Any, dict[str, int]]] = [
    ("GET", "/healthz", None, {"none": 200, "bad": 401, "other": 200, "own": 200, "operator": 200}),
    ("GET", "/readyz", None, {"none": 200, "bad": 401, "other": 200, "own": 200, "operator": 200}),
    ("GET", "/v1/openapi.json", None, {"none": 200, "bad": 401, "other": 200, "own": 200, "operator": 200}),
    ("GET", "/metrics", None, {"none": 200, "bad": 401, "other": 200, "own": 200, "operator": 200}),
    ("GET", "/v1/gpus", None, {"none": 200, "bad": 401, "other": 200, "own": 200, "operator": 200}),
    ("GET", "/v1/gpus/{gpu}", None, {"none": 200, "bad": 401, "other": 200, "own": 200, "operator": 200}),
    ("POST", "/v1/gpus/{gpu}/clear-quarantine", {}, {"none": 401, "bad": 401, "other": 403, "own": 403,
                                                     "operator": 409}),
    ("GET", "/v1/leases", None, {"none": 401, "bad": 401, "other": 200, "own": 200, "operator": 200}),
    ("GET", "/v1/leases/{lease}", None, {"none": 401, "bad": 401, "other": 404, "own": 200, "operator": 200}),
    ("POST", "/v1/leases/{lease}/heartbeat", "samples", {"none": 401, "bad": 401, "other": 404, "own": 200,
                                                         "operator": 200}),
    ("POST", "/v1/leases/{lease}/renew", {"duration_s": 600}, {"none": 401, "bad": 401, "other": 404, "own": 200,
                                                               "operator": 200}),
    ("POST", "/v1/leases/{lease}/reclaim", {"paused": True}, {"none": 401, "bad": 401, "other": 403, "own": 403,
                                                              "operator": 200}),
    ("GET", "/v1/reaper", None, {"none": 401, "bad": 401, "other": 403, "own": 403, "operator": 200}),
    ("GET", "/v1/events", None, {"none": 401, "bad": 401, "other": 403, "own": 403, "operator": 200}),
    ("POST", "/v1/leases", {"gpus": 1}, {"none": 401, "bad": 401, "other": 201, "own": 201, "operator": 400}),
    ("DELETE", "/v1/leases/{lease}", None, {"none": 401, "bad": 401, "other": 404, "own": 200, "operator": 200}),
]


@pytest.fixture
async def rig(tmp_path: Path, aiohttp_client: Any) -> AgentRig:
    return await start_rig(make_rig(tmp_path), aiohttp_client)


async def test_auth_matrix(rig: AgentRig) -> None:
    r = await rig.client.post("/v1/leases", json={"gpus": 1, "task_type": "secret-task-of-a"}, headers=rig.auth("vm-a"))
    lease = await r.json()
    gpu = lease["devices"][0]["gpu_id"]
    secrets = [rig.uuids["vm-a"], "vm-a", lease["id"], "secret-task-of-a"]
    failures = []
    for method, template, body, expected in MATRIX:
        for who in WHO:
            if method == "DELETE" and who in ("own", "operator"):
                continue  # checked once at the end (it ends the lease)
            path = template.format(gpu=gpu, lease=lease["id"])
            payload = ({"samples": [{"ts": time.time(), "gpu": gpu, "util_pct": 50, "mem_used_bytes": 1}]}
                       if body == "samples" else body)
            kw: dict[str, Any] = {"headers": headers(rig, who)}
            if payload is not None:
                kw["json"] = payload
            resp = await rig.client.request(method, path, **kw)
            text = await resp.text()
            if resp.status != expected[who]:
                failures.append(f"{method} {path} as {who}: {resp.status}, expected {expected[who]}: {text[:200]}")
            if who in ("none", "bad", "other"):
                leaked = [s for s in secrets if s in text and s not in path]  # echoing the caller's own input is fine
                if leaked:
                    failures.append(f"{method} {path} as {who} leaks {leaked}")
            if resp.status >= 400:
                err = (await resp.json())["error"]
                assert err["code"] and err["message"]
            if method == "POST" and template == "/v1/leases" and resp.status == 201:
                made = await resp.json()
                await rig.client.delete(f"/v1/leases/{made['id']}", headers=headers(rig, who))
    resp = await rig.client.delete(f"/v1/leases/{lease['id']}", headers=headers(rig, "own"))
    assert resp.status == 200
    assert not failures, "\n".join(failures)


def test_tokens_are_stored_hashed_and_compared_in_constant_time(tmp_path: Path) -> None:
    import inspect

    from hostagent.web import auth

    rig = make_rig(tmp_path)
    db = (rig.settings.state_dir / "journal.sqlite3").read_bytes()
    assert all(tok.encode() not in db for tok in rig.tokens.values())
    assert "compare_digest" in inspect.getsource(auth.TokenBook.resolve)
