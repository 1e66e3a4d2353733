"""Encoded lease views (web.lease_json): a listing is the same JSON as fresh views, and a change to a lease, or to
a queued lease's position or ETA, is never hidden by the cache."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from hostagent.services.leases import lease_view
from hostagent.web.lease_json import LeaseJson
from tests.support.agent import Clock, make_rig, start_rig


async def test_listing_matches_fresh_views_and_follows_every_change(tmp_path: Path, aiohttp_client: Any) -> None:
    clock = Clock()
    rig = await start_rig(make_rig(tmp_path, clock=clock), aiohttp_client)
    m = rig.runtime.manager
    op = rig.auth("operator")

    async def listing() -> list[dict[str, Any]]:
        r = await rig.client.get("/v1/leases?limit=1000", headers=op)
        assert r.status == 200 and r.content_type == "application/json"
        return (await r.json())["leases"]

    def fresh() -> list[dict[str, Any]]:
        return [lease_view(m.leases.get(x["id"]) or m.get(x["id"]), m) for x in first]

    held = (await (await rig.client.post("/v1/leases", json={"gpus": 7}, headers=rig.auth("vm-a"))).json())["id"]
    one = (await (await rig.client.post("/v1/leases", json={"gpus": 1}, headers=rig.auth("vm-b"))).json())["id"]
    queued = (await (await rig.client.post("/v1/leases", json={"gpus": 1, "accept_deferred": True},
                                           headers=rig.auth("vm-c"))).json())["id"]
    first = await listing()
    assert [x["id"] for x in first] and json.loads(json.dumps(fresh())) == first
    eta = next(x for x in first if x["id"] == queued)["queue"]["eta"]

    clock.advance(5.0)  # ETAs are recomputed as time passes: the cached bytes must not keep the old one
    m.queue_cache = None
    again = await listing()
    assert json.loads(json.dumps(fresh())) == again

    await rig.client.post(f"/v1/leases/{held}/renew", json={"duration_s": 60}, headers=rig.auth("vm-a"))
    renewed = next(x for x in await listing() if x["id"] == held)
    assert renewed["expires_at"] == m.leases[held].expires_at
    assert next(x for x in await listing() if x["id"] == queued)["queue"]["eta"] != eta

    await rig.client.delete(f"/v1/leases/{one}", headers=rig.auth("vm-b"))
    for _ in range(200):  # the queue grants in the background
        after = {x["id"]: x for x in await listing()}
        if after[queued]["state"] == "ACTIVE":
            break
        await asyncio.sleep(0.02)
    assert after[one]["state"] == "RELEASED" and after[queued]["state"] == "ACTIVE"
    assert "queue" not in after[queued] and after[queued]["devices"]


def test_ended_views_are_kept_in_a_bounded_lru() -> None:
    from hostagent.domain.lease import LeaseRequest, LeaseState, new_lease

    cache = LeaseJson(ended_kept=2)

    class NoManager:  # an ended lease's view never asks the manager
        leases: dict[str, Any] = {}

    ended = [new_lease(f"l-{i}", "u", "vm", LeaseRequest(), 1.0).transition(LeaseState.FAILED) for i in range(3)]
    for x in ended:
        assert json.loads(cache.encode(x, NoManager())) == lease_view(x)  # type: ignore[arg-type]
    assert cache.misses == 3
    cache.encode(ended[2], NoManager())  # type: ignore[arg-type]
    assert cache.hits == 1
    cache.encode(ended[0], NoManager())  # type: ignore[arg-type]  evicted: the oldest of three with room for two
    assert cache.misses == 4
