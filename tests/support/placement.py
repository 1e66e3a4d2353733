"""Test helpers for placement and learning: device views, store-shaped records, a spy around a store."""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Sequence
from typing import Any

from hostagent.domain.placement import GIB, DeviceView

# A ground truth known by construction: job "a" runs 10x faster on model X, job "b" 10x faster on model Y,
# job "c" the same everywhere.
TRUTH = {("a", "X"): 100.0, ("a", "Y"): 10.0, ("b", "X"): 5.0, ("b", "Y"): 50.0, ("c", "X"): 20.0, ("c", "Y"): 20.0}


def dev(gpu_id: str, model: str = "X", mem_gib: float = 16, numa: int | None = 0, **kw: Any) -> DeviceView:
    """A device view with sensible defaults."""
    return DeviceView(gpu_id=gpu_id, model=model, vendor=kw.pop("vendor", "NVIDIA Corporation"),
                      memory_bytes=int(mem_gib * GIB), numa_node=numa, **kw)


def store_records(n: int, *, seed: int = 0, start: float = 1.6e9, truth: dict[tuple[str, str], float] = TRUTH,
                  gpus: Sequence[tuple[str, str]] = (("g0", "X"), ("g1", "Y"), ("g2", "X"), ("g3", "Y")),
                  noise: float = 0.03) -> list[dict[str, Any]]:
    """Records shaped like ``UsageStore.training_records()``: one finished single-GPU lease each (ids unique per seed
    and start, as a host's lease ids are)."""
    rng = random.Random(seed)
    jobs = sorted({j for j, _ in truth})
    out = []
    for i in range(n):
        job = rng.choice(jobs)
        gpu_id, model = rng.choice(list(gpus))
        rate = truth[(job, model)] * math.exp(rng.gauss(0, noise))
        t = start + 60.0 * i
        out.append({
            "id": f"L{seed}-{start:.0f}-{i}", "host_id": "h1", "task_type": job, "data_scale": None, "precision": None,
            "min_memory_gib": 0.0, "duration_s": None, "priority": 0, "request": {"task_type": job},
            "created_at": t, "granted_at": t, "ended_at": t + 30.0, "outcome": "released", "held_s": 30.0,
            "devices": [{"gpu_id": gpu_id, "model": model, "memory_bytes": 16 * GIB, "numa_node": 0}],
            "usage": {"n": 3, "work_mean": rate, "util_mean": 90.0},
        })
    return out


def gpu_rows(gpus: Iterable[tuple[str, str]] = (("g0", "X"), ("g1", "Y"), ("g2", "X"), ("g3", "Y"))) -> list[dict[str, Any]]:
    """Rows shaped like ``UsageStore.list_gpus()``."""
    return [{"host_id": "h1", "gpu_id": g, "model": m, "vendor": "NVIDIA Corporation", "memory_bytes": 16 * GIB,
             "numa_node": 0, "link_speed": "16.0 GT/s PCIe", "link_width": 16, "probe_score": 1.0}
            for g, m in gpus]


class FakeStore:
    """In-memory TrainingSource + ModelRegistry with the UsageStore's method names and semantics."""

    def __init__(self, records: list[dict[str, Any]] | None = None, gpus: list[dict[str, Any]] | None = None) -> None:
        self.records = records or []
        self.gpus = gpus if gpus is not None else gpu_rows()
        self.versions: list[dict[str, Any]] = []

    def training_records(self, *, since: float | None = None) -> list[dict[str, Any]]:
        """Finished leases since ``since``."""
        return [r for r in self.records if since is None or r["created_at"] >= since]

    def list_gpus(self, *, all_hosts: bool = False) -> list[dict[str, Any]]:
        """The GPU table."""
        return list(self.gpus)

    def save_model_version(self, version: str, *, kind: str = "placement", artifact: bytes | None = None,
                           metrics: Any = None, params: Any = None, trained_on: int | None = None,
                           activate: bool = False, created_at: float | None = None) -> dict[str, Any]:
        """Append a version."""
        row = {"version": version, "kind": kind, "artifact": artifact, "metrics": metrics, "params": params,
               "trained_on": trained_on, "active": False, "created_at": created_at or len(self.versions)}
        self.versions.append(row)
        if activate:
            self.activate_model_version(version, kind=kind)
        return row

    def activate_model_version(self, version: str, *, kind: str = "placement") -> None:
        """Flip the active flag."""
        from hostagent.domain.errors import NotFound

        if not any(v["version"] == version for v in self.versions):
            raise NotFound(f"no {version}", field="version")
        for v in self.versions:
            v["active"] = v["version"] == version

    def list_model_versions(self, *, kind: str | None = None, limit: int = 100) -> list[dict[str, Any]]:
        """Newest first."""
        return sorted(self.versions, key=lambda v: v["created_at"], reverse=True)[:limit]

    def get_model_version(self, version: str | None = None, *, kind: str = "placement",
                          with_artifact: bool = True) -> dict[str, Any]:
        """By name or the active one."""
        from hostagent.domain.errors import NotFound

        for v in self.versions:
            if (version is None and v["active"]) or v["version"] == version:
                return v
        raise NotFound("no such version", field="version")


class OnlyThese:
    """Wraps an object and fails the test on any attribute outside ``allowed`` (proves what a function reads)."""

    def __init__(self, inner: Any, allowed: Iterable[str]) -> None:
        self._inner = inner
        self._allowed = set(allowed)
        self.calls: list[str] = []

    def __getattr__(self, name: str) -> Any:
        if name not in self._allowed:
            raise AssertionError(f"training touched {name!r}, outside the store's record API")
        self.calls.append(name)
        return getattr(self._inner, name)
