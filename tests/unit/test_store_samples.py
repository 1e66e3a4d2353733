"""Pure parts of the usage store: sample validation, rollup deltas, lease outcomes, the upsert's SQL per dialect."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sqlalchemy.dialects import mysql, sqlite

from hostagent.domain.errors import InvalidInput
from hostagent.store import schema
from hostagent.store.repo import _resolution, outcome_of
from hostagent.store.samples import ROLLUP_ADD, Sample, rollup_rows, validate_samples

NOW = 1_800_000_000.0


def ok(**kw: object) -> dict[str, object]:
    base: dict[str, object] = {"gpu_id": "gpu-0", "ts": NOW - 5, "util_pct": 50.0, "mem_used_bytes": 1024}
    base.update(kw)
    return base


def test_valid_batch_becomes_samples_in_ms() -> None:
    out = validate_samples([ok(), ok(ts=NOW - 4.0005, lease_id="L1", source="host")], now=NOW)
    assert out[0] == Sample("gpu-0", int((NOW - 5) * 1000), "", "guest", 50.0, 1024, None, None)
    assert out[1].ts_ms == round((NOW - 4.0005) * 1000) and out[1].lease_id == "L1" and out[1].source == "host"


@pytest.mark.parametrize("bad, field", [
    (ok(util_pct=100.5), "samples[1].util_pct"),
    (ok(util_pct=-1), "samples[1].util_pct"),
    (ok(util_pct=float("nan")), "samples[1].util_pct"),
    (ok(util_pct=True), "samples[1].util_pct"),
    (ok(mem_used_bytes=-1), "samples[1].mem_used_bytes"),
    (ok(mem_used_bytes=1.5), "samples[1].mem_used_bytes"),
    (ok(work_rate=-0.1), "samples[1].work_rate"),
    (ok(ts=NOW + 301), "samples[1].ts"),
    (ok(ts=12345), "samples[1].ts"),
    (ok(ts="soon"), "samples[1].ts"),
    (ok(gpu_id=""), "samples[1].gpu_id"),
    (ok(gpu_id="x" * 65), "samples[1].gpu_id"),
    (ok(source="martian"), "samples[1].source"),
    (ok(colour="blue"), "samples[1].colour"),
    ({"ts": NOW}, "samples[1].gpu_id"),
    ({"gpu_id": "g"}, "samples[1].ts"),
    ("not an object", "samples[1]"),
])
def test_bad_sample_names_its_field(bad: object, field: str) -> None:
    with pytest.raises(InvalidInput) as err:
        validate_samples([ok(), bad], now=NOW)  # type: ignore[list-item]
    assert err.value.field == field


def test_future_within_skew_is_accepted_and_skew_is_configurable() -> None:
    assert validate_samples([ok(ts=NOW + 299)], now=NOW)
    with pytest.raises(InvalidInput):
        validate_samples([ok(ts=NOW + 10)], now=NOW, max_skew_s=5)


def test_duplicates_inside_a_batch_are_dropped_and_default_lease_applies() -> None:
    out = validate_samples([ok(), ok(), ok(source="host")], now=NOW, default_lease_id="L9")
    assert len(out) == 2 and {s.lease_id for s in out} == {"L9"}


def test_a_sample_is_the_same_sample_by_its_key_whatever_its_readings() -> None:
    # the store's unique key is (host, gpu, instant, lease, source): a guest that resends an instant with other
    # readings has sent the same sample again, and the first one stands (the store would skip the second anyway)
    out = validate_samples([ok(util_pct=10.0), ok(util_pct=90.0, mem_used_bytes=5), ok(ts=NOW - 4, util_pct=90.0)],
                           now=NOW)
    assert [(s.ts_ms, s.util_pct) for s in out] == [(int((NOW - 5) * 1000), 10.0), (int((NOW - 4) * 1000), 90.0)]
    assert out[0].key == ("gpu-0", int((NOW - 5) * 1000), "", "guest") and type(out[0].key) is tuple
    assert Sample(*out[0]) == out[0] and Sample(**out[0].to_dict()) == out[0]  # the spool's form reads back


def test_rollup_rows_aggregate_per_bucket_and_lease() -> None:
    t0 = 1_800_000_000  # a multiple of 3600 and of 60
    ss = [Sample("g", (t0 + i * 10) * 1000, "L", "guest", float(i), 100 * i, 1.0, 2.0) for i in range(12)]
    ss.append(Sample("g", (t0 + 5) * 1000, "", "host", None, None, None, 7.0))
    rows = {(r["resolution"], r["bucket"], r["lease_id"]): r for r in rollup_rows("h", ss)}
    m0 = rows[(60, t0, "L")]
    assert (m0["n"], m0["util_sum"], m0["util_min"], m0["util_max"]) == (6, 15.0, 0.0, 5.0)
    assert m0["idle_n"] == 5  # 0..4 are under 5 %
    assert m0["mem_max"] == 500 and m0["first_ms"] == t0 * 1000 and m0["last_ms"] == (t0 + 50) * 1000
    assert rows[(60, t0 + 60, "L")]["n"] == 6
    h = rows[(3600, t0, "L")]
    assert h["n"] == 12 and h["work_sum"] == 12.0 and h["irq_sum"] == 24.0
    host = rows[(3600, t0, "")]
    assert host["n"] == 1 and host["util_n"] == 0 and host["util_min"] is None and host["irq_sum"] == 7.0


samples_st = st.lists(st.builds(
    Sample, gpu_id=st.sampled_from(["g0", "g1"]), ts_ms=st.integers(1_800_000_000_000, 1_800_000_900_000),
    lease_id=st.sampled_from(["", "L1"]), source=st.just("guest"),
    util_pct=st.none() | st.floats(0, 100), mem_used_bytes=st.none() | st.integers(0, 2**40),
    work_rate=st.none() | st.floats(0, 1e6), vfio_irq_rate=st.none() | st.floats(0, 1e6)), max_size=40)


def _merge(parts: list[list[dict[str, object]]]) -> dict[tuple[object, ...], dict[str, object]]:
    """Combine deltas the way the store's upsert does."""
    acc: dict[tuple[object, ...], dict[str, object]] = {}
    for part in parts:
        for r in part:
            k = (r["gpu_id"], r["resolution"], r["bucket"], r["lease_id"])
            if k not in acc:
                acc[k] = dict(r)
                continue
            a = acc[k]
            for c in ROLLUP_ADD:
                a[c] = a[c] + r[c]  # type: ignore[operator]
            for c, pick in (("util_min", min), ("first_ms", min), ("util_max", max), ("mem_max", max),
                            ("last_ms", max)):
                vals = [v for v in (a[c], r[c]) if v is not None]
                a[c] = pick(vals) if vals else None  # type: ignore[type-var]
    return acc


@settings(max_examples=60, deadline=None)
@given(samples_st, st.integers(0, 40))
def test_rollups_of_split_batches_merge_to_the_rollup_of_the_whole(samples: list[Sample], cut: int) -> None:
    whole = _merge([rollup_rows("h", samples)])
    split = _merge([rollup_rows("h", samples[:cut]), rollup_rows("h", samples[cut:])])
    assert whole.keys() == split.keys()
    for k in whole:
        for c, v in whole[k].items():
            assert split[k][c] == pytest.approx(v), (k, c)


@pytest.mark.parametrize("state, reason, outcome", [
    ("FAILED", None, "failed"), ("EXPIRED", "lease time over", "expired"), ("RELEASED", "released by guest", "released"),
    ("RELEASED", "idle: two strikes", "reclaimed"), ("ACTIVE", None, None),
])
def test_outcome_of(state: str, reason: str | None, outcome: str | None) -> None:
    assert outcome_of(state, reason) == outcome


def test_resolution_choice() -> None:
    assert _resolution("auto", 3600) == 0
    assert _resolution("auto", 86400) == 60
    assert _resolution("auto", 30 * 86400) == 3600
    assert _resolution(7200, 1) == 7200 and _resolution(300, 1) == 300
    for bad in (45, 5400, -3600, "daily", True):
        with pytest.raises(InvalidInput):
            _resolution(bad, 1)  # type: ignore[arg-type]


def test_upsert_renders_each_dialects_own_statement() -> None:
    from sqlalchemy.dialects.mysql import insert as my_insert
    from sqlalchemy.dialects.sqlite import insert as lite_insert

    from hostagent.store.upsert import _sets

    my = my_insert(schema.usage_rollups)
    sql = str(my.on_duplicate_key_update(**_sets(schema.usage_rollups, my.inserted, (), ["n"], ["util_min"], []))
              .compile(dialect=mysql.dialect()))
    assert "ON DUPLICATE KEY UPDATE" in sql and "n = (usage_rollups.n + VALUES(n))" in sql
    lite = lite_insert(schema.usage_rollups)
    sql = str(lite.on_conflict_do_update(index_elements=["host_id"], set_=_sets(
        schema.usage_rollups, lite.excluded, (), ["n"], [], ["util_max"])).compile(dialect=sqlite.dialect()))
    assert "ON CONFLICT" in sql and "excluded.n" in sql and "CASE WHEN" in sql


def test_fresh_writes_chain_from_the_watermark_and_forget_what_is_folded() -> None:
    from hostagent.store.rollup import Fresh, FreshWrites

    one = [Sample("g", 1_000 * i) for i in range(3)]
    fw = FreshWrites(cap=10)
    fw.add(Fresh(0, 5, one))
    fw.add(Fresh(5, 9, one))
    fw.add(Fresh(12, 15, one))  # rows 10-12 came another way: the chain stops before it
    assert [w.top for w in fw.chain(0, 100)] == [5, 9]
    assert [w.top for w in fw.chain(0, 6)] == [5, 9]  # exactly limit samples
    assert [w.top for w in fw.chain(0, 5)] == [5]  # at most limit samples, but always one write
    assert [w.top for w in fw.chain(0, 1)] == [5]
    assert fw.chain(3, 100) == []  # a watermark inside a write: none begins there
    assert fw.chain(9, 100) == [] and len(fw) == 1  # the two folded ones are forgotten
    assert [w.top for w in fw.chain(12, 100)] == [15]
    fw.folded(15)
    assert len(fw) == 0
    for k in range(4):  # past the cap the oldest go (their rows are left to the server's fold)
        fw.add(Fresh(3 * k, 3 * k + 3, one))
    assert len(fw) == 3 and fw.chain(0, 100) == [] and [w.top for w in fw.chain(3, 100)] == [6, 9, 12]


def test_rollup_rows_sum_coarse_buckets_from_fine_ones_as_from_samples() -> None:
    import random

    rng = random.Random(7)
    ss = [Sample(rng.choice("ab"), rng.randrange(0, 3 * 3600_000), rng.choice(("L", "")), "guest",
                 None if rng.random() < 0.2 else rng.uniform(0, 100),
                 None if rng.random() < 0.2 else rng.randrange(1 << 40),
                 None if rng.random() < 0.3 else rng.uniform(0, 10),
                 None if rng.random() < 0.3 else rng.uniform(0, 10)) for _ in range(2000)]
    both = {(r["resolution"], r["gpu_id"], r["bucket"], r["lease_id"]): r for r in rollup_rows("h", ss)}
    alone = {(r["resolution"], r["gpu_id"], r["bucket"], r["lease_id"]): r
             for r in rollup_rows("h", ss, resolutions=(3600,))}
    odd = {(r["resolution"], r["gpu_id"], r["bucket"], r["lease_id"]): r  # 90 s is no multiple of 60: from samples
           for r in rollup_rows("h", ss, resolutions=(60, 90)) if r["resolution"] == 90}
    assert {k for k in both if k[0] == 3600} == set(alone) and odd
    for k, r in alone.items():
        for col, v in r.items():
            assert both[k][col] == (pytest.approx(v) if isinstance(v, float) else v), (k, col)
    assert sum(r["n"] for r in odd.values()) == sum(r["n"] for r in alone.values()) == 2000
