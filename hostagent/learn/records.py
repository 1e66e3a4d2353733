"""Training examples from the usage store's own records (leases joined with their usage aggregates).

The model learns only from what the store recorded: ``training_records()`` (one row per finished lease: the
request, the devices, usage means) joined with ``list_gpus()`` (each GPU's link, probe score). A multi-GPU lease
gives one example per device, labelled with the lease's per-device mean work rate (the store aggregates usage
per lease, so the faster device of a mixed pair is labelled with the pair's mean: a known blur).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from hostagent.domain.placement import NUMA_POLICIES, DeviceView, PlacementRequest, link_gen_from_speed

ERROR_WINDOW_S = 7 * 86400.0  # failed leases on a device within this window count as its recent errors
FAILED_OUTCOMES = ("failed",)


class TrainingSource(Protocol):
    """Where training data comes from: the usage store (``hostagent.store.repo.UsageStore``) or a test fake."""

    def training_records(self, *, since: float | None = None) -> list[dict[str, Any]]:
        """One dict per finished lease: request columns, ``devices``, ``usage``, ``held_s``, ``outcome``..."""

    def list_gpus(self, *, all_hosts: bool = False) -> list[dict[str, Any]]:
        """The recorded GPUs (model, memory, topology, probe score)."""


@dataclass(frozen=True, slots=True)
class Example:
    """One (request, device) pair and what happened on it."""

    lease_id: str
    created_at: float
    request: PlacementRequest
    device: DeviceView
    work_rate: float | None  # mean reported work rate per device (guest's own unit), None when not reported
    util_pct: float | None
    held_s: float
    outcome: str | None  # released | reclaimed | expired | failed


def _num(x: Any) -> float | None:
    if x is None or isinstance(x, bool):
        return None
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def _request_of(rec: Mapping[str, Any], count: int) -> PlacementRequest:
    raw = rec.get("request")
    extra: Mapping[str, Any] = raw if isinstance(raw, Mapping) else {}
    policy = str(extra["numa_policy"]) if extra.get("numa_policy") in NUMA_POLICIES else "any"
    vm_node = extra.get("vm_numa_node")
    return PlacementRequest(
        count=max(1, count), task_type=str(rec.get("task_type") or extra.get("task_type") or "unspecified"),
        data_scale=_num(rec.get("data_scale")), precision=rec.get("precision"),
        min_memory_gib=max(0.0, _num(rec.get("min_memory_gib")) or 0.0), duration_s=_num(rec.get("duration_s")),
        priority=int(rec.get("priority") or 0), vendor=extra.get("vendor"), model=extra.get("model"),
        numa_policy=policy, vm_numa_node=vm_node if isinstance(vm_node, int) and not isinstance(vm_node, bool) else None,
    )


def examples_from_records(records: Sequence[Mapping[str, Any]],
                          gpus: Iterable[Mapping[str, Any]] = ()) -> list[Example]:
    """Turn store records into examples, oldest first; recent errors are counted from the records themselves."""
    gpu_rows = {(g.get("host_id"), g.get("gpu_id")): g for g in gpus}
    ordered = sorted(records, key=lambda r: (_num(r.get("created_at")) or 0.0, str(r.get("id"))))
    failures: dict[tuple[Any, str], list[float]] = {}
    out: list[Example] = []
    for rec in ordered:
        devices = [d for d in rec.get("devices") or [] if isinstance(d, Mapping) and d.get("gpu_id")]
        if not devices:
            continue
        created = _num(rec.get("created_at")) or 0.0
        request = _request_of(rec, len(devices))
        raw_usage = rec.get("usage")
        usage: Mapping[str, Any] = raw_usage if isinstance(raw_usage, Mapping) else {}
        host = rec.get("host_id")
        for d in devices:
            key = (host, str(d["gpu_id"]))
            g = gpu_rows.get(key, {})
            recent = [t for t in failures.get(key, []) if created - t <= ERROR_WINDOW_S]
            device = DeviceView(
                gpu_id=str(d["gpu_id"]), model=str(d.get("model") or g.get("model") or "unknown"),
                vendor=str(g.get("vendor") or ""), memory_bytes=d.get("memory_bytes") or g.get("memory_bytes"),
                numa_node=d.get("numa_node") if d.get("numa_node") is not None else g.get("numa_node"),
                link_gen=link_gen_from_speed(g.get("link_speed")), link_width=g.get("link_width"),
                switch_id=g.get("switch_id"), root_port=g.get("root_port"), probe_score=_num(g.get("probe_score")),
                recent_errors=len(recent),
            )
            out.append(Example(
                lease_id=str(rec.get("id")), created_at=created, request=request, device=device,
                work_rate=_num(usage.get("work_mean")), util_pct=_num(usage.get("util_mean")),
                held_s=_num(rec.get("held_s")) or 0.0, outcome=rec.get("outcome"),
            ))
        if rec.get("outcome") in FAILED_OUTCOMES:
            ended = _num(rec.get("ended_at")) or created
            for d in devices:
                failures.setdefault((host, str(d["gpu_id"])), []).append(ended)
    return out


def load_examples(source: TrainingSource, *, since: float | None = None) -> list[Example]:
    """Read the store's training records (and its GPU table) and build examples."""
    return examples_from_records(source.training_records(since=since), source.list_gpus(all_hosts=True))
