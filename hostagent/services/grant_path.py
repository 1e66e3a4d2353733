"""The grant path: from a request to an ACTIVE lease. Which GPUs could serve a request (`feasible`, `is_free`) and
the quotas it must fit (`check_quotas`); the arbitration into a grant, the queue or a refusal (`request_lease`);
placement and the BINDING claim with the original drivers (`claim`); every device onto vfio-pci with the ATTACHING
write, the attach and its verification (`bind_and_attach`, `bind_all`); and the rollback of a failed grant to
FAILED, every device given back or else quarantined (`rollback`). The queue grants through the same `claim` and
`bind_and_attach`.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Sequence
from typing import Any

from hostagent.domain.errors import Conflict, HostAgentError, HostError, InvalidInput
from hostagent.domain.hostdev import HostdevPci, free_guest_slots
from hostagent.domain.inventory import Gpu
from hostagent.domain.lease import (
    Lease,
    LeaseDevice,
    LeaseRequest,
    LeaseState,
    QuotaUse,
    Step,
    Verdict,
    Waiting,
    arbitrate,
    check_quota,
    new_lease,
)
from hostagent.services.faults import crash_point
from hostagent.services.lease_types import LOGGER, LeaseCore, clocked, guest_addr, render_hostdevs, step_hook
from hostagent.services.ports import HostOpResult
from hostagent.services.quarantine import quarantine_gpu

log = logging.getLogger(LOGGER)

S = LeaseState


def feasible(m: LeaseCore, request: LeaseRequest) -> list[Gpu]:
    """GPUs that could ever serve the request (viable, not quarantined, memory and model fit)."""
    out = []
    for g in m.gpus.values():
        if not g.viable or g.id in m.quarantined or g.id in m.attention:
            continue
        if request.min_memory_gib and (g.memory_bytes or 0) < request.min_memory_gib * 1024**3:
            continue
        if request.vendor and request.vendor.lower() not in g.vendor.lower() and request.vendor.lower() != f"{g.primary.vendor_id:04x}":
            continue
        if request.model and request.model.lower() not in g.model.lower():
            continue
        out.append(g)
    return out


def is_free(m: LeaseCore, gpu_id: str) -> bool:
    """Neither claimed by a lease, quarantined, nor waiting for an operator's attention."""
    return gpu_id not in m.claims and gpu_id not in m.quarantined and gpu_id not in m.attention


def check_quotas(m: LeaseCore, domain_uuid: str, domain_name: str, request: LeaseRequest) -> None:
    """Raise when the request would take the VM, or a project the VM is in, past its quota."""
    now = m.clock()
    mine = [x for x in m.leases.values() if x.domain_uuid == domain_uuid and x.state.holds_devices]
    held = sum(len(x.devices) for x in mine)
    hours = sum(len(x.devices) * max(0.0, now - max(x.granted_at or now, now - 86400)) / 3600 for x in mine)
    check_quota(f"VM {domain_name}", m.policy.vm_quota, QuotaUse(held, hours), request)
    for project, quota, members in m.policy.project_quotas:
        if domain_uuid in members or domain_name in members:
            uuids = {x.domain_uuid for x in m.leases.values() if x.domain_uuid in members or x.domain_name in members}
            pl = [x for x in m.leases.values() if x.domain_uuid in uuids and x.state.holds_devices]
            check_quota(f"project {project}", quota, QuotaUse(sum(len(x.devices) for x in pl)), request)


async def request_lease(m: LeaseCore, domain_uuid: str, request: LeaseRequest, *, actor: str) -> Lease:
    """POST /v1/leases: grant (ACTIVE), queue (QUEUED) or refuse (Conflict). Idempotent by key."""
    if request.idempotency_key:
        earlier = await m._run(m.journal.by_idempotency_key, domain_uuid, request.idempotency_key)
        if earlier is not None:
            if earlier.request != request:
                raise Conflict("idempotency_key was used before with a different request", field="idempotency_key")
            return m.leases.get(earlier.id, earlier)
    dom = await m.hv.get_domain(domain_uuid)
    if request.duration_s is not None and request.duration_s > m.policy.max_duration_s:
        raise InvalidInput(f"duration_s exceeds the maximum of {m.policy.max_duration_s}", field="duration_s")
    now = m.clock()
    async with m._decide:
        check_quotas(m, dom.uuid, dom.name, request)
        # The new lease is journaled with its first real step (QUEUED, BINDING or FAILED): one fsync, and a
        # crash before it leaves nothing to repair because nothing was done yet.
        lease = new_lease(f"l-{uuid.uuid4().hex[:12]}", dom.uuid, dom.name, request, now)
        born = (Step(None, S.REQUESTED, "requested"),)
        candidates = feasible(m, request)
        free = [g for g in candidates if is_free(m, g.id)]
        waiting = [Waiting(x.id, x.request.priority, x.queued_at or x.created_at, x.request.gpus)
                   for x in m.leases.values() if x.state is S.QUEUED]
        verdict = arbitrate(request, len(free), len(candidates), waiting)
        if verdict.verdict is Verdict.REFUSE:
            raise Conflict(verdict.reason, field="gpus")
        if verdict.verdict is Verdict.DEFER:
            if len(waiting) >= m.policy.queue_max:
                raise Conflict("the lease queue is full; retry later", field="accept_deferred")
            lease = await m._move(lease, S.QUEUED, actor, verdict.reason, earlier=born, queued_at=now,
                                  reasons=(verdict.reason,))
            m._wake_queue.set()
            return lease
        try:
            lease = await claim(m, lease, free, verdict.count, actor, verdict.reason, born)
        except Conflict as exc:  # placement found no acceptable set (e.g. numa_policy=required)
            if request.accept_deferred and len(waiting) < m.policy.queue_max:
                lease = await m._move(lease, S.QUEUED, actor, f"placement: {exc.message}", earlier=born,
                                      queued_at=now, reasons=(exc.message,))
                m._wake_queue.set()
                return lease
            await m._move(lease, S.FAILED, actor, "placement refused", error=exc.message, earlier=born,
                          ended_at=m.clock(), end_reason="refused")
            raise
    return await bind_and_attach(m, lease, actor)


async def claim(m: LeaseCore, lease: Lease, free: Sequence[Gpu], count: int, actor: str, why: str,
                earlier: Sequence[Step] = ()) -> Lease:
    """Place, claim devices in memory and journal BINDING with the original drivers (under the decide lock)."""
    placement = m.place(lease.request, free, count, lease.domain_uuid)
    chosen = [m.gpus[i] for i in placement.gpu_ids]
    for g in chosen:
        m.claims[g.id] = lease.id

    def with_drivers(new: Lease) -> Lease:  # worker thread, in the BINDING write's hop
        devices = []
        for g in chosen:
            drivers = m.host.current_drivers(g)
            devices.append(LeaseDevice(
                gpu_id=g.id, functions=tuple(str(f.address) for f in g.functions),
                original_drivers=tuple(drivers.get(str(f.address)) for f in g.functions),
                iommu_group=g.iommu_group if g.iommu_group is not None else -1,
            ))
        return new.with_changes(devices=tuple(devices))

    try:
        duration = lease.request.duration_s or m.policy.default_duration_s
        reasons = (why, *placement.reasons)
        record = {"rule": placement.rule, "candidates": [dict(c) for c in placement.candidates],
                  "dropped": [dict(d) for d in placement.dropped], "distance": placement.distance}
        # the original drivers are read in the BINDING write's own worker hop (one hop for both)
        return await m._move(
            lease, S.BINDING, actor, f"placed on {', '.join(placement.gpu_ids)} ({placement.rule})",
            earlier=earlier, amend=with_drivers, granted_gpus=len(chosen), reasons=reasons,
            distance=placement.distance, expires_at=m.clock() + duration,
            placement=tuple(sorted(record.items())),
        )
    except BaseException:
        for g in chosen:
            if m.claims.get(g.id) == lease.id:
                del m.claims[g.id]
        raise


async def bind_and_attach(m: LeaseCore, lease: Lease, actor: str) -> Lease:
    """BINDING -> ATTACHING -> ACTIVE, or roll back to FAILED with every device given back."""
    async with m.lease_lock(lease.id):
        bound: list[LeaseDevice] = []
        try:
            # the guest slots first (binding does not change the domain), so that the binds and the ATTACHING
            # write share one worker hop
            layout = m.policy.guest_layout
            per_dev = [0 if layout == "auto" else 1 if layout == "multifunction" else len(d.functions)
                       for d in lease.devices]
            slots: list[int] = []
            if sum(per_dev):
                xml_live = await m._timed_hv("domain_xml", m.hv.domain_xml(lease.domain_uuid, live=True))
                slots = list(free_guest_slots(xml_live, m.policy.guest_bus, sum(per_dev)))
            devices = []
            all_hostdevs: list[HostdevPci] = []
            for dev, n in zip(lease.devices, per_dev, strict=True):
                mine, slots = slots[:n], slots[n:]
                hds = render_hostdevs(dev.functions, m.policy.guest_bus, mine, m.policy)
                all_hostdevs.extend(hds)
                devices.append(LeaseDevice(dev.gpu_id, dev.functions, dev.original_drivers, dev.iommu_group,
                                           tuple(guest_addr(h) for h in hds)))
            lease = await bind_all(m, lease, lease.transition(S.ATTACHING, devices=tuple(devices)), bound, actor)
            crash_point("before-attach")
            await m._timed_hv("attach", m.hv.attach_hostdevs(lease.domain_uuid, all_hostdevs))
            crash_point("after-attach-call")
            changes: dict[str, Any] = {"granted_at": m.clock()}
            if layout == "auto":  # record the guest addresses libvirt chose
                placed = {str(h.source): guest_addr(h)
                          for h in await m.hv.attached_hostdevs(lease.domain_uuid)}
                changes["devices"] = tuple(LeaseDevice(d.gpu_id, d.functions, d.original_drivers, d.iommu_group,
                                                       tuple(placed.get(a, "") for a in d.functions))
                                           for d in lease.devices)
            return await m._move(lease, S.ACTIVE, actor, "attached and verified in the domain XML", **changes)
        except HostAgentError as exc:
            return await rollback(m, lease, bound, actor, exc)


async def bind_all(m: LeaseCore, lease: Lease, attaching: Lease, bound: list[LeaseDevice], actor: str) -> Lease:
    """Every device of `lease` onto vfio-pci, in order, then ATTACHING (`attaching`) journaled: one worker hop,
    the same durable order as a hop each. Devices bound are appended to `bound` (the caller rolls them back on
    a HostAgentError); a failed bind quarantines its GPU when it could not be undone."""
    detail = "all functions on vfio-pci; guest addresses chosen"
    devs = [(dev, m.gpus[dev.gpu_id]) for dev in lease.devices]
    timings: list[float] = []

    def work() -> tuple[tuple[Gpu, HostOpResult] | None, Exception | None]:  # worker thread: (failed bind, error)
        try:
            for dev, gpu in devs:
                res = clocked(timings, m.host.bind, gpu, step_hook("bind"))
                if not res.ok:
                    return (gpu, res), None
                bound.append(dev)
                crash_point("bind-device-done")
            m.journal.record(attaching, from_state=lease.state, actor=actor, detail=detail)
            return None, None
        except Exception as exc:  # noqa: BLE001  (raised in the loop, once `bound` says what to undo)
            return None, exc

    m._still_live(lease)
    async with m._holding_groups(dev.iommu_group for dev, _ in devs):
        failed, exc = await m._run(work)
    for seconds in timings:
        m._timing("bind", seconds)
    if exc is not None:
        raise exc
    if failed is not None:
        gpu, res = failed
        if res.needs_attention:
            await quarantine_gpu(m, gpu.id, f"bind failed and could not be undone: {res.error}", actor)
        raise HostError(f"binding {gpu.id} to vfio-pci failed: {res.error}", gpu=gpu.id)
    m._publish(attaching, detail)
    crash_point("after-attaching")
    return attaching


async def rollback(m: LeaseCore, lease: Lease, bound: Sequence[LeaseDevice], actor: str,
                   exc: HostAgentError) -> Lease:
    """Undo a failed grant in reverse order; FAILED with the error. Devices that will not come back are quarantined."""
    log.warning("lease %s failed: %s; rolling back", lease.id, exc.message, extra={"lease_id": lease.id})
    notes = []
    if exc.details.get("rollback_confirmed") is False:
        # The hypervisor attached part of the set and could not confirm its undo: the guest (QEMU) may still
        # hold the functions, so they stay on vfio-pci, flagged for an operator, never given back blind.
        for dev in bound:
            m.attention[dev.gpu_id] = f"attach to {lease.domain_name} failed and its undo was not confirmed"
            notes.append(f"kept {dev.gpu_id} on vfio-pci: the undo detach was not confirmed")
            await m._run(m.journal.event, "attention", actor=actor, lease_id=lease.id, gpu_id=dev.gpu_id,
                         detail=m.attention[dev.gpu_id])
        bound = []
    for dev in reversed(bound):
        gpu = m.gpus[dev.gpu_id]
        async with m._group_lock(dev.iommu_group):
            res = await m._run(m.host.give_back, gpu, dict(zip(dev.functions, dev.original_drivers)), None)
        if res.ok:
            notes.append(f"undo: gave {dev.gpu_id} back to its host driver")
        else:
            notes.append(f"undo failed for {dev.gpu_id}: {res.error}")
            await quarantine_gpu(m, dev.gpu_id, f"rollback could not return it to the host: {res.error}", actor)
    return await m._move(lease, S.FAILED, actor, "; ".join(notes) or "nothing to undo", error=exc.message,
                         ended_at=m.clock(), end_reason="failed")
