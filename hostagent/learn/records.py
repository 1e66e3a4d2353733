"""Training examples from the usage store's own records (leases joined with their usage aggregates).

The model learns only from what the store recorded: ``training_records()`` (one row per finished lease: the
request, the devices, usage means) joined with ``list_gpus()`` (each GPU's link, probe score). A multi-GPU lease
gives one example per device, labelled with the lease's per-device mean work rate (the store aggregates usage
per lease, so the faster device of a mixed pair is labelled with the pair's mean: a known blur).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from hostagent.domain.placement import NUMA_POLICIES, DeviceView, PlacementRequest, link_gen_from_speed

ERROR_WINDOW_S = 7 * 86400.0  # failed leases on a device within this window count as its recent errors
FAILED_OUTCOMES = ("failed",)
IMPLAUSIBLE_DECADES = 3.0  # a work rate this many orders of magnitude from the other tenants' median is not believed
PEER_MIN = 5  # ... judged only where the other tenants reported at least this many for the task type
TENANT_MAX_SHARE = 0.25  # no tenant carries more of the training weight (unless fewer than 1/share tenants exist)

log = logging.getLogger(__name__)


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
    outcome: str | None  # released | reclaimed | preempted | expired | failed
    tenant: str = ""  # the VM whose lease it was (its domain UUID): whose word the labels are
    host: str = ""  # the host whose lease it was (a fleet store holds many; lease ids are unique per host only)

    @property
    def lease_key(self) -> tuple[str, str]:
        """The lease's identity across a fleet's records: (host, lease id)."""
        return (self.host, self.lease_id)


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
                tenant=str(rec.get("domain_uuid") or ""), host=str(host or ""),
            ))
        if rec.get("outcome") in FAILED_OUTCOMES:
            ended = _num(rec.get("ended_at")) or created
            for d in devices:
                failures.setdefault((host, str(d["gpu_id"])), []).append(ended)
    doubtful = implausible(out)
    if doubtful:
        log.warning("%d training record(s) report a work rate over %g orders of magnitude from the other tenants' "
                    "for their task type: their work rate is not learnt from", len(doubtful), IMPLAUSIBLE_DECADES)
        out = [dataclasses.replace(e, work_rate=None) if i in doubtful else e for i, e in enumerate(out)]
    return out


def implausible(examples: Sequence[Example], *, decades: float = IMPLAUSIBLE_DECADES,
                min_peers: int = PEER_MIN) -> set[int]:
    """Indexes of examples whose reported work rate is more than `decades` orders of magnitude from the median of
    what OTHER tenants reported for the same task type (judged only where at least `min_peers` of theirs exist).
    A guest reports its own work rate: one that claims a thousand times everyone else's would otherwise teach the
    model that its GPUs are the best, for every tenant. Comparing with the others only, a tenant cannot move its
    own yardstick."""
    by_task: dict[str, list[tuple[str, float]]] = {}
    for e in examples:
        if e.work_rate is not None and e.work_rate > 0:
            by_task.setdefault(e.request.task_type, []).append((e.tenant, math.log10(e.work_rate)))
    out = set()
    for i, e in enumerate(examples):
        if e.work_rate is None or e.work_rate <= 0:
            continue
        peers = sorted(v for t, v in by_task[e.request.task_type] if t != e.tenant)
        if len(peers) < min_peers:
            continue
        median = peers[len(peers) // 2] if len(peers) % 2 else (peers[len(peers) // 2 - 1] + peers[len(peers) // 2]) / 2
        if abs(math.log10(e.work_rate) - median) > decades:
            out.add(i)
    return out


def mixed_sets(examples: Sequence[Example]) -> set[tuple[str, str]]:
    """The leases (`Example.lease_key`) whose devices are of more than one GPU model. A job spread over several GPUs
    runs at its slowest device's pace (each step waits for every device), and the work rate a lease reports is per
    device of the set: on a set of one GPU model that is the model's own rate, on a mixed set only the slowest model's;
    for the faster ones it is a floor. Read as their rate it teaches that a fast GPU is slow for the task type (on a
    busy host, where a two-GPU job takes whatever two GPUs are free, every fast GPU paired with a slow one), so a
    mixed set's work rate is not learnt as any pair's rate; it still counts for the job's run time."""
    models: dict[tuple[str, str], set[str]] = {}
    for e in examples:
        models.setdefault(e.lease_key, set()).add(e.device.model)
    return {key for key, seen in models.items() if len(seen) > 1}


def own_rates(examples: Sequence[Example]) -> list[bool]:
    """For each example, whether it reports its device's own work rate: a rate above 0, on a lease that is not a
    mixed set (:func:`mixed_sets`). Training labels only these with a rate, and the held-out figures judge on them."""
    mixed = mixed_sets(examples)
    return [e.work_rate is not None and e.work_rate > 0 and e.lease_key not in mixed for e in examples]


def tenant_weights(tenants: Sequence[str], share: float = TENANT_MAX_SHARE) -> list[float]:
    """A weight per example so that no tenant carries more than `share` of the total weight (or an equal part,
    when fewer than 1/share tenants have records): the largest tenants' examples are scaled down to a common cap,
    the others keep weight 1. One guest leasing all day cannot make the model its own."""
    counts: dict[str, int] = {}
    for t in tenants:
        counts[t] = counts.get(t, 0) + 1
    if not counts:
        return []
    share = max(share, 1.0 / len(counts))
    order = sorted(counts.values(), reverse=True)
    cap = float(order[0])
    rest = sum(order)
    for k, n in enumerate(order, start=1):
        rest -= n  # the records of the tenants smaller than the k largest
        nxt = order[k] if k < len(order) else 0
        # capping the k largest at c gives each exactly `share` (c = share * (rest + k c)); with k >= 1/share
        # equal parts are within it, so their own count is cap enough. The first k whose cap leaves the next
        # tenant uncapped is the answer (k = 1 with c >= n: the largest is within its share, nothing is capped).
        c = min(float(n), share * rest / (1 - share * k) if share * k < 1 else float(n))
        if c >= nxt:
            cap = c
            break
    return [min(1.0, cap / counts[t]) for t in tenants]


def load_examples(source: TrainingSource, *, since: float | None = None) -> list[Example]:
    """Read the store's training records (and its GPU table) and build examples."""
    return examples_from_records(source.training_records(since=since), source.list_gpus(all_hosts=True))
