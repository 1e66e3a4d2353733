"""Training from the real usage store (SQLite): records written through the store's normal path, model versions."""

from __future__ import annotations

import math
import random
from pathlib import Path

from hostagent.domain.placement import GIB, PlacementRequest, place
from hostagent.learn import lifecycle
from hostagent.store.repo import UsageStore
from tests.support.placement import TRUTH, OnlyThese, dev

T0 = 1_700_000_000.0


def _fill(store: UsageStore, n: int, start: float, seed: int) -> None:
    rng = random.Random(seed)
    gpus = [("g0", "X"), ("g1", "Y")]
    for i in range(n):
        job = rng.choice(["a", "b", "c"])
        gpu, model = rng.choice(gpus)
        t = start + 100.0 * i
        lease = f"L{seed}-{i}"
        store.insert_lease({"id": lease, "domain_uuid": "00000000-0000-4000-8000-000000000001", "state": "RELEASED",
                            "created_at": t, "granted_at": t, "ended_at": t + 50, "end_reason": "released",
                            "granted_gpus": 1, "request": {"gpus": 1, "task_type": job},
                            "devices": [{"gpu_id": gpu}]})
        rate = TRUTH[(job, model)] * math.exp(rng.gauss(0, 0.03))
        store.add_samples([{"gpu_id": gpu, "ts": t + 10 + k, "lease_id": lease, "work_rate": rate, "util_pct": 90.0}
                           for k in range(2)], now=t + 60)


def test_model_trains_from_store_records_and_versions_live_in_the_store(tmp_path: Path) -> None:
    now = [T0]
    store = UsageStore(f"sqlite:///{tmp_path / 'u.db'}", "h1", spool_path=tmp_path / "spool.db",
                       clock=lambda: now[0])
    try:
        store.upsert_gpus([{"gpu_id": g, "address": f"0000:0{i}:00.0", "model": m, "memory_bytes": 16 * GIB,
                            "numa_node": 0, "link_speed": "16.0 GT/s PCIe", "link_width": 16}
                           for i, (g, m) in enumerate([("g0", "X"), ("g1", "Y")])])
        _fill(store, 150, T0, seed=0)
        now[0] = T0 + 20000
        spy = OnlyThese(store, {"training_records", "list_gpus", "get_model_version", "save_model_version"})
        res = lifecycle.train(spy, now=now[0])  # type: ignore[arg-type]
        assert res.decision == "promoted" and res.metrics["labelled"] == 150
        assert "training_records" in spy.calls
        scorer = lifecycle.load_active(store)
        assert scorer is not None and scorer.name == res.version
        devices = [dev("g0", "X"), dev("g1", "Y")]
        assert place(PlacementRequest(task_type="a"), devices, scorer=scorer).chosen == ("g0",)
        assert place(PlacementRequest(task_type="b"), devices, scorer=scorer).chosen == ("g1",)
        row = store.get_model_version(res.version)
        assert row["active"] and row["metrics"]["decision"] == "promoted" and row["trained_on"] == 150
        # more records, then a second model; rollback returns to the first
        _fill(store, 60, T0 + 30000, seed=1)
        now[0] = T0 + 60000
        second = lifecycle.train(store, now=now[0], tolerance=0.1)
        assert second.decision == "promoted", second.metrics["reason"]
        assert [v["version"] for v in lifecycle.show(store)] == [second.version, res.version]
        assert lifecycle.rollback(store)["active"] == res.version
        assert store.get_model_version(None)["version"] == res.version
    finally:
        store.close()
