"""Nothing lost in the usage store, on the real MariaDB and on SQLite alike: an event names any number of GPUs, every
column's limit is enforced before the database (identically on both backends) and inside SQLite too, and a row the
store refuses is set aside with its error while everything after it is written, then replayed once when fixed."""

from __future__ import annotations

import csv
import io
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import MetaData, String, create_engine, func, insert, select, text
from sqlalchemy.exc import DataError, IntegrityError

from hostagent.domain.errors import InvalidInput
from hostagent.store import schema as t
from hostagent.store.migrate import upgrade
from hostagent.store.repo import UsageStore, _refused
from hostagent.store.samples import validate_samples
from tests.support.store import backend_url, lease_doc, mysql_database, mysql_url, store  # noqa: F401

NOW = time.time()
T0 = int(NOW // 3600 * 3600) - 3600
LONG_GPUS = [f"gpu-{i:02d}-" + "x" * 57 for i in range(8)]  # 64 characters each: the column's whole width


@pytest.fixture(params=["sqlite", "mysql"])
def own_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A migrated store of its own (a test that narrows a column by hand must not share the module's)."""
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'own.sqlite3'}"
        upgrade(url)
        yield url
        return
    with mysql_database("ha_limits") as name:
        upgrade(mysql_url(name))
        yield mysql_url(name)


def rows(s: UsageStore, table: Any, **where: Any) -> list[dict[str, Any]]:
    with s.engine.connect() as c:
        q = select(table).where(*[table.c[k] == v for k, v in where.items()])
        return [dict(r._mapping) for r in c.execute(q)]


def journal_event(lease_id: str, seq: int, *, actor: str = "agent", gpus: list[str] | None = None,
                  kind: str = "transition", to_state: str = "ACTIVE") -> dict[str, Any]:
    return {"seq": seq, "lease_id": lease_id, "gpu_id": ",".join(gpus) if gpus else None, "ts": T0 + seq,
            "kind": kind, "from_state": "ATTACHING", "to_state": to_state, "actor": actor, "detail": None,
            "error": None}


def test_an_eight_gpu_event_keeps_every_gpu_id(store: UsageStore) -> None:
    store.upsert_gpus([{"gpu_id": g, "address": f"0000:{i + 3:02x}:00.0"} for i, g in enumerate(LONG_GPUS)])
    doc = lease_doc("L8", created_at=T0, gpus=LONG_GPUS, state="ACTIVE")
    store.mirror([doc], [journal_event("L8", 1, gpus=LONG_GPUS)])
    store.add_reclaim_event(action="strike-one", lease_id="L8", gpu_id=",".join(LONG_GPUS), ts=T0 + 5)
    (event,) = store.get_lease("L8")["events"]
    assert event["gpu_ids"] == sorted(LONG_GPUS)
    assert store.list_reclaim_events(lease_id="L8")[0]["gpu_ids"] == sorted(LONG_GPUS)
    assert len(rows(store, t.event_gpus, host_id=store.host_id)) == 16
    out = io.StringIO()
    assert store.export_csv("lease_events", None, None, out) == 1
    (row,) = list(csv.DictReader(io.StringIO(out.getvalue())))
    assert row["gpu_ids"].split(" ") == sorted(LONG_GPUS) and row["lease_id"] == "L8"
    # mirrored again (a restart before the journal marked it): still one event, eight GPU rows
    store.mirror([doc], [journal_event("L8", 1, gpus=LONG_GPUS)])
    assert len(rows(store, t.lease_events, host_id=store.host_id)) == 1
    assert len(rows(store, t.event_gpus, host_id=store.host_id)) == 16


@pytest.mark.parametrize(("field", "value"), [("project", "p" * 129), ("task_type", "t" * 65),
                                              ("idempotency_key", "k" * 129)])
def test_a_value_longer_than_its_column_is_refused_the_same_on_both_backends(store: UsageStore, field: str,
                                                                             value: str) -> None:
    doc = lease_doc("LX", created_at=T0, gpus=["g0"])
    doc["request"][field] = value
    with pytest.raises(InvalidInput, match=rf"leases\.{field} holds at most"):
        store.insert_lease(doc)
    assert rows(store, t.leases, host_id=store.host_id) == []


def test_the_apis_longest_labels_fit(store: UsageStore) -> None:
    doc = lease_doc("LP", created_at=T0, gpus=["g0"])
    doc["request"].update(project="p" * 128, idempotency_key="k" * 128)  # what the API accepts
    store.insert_lease(doc)
    assert store.get_lease("LP")["project"] == "p" * 128


def test_free_text_too_long_is_shortened_not_refused(store: UsageStore) -> None:
    store.insert_lease(lease_doc("LA", created_at=T0, gpus=["g0"]))
    actor = "guest:" + "d" * 400
    store.add_lease_event("LA", actor=actor, detail="x" * 20_000, ts=T0)
    (ev,) = store.get_lease("LA")["events"]
    assert len(ev["actor"]) == t.ACTOR and ev["actor"].endswith("…") and ev["actor"].startswith("guest:ddd")
    assert ev["detail"].endswith("…") and len(ev["detail"]) < 20_000


def test_out_of_range_numbers_are_refused_before_the_database(store: UsageStore) -> None:
    doc = lease_doc("LN", created_at=T0, gpus=["g0"])
    doc["request"]["duration_s"] = 2**40
    with pytest.raises(InvalidInput, match=r"leases\.duration_s must be within"):
        store.insert_lease(doc)


def test_the_database_itself_refuses_what_the_checks_would_miss(own_url: str) -> None:
    """SQLite is as strict as MariaDB: a string past its column's length is an error on both, never stored."""
    engine = create_engine(own_url)
    try:
        with pytest.raises((DataError, IntegrityError)) as err, engine.begin() as c:
            c.execute(insert(t.lease_events).values(uid="u1", host_id="h", ts=1.0, kind="k" * 33, actor="a"))
        assert _refused(err.value) and "kind" in str(err.value)
        with pytest.raises((DataError, IntegrityError)), engine.begin() as c:
            c.execute(insert(t.hosts).values(id="h" * 65, hostname="x", first_seen=1.0, last_seen=1.0))
        with engine.connect() as c:
            assert c.execute(select(func.count()).select_from(t.lease_events)).scalar_one() == 0
    finally:
        engine.dispose()


def test_guards_installed_again_replace_the_old_ones(tmp_path: Path) -> None:
    """A migration that changes a column's length installs the SQLite guards again (install_sqlite_guards): the old
    triggers are dropped and made anew from the new lengths, once each."""
    from hostagent.store.limits import install_sqlite_guards

    url = f"sqlite:///{tmp_path / 'guards.sqlite3'}"
    upgrade(url)
    engine = create_engine(url)
    try:
        def triggers() -> list[str]:
            with engine.connect() as c:
                return sorted(r[0] for r in c.execute(text("SELECT name FROM sqlite_master WHERE type='trigger'")))
        before = triggers()
        assert before and all(n.startswith("guard_") for n in before)
        # a migration widens lease_events.kind from 32 to 40 characters: the guards follow the new length
        wider = MetaData()
        for table in t.metadata.sorted_tables:
            table.to_metadata(wider)
        wider.tables["lease_events"].c.kind.type = String(40)  # a new type: the schema's own stays as it is
        with engine.begin() as c:
            made = install_sqlite_guards(c, wider)
        assert made == len(before) and triggers() == before  # replaced, not doubled, not refused as existing
        with engine.begin() as c:
            c.execute(insert(t.lease_events).values(uid="u1", host_id="h", ts=1.0, kind="k" * 40, actor="a"))
        with pytest.raises((DataError, IntegrityError)), engine.begin() as c:
            c.execute(insert(t.lease_events).values(uid="u2", host_id="h", ts=1.0, kind="k" * 41, actor="a"))
        assert t.lease_events.c.kind.type.length == 32
    finally:
        engine.dispose()


def narrow_actor(url: str, width: int) -> None:
    """Make lease_events.actor refuse anything longer than ``width`` characters, by hand, as an operator might."""
    engine = create_engine(url)
    try:
        with engine.begin() as c:
            if engine.dialect.name == "sqlite":
                c.execute(text(f"CREATE TRIGGER narrow_actor BEFORE INSERT ON lease_events WHEN length(NEW.actor) > "
                               f"{width} BEGIN SELECT RAISE(ABORT, 'Data too long for column ''actor'''); END"))
            else:
                c.execute(text(f"ALTER TABLE lease_events MODIFY actor VARCHAR({width}) NOT NULL"))
    finally:
        engine.dispose()


def widen_actor(url: str) -> None:
    engine = create_engine(url)
    try:
        with engine.begin() as c:
            if engine.dialect.name == "sqlite":
                c.execute(text("DROP TRIGGER narrow_actor"))
            else:
                c.execute(text(f"ALTER TABLE lease_events MODIFY actor VARCHAR({t.ACTOR}) NOT NULL"))
    finally:
        engine.dispose()


def test_a_refused_row_is_set_aside_and_everything_else_is_written(own_url: str, tmp_path: Path) -> None:
    noted: list[tuple[str, int, str]] = []
    s = UsageStore(own_url, "h-aside", spool_path=tmp_path / "spool.sqlite3")
    s.on_set_aside = lambda op, payload, n, error: noted.append((op, n, error))
    try:
        narrow_actor(own_url, 5)
        docs = [lease_doc(f"L{i}", created_at=T0 + i, gpus=["g0"]) for i in range(3)]
        events = [journal_event("L0", 1), journal_event("L1", 2, actor="guest:vm-bravo"), journal_event("L2", 3)]
        s.mirror(docs, events, set_aside=True)
        # the leases and the two events the store takes are in; the refused one waits, with the database's error
        assert sorted(r["id"] for r in rows(s, t.leases, host_id="h-aside")) == ["L0", "L1", "L2"]
        assert sorted(r["lease_id"] for r in rows(s, t.lease_events, host_id="h-aside")) == ["L0", "L2"]
        (aside,) = s.rejected()
        assert aside["op"] == "lease_event" and aside["payload"]["actor"] == "guest:vm-bravo"
        assert "actor" in aside["error"] and s.status()["spool_dead"] == 1 and s.figures["rows_set_aside"] == 1
        assert [(op, n) for op, n, _ in noted] == [("lease_event", 1)]
        # later writes keep flowing
        s.mirror([], [journal_event("L2", 4, to_state="RELEASED")], set_aside=True)
        assert len(rows(s, t.lease_events, host_id="h-aside")) == 3
        # replay before the fix: refused again, kept once
        assert s.replay_rejected() == {"stored": 0, "failed": 1, "left": 1, "errors": [
            {"seq": aside["seq"], "op": "lease_event", "error": s.rejected()[0]["error"]}]}
        widen_actor(own_url)
        assert s.replay_rejected()["stored"] == 1 and s.rejected() == [] and s.status()["spool_dead"] == 0
        assert s.replay_rejected() == {"stored": 0, "failed": 0, "left": 0, "errors": []}
        stored = rows(s, t.lease_events, host_id="h-aside", lease_id="L1")
        assert [r["actor"] for r in stored] == ["guest:vm-bravo"]
    finally:
        s.close()


def test_samples_of_an_unknown_lease_are_set_aside_and_replayed_once_it_exists(store: UsageStore) -> None:
    store.upsert_gpus([{"gpu_id": "g0", "address": "0000:03:00.0"}])
    store.insert_lease(lease_doc("K1", created_at=T0, gpus=["g0"]))
    good = validate_samples([{"gpu_id": "g0", "ts": T0 + i, "lease_id": "K1", "util_pct": 50.0} for i in range(5)],
                            now=NOW)
    orphan = validate_samples([{"gpu_id": "g0", "ts": T0 + i, "lease_id": "K2", "util_pct": 70.0} for i in range(3)],
                              now=NOW)
    assert store.write_samples(good + orphan, set_aside=True) == 8
    store.settle_rollups()
    assert len(rows(store, t.usage_samples, host_id=store.host_id)) == 5
    (aside,) = store.rejected()
    assert aside["op"] == "samples" and aside["rows"] == 3 and "K2" in aside["error"]
    store.insert_lease(lease_doc("K2", created_at=T0, gpus=["g0"]))
    assert store.replay_rejected()["stored"] == 1
    assert store.replay_rejected()["stored"] == 0
    assert len(rows(store, t.usage_samples, host_id=store.host_id)) == 8
    assert store.lease_usage_summary("K2")["total"]["n"] == 3


def test_a_spooled_batch_with_one_bad_row_replays_the_rest(own_url: str, tmp_path: Path) -> None:
    s = UsageStore(own_url, "h-spool", spool_path=tmp_path / "spool.sqlite3")
    try:
        narrow_actor(own_url, 5)
        s._down = True  # an outage: the batch goes to the spool whole
        s.mirror([lease_doc("S1", created_at=T0, gpus=["g0"])],
                 [journal_event("S1", 1), journal_event("S1", 2, actor="operator:x"), journal_event("S1", 3)],
                 set_aside=True)
        assert s.spool_depth == 1
        assert s.replay_spool() is True
        assert len(rows(s, t.lease_events, host_id="h-spool")) == 2
        assert [r["payload"]["actor"] for r in s.rejected()] == ["operator:x"]
    finally:
        s.close()


def test_migration_carries_comma_joined_gpu_ids(tmp_path: Path) -> None:
    _carry_case(f"sqlite:///{tmp_path / 'carry.sqlite3'}")
    with mysql_database("ha_carry") as name:
        _carry_case(mysql_url(name))


def _carry_case(url: str) -> None:
    upgrade(url, "0002")
    engine = create_engine(url)
    try:
        with engine.begin() as c:
            c.execute(text("INSERT INTO lease_events (uid, host_id, lease_id, gpu_id, ts, kind, actor) VALUES "
                           "('e1', 'h', 'L', 'gpu-a,gpu-b', 1, 'transition', 'agent'), "
                           "('e2', 'h', 'L', 'gpu-c', 2, 'transition', 'agent'), "
                           "('e3', 'h', NULL, NULL, 3, 'boot', 'agent')"))
            c.execute(text("INSERT INTO reclaim_events (uid, host_id, lease_id, gpu_id, ts, action) VALUES "
                           "('r1', 'h', 'L', 'gpu-a,gpu-b', 4, 'strike-one')"))
        upgrade(url)
        with engine.connect() as c:
            links = sorted(tuple(r) for r in c.execute(text("SELECT uid, gpu_id, host_id FROM event_gpus")))
        assert links == [("e1", "gpu-a", "h"), ("e1", "gpu-b", "h"), ("e2", "gpu-c", "h"),
                         ("r1", "gpu-a", "h"), ("r1", "gpu-b", "h")]
    finally:
        engine.dispose()


def test_uids_of_events_without_a_lease_never_collide_for_a_long_host_id(tmp_path: Path, own_url: str) -> None:
    s = UsageStore(own_url, "h" * 64, spool_path=tmp_path / "spool.sqlite3")
    try:
        evs = [journal_event(None, seq, kind="boot") | {"lease_id": None} for seq in (1, 2, 3)]  # type: ignore[arg-type]
        s.mirror([], evs)
        assert len(rows(s, t.lease_events, host_id="h" * 64)) == 3
    finally:
        s.close()
