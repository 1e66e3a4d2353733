"""Admission: what a tenant may ask of this host, decided under the lease driver's decide lock so that concurrent
requests cannot slip past it together. Owns the tenants' accounting (GPUs held, queued and used in the last day,
per VM and per project, from live leases and the ledger of ended ones: `use_of`), the quota cap of a
request (`quota_cap_for`), the operator's priority policy (`apply_priority_policy`), each VM's share of the queue
(`check_queue_share`), and the queue's default wait (`queue_deadline`). The rules themselves are pure, in
:mod:`hostagent.domain.admission`."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from hostagent.domain.admission import Ledger, TenantUse, gpu_hours, quota_cap
from hostagent.domain.errors import Conflict, TooManyRequests
from hostagent.domain.lease import Lease, LeaseRequest, LeaseState, Quota
from hostagent.services.lease_types import LeaseCore

S = LeaseState
def _classes(m: LeaseCore, domain_uuid: str, domain_name: str
             ) -> list[tuple[str, Quota, Callable[[str, str], bool]]]:
    """The quota classes a VM belongs to: itself, then each project that names it (by UUID or name)."""
    out: list[tuple[str, Quota, Callable[[str, str], bool]]] = [
        (f"VM {domain_name}", m.policy.vm_quota, lambda u, _n: u == domain_uuid)]
    for project, quota, members in m.policy.project_quotas:
        if domain_uuid in members or domain_name in members:
            ms = frozenset(members)
            out.append((f"project {project}", quota, lambda u, n, ms=ms: u in ms or n in ms))  # type: ignore[misc]
    return out


def any_caps(m: LeaseCore) -> bool:
    """Whether any quota class (the VMs', a project's) limits how many GPUs it may take: without one, every
    request's quota cap is its own size."""
    return m.policy.vm_quota.caps or any(quota.caps for _, quota, _ in m.policy.project_quotas)


def use_of(m: LeaseCore, match: Callable[[str, str], bool], quota: Quota, *, exclude: str | None = None
           ) -> TenantUse:
    """What the tenant `match` picks holds (leases granted or being granted), has queued (each queued request
    counted for at most the quota's GPUs) and used in the last day. `exclude`: a lease left out (the queued
    request being granted is not in the way of itself)."""
    now = m.clock()
    held = queued = 0
    spans: list[tuple[float, float | None, int]] = []
    for x in m.leases.values():
        if x.id == exclude or not match(x.domain_uuid, x.domain_name):
            continue
        if x.state.holds_devices:
            held += len(x.devices) or x.granted_gpus or x.request.gpus
            if x.granted_at is not None:
                spans.append((x.granted_at, None, len(x.devices)))
        elif x.state is S.QUEUED:
            queued += min(x.request.gpus, quota.max_gpus) if quota.max_gpus else x.request.gpus
    if quota.max_gpu_hours_per_day:
        spans += m.ledger.spans(match, now)
    return TenantUse(held, queued, gpu_hours(spans, now) if quota.max_gpu_hours_per_day else 0.0)


def quota_cap_for(m: LeaseCore, domain_uuid: str, domain_name: str, request: LeaseRequest, *,
                  exclude: str | None = None) -> int:
    """How many GPUs the VM's quota and every project quota it is in let this request take (Conflict when none,
    or when a whole request does not fit)."""
    n = request.gpus
    for who, quota, match in _classes(m, domain_uuid, domain_name):
        if not quota.caps:
            continue  # a class without limits caps nothing: no walk of every lease for it (the queue asks often)
        n = quota_cap(who, quota, use_of(m, match, quota, exclude=exclude), dataclasses.replace(request, gpus=n))
    return n


def gpu_hours_left(m: LeaseCore, domain_uuid: str, domain_name: str, *, exclude: str | None = None
                   ) -> tuple[float, str] | None:
    """The fewest GPU-hours any GPU-hours quota of the VM (its own, its projects') leaves once the tenant's live
    leases run to their ends, and whose quota that is; None when no such quota applies. `exclude`: a lease whose
    own time to come is not counted (the one being granted or renewed; what it used so far still counts).

    The window slides, so this is conservative: what it leaves can only grow as older use falls out of the day."""
    now = m.clock()
    least: tuple[float, str] | None = None
    for who, quota, match in _classes(m, domain_uuid, domain_name):
        if not quota.max_gpu_hours_per_day:
            continue
        used = use_of(m, match, quota).gpu_hours
        ahead = sum(len(x.devices) * max(0.0, x.expires_at - now) for x in m.leases.values()
                    if x.id != exclude and x.state.holds_devices and x.expires_at is not None
                    and match(x.domain_uuid, x.domain_name)) / 3600.0
        left = quota.max_gpu_hours_per_day - used - ahead
        if least is None or left < least[0]:
            least = (left, who)
    return least


def cap_length(m: LeaseCore, lease: Lease, gpus: int, duration_s: float) -> tuple[float, str | None]:
    """A lease's length within what its GPU-hours quotas leave for `gpus` GPUs, and the reason when it was cut:
    a tenant with one GPU-hour left cannot take eight GPUs for a day on it. Conflict when nothing is left (the
    tenant's live leases already commit the rest of its day)."""
    left = gpu_hours_left(m, lease.domain_uuid, lease.domain_name, exclude=lease.id)
    if left is None or gpus <= 0:
        return duration_s, None
    hours, who = left
    fits = int(max(0.0, hours) * 3600.0 / gpus)
    if fits >= duration_s:
        return duration_s, None
    if fits < 1:
        raise Conflict(f"quota: {who}'s GPU-hours of the last 24 h are spent or committed to its running leases",
                       field="gpus")
    return fits, (f"length capped to {fits} s: {who}'s GPU-hours quota leaves {max(0.0, hours):.2f} GPU-hours "
                  f"for {gpus} GPU(s)")


def apply_priority_policy(m: LeaseCore, domain_uuid: str, domain_name: str, request: LeaseRequest, *,
                          trusted: bool, stated: bool = True) -> tuple[LeaseRequest, str | None]:
    """A request that states no priority (`stated` false) gets the operator's: the first of
    `leases.priority_rules` it matches (task type, project, VM, length), else 0. A guest's request at most at the
    highest priority its classes allow (`leases.guest_max_priority` for every VM, raised by a project's
    `max_priority`); the reason says so when it was capped. An operator's request (`trusted`) keeps its priority."""
    if not stated:
        rule = priority_rule(m, domain_uuid, domain_name, request)
        if rule is not None:
            return (dataclasses.replace(request, priority=rule[1]),
                    f"priority {rule[1]} from the operator's rule {rule[0]!r} (the request stated none)")
        return request, None
    if trusted:
        return request, None
    caps = [q.max_priority for _, q, _ in _classes(m, domain_uuid, domain_name) if q.max_priority is not None]
    if not caps or request.priority <= max(caps):
        return request, None
    top = max(caps)
    return (dataclasses.replace(request, priority=top),
            f"priority {request.priority} capped to {top}, the highest this VM's policy allows")


def priority_rules(rules: Mapping[str, Mapping[str, Any]]) -> tuple[Any, ...]:
    """leases.priority_rules (config) as the LeasePolicy's tuples, in file order."""
    return tuple((name, int(r["priority"]), r.get("task_type"), r.get("project"),
                  tuple(str(d) for d in r.get("domains", ())), r.get("max_duration_s")) for name, r in rules.items())


def priority_rule(m: LeaseCore, domain_uuid: str, domain_name: str, request: LeaseRequest
                  ) -> tuple[str, int] | None:
    """The first of the operator's priority rules the request matches: (rule name, priority), or None."""
    length = request.duration_s or m.policy.default_duration_s
    for name, priority, task_type, project, domains, max_duration_s in m.policy.priority_rules:
        if task_type is not None and request.task_type != task_type:
            continue
        if domains and domain_uuid not in domains and domain_name not in domains:
            continue
        if project is not None and request.project != project and not any(
                p == project and (domain_uuid in members or domain_name in members)
                for p, _, members in m.policy.project_quotas):
            continue
        if max_duration_s is not None and length > max_duration_s:
            continue
        return name, priority
    return None


def check_queue_share(m: LeaseCore, domain_uuid: str, domain_name: str) -> None:
    """Refuse (429) a VM's request to queue when it already has its share of the queue waiting."""
    share = m.policy.queue_max_per_vm
    if not share:
        return
    mine = sum(1 for x in m.leases.values() if x.state is S.QUEUED and x.domain_uuid == domain_uuid)
    if mine >= share:
        raise TooManyRequests(f"VM {domain_name} already has {mine} request(s) queued, its share of the queue "
                              f"(leases.queue_max_per_vm = {share}); retry when one is granted or withdrawn",
                              field="accept_deferred", retry_after=30)


def queue_deadline(policy: Any, lease: Lease) -> float | None:
    """When a queued request gives up: its own `not_after`, or `leases.queue_max_wait_s` after it was queued,
    whichever comes first (None: it waits as long as it takes)."""
    limits = [lease.request.not_after] if lease.request.not_after is not None else []
    if policy.queue_max_wait_s:
        limits.append((lease.queued_at or lease.created_at) + policy.queue_max_wait_s)
    return min(limits) if limits else None


__all__ = ["apply_priority_policy", "cap_length", "check_queue_share", "gpu_hours_left", "queue_deadline",
           "quota_cap_for", "use_of"]
