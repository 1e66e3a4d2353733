"""The journal answers lease lists, GPU history and a GPU's events from indexed rows: the same answers as a
brute-force pass over every lease and event, pages by a keyset cursor, upgrades an older journal in place, and
reads a bounded number of rows and documents however long the journal is."""

from __future__ import annotations

import base64
import json
import random
import re
import sqlite3
import types
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest

import hostagent.store.journal as journal_module
from hostagent.domain.errors import InvalidInput
from hostagent.domain.lease import Lease, LeaseDevice, LeaseRequest, LeaseState, Step, new_lease
from hostagent.store.journal import Journal, JournalEvent
from hostagent.store.lease_listing import Order, Position, decode_cursor, encode_cursor
from tests.support.agent import make_rig, start_rig

S = LeaseState
T0 = 1_800_000_000.0
GPUS = ("gpu-1", "gpu-2", "gpu-10", "gpu-3")  # gpu-1 is a prefix of gpu-10: matches must be whole ids
DOMAINS = ("uuid-a", "uuid-b", "uuid-c")
ENDINGS = ("released by guest", "reclaim: idle twice", "reclaimed by operator", "not reclaimed", "expired")
LIVE = [s for s in S if not s.terminal]

# The journal's schema before indexed history (hostagent/store/journal.py, _SCHEMA, as it was).
OLD_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS leases (
    id TEXT PRIMARY KEY, state TEXT NOT NULL, domain_uuid TEXT NOT NULL, idem_key TEXT,
    doc TEXT NOT NULL, updated_at REAL NOT NULL);
CREATE INDEX IF NOT EXISTS leases_state ON leases(state);
CREATE TABLE IF NOT EXISTS events (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, lease_id TEXT, gpu_id TEXT, ts REAL NOT NULL, kind TEXT NOT NULL,
    from_state TEXT, to_state TEXT, actor TEXT NOT NULL, detail TEXT, error TEXT, mirrored INTEGER NOT NULL DEFAULT 0);
CREATE INDEX IF NOT EXISTS events_lease ON events(lease_id);
CREATE INDEX IF NOT EXISTS events_mirror ON events(mirrored);
CREATE TABLE IF NOT EXISTS quarantine (gpu_id TEXT PRIMARY KEY, reason TEXT NOT NULL, since REAL NOT NULL);
CREATE TABLE IF NOT EXISTS tokens (
    sha256 TEXT PRIMARY KEY, role TEXT NOT NULL, domain_uuid TEXT, domain_name TEXT, created REAL NOT NULL,
    revoked REAL);
"""


# -- building journals ----------------------------------------------------------------------------------------------

def assert_gpu_index_rows(journal: Journal, model: Any) -> list[Any]:
    """lease_gpus and event_gpus hold exactly one row per GPU of each lease and event; returns the events."""
    db = journal._db
    assert sorted(db.execute("SELECT * FROM lease_gpus").fetchall()) == sorted(
        (g, x.id, x.created_at, int((x.end_reason or "").startswith("reclaim")))
        for x in model.by_id.values() for g in x.gpu_ids)
    events = all_events(journal)
    assert sorted(db.execute("SELECT * FROM event_gpus").fetchall()) == sorted(
        (g, e.seq) for e in events for g in (e.gpu_id or "").split(",") if g)
    return events

def device(gpu_id: str) -> LeaseDevice:
    return LeaseDevice(gpu_id=gpu_id, functions=("0000:3b:00.0",), original_drivers=("nvidia",), iommu_group=7)


def open_journal(path: Path, clock: Any = None) -> Journal:
    journal = Journal(path, clock=clock) if clock else Journal(path)
    journal._db.execute("PRAGMA synchronous=OFF")  # these tests build big journals; fsync is not what they check
    return journal


class Model:
    """What was journaled, kept apart from the journal: each lease's latest form in the order first journaled."""

    def __init__(self) -> None:
        self.by_id: dict[str, Lease] = {}

    def put(self, lease: Lease) -> None:
        self.by_id[lease.id] = lease  # a dict keeps the first insertion's place: the journal's rowid order

    def ordered(self) -> list[Lease]:
        """Newest first, ties in creation time in the order first journaled."""
        first = {lid: n for n, lid in enumerate(self.by_id)}
        return sorted(self.by_id.values(), key=lambda x: (x.created_at, first[x.id]), reverse=True)

    def leases(self, states: Iterable[LeaseState] | None, domain: str | None, since: float | None,
               limit: int) -> list[Lease]:
        wanted = None if states is None else set(states)
        return [x for x in self.ordered() if (wanted is None or x.state in wanted)
                and (domain is None or x.domain_uuid == domain)
                and (since is None or x.created_at >= since or (x.ended_at or 1e18) >= since)][:limit]

    def history(self, gpu_id: str) -> dict[str, Any]:
        mine = [x for x in self.ordered() if gpu_id in x.gpu_ids]
        return {"leases": len(mine), "last_lease_at": mine[0].created_at if mine else None,
                "last_lease_id": mine[0].id if mine else None,
                "reclaims": sum(1 for x in mine if (x.end_reason or "").startswith("reclaim"))}


def journal_lease(journal: Journal, model: Model, lease_id: str, created_at: float, domain: str,
                  kind: str, gpus: tuple[str, ...], ending: str = "released by guest") -> Lease:
    """Journal one lease through the steps of its kind, the way the lease driver does."""
    lease = new_lease(lease_id, domain, f"vm-{domain}", LeaseRequest(gpus=max(1, len(gpus))), created_at)
    born = [Step(None, S.REQUESTED)]
    if kind == "queued":
        final = lease.transition(S.QUEUED, queued_at=created_at)
        journal.record(final, from_state=S.REQUESTED, actor="t", earlier=born)
    elif kind == "refused":
        final = lease.transition(S.FAILED, ended_at=created_at + 1, end_reason="refused")
        journal.record(final, from_state=S.REQUESTED, actor="t", earlier=born)
    else:
        binding = lease.transition(S.BINDING, devices=tuple(device(g) for g in gpus), granted_gpus=len(gpus),
                                   placement=(("distance", len(gpus)), ("rule", "pack")))
        journal.record(binding, from_state=S.REQUESTED, actor="t", earlier=born)
        if kind == "failed":
            final = binding.transition(S.FAILED, ended_at=created_at + 2, end_reason="failed", error="bind failed")
            journal.record(final, from_state=S.BINDING, actor="t", error="bind failed")
        else:
            final = binding.transition(S.ATTACHING).transition(S.ACTIVE, granted_at=created_at + 3)
            journal.record(final, from_state=S.ATTACHING, actor="t", earlier=[Step(S.BINDING, S.ATTACHING)])
            if kind == "ended":
                end = S.EXPIRED if ending == "expired" else S.RELEASED
                steps = [Step(S.ACTIVE, S.RELEASING), Step(S.RELEASING, S.DETACHING), Step(S.DETACHING, S.REBINDING)]
                final = (final.transition(S.RELEASING, end_reason=ending).transition(S.DETACHING)
                         .transition(S.REBINDING).transition(end, ended_at=created_at + 500))
                journal.record(final, from_state=S.REBINDING, actor="t", earlier=steps)
    model.put(final)
    return final


def mixed_journal(journal: Journal, model: Model, n: int, seed: int = 7) -> None:
    """n leases of every kind on 1-3 GPUs each, journaled in an order unlike their creation times (many equal),
    with GPU events of no lease between them."""
    rng = random.Random(seed)
    for i in range(n):
        created = T0 + rng.randrange(n // 4) * 10.0  # about four leases per creation time
        kind = rng.choice(("queued", "refused", "failed", "active", "ended", "ended", "ended"))
        gpus = tuple(rng.sample(GPUS, rng.randint(1, 3)))
        journal_lease(journal, model, f"l-{i:04d}", created, rng.choice(DOMAINS), kind, gpus, rng.choice(ENDINGS))
        if i % 9 == 0:
            journal.event("strike-one", actor="reaper", gpu_id=",".join(rng.sample(GPUS, 2)), detail="idle")
        if i % 13 == 0:
            journal.event("quarantine", actor="op", gpu_id=rng.choice(GPUS), detail="xid 79")
        if i % 17 == 0:
            journal.event("boot", actor="agent")


def all_events(journal: Journal) -> list[JournalEvent]:
    return journal.events(limit=10**9)


def old_gpu_events(journal: Journal, gpu_id: str) -> list[int]:
    """The seqs the journal's former table scan (a LIKE on the comma-joined ids) found for a GPU."""
    return [s for (s,) in journal._db.execute("SELECT seq FROM events WHERE (',' || gpu_id || ',') LIKE ? ORDER BY seq",
                                              (f"%,{gpu_id},%",))]


def pages(journal: Journal, limit: int, **filters: Any) -> Iterator[list[Lease]]:
    cursor = None
    while True:
        page, cursor = journal.lease_page(limit=limit, cursor=cursor, **filters)
        yield page
        if cursor is None:
            return


def check_against_model(journal: Journal, model: Model) -> None:
    for states in (None, [S.ACTIVE], [S.RELEASED, S.FAILED], LIVE, [S.EXPIRED], []):
        for domain in (None, "uuid-b", "uuid-nobody"):
            for since in (None, T0 - 1, T0 + 400.0, T0 + 10**6):
                for limit in (1, 7, 10**6):
                    got = journal.leases(states=states, domain_uuid=domain, since=since, limit=limit)
                    want = model.leases(states, domain, since, limit)
                    assert [x.id for x in got] == [x.id for x in want], (states, domain, since, limit)
                    assert got == want
    for gpu_id in (*GPUS, "gpu-nope", "gpu"):
        assert journal.gpu_history(gpu_id) == model.history(gpu_id), gpu_id
    events = all_events(journal)
    lease_ids = [None, *list(model.by_id)[:3]]
    for gpu_id in (*GPUS, "gpu-nope", "gpu"):
        assert [e.seq for e in journal.events(gpu_id=gpu_id, limit=10**9)] == old_gpu_events(journal, gpu_id)
        for kinds in (None, ["transition"], ["strike-one", "quarantine"]):
            for since_seq in (0, len(events) // 2):
                for lease_id in lease_ids:
                    for limit in (1, 5, 10**6):
                        want = [e for e in events if e.seq > since_seq and gpu_id in (e.gpu_id or "").split(",")
                                and (kinds is None or e.kind in kinds) and (lease_id is None or e.lease_id == lease_id)]
                        got = journal.events(gpu_id=gpu_id, kinds=kinds, since_seq=since_seq, lease_id=lease_id,
                                             limit=limit)
                        assert got == want[-limit:], (gpu_id, kinds, since_seq, lease_id, limit)


# -- the same answers -----------------------------------------------------------------------------------------------
def test_lists_history_and_gpu_events_match_a_brute_force_pass(tmp_path: Path) -> None:
    journal, model = open_journal(tmp_path / "j.sqlite3"), Model()
    mixed_journal(journal, model, 300)
    states = {x.state for x in model.by_id.values()}
    assert {S.QUEUED, S.ACTIVE, S.RELEASED, S.EXPIRED, S.FAILED} <= states  # every kind is there
    assert len({x.created_at for x in model.by_id.values()}) < len(model.by_id)  # and ties in creation time
    assert any(x.end_reason and x.end_reason.startswith("reclaim") for x in model.by_id.values())
    check_against_model(journal, model)
    # pages, concatenated, are the list
    for filters in ({}, {"domain_uuid": "uuid-a"}, {"states": [S.RELEASED]}, {"since": T0 + 400.0},
                    {"states": LIVE, "domain_uuid": "uuid-c"}):
        walked = [x for page in pages(journal, 7, **filters) for x in page]
        assert walked == journal.leases(limit=10**6, **filters), filters
    journal.close()


async def test_gpu_detail_answers_as_before(tmp_path: Path, aiohttp_client: Any) -> None:
    """GET /v1/gpus/{id}: the history and the last placement that a pass over all the journal's leases gives."""
    rig = await start_rig(make_rig(tmp_path), aiohttp_client)
    r = await rig.client.post("/v1/leases", json={"gpus": 1}, headers=rig.auth("vm-a"))
    body = await r.json()
    assert r.status == 201, body
    gpu_id = body["devices"][0]["gpu_id"]
    journal = rig.runtime.journal
    granted = journal.get(body["id"])
    assert granted is not None and granted.placement
    # ended leases of this GPU created when the live one was (ties), a reclaim among them, and an older one
    for n, ending in enumerate(("reclaim: idle twice", "released by guest")):
        journal_lease(journal, Model(), f"l-tie-{n}", granted.created_at, rig.uuids["vm-b"], "ended",
                      (gpu_id, "gpu-other"), ending)
    journal_lease(journal, Model(), "l-old", granted.created_at - 50, rig.uuids["vm-b"], "ended", (gpu_id,),
                  "reclaimed by operator")
    # what gpu_detail computed before: every lease, newest first by (created_at, rowid), then this GPU's
    rows = journal._db.execute("SELECT doc, rowid FROM leases").fetchall()
    found = sorted(((Lease.from_dict(json.loads(d)), n) for d, n in rows),
                   key=lambda xn: (xn[0].created_at, xn[1]), reverse=True)
    mine = [x for x, _ in found if gpu_id in x.gpu_ids]
    history = {"leases": len(mine), "last_lease_at": mine[0].created_at,
               "reclaims": sum(1 for x in mine if (x.end_reason or "").startswith("reclaim"))}
    assert history == {"leases": 4, "last_lease_at": granted.created_at, "reclaims": 2}
    assert mine[0].id == "l-tie-1"  # of the newest, the one journaled last
    last_placement = json.loads(json.dumps({"lease_id": mine[0].id, **dict(mine[0].placement)}))
    op = await (await rig.client.get(f"/v1/gpus/{gpu_id}", headers=rig.auth("operator"))).json()
    assert op["history"] == history and op["last_placement"] == last_placement and op["events"]
    guest = await (await rig.client.get(f"/v1/gpus/{gpu_id}", headers=rig.auth("vm-a"))).json()
    assert guest["history"] == history and "last_placement" not in guest and "events" not in guest


# -- pages ----------------------------------------------------------------------------------------------------------
def test_pages_return_every_lease_there_at_the_start_once_while_leases_arrive(tmp_path: Path) -> None:
    journal, model = open_journal(tmp_path / "j.sqlite3"), Model()
    mixed_journal(journal, model, 60, seed=3)
    original = [x.id for x in journal.leases(limit=10**6)]
    assert original == [x.id for x in model.ordered()]
    newest = max(x.created_at for x in model.by_id.values())
    tie = model.ordered()[30].created_at
    seen: list[str] = []
    cursor: str | None = None
    n = 0
    while True:
        page, cursor = journal.lease_page(limit=7, cursor=cursor)
        assert len(page) == 7 or cursor is None
        seen += [x.id for x in page]
        # between pages: a newer lease, one created with leases already listed or still to come, and an older one
        for created in (newest + 10 + n, tie, T0 - 100 - n):
            journal_lease(journal, model, f"new-{n}", created, "uuid-a", "ended", ("gpu-1",))
            n += 1
        if cursor is None:
            break
    assert len(seen) == len(set(seen))  # nothing twice
    old = set(original)
    assert [lid for lid in seen if lid in old] == original  # every original lease, once, in order
    journal.close()


def test_the_last_page_says_it_is_the_last(tmp_path: Path) -> None:
    journal, model = open_journal(tmp_path / "j.sqlite3"), Model()
    for i in range(14):
        journal_lease(journal, model, f"l-{i}", T0 + i // 3, "uuid-a", "queued", ())
    first, cursor = journal.lease_page(limit=7)
    assert cursor is not None and [x.id for x in first] == [x.id for x in model.ordered()[:7]]
    second, cursor = journal.lease_page(limit=7, cursor=cursor)
    assert cursor is None and [x.id for x in second] == [x.id for x in model.ordered()[7:]]  # no empty third page
    assert journal.lease_page(limit=20) == (model.ordered(), None)
    journal.close()


def b64(text: str) -> str:
    return base64.urlsafe_b64encode(text.encode()).decode()


@pytest.mark.parametrize("cursor", [
    "garbage!!", "", "é", b64("garbage"), b64("1800000000.0"), b64("nan:5"), b64("inf:5"), b64("-inf:5"),
    b64("1800000000.0:x"), b64("1_800_000_000.0:5"), b64(" 1800000000.0:5"), b64("1800000000.0:5:6"),
    base64.urlsafe_b64encode(b"\xff\xfe:1").decode(),
    # well-formed, but past SQLite's signed 64-bit INTEGER: binding it raised OverflowError (a 500)
    b64(f"1800000000.0:{2**63}").rstrip("="), b64(f"1800000000.0:{-2**63 - 1}").rstrip("="),
])
def test_a_malformed_cursor_is_invalid_input_on_cursor(tmp_path: Path, cursor: str) -> None:
    journal = open_journal(tmp_path / "j.sqlite3")
    journal_lease(journal, Model(), "l-1", T0, "uuid-a", "queued", ())
    for call in (lambda: journal.lease_page(cursor=cursor), lambda: journal.leases(cursor=cursor)):
        with pytest.raises(InvalidInput) as err:
            call()
        assert err.value.field == "cursor" and err.value.message == "cursor is not one this API issued"
    journal.close()


def test_an_issued_cursor_padded_or_not_is_the_one_issued(tmp_path: Path) -> None:
    journal, model = open_journal(tmp_path / "j.sqlite3"), Model()
    for i in range(3):
        journal_lease(journal, model, f"l-{i}", T0 + 0.1 * i, "uuid-a", "queued", ())
    _, cursor = journal.lease_page(limit=1)
    assert cursor is not None and re.fullmatch(r"[A-Za-z0-9_-]+", cursor)  # URL-safe as it is
    assert [x.id for x in journal.leases(cursor=cursor)] == ["l-1", "l-0"]
    with pytest.raises(InvalidInput):
        journal.leases(cursor=cursor + "=" * (-len(cursor) % 4 or 4))
    journal.close()


# -- an older journal -----------------------------------------------------------------------------------------------
def old_journal(path: Path) -> Model:
    """A journal file as the schema before indexed history wrote it, with leases of every kind and GPU events."""
    scratch = open_journal(path.with_name("scratch.sqlite3"))
    model = Model()
    mixed_journal(scratch, model, 40, seed=11)
    db = sqlite3.connect(str(path))
    db.executescript(OLD_SCHEMA)
    for x in model.by_id.values():  # in the order first journaled
        db.execute("INSERT INTO leases(id, state, domain_uuid, idem_key, doc, updated_at) VALUES(?,?,?,?,?,?)",
                   (x.id, x.state.value, x.domain_uuid, x.request.idempotency_key, json.dumps(x.to_dict()), T0))
    db.executemany("INSERT INTO events(seq, lease_id, gpu_id, ts, kind, from_state, to_state, actor, detail, error)"
                   " VALUES(?,?,?,?,?,?,?,?,?,?)",
                   [tuple(e.to_dict().values()) for e in all_events(scratch)])
    db.commit()
    db.close()
    scratch.close()
    return model


def snapshot(journal: Journal) -> dict[str, Any]:
    db = journal._db
    return {
        "schema": sorted(db.execute("SELECT type, name, sql FROM sqlite_master").fetchall()),
        "leases": db.execute("SELECT id, created_at, ended_at FROM leases ORDER BY rowid").fetchall(),
        "lease_gpus": sorted(db.execute("SELECT * FROM lease_gpus").fetchall()),
        "event_gpus": sorted(db.execute("SELECT * FROM event_gpus").fetchall()),
    }


def test_an_older_journal_is_upgraded_on_open_once(tmp_path: Path) -> None:
    path = tmp_path / "j.sqlite3"
    model = old_journal(path)
    journal = Journal(path)
    db = journal._db
    assert {"created_at", "ended_at"} <= {r[1] for r in db.execute("PRAGMA table_info(leases)")}
    assert db.execute("SELECT id, created_at, ended_at FROM leases ORDER BY rowid").fetchall() == [
        (x.id, x.created_at, x.ended_at) for x in model.by_id.values()]
    events = assert_gpu_index_rows(journal, model)
    indexes = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='index'")}
    assert {"leases_created", "leases_domain", "leases_state_created", "leases_idem"} <= indexes
    assert "leases_state" not in indexes  # (state, created_at) serves what it served
    check_against_model(journal, model)
    before = snapshot(journal)
    journal.close()

    journal = Journal(path)  # again: nothing to do, nothing done twice
    assert snapshot(journal) == before
    check_against_model(journal, model)
    journal_lease(journal, model, "l-after", T0 + 10**5, "uuid-a", "ended", ("gpu-3",), "reclaim: idle twice")
    check_against_model(journal, model)
    journal.close()


# -- bounded work ---------------------------------------------------------------------------------------------------
@pytest.fixture
def big(tmp_path: Path) -> Iterator[tuple[Journal, Model]]:
    """3,000 leases on other GPUs, then 5 on gpu-7 (one of them a reclaim), with gpu-7's events among many."""
    journal, model = open_journal(tmp_path / "j.sqlite3"), Model()
    for i in range(3000):
        lease = (new_lease(f"l-{i:04d}", DOMAINS[i % 3], "vm", LeaseRequest(), T0 + i)
                 .transition(S.BINDING, devices=(device(f"gpu-x{i % 40}"),))
                 .transition(S.FAILED, ended_at=T0 + i + 1, end_reason="failed"))
        journal.record(lease, from_state=S.BINDING, actor="t",
                       earlier=[Step(None, S.REQUESTED), Step(S.REQUESTED, S.BINDING)])
        model.put(lease)
    for i in range(5):
        journal_lease(journal, model, f"mine-{i}", T0 + 1000 + i, DOMAINS[0], "ended", ("gpu-7",),
                      "reclaim: idle twice" if i == 2 else "released by guest")
    yield journal, model
    journal.close()


def test_history_and_short_lists_parse_a_few_documents_through_indexes(big: tuple[Journal, Model],
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    journal, model = big
    parsed: list[str] = []
    monkeypatch.setattr(journal_module, "json", types.SimpleNamespace(
        dumps=json.dumps, loads=lambda doc: parsed.append(doc) or json.loads(doc)))
    statements: list[str] = []
    journal._db.set_trace_callback(statements.append)

    def cost(call: Any) -> tuple[Any, int, int]:
        """The call's result, how many documents it parsed, and about how many SQLite instructions it ran."""
        parsed.clear()
        ticks = [0]

        def tick() -> int:
            ticks[0] += 10
            return 0  # go on

        journal._db.set_progress_handler(tick, 10)
        try:
            return call(), len(parsed), ticks[0]
        finally:
            journal._db.set_progress_handler(None, 0)

    # the SQL alone of one pass over every lease, as lists and GPU history made before
    _, _, full = cost(lambda: journal._db.execute("SELECT doc, rowid FROM leases").fetchall())
    statements.clear()
    bound = full // 10  # a GPU's 75 leases or 40 events take about 700; a list of 10, about 100
    costs = {
        "history": cost(lambda: journal.gpu_history("gpu-7")),
        "history of 75": cost(lambda: journal.gpu_history("gpu-x3")),
        "newest": cost(lambda: journal.leases(limit=10)),
        "a VM's": cost(lambda: journal.lease_page(limit=10, domain_uuid=DOMAINS[1])),
        "a state's": cost(lambda: journal.leases(limit=10, states=[S.FAILED])),
        "a GPU's events": cost(lambda: journal.events(gpu_id="gpu-7", limit=50)),
    }
    cursor = costs["a VM's"][0][1]
    costs["a VM's next"] = cost(lambda: journal.leases(limit=10, cursor=cursor, domain_uuid=DOMAINS[1]))
    journal._db.set_trace_callback(None)
    # a page parses at most its own documents: fewer where ended leases were parsed by an earlier page
    assert {k: (docs <= 10, steps < bound) for k, (_, docs, steps) in costs.items()} == {
        "history": (True, True), "history of 75": (True, True), "newest": (True, True), "a VM's": (True, True),
        "a state's": (True, True), "a GPU's events": (True, True), "a VM's next": (True, True)}, (full, costs)
    assert (costs["history"][1], costs["history of 75"][1], costs["a GPU's events"][1]) == (0, 0, 0)
    # and they are the right answers
    assert costs["history"][0] == model.history("gpu-7") and costs["history"][0]["reclaims"] == 1
    assert costs["history of 75"][0] == model.history("gpu-x3") and costs["history of 75"][0]["leases"] == 75
    assert costs["newest"][0] == model.ordered()[:10]
    assert costs["a VM's"][0][0] + costs["a VM's next"][0] == model.leases(None, DOMAINS[1], None, 20)
    assert costs["a state's"][0] == model.leases([S.FAILED], None, None, 10)
    assert [e.seq for e in costs["a GPU's events"][0]] == old_gpu_events(journal, "gpu-7")
    assert len(costs["a GPU's events"][0]) == 5 * 8
    # through indexes: no table walked whole, no sort but among one creation time's rows of one GPU
    plans = {sql: [r[3] for r in journal._db.execute("EXPLAIN QUERY PLAN " + sql)]
             for sql in statements if sql.startswith("SELECT")}
    assert len(plans) == 9  # gpu_history's two for each GPU, four lists, the events
    for sql, plan in plans.items():
        for line in plan:
            assert re.match(r"SEARCH |SCAN \w+ USING (COVERING )?INDEX |USE TEMP B-TREE FOR ORDER BY", line), plan
            assert not line.startswith("USE TEMP B-TREE") or "g.created_at=" in sql, (sql, plan)
        assert not any(re.fullmatch(r"SCAN (leases|events|lease_gpus|event_gpus)", line) for line in plan)


# -- retention ------------------------------------------------------------------------------------------------------
def test_prune_takes_index_rows_with_their_leases_and_events(tmp_path: Path) -> None:
    now = [T0]
    journal, model = open_journal(tmp_path / "j.sqlite3", clock=lambda: now[0]), Model()
    for i in range(6):  # ended long ago: they go
        journal_lease(journal, model, f"old-{i}", T0 + i, "uuid-a", "ended", (GPUS[i % 4], GPUS[(i + 1) % 4]),
                      ENDINGS[i % len(ENDINGS)])
    journal.event("strike-one", actor="reaper", gpu_id="gpu-1,gpu-2")  # of no lease, old: goes
    journal_lease(journal, model, "live", T0 + 10, "uuid-b", "active", ("gpu-1", "gpu-10"))  # live: stays
    journal.mark_mirrored(e.seq for e in journal.unmirrored(10**6))
    journal_lease(journal, model, "unmirrored", T0 + 11, "uuid-b", "ended", ("gpu-2",))  # not in the store: stays
    now[0] = T0 + 40 * 86400
    journal_lease(journal, model, "recent", now[0], "uuid-c", "ended", ("gpu-1", "gpu-3"), "reclaim: idle twice")
    journal.event("quarantine", actor="op", gpu_id="gpu-3")  # of no lease, recent: stays
    journal.mark_mirrored(e.seq for e in journal.unmirrored(10**6) if e.lease_id != "unmirrored")

    # REQUESTED..RELEASED: 8 events each, and the strike
    assert journal.prune(T0 + 30 * 86400, mirrored_only=True) == (6, 6 * 8 + 1)
    db = journal._db
    for gone in (f"old-{i}" for i in range(6)):
        del model.by_id[gone]
    events = assert_gpu_index_rows(journal, model)
    assert {e.lease_id for e in events} == {"live", "unmirrored", "recent", None}
    check_against_model(journal, model)
    journal.close()


def test_a_page_parses_each_ended_lease_once_and_never_serves_a_stale_one(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Listings of a long history are re-read often: ended leases (which never change) are parsed once; a live
    one is parsed at every read, and a rewrite of any lease is never hidden by a parsed copy."""
    from hostagent.domain.lease import Lease, LeaseRequest, LeaseState, new_lease
    from hostagent.store import journal as journal_module
    from hostagent.store.journal import Journal

    j = Journal(tmp_path / "j.sqlite3")
    ended = [new_lease(f"l-end{i}", "u", "vm", LeaseRequest(), 100.0 + i).transition(LeaseState.FAILED,
                                                                                         ended_at=200.0 + i)
             for i in range(3)]
    for x in ended:
        j.record(x, from_state=None, actor="t")
    live = new_lease("l-live", "u", "vm", LeaseRequest(), 300.0).transition(LeaseState.QUEUED)
    j.record(live, from_state=None, actor="t")
    parses: list[str] = []
    real = Lease.from_dict

    def counting(d: Any) -> Lease:
        parses.append(d["id"])
        return real(d)

    monkeypatch.setattr(journal_module.Lease, "from_dict", staticmethod(counting))
    first, _ = j.lease_page(limit=10)
    second, _ = j.lease_page(limit=10)
    assert [x.id for x in first] == [x.id for x in second] == ["l-live", "l-end2", "l-end1", "l-end0"]
    assert sorted(parses) == sorted(["l-live", "l-end0", "l-end1", "l-end2", "l-live"])
    rewritten = ended[1].with_changes(error="set after the end")
    j.record(rewritten, from_state=LeaseState.FAILED, actor="t", detail="rewrite")
    third, _ = j.lease_page(limit=10)
    assert next(x for x in third if x.id == "l-end1").error == "set after the end"
    monkeypatch.setattr(journal_module, "ENDED_PARSED_KEPT", 1)
    j.record(new_lease("l-end9", "u", "vm", LeaseRequest(), 400.0).transition(LeaseState.FAILED, ended_at=401.0),
             from_state=None, actor="t")
    j.lease_page(limit=10)
    assert list(j._ended) == ["l-end9"]  # bounded: the newest parsed stays


@pytest.mark.parametrize("position", [
    Position((2**63,), T0, 5), Position((1,), T0, 2**63), Position((1,), T0, -2**63 - 1), Position((-2**70,), T0, 5),
])
def test_a_sorted_page_cursor_past_sqlite_integers_is_invalid_input(tmp_path: Path, position: Position) -> None:
    """The dashboard's keyset cursors carry sort keys and a rowid: one crafted past SQLite's INTEGER is refused
    before it reaches a statement (where it raised OverflowError)."""
    cursor = encode_cursor(Order("gpus", True, T0), position)
    with pytest.raises(InvalidInput) as err:
        decode_cursor(cursor, "gpus", True, field="after")
    assert err.value.field == "after"
    fine = encode_cursor(Order("gpus", True, T0), Position((2**63 - 1,), T0, -2**63))
    assert decode_cursor(fine, "gpus", True)[1] == Position((2**63 - 1,), T0, -2**63)
