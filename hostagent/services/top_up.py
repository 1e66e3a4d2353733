"""Partial grants that complete: an ACTIVE lease granted fewer GPUs than it asked (`accept_partial`) is topped up,
one GPU at a time, as GPUs free, unless its request declined it (`top_up: false`).

A top-up waits its turn like a queued request: it takes a free GPU only when no queued request can start on it and
the head of the queue is not delayed by it (EASY backfilling on the lease's remaining time), and never a GPU booked
before the lease ends. The steps, each journaled before the next:

1. the new device is added to the lease's devices, marked `adding` (with its original drivers), GPU claimed;
2. every function of its IOMMU group onto vfio-pci;
3. attached live to the same domain (hot-plug), then `adding` cleared with the guest addresses libvirt chose, and
   `granted_gpus` raised. The guest agent learns it from its next heartbeat reply (`granted_gpus`) and re-reads
   the lease's devices.

A failure gives the device back and drops it from the lease (the lease keeps what it had); an attach whose undo
libvirt could not confirm keeps the device in the lease (the guest may hold it: it goes back with the lease). After
a crash, reconcile finishes a top-up whose device is attached and undoes one whose device is not
(`settle_after_crash`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

from hostagent.domain.errors import Conflict, HostAgentError
from hostagent.domain.hostdev import HostdevPci, free_guest_slots, guest_slots_needed
from hostagent.domain.inventory import Gpu
from hostagent.domain.lease import Lease, LeaseDevice, LeaseState
from hostagent.services import bookings
from hostagent.services.admission import cap_length, quota_cap_for
from hostagent.services.faults import crash_point
from hostagent.services.grant_path import backfill_room, busy_until, feasible, head_shadow, is_free, quota_view
from hostagent.services.lease_types import LOGGER, LeaseCore, render_hostdevs, with_live_addresses
from hostagent.services.quarantine import quarantine_gpu

log = logging.getLogger(LOGGER)
S = LeaseState


def wants_more(lease: Lease) -> int:
    """How many GPUs an ACTIVE partial lease still waits for (0: none, or it declined top-ups)."""
    if lease.state is not S.ACTIVE or not lease.request.top_up or lease.adding or lease.notice or lease.move:
        return 0
    return max(0, lease.request.gpus - len(lease.devices))


def rest_expected_at(m: LeaseCore, lease: Lease, now: float) -> float | None:
    """When the GPUs a partial lease still waits for are expected free (the GPUs it could use, by their holders'
    expected ends); None when not enough of them have a known end."""
    missing = wants_more(lease)
    if not missing:
        return None
    mine = set(lease.gpu_ids)
    ends = sorted(now if is_free(m, g.id) else busy_until(m, g.id, now) for g in feasible(m, lease.request)
                  if g.id not in mine)
    return ends[missing - 1] if len(ends) >= missing and ends[missing - 1] < float("inf") else None


def next_top_up(m: LeaseCore) -> tuple[Lease, Gpu] | None:
    """The partial lease to top up now and the GPU it gets (oldest grant first, highest priority first), or None.
    Called under the decide lock when the queue has nothing to grant."""
    now = m.clock()
    waiting = sorted((x for x in m.leases.values() if wants_more(x)),
                     key=lambda x: (-x.request.priority, x.granted_at or x.created_at))
    if not waiting:
        return None
    hs = head_shadow(m, now, allows=quota_view(m))
    for lease in waiting:
        end = lease.expires_at if lease.expires_at is not None else now + m.policy.default_duration_s
        if not _quota_allows_one_more(m, lease, end - now):
            continue
        free = [g for g in feasible(m, lease.request) if is_free(m, g.id)]
        free = bookings.clear_for(m, free, now, end)
        if not free:
            continue
        if hs is not None:  # the head of the queue waits: take only what cannot delay it
            room = backfill_room(m, dataclasses.replace(lease.request, gpus=1, duration_s=max(1, int(end - now))),
                                 free, now, hs)
            if room is None:
                continue
            free = list(room[0])
        placement = m.place(dataclasses.replace(lease.request, gpus=1), free, 1, lease.domain_uuid)
        return lease, m.gpus[placement.gpu_ids[0]]
    return None


def _quota_allows_one_more(m: LeaseCore, lease: Lease, left_s: float) -> bool:
    """Whether the VM's and its projects' quotas let the lease hold one GPU more for the rest of its time: the GPU
    count (what it and its tenant hold and have queued) and the GPU-hours of the day (it must not be cut short)."""
    try:
        if quota_cap_for(m, lease.domain_uuid, lease.domain_name,
                         dataclasses.replace(lease.request, gpus=1, accept_partial=True)) < 1:
            return False
    except Conflict:
        return False
    _, cut = cap_length(m, lease, len(lease.devices) + 1, max(1.0, left_s))
    return cut is None


async def top_up(m: LeaseCore, lease_id: str, gpu: Gpu) -> Lease | None:
    """Add `gpu` to an ACTIVE partial lease: journal, bind, attach (see the module). Called under the decide lock
    for step 1 (the claim); returns the lease, or None when it no longer wants the GPU."""
    async with m.lease_lock(lease_id):
        lease = m.leases.get(lease_id)
        if lease is None or not wants_more(lease) or not is_free(m, gpu.id):
            return None
        m.claims[gpu.id] = lease.id
        try:
            drivers = await m._run(m.host.current_drivers, gpu)
            dev = LeaseDevice(gpu.id, tuple(str(f.address) for f in gpu.functions),
                              tuple(drivers.get(str(f.address)) for f in gpu.functions),
                              gpu.iommu_group if gpu.iommu_group is not None else -1)
            lease = await m._write(lease.with_changes(devices=(*lease.devices, dev), adding=(gpu.id,)), S.ACTIVE,
                                   "queue", f"top-up: adding {gpu.id} ({len(lease.devices) + 1} of "
                                   f"{lease.request.gpus})")
        except BaseException:
            if m.claims.get(gpu.id) == lease.id and gpu.id not in lease.gpu_ids:
                del m.claims[gpu.id]
            raise
        crash_point("top-up:journaled")
        try:
            async with m._group_lock(dev.iommu_group):
                res = await m._run(m.host.bind, gpu, None)
            crash_point("top-up:bound")
            if not res.ok:
                if res.needs_attention:
                    await quarantine_gpu(m, gpu.id, f"top-up bind failed and could not be undone: {res.error}",
                                         "queue")
                return await _drop(m, lease, dev, f"binding it to vfio-pci failed: {res.error}", give_back=False)
            xml = await m.hv.domain_xml(lease.domain_uuid, live=True)
            slots = list(free_guest_slots(xml, m.policy.guest_bus,
                                          guest_slots_needed(m.policy.guest_layout, len(dev.functions))))
            hds = render_hostdevs(dev.functions, m.policy.guest_bus, slots, m.policy)
            await m._timed_hv("attach", m.hv.attach_hostdevs(lease.domain_uuid, hds))
            crash_point("top-up:attached")
        except HostAgentError as exc:
            if exc.details.get("rollback_confirmed") is False:  # the guest may hold it: it stays with the lease
                lease = m.leases.get(lease_id) or lease
                return await m._write(lease.with_changes(adding=()), S.ACTIVE, "queue",
                                      f"top-up of {gpu.id}: attach failed and its undo was not confirmed; kept in "
                                      "the lease (it goes back with the lease)")
            return await _drop(m, m.leases.get(lease_id) or lease, dev, exc.message, give_back=True)
        live = await m.hv.attached_hostdevs(lease.domain_uuid)
        lease = m.leases.get(lease_id) or lease
        devices = with_live_addresses(lease.devices, live)  # the addresses libvirt gave the new device
        why = f"topped up with {gpu.id}: {len(devices)} of {lease.request.gpus} GPU(s)"
        done = await m._write(lease.with_changes(devices=devices, adding=(), granted_gpus=len(devices),
                                                 reasons=(*lease.reasons, why)), S.ACTIVE, "queue", why)
        log.info("lease %s: %s", lease.id, why, extra={"lease_id": lease.id})
        return done


async def _drop(m: LeaseCore, lease: Lease, dev: LeaseDevice, why: str, *, give_back: bool) -> Lease:
    """Undo a top-up: the device back to its host drivers (unless the bind undid itself), out of the lease."""
    note = f"top-up of {dev.gpu_id} failed: {why}"
    if give_back:
        async with m._group_lock(dev.iommu_group):
            res = await m._run(m.host.give_back, m.gpus[dev.gpu_id], dict(zip(dev.functions, dev.original_drivers)),
                               None)
        if not res.ok:
            await quarantine_gpu(m, dev.gpu_id, f"a failed top-up could not return it to the host: {res.error}",
                                 "queue")
            note += f"; give-back failed: {res.error} (quarantined)"
    if m.claims.get(dev.gpu_id) == lease.id:
        del m.claims[dev.gpu_id]
    log.warning("lease %s: %s", lease.id, note, extra={"lease_id": lease.id})
    return await m._write(lease.with_changes(devices=tuple(d for d in lease.devices if d.gpu_id != dev.gpu_id),
                                             adding=()), S.ACTIVE, "queue", note)


async def settle_after_crash(m: LeaseCore, lease: Lease, live: Sequence[HostdevPci] | None,
                             actor: str) -> list[str]:
    """Reconcile of an ACTIVE lease the agent stopped in the middle of a top-up (`adding`): a device whose every
    function the domain holds (`live`: the lease's hostdevs in the live domain) is kept (the top-up finished, with
    the guest addresses libvirt gave it), one it does not hold is given back and dropped (the lease keeps what it
    had); unknown (libvirt unreachable): left for the next reconcile. Returns what was done."""
    if not lease.adding or live is None:
        return []
    attached = {str(h.source) for h in live}
    notes = []
    for gid in lease.adding:
        dev = next((d for d in lease.devices if d.gpu_id == gid), None)
        if dev is None:
            continue
        if set(dev.functions) <= attached:
            lease = await m._write(lease.with_changes(adding=tuple(g for g in lease.adding if g != gid),
                                                      devices=with_live_addresses(lease.devices, live),
                                                      granted_gpus=len(lease.devices)), S.ACTIVE, actor,
                                   f"reconcile: the top-up with {gid} had attached")
            notes.append(f"finished the top-up with {gid} (attached)")
        else:
            lease = await _drop(m, lease, dev, "the agent stopped before it was attached", give_back=True)
            notes.append(f"undid the top-up with {gid} (not attached): given back")
    return notes
