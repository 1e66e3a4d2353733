"""Test support for the placement model's lifecycle: finished leases with work rates from a known truth, written to
a usage store through its normal path, to train on."""

from __future__ import annotations

import math
import random
from pathlib import Path

from hostagent.domain.placement import GIB
from hostagent.store.repo import UsageStore
from tests.support.placement import TRUTH

GPUS = (("g0", "X"), ("g1", "Y"))


def fill_store(url: str, host: str, spool: Path, n: int, start: float, seed: int) -> None:
    """`n` finished single-GPU leases (one every 100 s from `start`) of jobs a, b, c on the GPUs g0 (model X) and g1
    (model Y), each with two samples: the truth's work rate (3 % noise) and a utilization of 90 % on X, 60 % on Y."""
    rng = random.Random(seed)
    store = UsageStore(url, host, spool_path=spool, clock=lambda: start + 200.0 * n)
    try:
        store.upsert_gpus([{"gpu_id": g, "address": f"0000:0{i}:00.0", "model": m, "memory_bytes": 16 * GIB,
                            "numa_node": 0, "link_speed": "16.0 GT/s PCIe", "link_width": 16}
                           for i, (g, m) in enumerate(GPUS)])
        for i in range(n):
            job = rng.choice(["a", "b", "c"])
            gpu, model = rng.choice(GPUS)
            t, lease = start + 100.0 * i, f"L{seed}-{i}"
            store.insert_lease({"id": lease, "domain_uuid": "00000000-0000-4000-8000-000000000001",
                                "state": "RELEASED", "created_at": t, "granted_at": t, "ended_at": t + 50,
                                "end_reason": "released", "granted_gpus": 1, "request": {"gpus": 1, "task_type": job},
                                "devices": [{"gpu_id": gpu}]})
            rate = TRUTH[(job, model)] * math.exp(rng.gauss(0, 0.03))
            store.add_samples([{"gpu_id": gpu, "ts": t + 10 + k, "lease_id": lease, "work_rate": rate,
                                "util_pct": 90.0 if model == "X" else 60.0} for k in range(2)], now=t + 60)
    finally:
        store.close()
