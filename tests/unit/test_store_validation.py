"""The heartbeat fast path of sample validation agrees with the general one; the ingest statements per dialect."""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from sqlalchemy.dialects import mysql, sqlite

from hostagent.domain.errors import InvalidInput
from hostagent.store import schema
from hostagent.store.repo import SAMPLE_COLUMNS
from hostagent.store.rollup import _compiled
from hostagent.store.samples import MIN_TS, _fast, _one, validate_samples
from hostagent.store.upsert import _insert_ignore_sql

NOW = 1_800_000_000.0

numbers = st.one_of(st.none(), st.booleans(), st.integers(-5, 2**54), st.floats(allow_nan=True, allow_infinity=True),
                    st.floats(-1.0, 120.0), st.text(max_size=3))
idents = st.one_of(st.none(), st.just(""), st.text(max_size=70), st.integers(0, 3), st.just("gpu\n0"))
samples = st.fixed_dictionaries(
    {"gpu_id": st.one_of(st.just("gpu-0"), idents), "ts": st.one_of(st.floats(MIN_TS - 10, NOW + 400), numbers)},
    optional={"lease_id": st.one_of(st.just("L1"), idents), "source": st.sampled_from(("guest", "host", "x", 3)),
              "util_pct": numbers, "mem_used_bytes": numbers, "work_rate": numbers, "vfio_irq_rate": numbers,
              "bogus": st.just(1)})


@settings(max_examples=600, deadline=None)
@given(samples, st.sampled_from(("", "L9")))
# well-formed samples, which the drawn ones seldom are: a lease named in the sample, a work rate under 1, an
# integer memory figure sent as a float (which only the general path takes)
@example({"gpu_id": "gpu-0", "ts": NOW - 1, "lease_id": "L1", "util_pct": 0.5, "work_rate": 0.5,
          "vfio_irq_rate": 0.25, "mem_used_bytes": 1 << 20}, "")
@example({"gpu_id": "gpu-0", "ts": NOW - 1, "lease_id": "L1", "work_rate": 0.5, "mem_used_bytes": 1048576.0}, "L9")
def test_the_fast_path_accepts_only_what_the_general_one_accepts_and_makes_the_same_sample(
        d: dict[str, Any], lease: str) -> None:
    fast = _fast(d, NOW + 300.0, lease, "guest")
    try:
        slow = _one(d, 0, NOW, 300.0, lease, "guest")
    except InvalidInput:
        assert fast is None
        return
    assert slow.lease_id == (d.get("lease_id") or lease)  # the sample's own lease, else the heartbeat's
    if fast is not None:
        assert fast == slow
        assert all(type(getattr(fast, f)) is type(getattr(slow, f)) for f in ("util_pct", "mem_used_bytes",
                                                                              "work_rate", "vfio_irq_rate"))


def test_a_plain_heartbeat_takes_the_fast_path() -> None:
    d = {"gpu_id": "gpu-0", "ts": NOW - 1, "util_pct": 50, "mem_used_bytes": 1 << 30, "work_rate": 1.5,
         "vfio_irq_rate": 300.0}
    s = _fast(d, NOW + 300, "L1", "guest")
    assert s is not None and s.lease_id == "L1" and s.util_pct == 50.0 and type(s.util_pct) is float
    assert validate_samples([d, d], now=NOW, default_lease_id="L1") == [s]  # a repeat inside the batch goes
    assert _fast({**d, "ts": math.nan}, NOW + 300, "", "guest") is None
    with pytest.raises(InvalidInput) as err:
        validate_samples([d, {**d, "ts": NOW - 2, "util_pct": math.inf}], now=NOW)
    assert err.value.field == "samples[1].util_pct"


def test_insert_ignore_is_each_dialects_own_statement_with_positional_parameters() -> None:
    my = _insert_ignore_sql(mysql.dialect(paramstyle="format"), schema.usage_samples, SAMPLE_COLUMNS)
    lite = _insert_ignore_sql(sqlite.dialect(), schema.usage_samples, SAMPLE_COLUMNS)
    assert my.startswith("INSERT IGNORE INTO usage_samples (host_id, gpu_id, ts_ms,") and my.endswith("%s)")
    assert lite.startswith("INSERT OR IGNORE INTO usage_samples (") and lite.endswith("?)")


def test_rollup_statements_render_per_dialect() -> None:
    my_sql, my_order, _ = _compiled(mysql.dialect(paramstyle="format"), "fold/60")
    lite_sql, lite_order, defaults = _compiled(sqlite.dialect(), "fold/3600")
    assert "ON DUPLICATE KEY UPDATE" in my_sql and "FLOOR" not in my_sql and "GROUP BY" in my_sql
    assert "FORCE INDEX (ix_usage_samples_host_id_id)" in my_sql and "FORCE INDEX" not in lite_sql
    assert "ON CONFLICT" in lite_sql and "DO UPDATE" in lite_sql
    assert {"host_id", "low", "high"} <= set(my_order) and {"host_id", "low", "high"} <= set(lite_order)
    assert 3_600_000 in defaults.values()  # the bucket width is a constant of the statement, not a parameter
    assert "FOR UPDATE" in _compiled(mysql.dialect(paramstyle="format"), "mark_lock")[0]
