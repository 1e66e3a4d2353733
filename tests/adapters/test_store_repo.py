"""The usage store's repository against the real MariaDB and SQLite (every test runs on both)."""

from __future__ import annotations

import csv
import io
import random
import time
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select

from hostagent.domain.errors import InvalidInput, NotFound
from hostagent.domain.inventory import Gpu, IommuGroup, PciFunction
from hostagent.domain.pci import PciAddress
from hostagent.store import schema as t
from hostagent.store.repo import UsageStore, hash_token
from hostagent.store.upsert import _row_upsert
from tests.support.store import backend_url, lease_doc, sample_rows, store  # noqa: F401

NOW = time.time()
T0 = int(NOW // 3600 * 3600) - 3 * 3600  # three hours ago, on an hour boundary


def setup_lease(s: UsageStore, lease_id: str = "L1", gpus: tuple[str, ...] = ("gpu-0", "gpu-1"), **kw: Any) -> None:
    s.upsert_gpus([{"gpu_id": g, "address": f"0000:{3 + i:02x}:00.0", "model": "A100", "memory_bytes": 40 << 30}
                   for i, g in enumerate(gpus)])
    s.insert_lease(lease_doc(lease_id, created_at=kw.pop("created_at", T0), gpus=list(gpus), **kw))


def count(s: UsageStore, table: Any, **where: Any) -> int:
    with s.engine.connect() as c:
        q = select(func.count()).select_from(table).where(table.c.host_id == s.host_id,
                                                          *[table.c[k] == v for k, v in where.items()])
        return int(c.execute(q).scalar_one())


def test_lease_round_trip_with_devices_events_and_outcome(store: UsageStore) -> None:
    setup_lease(store)
    store.add_lease_event("L1", actor="agent", from_state="ATTACHING", to_state="ACTIVE", ts=T0 + 2)
    store.update_lease("L1", {"state": "RELEASED", "ended_at": T0 + 600, "end_reason": "idle: strike two"})
    store.add_lease_event("L1", actor="reaper", from_state="REBINDING", to_state="RELEASED", ts=T0 + 600)
    lease = store.get_lease("L1")
    assert lease["host_id"] == store.host_id and lease["state"] == "RELEASED" and lease["outcome"] == "reclaimed"
    assert (lease["gpus_requested"], lease["task_type"], lease["precision"], lease["priority"]) == (2, "training", "bf16", 2)
    assert lease["accept_deferred"] is True and lease["accept_partial"] is False
    assert lease["idempotency_key"] == "idem-L1" and lease["reasons"] == ["free", "memory >= 16 GiB", "same NUMA node"]
    assert [d["gpu_id"] for d in lease["devices"]] == ["gpu-0", "gpu-1"]
    assert lease["devices"][0]["functions"] == ["0000:3b:00.0", "0000:3b:00.1"]
    assert [(e["from_state"], e["to_state"], e["actor"]) for e in lease["events"]] == [
        ("ATTACHING", "ACTIVE", "agent"), ("REBINDING", "RELEASED", "reaper")]


def test_insert_lease_is_an_idempotent_upsert_and_replaces_devices(store: UsageStore) -> None:
    setup_lease(store)
    store.insert_lease(lease_doc("L1", created_at=T0, gpus=["gpu-1"], state="ACTIVE"))
    store.insert_lease(lease_doc("L1", created_at=T0, gpus=["gpu-1"], state="ACTIVE"))
    assert count(store, t.leases) == 1
    assert [d["gpu_id"] for d in store.get_lease("L1")["devices"]] == ["gpu-1"]


def test_the_lease_upsert_statement_is_built_once_and_each_write_still_replaces(store: UsageStore) -> None:
    setup_lease(store)
    before = _row_upsert.cache_info()
    for state in ("ATTACHING", "ACTIVE", "RELEASED"):
        store.insert_lease(lease_doc("L1", created_at=T0, gpus=["gpu-1"], state=state))
        assert store.get_lease("L1")["state"] == state
    after = _row_upsert.cache_info()
    assert after.hits - before.hits >= 3  # every write reused the statement built earlier
    assert after.misses == before.misses


def test_event_with_the_same_uid_is_written_once(store: UsageStore) -> None:
    setup_lease(store)
    for _ in range(3):
        store.add_lease_event("L1", actor="agent", to_state="ACTIVE", uid="a" * 32)
    assert len(store.get_lease("L1")["events"]) == 1


def test_record_lease_mirrors_journal_objects_idempotently(store: UsageStore) -> None:
    class Obj:
        def __init__(self, d: dict[str, Any]) -> None:
            self.d = d

        def to_dict(self) -> dict[str, Any]:
            return self.d
    setup_lease(store, "L2")
    ev = Obj({"seq": 41, "kind": "transition", "from_state": "BINDING", "to_state": "ATTACHING", "actor": "agent",
              "ts": T0 + 1, "detail": None, "error": None, "gpu_id": "gpu-0"})
    doc = lease_doc("L2", created_at=T0, gpus=["gpu-0"], state="ATTACHING")
    store.record_lease(Obj(doc), ev)
    store.record_lease(Obj(doc), ev)  # a restart re-mirrors the same journal event
    assert [e["to_state"] for e in store.get_lease("L2")["events"]] == ["ATTACHING"]


def test_unknown_lease_and_bad_fields_are_refused(store: UsageStore) -> None:
    setup_lease(store)
    with pytest.raises(NotFound) as nf:
        store.update_lease("nope", {"state": "FAILED"})
    assert nf.value.field == "lease_id"
    with pytest.raises(NotFound):
        store.add_lease_event("nope", actor="agent", to_state="FAILED")
    with pytest.raises(InvalidInput) as bad:
        store.update_lease("L1", {"colour": "red"})
    assert bad.value.field == "colour"
    with pytest.raises(InvalidInput) as bad:
        store.insert_lease({"id": "L3", "domain_uuid": "u", "state": "ACTIVE", "created_at": "yesterday"})
    assert bad.value.field == "created_at"
    with pytest.raises(NotFound):
        store.get_lease("nope")


def test_list_leases_filters(store: UsageStore) -> None:
    setup_lease(store, "A", created_at=T0)
    setup_lease(store, "B", created_at=T0 + 10, domain_uuid="other-vm")
    setup_lease(store, "C", created_at=T0 + 20, state="RELEASED", ended_at=T0 + 30)
    assert [x["id"] for x in store.list_leases()] == ["C", "B", "A"]
    assert [x["id"] for x in store.list_leases(state="ACTIVE")] == ["B", "A"]
    assert [x["id"] for x in store.list_leases(state=["RELEASED"])] == ["C"]
    assert [x["id"] for x in store.list_leases(domain_uuid="other-vm")] == ["B"]
    assert [x["id"] for x in store.list_leases(since=T0 + 31)] == ["B", "A"]  # C ended before
    assert [x["id"] for x in store.list_leases(limit=1)] == ["C"]
    assert store.list_leases()[0]["devices"]


def test_samples_and_rollups_agree_with_raw_and_replays_add_nothing(store: UsageStore) -> None:
    setup_lease(store)
    rng = random.Random(7)
    rows = sample_rows(["gpu-0", "gpu-1"], "L1", T0 + 5, 400, util=lambda i, j: round(rng.uniform(0, 100), 3))
    for i in range(0, len(rows), 137):
        assert store.add_samples(rows[i:i + 137], now=NOW) == len(rows[i:i + 137])
    store.add_samples(rows[100:300], now=NOW)  # a replayed heartbeat window
    assert count(store, t.usage_samples) == 800
    s, r = t.usage_samples.c, t.usage_rollups.c
    with store.engine.connect() as c:
        for res in (60, 3600):
            bucket = s.ts_ms / 1000 - (s.ts_ms / 1000) % res
            raw = {(row[0], int(row[1])): row[2:] for row in c.execute(
                select(s.gpu_id, func.floor(s.ts_ms / 1000 / res) * res, func.count(), func.sum(s.util_pct),
                       func.min(s.util_pct), func.max(s.util_pct), func.max(s.mem_used_bytes))
                .where(s.host_id == store.host_id).group_by(s.gpu_id, func.floor(s.ts_ms / 1000 / res)))}
            del bucket
            rolled = {(row[0], int(row[1])): row[2:] for row in c.execute(
                select(r.gpu_id, r.bucket, r.n, r.util_sum, r.util_min, r.util_max, r.mem_max)
                .where(r.host_id == store.host_id, r.resolution == res))}
            assert raw.keys() == rolled.keys()
            for k, v in raw.items():
                assert rolled[k][0] == v[0] and rolled[k][1] == pytest.approx(float(v[1]))
                assert (rolled[k][2], rolled[k][3], rolled[k][4]) == (pytest.approx(v[2]), pytest.approx(v[3]), v[4])
    assert store.status()["samples_duplicate"] == 200


def test_a_bad_sample_or_unknown_reference_writes_nothing(store: UsageStore) -> None:
    setup_lease(store)
    rows = sample_rows(["gpu-0"], "L1", T0, 10)
    with pytest.raises(InvalidInput) as bad:
        store.add_samples(rows[:5] + [{**rows[5], "util_pct": 140}] + rows[6:], now=NOW)
    assert bad.value.field == "samples[5].util_pct"
    with pytest.raises(InvalidInput) as bad:
        store.add_samples(rows[:5] + [{**rows[5], "ts": NOW + 3600}], now=NOW)
    assert bad.value.field == "samples[5].ts"
    with pytest.raises(NotFound) as nf:
        store.add_samples(rows[:5] + [{**rows[5], "lease_id": "ghost"}], now=NOW)
    assert nf.value.field == "samples.lease_id"
    with pytest.raises(NotFound) as nf:
        store.add_samples(rows[:5] + [{**rows[5], "gpu_id": "gpu-9"}], now=NOW)
    assert nf.value.field == "samples.gpu_id"
    assert count(store, t.usage_samples) == 0 and count(store, t.usage_rollups) == 0


def test_known_lease_cache_is_bounded_and_an_evicted_lease_is_asked_for_again(store: UsageStore,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(UsageStore, "KNOWN_LEASES_MAX", 3)
    for i in range(6):
        setup_lease(store, f"L{i}")
    assert list(store._known_leases) == ["L3", "L4", "L5"]  # noqa: SLF001 - the cache under test
    store.add_samples(sample_rows(["gpu-0"], "L0", T0, 2), now=NOW)  # evicted, still in the store: accepted
    assert list(store._known_leases) == ["L4", "L5", "L0"]  # noqa: SLF001
    store.add_samples(sample_rows(["gpu-0"], "L4", T0, 2), now=NOW)  # in use: moves to the recent end
    assert list(store._known_leases) == ["L5", "L0", "L4"]  # noqa: SLF001
    with pytest.raises(NotFound):
        store.add_samples(sample_rows(["gpu-0"], "ghost", T0, 2), now=NOW)
    assert "ghost" not in store._known_leases and count(store, t.usage_samples) == 4  # noqa: SLF001


def test_lease_usage_summary_and_gpu_history(store: UsageStore) -> None:
    setup_lease(store)
    store.add_samples(sample_rows(["gpu-0", "gpu-1"], "L1", T0, 720, util=lambda i, j: 80.0 if j == 0 else 2.0),
                      now=NOW)  # two hours at 10 s
    summary = store.lease_usage_summary("L1")
    g0, g1 = summary["gpus"]["gpu-0"], summary["gpus"]["gpu-1"]
    assert g0["n"] == g1["n"] == 720 and summary["total"]["n"] == 1440
    assert g0["util_mean"] == pytest.approx(80.0) and g0["idle_fraction"] == 0.0
    assert g1["util_mean"] == pytest.approx(2.0) and g1["idle_fraction"] == 1.0
    assert summary["total"]["first_ts"] == T0 and summary["total"]["last_ts"] == T0 + 7190
    with pytest.raises(NotFound) as nf:
        store.lease_usage_summary("nope")
    assert nf.value.field == "lease_id" and "nope" in nf.value.message
    minutes = store.gpu_history("gpu-0", T0, T0 + 7200, "minute")
    assert len(minutes) == 120 and all(p["n"] == 6 for p in minutes) and minutes[0]["ts"] == T0
    hours = store.gpu_history("gpu-0", T0, T0 + 7200, "hour")
    assert [(p["ts"], p["n"]) for p in hours] == [(T0, 360), (T0 + 3600, 360)]
    two_h = store.gpu_history("gpu-0", T0 - 7200, T0 + 7200, 7200)
    assert sum(p["n"] for p in two_h) == 720
    five = store.gpu_history("gpu-0", T0, T0 + 600, 300)
    assert [p["n"] for p in five] == [30, 30]
    # the work rate is the bucket's mean (sample_rows reports i % 5 for its i-th instant)
    assert minutes[0]["work_rate"] == pytest.approx(10 / 6) and hours[0]["work_rate"] == pytest.approx(2.0)
    assert [p["work_rate"] for p in five] == [pytest.approx(2.0)] * 2
    raw = store.gpu_history("gpu-0", T0, T0 + 100, "raw")
    assert [p["ts"] for p in raw] == [T0 + 10 * i for i in range(10)]
    assert store.gpu_history("gpu-1", T0 + 30 * 86400, T0 + 31 * 86400) == []


def test_training_records_join_lease_usage_and_device_models(store: UsageStore) -> None:
    setup_lease(store, "T1", created_at=T0, state="RELEASED", ended_at=T0 + 3600)
    setup_lease(store, "T2", created_at=T0 + 5, state="ACTIVE")  # still running: not a training record
    store.add_samples(sample_rows(["gpu-0"], "T1", T0 + 1, 30, util=lambda i, j: 50.0), now=NOW)
    recs = [r for r in store.training_records(since=T0 - 1) if r["host_id"] == store.host_id]
    assert [r["id"] for r in recs] == ["T1"]
    rec = recs[0]
    assert rec["task_type"] == "training" and rec["outcome"] == "released" and rec["held_s"] == 3599
    assert rec["usage"]["n"] == 30 and rec["usage"]["util_mean"] == pytest.approx(50.0)
    assert {d["model"] for d in rec["devices"]} == {"A100"}


def test_export_csv(store: UsageStore, tmp_path: Path) -> None:
    setup_lease(store)
    store.add_samples(sample_rows(["gpu-0"], "L1", T0, 50), now=NOW)
    buf = io.StringIO()
    assert store.export_csv("samples", T0, T0 + 100, buf) == 10
    rows = list(csv.DictReader(io.StringIO(buf.getvalue())))
    assert len(rows) == 10 and rows[0]["gpu_id"] == "gpu-0" and int(rows[0]["ts_ms"]) == T0 * 1000
    assert store.export_csv("leases", None, None, tmp_path / "leases.csv") == 1
    assert "idem-L1" in (tmp_path / "leases.csv").read_text()
    for lid in ("L4", "L2", "L3"):  # created in the same second: the export orders them by id, whatever the store
        store.insert_lease(lease_doc(lid, created_at=T0 + 50, gpus=["gpu-0"]))
    buf = io.StringIO()
    assert store.export_csv("leases", None, None, buf) == 4
    assert [r["id"] for r in csv.DictReader(io.StringIO(buf.getvalue()))] == ["L1", "L2", "L3", "L4"]
    assert store.export_csv("rollups_hour", None, None, io.StringIO()) == 1
    with pytest.raises(InvalidInput):
        store.export_csv("passwords", None, None, io.StringIO())


def test_prune_keeps_hourly_rollups(store: UsageStore) -> None:
    setup_lease(store)
    store.add_samples(sample_rows(["gpu-0"], "L1", T0, 360), now=NOW)  # one hour
    hourly_before = store.gpu_history("gpu-0", T0, T0 + 3600, "hour")
    counts = store.prune(raw_older_than_s=NOW - (T0 + 1800), minute_older_than_s=NOW - (T0 + 600), now=NOW,
                         chunk_s=600)
    assert counts == {"samples": 180, "minute_rollups": 10}
    assert count(store, t.usage_samples) == 180
    assert store.gpu_history("gpu-0", T0, T0 + 3600, "hour") == hourly_before


def test_tokens_are_hashed_bound_and_revocable(store: UsageStore) -> None:
    token, rec = store.tokens.issue(role="guest", domain_uuid="dom-1", domain_name="vm1")
    assert "sha256" not in rec and rec["hash_prefix"] == hash_token(token)[:12]
    with store.engine.connect() as c:
        assert c.execute(select(t.tokens.c.sha256).where(t.tokens.c.sha256 == hash_token(token))).scalar() is not None
        assert c.execute(select(func.count()).select_from(t.tokens).where(t.tokens.c.sha256 == token)).scalar() == 0
    assert store.tokens.lookup(token)["domain_uuid"] == "dom-1"
    assert store.tokens.lookup("wrong") is None
    other, _ = store.tokens.issue(role="guest", domain_uuid="dom-1")
    expired, _ = store.tokens.issue(role="reader", expires_at=NOW - 1)
    assert store.tokens.lookup(expired) is None
    assert store.tokens.revoke(rec["hash_prefix"]) is True
    assert store.tokens.lookup(token) is None and store.tokens.lookup(other) is not None
    assert store.tokens.revoke_domain("dom-1") == 1
    assert store.tokens.lookup(other) is None
    with pytest.raises(InvalidInput) as bad:
        store.tokens.issue(role="guest")
    assert bad.value.field == "domain_uuid"
    with pytest.raises(InvalidInput):
        store.tokens.issue(role="root")


def test_model_versions_with_large_artifacts(store: UsageStore) -> None:
    blob = random.Random(3).randbytes(300_000)  # past MySQL's 64 KiB BLOB
    v = f"m-{store.host_id}"
    saved = store.save_model_version(v, artifact=blob, metrics={"top1": 0.71}, trained_on=1234, activate=True)
    assert saved["active"] is True and "artifact" not in saved
    got = store.get_model_version(v)
    assert got["artifact"] == blob and got["metrics"] == {"top1": 0.71}
    v2 = f"m2-{store.host_id}"
    store.save_model_version(v2, artifact_path="/var/lib/hostagent/models/x.skops", activate=True)
    assert store.get_model_version()["version"] == v2
    assert [m["version"] for m in store.list_model_versions()][:2] == [v2, v]
    with pytest.raises(InvalidInput):
        store.save_model_version(v, artifact=b"again")
    with pytest.raises(NotFound):
        store.activate_model_version("never")


def test_probe_results_and_reclaim_events(store: UsageStore) -> None:
    setup_lease(store)
    store.add_probe_result("gpu-0", score=0.93, spread=0.02, details={"gflops": 19.1}, ts=T0)
    store.add_probe_result("gpu-0", score=0.4, ok=False, ts=T0 + 60)
    with pytest.raises(NotFound):
        store.add_probe_result("gpu-9", score=1.0)
    assert [p["score"] for p in store.list_probe_results(gpu_id="gpu-0")] == [0.4, 0.93]
    uid = store.add_reclaim_event(action="strike1", lease_id="L1", gpu_id="gpu-0", reason="util < 5 %", ts=T0)
    store.add_reclaim_event(action="strike1", lease_id="L1", gpu_id="gpu-0", reason="util < 5 %", ts=T0, uid=uid)
    store.add_reclaim_event(action="strike2", lease_id="L1", gpu_id="gpu-0", ts=T0 + 300, details={"grace_s": 300})
    assert [e["action"] for e in store.list_reclaim_events(lease_id="L1")] == ["strike1", "strike2"]


def test_domain_gpu_records_and_hosts_share_one_database(store: UsageStore, backend_url: str,  # noqa: F811
                                                         tmp_path: Path) -> None:
    fn = PciFunction(PciAddress.parse("0000:3b:00.0"), 0x10DE, 0x20B0, 0x030200, numa_node=1, iommu_group=7,
                     link_speed="16.0 GT/s PCIe", link_width=16,
                     parent_chain=(PciAddress.parse("0000:3a:00.0"), PciAddress.parse("0000:00:03.0")))
    gpu = Gpu("gpu-0000-3b-00-0", fn, (fn,), IommuGroup(7, (fn,)), memory_bytes=40 << 30)
    store.upsert_gpus([gpu])
    other = UsageStore(backend_url, store.host_id + "-b", spool_path=tmp_path / "other.sqlite3")
    try:
        other.upsert_gpus([{"gpu_id": "gpu-0000-3b-00-0", "address": "0000:3b:00.0"}])
        mine = store.list_gpus()
        assert len(mine) == 1 and mine[0]["numa_node"] == 1 and mine[0]["switch_id"] == "0000:3a:00.0"
        assert mine[0]["root_port"] == "0000:00:03.0" and mine[0]["memory_bytes"] == 40 << 30
        assert {g["host_id"] for g in store.list_gpus(all_hosts=True)} >= {store.host_id, other.host_id}
        with pytest.raises(NotFound):  # another host's lease is not this host's
            setup_lease(other, "X1", gpus=("gpu-0000-3b-00-0",))
            store.update_lease("X1", {"state": "FAILED"})
    finally:
        other.close()


def test_update_lease_replaces_devices_keeps_a_given_outcome_and_changes_only_what_it_names(
        store: UsageStore) -> None:
    setup_lease(store)
    store.update_lease("L1", {"devices": [{"gpu_id": "gpu-1", "functions": ["0000:04:00.0"], "iommu_group": 9}]})
    lease = store.get_lease("L1")
    assert [(d["gpu_id"], d["functions"], d["iommu_group"]) for d in lease["devices"]] == [
        ("gpu-1", ["0000:04:00.0"], 9)]
    store.update_lease("L1", {"end_reason": "noted"})  # neither state nor outcome: nothing derived
    lease = store.get_lease("L1")
    assert (lease["state"], lease["end_reason"], lease["outcome"]) == ("ACTIVE", "noted", None)
    store.update_lease("L1", {"state": "RELEASED", "end_reason": "idle: strike two", "outcome": "failed"})
    assert store.get_lease("L1")["outcome"] == "failed"  # given, not derived from the state ("reclaimed")


def test_one_lease_id_on_two_hosts_of_one_database_is_two_leases(store: UsageStore, backend_url: str,  # noqa: F811
                                                                  tmp_path: Path) -> None:
    """A fleet shares the database: a host's change reaches its own lease, never another host's of the same id."""
    other = UsageStore(backend_url, store.host_id + "-b", spool_path=tmp_path / "other.sqlite3")
    try:
        setup_lease(store)
        setup_lease(other)
        other.update_lease("L1", {"state": "FAILED", "end_reason": "other host"})
        assert other.get_lease("L1")["state"] == "FAILED"
        mine = store.get_lease("L1")
        assert (mine["state"], mine["end_reason"]) == ("ACTIVE", None), mine
    finally:
        other.close()


def test_a_token_hash_that_is_not_sha256_is_refused_by_name(store: UsageStore) -> None:
    for bad in ("abc", "G" * 64, hash_token("x").upper()):
        with pytest.raises(InvalidInput) as err:
            store.tokens.add_hash(bad, role="reader")
        assert err.value.field == "sha256" and "64 lowercase hex digits" in err.value.message
    assert store.tokens.add_hash(hash_token("x"), role="reader")["role"] == "reader"


def test_repeats_inside_one_batch_are_written_once(store: UsageStore) -> None:
    """A heartbeat retried into the same batch must not sink the batch (IntegrityError) nor count twice."""
    now = time.time()
    store.upsert_gpus([{"gpu_id": "gpu-dup", "address": "0000:77:00.0", "model": "T4"}])
    store.insert_lease(lease_doc("l-dup", created_at=now, gpus=["gpu-dup"]))
    rows = sample_rows(["gpu-dup"], "l-dup", now - 100, 5)
    assert store.add_samples(rows + rows[:3], now=now) >= 5
    usage = store.lease_usage_summary("l-dup")
    assert usage["total"]["n"] == 5


def test_a_hosts_device_rows_never_wait_on_another_hosts_open_transaction(store: UsageStore, backend_url: str,  # noqa: F811
                                                                           tmp_path: Path) -> None:
    """Two hosts of one fleet mirror new leases at once. The devices of a new lease used to be written as a DELETE of
    the lease's rows (matching none) then an INSERT: on InnoDB that DELETE locks the gap up to the next key, which
    may be a row another host has just inserted and not yet committed, so one host's write waited on another's
    transaction (and two such pairs deadlocked: `bench fleet` saw error 1213). Rows are now named by their key."""
    if not backend_url.startswith("mysql"):
        pytest.skip("InnoDB's gap locks: SQLite has one writer at a time")
    from sqlalchemy import text

    first = UsageStore(backend_url, store.host_id + "-a", spool_path=tmp_path / "a.sqlite3")  # sorts before `second`
    second = UsageStore(backend_url, store.host_id + "-b", spool_path=tmp_path / "b.sqlite3")
    try:
        for s, lid in ((first, "L9"), (second, "L1")):
            setup_lease(s, lid, gpus=("gpu-0",))
        row = {"functions": ["0000:03:00.0"], "iommu_group": 3}
        with second.engine.connect() as held, first.engine.connect() as c:
            second._replace_devices(held, "L1", [dict(row, lease_id="L1", gpu_id="gpu-5",
                                                                 host_id=second.host_id)])
            # the first host's new rows sort just before the row `held` has not committed
            c.execute(text("SET SESSION innodb_lock_wait_timeout = 2"))
            c.commit()
            first._replace_devices(c, "L9", [dict(row, lease_id="L9", gpu_id="gpu-1",
                                                              host_id=first.host_id)])
            c.commit()
            held.rollback()
        assert [d["gpu_id"] for d in first.get_lease("L9")["devices"]] == ["gpu-1"]
        assert [d["gpu_id"] for d in second.get_lease("L1")["devices"]] == ["gpu-0"]  # rolled back
    finally:
        first.close()
        second.close()
