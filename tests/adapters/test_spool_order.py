"""After a usage-store outage, the writes spooled locally reach the store before any write made after them.

The store is reachable again while the spool still holds writes in two cases: a replay that stopped part-way (it
replays at most `max_ops` writes per call; the agent's replay loop goes on at once) and an agent started over a
spool its last run left. A new write that went straight to the store then would be overtaken by the older ones
on replay (a lease's state set back, its events out of order). Against the real MariaDB through a TCP proxy the
test cuts (tests/adapters/test_store_outage.py has the other outage rigs); the spool order is checked in the
database itself, by the events' insertion order and the lease's final state.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from hostagent.store.aio import AsyncUsageStore
from hostagent.store.migrate import upgrade
from hostagent.store.repo import UsageStore
from tests.adapters.test_store_outage import proxy  # noqa: F401  (the fixture: a TCP proxy in front of MariaDB)
from tests.support.store import TcpProxy, lease_doc, mysql_database, mysql_query, mysql_url
from tests.support.waits import wait_until

T0 = int(time.time()) - 3600
HOST = "order-host"
STEPS = ("BINDING", "ACTIVE", "RELEASING", "DETACHING", "DETACH_PENDING", "DETACHING", "DETACH_PENDING", "DETACHING",
         "REBINDING")


@pytest.fixture
def db() -> Iterator[str]:
    with mysql_database("ha_spoolorder") as name:
        upgrade(mysql_url(name))
        yield name




query = mysql_query  # ask MariaDB directly, bypassing the proxy and the store


def state_in_db(db: str, lease_id: str) -> object:
    rows = query(db, "SELECT state FROM leases WHERE host_id = %s AND id = %s", HOST, lease_id)
    return rows[0][0] if rows else None


def transitions_in_db(db: str, lease_id: str) -> list[object]:
    """The lease's events in the order the store received them (auto-increment id), not by their timestamps."""
    return [r[0] for r in query(db, "SELECT to_state FROM lease_events WHERE host_id = %s AND lease_id = %s "
                                    "ORDER BY id", HOST, lease_id)]


async def test_a_new_write_waits_behind_a_spool_whose_replay_stopped_part_way(db: str, proxy: TcpProxy,
                                                                              tmp_path: Path,
                                                                              caplog: pytest.LogCaptureFixture) -> None:
    """Through the async facade the agent uses; its replay loop is left off so the test decides when replays
    happen (the loop replays exactly this way, `max_ops` at a time)."""
    f = await AsyncUsageStore.open(mysql_url(db, host="127.0.0.1", port=proxy.port), HOST, start=False,
                                   spool_path=tmp_path / "spool.sqlite3", connect_timeout=1, io_timeout=5)
    try:
        await f.upsert_gpus([{"gpu_id": "gpu-0", "address": "0000:01:00.0"}])
        await f.insert_lease(lease_doc("O1", created_at=T0, gpus=["gpu-0"], state="BINDING"))
        await f.run(proxy.cut)
        for before, after in zip(STEPS, STEPS[1:]):  # a release whose detach is retried, all during the outage
            await f.update_lease("O1", {"state": after})
            await f.add_lease_event("O1", actor="agent", from_state=before, to_state=after)
        assert f.spool_depth == 2 * (len(STEPS) - 1) and not f.store.reachable
        # the operator hears of the outage once, with what failed, not once per spooled write
        said = [r for r in caplog.records if r.name == "hostagent.store.repo" and "unreachable" in r.getMessage()]
        assert len(said) == 1 and said[0].levelname == "WARNING", [r.getMessage() for r in said]
        assert said[0].getMessage().startswith("usage store unreachable, spooling writes: ")
        await f.run(proxy.restore)

        # one write at a time (the first tries may meet only connections the cut broke) until the store answers
        for _ in range(100):
            assert await f.run(f.store.replay_spool, 1) is False
            if f.store.reachable:
                break
        left = f.spool_depth
        assert f.store.reachable and left > 0
        assert state_in_db(db, "O1") != "RELEASED"

        # the guest releases now: these writes are newer than every one still spooled
        await f.update_lease("O1", {"state": "RELEASED", "ended_at": T0 + 60})
        await f.add_lease_event("O1", actor="agent", from_state=STEPS[-1], to_state="RELEASED")
        assert f.spool_depth == left + 2, "a new write went straight to the store past the spooled ones"
        assert state_in_db(db, "O1") != "RELEASED" and "RELEASED" not in transitions_in_db(db, "O1")

        assert await f.run(wait_until, f.store.replay_spool, 30)
        assert f.spool_depth == 0 and not f.degraded
        assert state_in_db(db, "O1") == "RELEASED"
        assert transitions_in_db(db, "O1") == [*STEPS[1:], "RELEASED"]
    finally:
        await f.close()


def test_a_restarted_agent_writes_behind_the_spool_its_last_run_left(db: str, proxy: TcpProxy,
                                                                     tmp_path: Path) -> None:
    url = mysql_url(db, host="127.0.0.1", port=proxy.port)
    spool = tmp_path / "spool.sqlite3"
    s = UsageStore(url, HOST, spool_path=spool, connect_timeout=1, io_timeout=5)
    s.upsert_gpus([{"gpu_id": "gpu-0", "address": "0000:01:00.0"}])
    proxy.cut()
    s.insert_lease(lease_doc("R1", created_at=T0, gpus=["gpu-0"], state="BINDING"))
    s.update_lease("R1", {"state": "ACTIVE"})
    s.add_lease_event("R1", actor="agent", from_state="BINDING", to_state="ACTIVE")
    assert [x.op for x in s.spool.peek()] == ["lease", "lease_update", "lease_event"]
    s.close()

    proxy.restore()
    s2 = UsageStore(url, HOST, spool_path=spool, connect_timeout=1, io_timeout=5)  # reachable, spool waiting
    try:
        # (opening registers the host: a write of its own, spooled behind the last run's three)
        assert s2.reachable and s2.degraded and [x.op for x in s2.spool.peek()][:3] == ["lease", "lease_update",
                                                                                      "lease_event"]
        before = s2.spool_depth
        s2.update_lease("R1", {"state": "RELEASED", "ended_at": T0 + 60})
        s2.add_lease_event("R1", actor="agent", from_state="ACTIVE", to_state="RELEASED")
        assert s2.spool_depth == before + 2, "a new write went straight to the store past the spooled ones"
        assert state_in_db(db, "R1") is None and transitions_in_db(db, "R1") == []
        assert wait_until(s2.replay_spool, timeout=30)
        assert state_in_db(db, "R1") == "RELEASED"
        assert transitions_in_db(db, "R1") == ["ACTIVE", "RELEASED"]
    finally:
        s2.close()
