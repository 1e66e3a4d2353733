"""A property of both backends (the real MariaDB and SQLite): whatever the lease shapes (1 to 8 GPUs of a dgx8,
whole multi-function groups of a workstation), domain names (up to 250 characters, non-ASCII) and labels (Unicode,
up to the API's limits), every journal entry and every accepted sample reaches the usage store exactly once through
grant, heartbeats, idle reclaim and release, and readiness says the store is healthy exactly when nothing is behind
or set aside."""

from __future__ import annotations

import asyncio
import hashlib
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from sqlalchemy import create_engine, func, select

from hostagent.runtime import make_app
from hostagent.store import schema as t
from tests.support.agent import Clock, make_rig
from tests.support.store import mysql_database, mysql_url

RECLAIM = {"enabled": True, "check_interval_s": 3600.0, "grace_s": 60.0, "min_lease_age_s": 0.0,
           "notice_window_s": 20.0, "idle_util_pct": 5.0}
LABEL = st.text(st.characters(codec="utf-8", categories=("L", "N", "Zs", "Pd", "So")), min_size=1, max_size=60).filter(
    lambda s: s.strip() == s and s.strip())
NAME = st.builds(lambda stem, n: (stem + "-" * n)[:250], st.text(st.characters(categories=("Ll", "Nd")), min_size=1,
                                                                  max_size=8).map(lambda s: "vm-é" + s),
                 st.integers(0, 246))
LEASE = st.fixed_dictionaries({"gpus": st.integers(1, 8), "end": st.sampled_from(["release", "reclaim"]),
                               "beats": st.integers(0, 3), "project": LABEL, "task_type": LABEL})


@pytest.fixture(scope="module", params=["sqlite", "mysql"])
def parity_url(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path_factory.mktemp('parity') / 'usage.sqlite3'}"
        return
    with mysql_database("ha_parity") as name:
        yield mysql_url(name)


def count(url: str, table: Any, host: str) -> int:
    engine = create_engine(url)
    try:
        with engine.connect() as c:
            return int(c.execute(select(func.count()).select_from(table).where(table.c.host_id == host)).scalar_one())
    finally:
        engine.dispose()


def uids(url: str, host: str) -> list[str]:
    engine = create_engine(url)
    try:
        with engine.connect() as c:
            return [r[0] for r in c.execute(select(t.lease_events.c.uid).where(t.lease_events.c.host_id == host))]
    finally:
        engine.dispose()


async def scenario(tmp: Path, url: str, vm_name: str, shapes: list[dict[str, Any]], workstation: bool) -> None:
    host = f"parity-{uuid.uuid4().hex[:10]}"
    clock = Clock(time.time())
    rig = make_rig(tmp, scenario="workstation-vfio" if workstation else "dgx8", vms=(vm_name,), clock=clock,
                   store={"url": url}, reclaim=RECLAIM, agent={"host_id": host})
    client = TestClient(TestServer(make_app(rig.runtime)))
    await client.start_server()
    rt = rig.runtime
    h = rig.auth(vm_name)
    accepted = 0

    async def settle_and_check(step: str) -> None:
        await rt.ingestor.flush()
        while await rt.run(rt._mirror_batch):
            pass
        health = (await (await client.get("/readyz")).json())["checks"]["store"]
        behind = await rt.run(rt.journal.backlog)
        truth = behind == (0, None) and not rt.store.store.rejected() and rt.store.store.spool_depth == 0
        assert health["ok"] is truth is True, (step, health, behind)

    try:
        total = len(rt.manager.gpus)
        for shape in shapes:
            n = min(shape["gpus"], total)
            r = await client.post("/v1/leases", headers=h, json={
                "gpus": n, "project": shape["project"], "task_type": shape["task_type"]})
            assert r.status == 201, await r.text()
            lease = await r.json()
            await settle_and_check("grant")
            for k in range(shape["beats"]):
                samples = [{"ts": time.time() + k * 0.5 + i * 0.01, "gpu": d["gpu_id"], "util_pct": 2.0,
                            "mem_used_bytes": 0} for d in lease["devices"] for i in range(4)]
                r = await client.post(f"/v1/leases/{lease['id']}/heartbeat", headers=h, json={"samples": samples})
                assert r.status == 200, await r.text()
                accepted += len(samples)
                await settle_and_check("heartbeat")
            if shape["end"] == "reclaim":
                for _ in range(8):  # strike one, strike two (the notice), the notice window over
                    clock.advance(61)
                    await rt.reaper.check(lease["id"], clock.now, rt.host.vfio_interrupts())
                    if lease["id"] not in rt.manager.leases:
                        break
                ended = await rt.run(rt.journal.get, lease["id"])
                assert ended is not None and ended.end_reason == "reclaimed: idle", ended
            else:
                assert (await client.delete(f"/v1/leases/{lease['id']}", headers=h)).status == 200
            await settle_and_check(shape["end"])
        # exactly once: every journal event by its uid, every accepted sample
        expected = set()
        for ev in rt.journal.events(limit=100_000):
            lease_id = ev.lease_id if ev.lease_id and rt.journal.get(ev.lease_id) else None
            expected.add(hashlib.sha256(f"{host}/{lease_id}/{ev.seq}".encode()).hexdigest()[:32])
        stored = uids(url, host)
        assert len(stored) == len(set(stored)) and set(stored) == expected
        assert count(url, t.usage_samples, host) == accepted
        assert count(url, t.leases, host) == len(shapes)
    finally:
        await client.close()


# No shrinking: a failing case is reported as drawn (each case starts an agent; shrinking would take minutes).
@settings(max_examples=6, deadline=None, derandomize=True, phases=[Phase.explicit, Phase.generate],
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(vm_name=NAME, shapes=st.lists(LEASE, min_size=1, max_size=3), workstation=st.booleans())
def test_every_journal_entry_and_sample_reaches_the_store_exactly_once(parity_url: str, tmp_path: Path, vm_name: str,
                                                                       shapes: list[dict[str, Any]],
                                                                       workstation: bool) -> None:
    run_dir = tmp_path / uuid.uuid4().hex[:8]
    run_dir.mkdir()
    asyncio.run(scenario(run_dir, parity_url, vm_name, shapes, workstation))
