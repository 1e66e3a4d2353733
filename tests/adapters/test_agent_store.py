"""The agent records every lease, event and sample in the usage store (SQLite and the real MariaDB), and keeps
leasing through a MariaDB outage under heartbeat load without losing or duplicating a sample."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.agent import AgentRig, make_rig, start_rig
from tests.support.store import MYSQL_HOST, MYSQL_PORT, TcpProxy, mysql_admin, mysql_database, mysql_url


@pytest.fixture(params=["sqlite", "mysql"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'usage.sqlite3'}"
        return
    with mysql_database("ha_agent") as name:
        yield mysql_url(name)


async def settle(rig: AgentRig) -> None:
    """Flush queued samples and the journal mirror."""
    rt = rig.runtime
    await rt.ingestor.flush()
    while await rt.run(rt._mirror_batch):
        pass


def samples_for(gpu: str, start: float, n: int, util: float = 60.0) -> list[dict[str, Any]]:
    return [{"ts": start + i * 0.01, "gpu": gpu, "util_pct": util, "mem_used_bytes": 2**30} for i in range(n)]


async def test_leases_events_and_samples_reach_the_store(tmp_path: Path, aiohttp_client: Any, store_url: str) -> None:
    rig = await start_rig(make_rig(tmp_path, store={"url": store_url}), aiohttp_client)
    h = rig.auth("vm-a")
    r = await rig.client.post("/v1/leases", json={"gpus": 2, "task_type": "training"}, headers=h)
    lease = await r.json()
    gpu = lease["devices"][0]["gpu_id"]
    now = time.time()
    for k in range(5):
        r = await rig.client.post(f"/v1/leases/{lease['id']}/heartbeat",
                                  json={"samples": samples_for(gpu, now + k, 20)}, headers=h)
        assert r.status == 200
    await rig.client.delete(f"/v1/leases/{lease['id']}", headers=h)
    await settle(rig)
    stored = await rig.runtime.store.get_lease(lease["id"])
    assert stored["state"] == "RELEASED"
    kinds = [e["to_state"] for e in stored["events"] if e["kind"] == "transition"]
    assert kinds == ["REQUESTED", "BINDING", "ATTACHING", "ACTIVE", "RELEASING", "DETACHING", "REBINDING", "RELEASED"]
    usage = await rig.runtime.store.lease_usage_summary(lease["id"])
    assert usage["total"]["n"] == 100 and usage["total"]["util_mean"] == pytest.approx(60.0)
    detail = await (await rig.client.get(f"/v1/leases/{lease['id']}", headers=h)).json()
    assert detail["usage"]["samples"] == 100
    assert (await (await rig.client.get("/readyz")).json())["checks"]["store"]["ok"] is True


async def test_mariadb_outage_under_heartbeat_load(tmp_path: Path, aiohttp_client: Any) -> None:
    proxy = TcpProxy(MYSQL_HOST, MYSQL_PORT).start()
    try:
        with mysql_database("ha_outage") as name:
            rig = await start_rig(make_rig(tmp_path, store={"url": mysql_url(name, host="127.0.0.1", port=proxy.port),
                                                            "flush_interval_s": 0.1}), aiohttp_client)
            sent = await _load_through_outage(rig, proxy)
            # Every sample is in MySQL exactly once; leases and their events were mirrored too.
            admin = mysql_admin()
            with admin.cursor() as cur:
                cur.execute(f"SELECT lease_id, COUNT(*) FROM `{name}`.usage_samples GROUP BY lease_id")
                counts = dict(cur.fetchall())
                cur.execute(f"SELECT COUNT(*), COUNT(DISTINCT lease_id, gpu_id, ts_ms, source) FROM "
                            f"`{name}`.usage_samples")
                total, distinct = cur.fetchone()
                cur.execute(f"SELECT id, state FROM `{name}`.leases")
                states = dict(cur.fetchall())
            admin.close()
            assert counts == sent
            assert total == distinct == sum(sent.values())
            assert all(states[lid] in ("ACTIVE", "RELEASED") for lid in sent)
    finally:
        proxy.close()


async def _load_through_outage(rig: AgentRig, proxy: TcpProxy) -> dict[str, int]:
    sent: dict[str, int] = {}
    leases: list[tuple[str, str, str]] = []  # (lease id, gpu, vm)

    async def new_lease(vm: str) -> None:
        r = await rig.client.post("/v1/leases", json={"gpus": 1}, headers=rig.auth(vm))
        body = await r.json()
        assert r.status == 201, body  # leasing never stops
        leases.append((body["id"], body["devices"][0]["gpu_id"], vm))

    t0 = time.time()

    async def beat(round_: int) -> None:
        for lid, gpu, vm in leases:
            batch = samples_for(gpu, t0 + round_ * 0.1, 10)  # 10 ms apart: every sample key is distinct
            r = await rig.client.post(f"/v1/leases/{lid}/heartbeat", json={"samples": batch}, headers=rig.auth(vm))
            assert r.status == 200, await r.text()
            sent[lid] = sent.get(lid, 0) + len(batch)

    await new_lease("vm-a")
    for i in range(10):
        await beat(i)
        await asyncio.sleep(0.02)
    proxy.cut()
    for i in range(10, 30):
        if i == 15:
            await new_lease("vm-b")  # a grant during the outage
        await beat(i)
        await asyncio.sleep(0.02)
    await rig.runtime.ingestor.flush()
    ready = await (await rig.client.get("/readyz")).json()
    assert ready["ready"] is True and ready["checks"]["store"]["ok"] is False and ready["checks"]["store"]["spool_depth"] > 0
    metrics = await (await rig.client.get("/metrics")).text()
    assert "hostagent_store_degraded 1.0" in metrics
    proxy.restore()
    rig.runtime.store.kick()
    for i in range(30, 35):
        await beat(i)
    await settle(rig)
    deadline = time.monotonic() + 60
    while rig.runtime.store.status()["degraded"] and time.monotonic() < deadline:
        rig.runtime.store.kick()
        await asyncio.sleep(0.2)
    await settle(rig)
    assert not rig.runtime.store.status()["degraded"]
    return sent


async def test_mirror_writes_a_batch_in_one_store_transaction(tmp_path: Path, aiohttp_client: Any) -> None:
    rig = await start_rig(make_rig(tmp_path), aiohttp_client)
    rt = rig.runtime
    writes: list[tuple[str, Any]] = []
    write = rt.store.store._write

    def counted(op: str, payload: Any) -> Any:
        writes.append((op, payload))
        return write(op, payload)

    rt.store.store._write = counted  # type: ignore[method-assign]
    h = rig.auth("vm-a")
    with rt._mirror_lock:  # the mirror waits: the lease's 8 events arrive in one batch, this one
        r = await rig.client.post("/v1/leases", json={"gpus": 1}, headers=h)
        lease = await r.json()
        assert (await rig.client.delete(f"/v1/leases/{lease['id']}", headers=h)).status == 200
        writes.clear()
        assert await rt.run(rt._mirror_batch_locked) >= 8
    # one store transaction for the batch: the lease's row once, then its 8 events
    assert [op for op, _ in writes] == ["mirror"]
    assert [x["row"]["id"] for x in writes[0][1]["leases"]] == [lease["id"]]
    assert len(writes[0][1]["events"]) == 8
    stored = await rt.store.get_lease(lease["id"])
    assert stored["state"] == "RELEASED" and len(stored["events"]) == 8
