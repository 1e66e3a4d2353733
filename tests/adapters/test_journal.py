"""The journal: retention (ended leases older than leases.journal_retention_days leave it, never before the usage
store has them; live leases and recent history stay) and which writes are fsync'd."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from hostagent.config import settings_from_dict
from hostagent.domain.errors import ConfigError
from hostagent.store.journal import Journal
from tests.support.agent import AgentRig, Clock, make_rig, start_rig

DAY = 86400.0


async def lease_and_release(rig: AgentRig, who: str) -> str:
    r = await rig.client.post("/v1/leases", json={"gpus": 1}, headers=rig.auth(who))
    body = await r.json()
    assert r.status == 201, body
    r = await rig.client.delete(f"/v1/leases/{body['id']}", headers=rig.auth(who))
    assert r.status == 200, await r.json()
    return str(body["id"])


async def mirrored(rig: AgentRig) -> None:
    for _ in range(200):
        if not await asyncio.to_thread(rig.runtime.journal.unmirrored, 1):
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the mirror did not catch up")


async def test_old_ended_leases_go_live_and_recent_stay(tmp_path: Path, aiohttp_client: Any) -> None:
    clock = Clock()
    rig = await start_rig(make_rig(tmp_path, clock=clock, leases={"journal_retention_days": 30}), aiohttp_client)
    old = [await lease_and_release(rig, "vm-a") for _ in range(3)]
    r = await rig.client.post("/v1/leases", json={"gpus": 1}, headers=rig.auth("vm-b"))
    live = (await r.json())["id"]
    clock.advance(31 * DAY)
    recent = await lease_and_release(rig, "vm-a")
    await mirrored(rig)
    assert await rig.runtime.prune_journal() == (3, 3 * 8)  # REQUESTED..RELEASED: 8 transitions each
    for lid in old:
        r = await rig.client.get(f"/v1/leases/{lid}", headers=rig.auth("vm-a"))
        assert r.status == 404
        assert not rig.runtime.journal.events(lease_id=lid)
        assert rig.runtime.store.store.get_lease(lid)["state"] == "RELEASED"  # the store keeps its own history
    for lid, who, state in ((live, "vm-b", "ACTIVE"), (recent, "vm-a", "RELEASED")):
        r = await rig.client.get(f"/v1/leases/{lid}", headers=rig.auth(who))
        assert r.status == 200 and (await r.json())["state"] == state
    clock.advance(365 * DAY)  # a live lease is never pruned, however old (its TTL is the reaper's business)
    await mirrored(rig)
    assert await rig.runtime.prune_journal() == (1, 8)  # the recent one only
    live_lease = rig.runtime.journal.get(live)
    assert live_lease is not None and live_lease.state.value == "ACTIVE"
    assert len(rig.runtime.journal.events(lease_id=live)) == 4


def test_unmirrored_history_stays_until_copied(tmp_path: Path) -> None:
    now = [1_800_000_000.0]
    journal = Journal(tmp_path / "j.sqlite3", clock=lambda: now[0])
    from hostagent.domain.lease import LeaseRequest, LeaseState, new_lease

    lease = new_lease("l-1", "uuid-1", "vm-1", LeaseRequest(), now[0])
    journal.record(lease.transition(LeaseState.QUEUED, queued_at=now[0]), from_state=LeaseState.REQUESTED, actor="t")
    queued = journal.get("l-1")
    assert queued is not None
    journal.record(queued.transition(LeaseState.RELEASED, ended_at=now[0]), from_state=LeaseState.QUEUED, actor="t")
    journal.event("boot", actor="agent", detail="no lease")
    before = now[0] + 1
    assert journal.prune(before, mirrored_only=True) == (0, 0)
    journal.mark_mirrored(e.seq for e in journal.unmirrored())
    assert journal.prune(before, mirrored_only=True) == (1, 3)  # 2 transitions + the boot event
    assert journal.get("l-1") is None and not journal.events()
    # without a store, age alone decides
    lease = new_lease("l-2", "uuid-1", "vm-1", LeaseRequest(), now[0])
    journal.record(lease.transition(LeaseState.FAILED, ended_at=now[0]), from_state=LeaseState.REQUESTED, actor="t")
    assert journal.prune(now[0], mirrored_only=False) == (0, 0)  # not older than the cut
    assert journal.prune(before, mirrored_only=False) == (1, 1)
    journal.close()


def test_retention_must_not_be_negative() -> None:
    with pytest.raises(ConfigError, match="journal_retention_days"):
        settings_from_dict({"leases": {"journal_retention_days": -1}})


def test_mirror_marks_skip_the_fsync_lease_steps_keep_it(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "j.sqlite3")
    from hostagent.domain.lease import LeaseRequest, LeaseState, new_lease

    syncs: list[int] = []
    journal._db.set_trace_callback(lambda sql: syncs.append(journal._db.execute("PRAGMA synchronous").fetchone()[0])
                                   if sql.startswith(("UPDATE events", "INSERT INTO leases")) else None)
    lease = new_lease("l-1", "uuid-1", "vm-1", LeaseRequest(), 0.0)
    journal.record(lease.transition(LeaseState.QUEUED, queued_at=0.0), from_state=LeaseState.REQUESTED, actor="t")
    journal.mark_mirrored(e.seq for e in journal.unmirrored())
    journal._db.set_trace_callback(None)
    assert syncs == [2, 1]  # FULL for the lease step, NORMAL for the bookkeeping
    assert journal._db.execute("PRAGMA synchronous").fetchone()[0] == 2  # and FULL again after it
    assert not journal.unmirrored()
    journal.close()


def test_a_lease_step_updates_its_row_in_place(tmp_path: Path) -> None:
    """Each step rewrites the lease's one row where it is (same rowid, every column from the latest step) and
    writes less to the WAL than a delete-and-insert would."""
    from hostagent.domain.lease import LeaseRequest, LeaseState, new_lease

    journal = Journal(tmp_path / "j.sqlite3")
    lease = new_lease("l-1", "uuid-1", "vm-1", LeaseRequest(idempotency_key="k-1"), 0.0)
    journal.record(lease.transition(LeaseState.BINDING), from_state=LeaseState.REQUESTED, actor="t")
    rowid = journal._db.execute("SELECT rowid FROM leases WHERE id='l-1'").fetchone()[0]
    journal._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    lease = lease.transition(LeaseState.BINDING)
    for step in (LeaseState.ATTACHING, LeaseState.ACTIVE):
        nxt = lease.transition(step)
        journal.record(nxt, from_state=lease.state, actor="t")
        lease = nxt
    rows = journal._db.execute("SELECT rowid, state, domain_uuid, idem_key, doc FROM leases").fetchall()
    assert [(r[0], r[1], r[2], r[3]) for r in rows] == [(rowid, "ACTIVE", "uuid-1", "k-1")]
    assert json.loads(rows[0][4])["state"] == "ACTIVE"
    assert journal.get("l-1") == lease
    assert journal.by_idempotency_key("uuid-1", "k-1") == lease
    # two steps in place: the leases table, its state index, the events table and its indexes and the
    # AUTOINCREMENT counter; a delete-and-insert also rewrote the primary key's index (about 9 frames a step)
    frames = (tmp_path / "j.sqlite3-wal").stat().st_size // (4096 + 24)
    assert frames <= 2 * 7
    journal.close()


async def test_docs_are_the_stored_documents_of_known_leases(tmp_path: Path, aiohttp_client: Any) -> None:
    rig = await start_rig(make_rig(tmp_path), aiohttp_client)
    ids = [await lease_and_release(rig, "vm-a") for _ in range(2)]
    journal = rig.runtime.journal
    docs = journal.docs([ids[1], "l-unknown", ids[0], ids[1]])
    assert set(docs) == set(ids)  # unknown ids left out, repeats once
    for lid in ids:
        lease = journal.get(lid)
        assert lease is not None and docs[lid] == json.loads(json.dumps(lease.to_dict()))  # as stored
        assert docs[lid]["state"] == "RELEASED" and docs[lid]["devices"]
    assert journal.docs([]) == {}
