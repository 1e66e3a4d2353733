"""Outage tolerance against the real MariaDB: a TCP proxy the test cuts under heartbeat load, then restores, and a
commit whose reply is lost. The server really stopped and started again: tests/adapters/test_agent_store.py."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pymysql
import pytest
from sqlalchemy import Connection
from sqlalchemy.exc import OperationalError

from hostagent.domain.errors import StoreUnavailable
from hostagent.store.aio import AsyncUsageStore
from hostagent.store.ingest import SampleIngestor
from hostagent.store.migrate import upgrade
from hostagent.store.repo import UsageStore
from tests.support.store import (
    MYSQL_HOST,
    MYSQL_PORT,
    TcpProxy,
    lease_doc,
    mysql_admin,
    mysql_database,
    mysql_url,
    sample_rows,
    wait_until,
)
from tests.support.waits import until

GPUS = [f"gpu-{i}" for i in range(4)]
T0 = int(time.time()) - 3600


@pytest.fixture
def db() -> Iterator[str]:
    """A fresh MariaDB database name."""
    with mysql_database("ha_outage") as name:
        yield name


@pytest.fixture
def proxy() -> Iterator[TcpProxy]:
    """A proxy in front of MariaDB."""
    p = TcpProxy(MYSQL_HOST, MYSQL_PORT).start()
    yield p
    p.close()


def query(db: str, sql: str) -> tuple[tuple[object, ...], ...]:
    """Ask MariaDB directly, bypassing the proxy."""
    conn = mysql_admin()
    try:
        conn.select_db(db)
        with conn.cursor() as cur:
            cur.execute(sql)
            return tuple(cur.fetchall())
    finally:
        conn.close()


async def test_cut_under_heartbeat_load_every_sample_lands_exactly_once(db: str, proxy: TcpProxy,
                                                                        tmp_path: Path) -> None:
    upgrade(mysql_url(db))
    f = await AsyncUsageStore.open(mysql_url(db, host="127.0.0.1", port=proxy.port), "outage-host",
                                   spool_path=tmp_path / "spool.sqlite3", connect_timeout=1, io_timeout=5,
                                   replay_min_s=0.05, replay_max_s=0.5)
    await f.upsert_gpus([{"gpu_id": g, "address": f"0000:{i + 1:02x}:00.0"} for i, g in enumerate(GPUS)])
    await f.insert_lease(lease_doc("L1", created_at=T0, gpus=GPUS))
    ing = SampleIngestor(f.store.write_samples, batch=100, interval_s=0.05)  # the agent's path: background rollups
    ing.start()
    sent = 0
    keys: set[tuple[str, str, int]] = set()  # (lease, GPU, ts_ms) of every sample submitted

    async def heartbeats(n: int) -> None:
        nonlocal sent
        for _ in range(n):
            ts = T0 + sent // len(GPUS) * 0.5
            ing.submit([{"gpu_id": g, "ts": ts, "lease_id": "L1", "util_pct": 40.0, "mem_used_bytes": 1 << 30}
                        for g in GPUS])
            keys.update(("L1", g, int(round(ts * 1000))) for g in GPUS)
            sent += len(GPUS)
            await asyncio.sleep(0.002)

    load = asyncio.create_task(heartbeats(300))
    await until(lambda: ing.flushed > 200, 60.0)
    await asyncio.to_thread(proxy.cut)  # mid-load
    await load
    await until(lambda: f.degraded and f.spool_depth > 0, 60.0)
    # leasing goes on: a transition mirrored during the outage is spooled, not lost, and nothing waits on MySQL
    await f.update_lease("L1", {"state": "RELEASING"})
    await f.add_lease_event("L1", actor="agent", from_state="ACTIVE", to_state="RELEASING")
    await heartbeats(200)
    await ing.flush()
    assert f.degraded and f.spool_depth > 0 and f.status()["reachable"] is False
    with pytest.raises(StoreUnavailable):
        await f.get_lease("L1")
    await asyncio.to_thread(proxy.restore)
    await heartbeats(100)
    await ing.close()
    await until(lambda: not f.degraded, 60.0)
    assert f.spool_depth == 0 and f.status()["spool_dead"] == 0 and f.status()["outages"] >= 1
    assert ing.figures()["dropped"] == 0 and ing.figures()["rejected"] == 0 and ing.flushed == sent

    # exactly the samples submitted (the unique key hides a duplicate row: the rollup sums below would show it)
    assert set(query(db, "SELECT lease_id, gpu_id, ts_ms FROM usage_samples")) == keys and sent == len(keys) == 2400
    (rolled,), = query(db, "SELECT SUM(n) FROM usage_rollups WHERE resolution = 3600")
    (rolled_min,), = query(db, "SELECT SUM(n) FROM usage_rollups WHERE resolution = 60")
    assert int(rolled) == int(rolled_min) == sent  # nothing rolled up twice by the replay
    lease = await f.get_lease("L1")
    assert lease["state"] == "RELEASING" and [e["to_state"] for e in lease["events"]] == ["RELEASING"]
    await f.close()


@pytest.mark.mysql
def test_a_batch_committed_as_the_connection_died_is_replayed_without_counting_twice(db: str,
                                                                                     tmp_path: Path) -> None:
    """The one way an outage can make a duplicate: the server commits a batch, the connection dies before the
    client hears so, and the store spools the batch it thinks failed. The replay's INSERT IGNORE skips the stored
    rows, and the rollups, folded by id, count them once (a real shutdown only hits this window by chance)."""
    s = UsageStore(mysql_url(db), "ambiguous-host", spool_path=tmp_path / "spool.sqlite3")
    try:
        s.upsert_gpus([{"gpu_id": g, "address": f"0000:{i + 1:02x}:00.0"} for i, g in enumerate(GPUS)])
        s.insert_lease(lease_doc("A1", created_at=T0, gpus=GPUS))
        held = s._writer.begin

        @contextmanager
        def commit_then_lose_the_reply() -> Iterator[Connection]:
            with held() as conn:
                yield conn
            raise OperationalError("COMMIT", None, pymysql.err.OperationalError(2013, "Lost connection during query"))

        s._writer.begin = commit_then_lose_the_reply  # type: ignore[method-assign]
        rows = sample_rows(GPUS, "A1", T0, 25)
        assert s.add_samples(rows) == 100
        s._writer.begin = held  # type: ignore[method-assign]
        assert s.degraded and s.spool_depth == 1  # the batch is spooled, though the server has it
        (stored,), = query(db, "SELECT COUNT(*) FROM usage_samples")
        assert stored == 100
        assert s.replay_spool() is True
        assert s.figures["samples_duplicate"] == 100 and s.spool.dead == 0
        (n60, u60), (n3600, u3600) = query(db, "SELECT SUM(n), SUM(util_sum) FROM usage_rollups "
                                               "GROUP BY resolution ORDER BY resolution")
        assert int(n60) == int(n3600) == 100
        assert float(u60) == float(u3600) == pytest.approx(sum(r["util_pct"] for r in rows))
    finally:
        s.close()


def test_start_while_down_spools_then_restart_replays_in_order(db: str, proxy: TcpProxy, tmp_path: Path) -> None:
    url = mysql_url(db, host="127.0.0.1", port=proxy.port)
    spool = tmp_path / "spool.sqlite3"
    proxy.cut()
    s = UsageStore(url, "cold-host", spool_path=spool, connect_timeout=1, io_timeout=5)  # empty database, unreachable
    assert s.degraded and not s.reachable
    s.upsert_gpus([{"gpu_id": "gpu-0", "address": "0000:01:00.0"}])
    s.insert_lease(lease_doc("C1", created_at=T0, gpus=["gpu-0"], state="BINDING"))
    s.update_lease("C1", {"state": "ACTIVE", "granted_at": T0 + 3})
    s.add_lease_event("C1", actor="agent", from_state="BINDING", to_state="ACTIVE")
    samples = [{"gpu_id": "gpu-0", "ts": T0 + i, "lease_id": "C1", "util_pct": 10.0} for i in range(50)]
    assert s.add_samples(samples) == 50
    assert s.spool_depth == 6
    s.close()

    proxy.restore()
    s2 = UsageStore(url, "cold-host", spool_path=spool, connect_timeout=1, io_timeout=5)  # migrates, then replays
    try:
        assert s2.degraded  # the spool from the last run is still waiting
        assert wait_until(s2.replay_spool, timeout=30)
        assert not s2.degraded
        assert s2.replay_spool() is True  # a second replay finds nothing
        lease = s2.get_lease("C1")
        assert lease["state"] == "ACTIVE" and lease["granted_at"] == T0 + 3 and len(lease["events"]) == 1
        assert s2.lease_usage_summary("C1")["total"]["n"] == 50
        (n,), = query(db, "SELECT COUNT(*) FROM usage_samples")
        assert n == 50
    finally:
        s2.close()


def test_a_poison_op_is_moved_aside_and_does_not_block_the_spool(db: str, tmp_path: Path) -> None:
    s = UsageStore(mysql_url(db), "poison-host", spool_path=tmp_path / "spool.sqlite3")
    try:
        s.upsert_gpus([{"gpu_id": "gpu-0", "address": "0000:01:00.0"}])
        # a device row for a lease the store never got: the foreign key refuses it on replay
        s.spool.append("lease_update", {"id": "ghost", "values": {"state": "FAILED"},
                                        "devices": [{"lease_id": "ghost", "gpu_id": "gpu-0", "host_id": "poison-host",
                                                     "functions": [], "iommu_group": 1}]})
        s.spool.append("lease_event", {"uid": "b" * 32, "host_id": "poison-host", "lease_id": None, "gpu_id": None,
                                       "ts": T0, "kind": "note", "from_state": None, "to_state": None,
                                       "actor": "test", "detail": "after the poison", "error": None})
        assert s.degraded
        assert s.replay_spool() is True
        assert s.spool.dead == 1 and s.spool_depth == 0
        (n,), = query(db, "SELECT COUNT(*) FROM lease_events WHERE detail = 'after the poison'")
        assert n == 1
    finally:
        s.close()

