"""Make-before-break moves: an ACTIVE lease's GPU is replaced by another without the guest losing its device.

`start` (the operator's `POST /v1/leases/{id}/move`, `hostagent lease move`):

1. *make*: the target joins the lease's devices (journaled, `move.phase = making`, the GPU claimed), its whole IOMMU
   group goes onto vfio-pci, and it is attached live to the same domain; then `move.phase = waiting` with a
   deadline. A failure here gives the target back and the guest keeps the device it had (409).
2. *tell*: while waiting, the lease's JSON and heartbeat replies carry a `move` warning with both GPUs and the
   deadline; the guest agent runs its `on_move` hook (checkpoint, restart on the new device) and confirms
   (`POST /v1/leases/{id}/move/done`).
3. *break*: on the confirmation or at the deadline (`due`, on the agent's expiry tick), `move.phase = breaking`,
   the old device is detached (waiting for the guest's DEVICE_REMOVED) and given back to its host driver, and the
   lease goes on with the new one. A detach the guest does not acknowledge keeps `breaking`: retried each tick.

Every step is journaled before the next; after a crash `settle_after_crash` finishes or undoes the make (the target
attached or not) and resumes a break.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

from hostagent.domain.errors import Conflict, HostAgentError, InvalidInput, NotFound
from hostagent.domain.hostdev import HostdevPci, free_guest_slots, guest_slots_needed
from hostagent.domain.lease import Lease, LeaseDevice, LeaseState
from hostagent.services import bookings
from hostagent.services.faults import crash_point
from hostagent.services.grant_path import feasible, is_free
from hostagent.services.lease_types import LOGGER, LeaseCore, render_hostdevs, with_live_addresses
from hostagent.services.quarantine import quarantine_gpu
from hostagent.services.release_path import detach

log = logging.getLogger(LOGGER)
S = LeaseState
DEFAULT_DEADLINE_S = 300
MAX_DEADLINE_S = 3600


def move_of(lease: Lease) -> dict[str, Any]:
    """The lease's move under way ({} when none): from, to, phase, deadline."""
    return dict(lease.move)


def _with_move(lease: Lease, **move: Any) -> Lease:
    return lease.with_changes(move=tuple(sorted(move.items())))


def check(m: LeaseCore, lease: Lease, to_gpu: str, from_gpu: str | None) -> tuple[LeaseDevice, Any]:
    """Bad input is a clear 4xx and changes nothing: which device leaves, and the GPU that takes its place."""
    if lease.state is not S.ACTIVE:
        raise Conflict(f"only an ACTIVE lease can move; {lease.id} is {lease.state.value}", field="id")
    if lease.move or lease.adding:
        raise Conflict(f"lease {lease.id} is already changing its devices; retry when that is done", field="id")
    if from_gpu is None:
        if len(lease.devices) != 1:
            raise InvalidInput(f"lease {lease.id} holds {len(lease.devices)} GPUs: say which one moves ('from')",
                               field="from")
        from_gpu = lease.devices[0].gpu_id
    old = next((d for d in lease.devices if d.gpu_id == from_gpu), None)
    if old is None:
        raise InvalidInput(f"{from_gpu} is not a GPU of lease {lease.id} ({', '.join(lease.gpu_ids)})", field="from")
    if to_gpu == from_gpu:
        raise InvalidInput("'to' is the GPU the lease already has", field="to")
    gpu = m.gpus.get(to_gpu)
    if gpu is None:
        raise NotFound(f"no GPU {to_gpu!r}", field="to")
    if not gpu.viable:
        raise Conflict(f"{to_gpu} cannot be passed through: {gpu.unviable_reason}", field="to")
    if not is_free(m, to_gpu):
        why = m.quarantined.get(to_gpu) or m.attention.get(to_gpu) or f"held by {m.claims.get(to_gpu)}"
        raise Conflict(f"{to_gpu} is not free ({why})", field="to")
    if gpu not in feasible(m, lease.request):
        raise Conflict(f"{to_gpu} does not meet the lease's request (memory, model or features)", field="to")
    end = lease.expires_at if lease.expires_at is not None else m.clock() + m.policy.default_duration_s
    if not bookings.clear_for(m, [gpu], m.clock(), end):
        raise Conflict(f"{to_gpu} is booked before the lease ends", field="to")
    return old, gpu


async def start(m: LeaseCore, lease_id: str, to_gpu: str, from_gpu: str | None = None, *,
                deadline_s: int = DEFAULT_DEADLINE_S, actor: str) -> Lease:
    """Make: bind and attach `to_gpu` beside `from_gpu`, then wait for the guest (see the module)."""
    if isinstance(deadline_s, bool) or not isinstance(deadline_s, int) or not 1 <= deadline_s <= MAX_DEADLINE_S:
        raise InvalidInput(f"deadline_s must be an integer 1..{MAX_DEADLINE_S}", field="deadline_s")
    lock = m.lease_lock(lease_id)
    async with m._decide:  # the decide lock first, then the lease's, as every path takes them
        lease = m.get(lease_id)
        await lock.acquire()  # held through the make, so a release waits for it to finish or undo
        try:
            lease = m.leases.get(lease_id) or lease
            old, gpu = check(m, lease, to_gpu, from_gpu)
            m.claims[gpu.id] = lease.id
            try:
                drivers = await m._run(m.host.current_drivers, gpu)
                new = LeaseDevice(gpu.id, tuple(str(f.address) for f in gpu.functions),
                                  tuple(drivers.get(str(f.address)) for f in gpu.functions),
                                  gpu.iommu_group if gpu.iommu_group is not None else -1)
                lease = await m._write(_with_move(lease.with_changes(devices=(*lease.devices, new)),
                                                  **{"from": old.gpu_id, "to": gpu.id, "phase": "making"}),
                                       S.ACTIVE, actor, f"move: {old.gpu_id} -> {gpu.id}, making")
            except BaseException:
                if m.claims.get(gpu.id) == lease.id and gpu.id not in lease.gpu_ids:
                    del m.claims[gpu.id]
                raise
        except BaseException:
            lock.release()
            raise
    try:
        crash_point("move:making")
        try:
            async with m._group_lock(new.iommu_group):
                res = await m._run(m.host.bind, gpu, None)
            if not res.ok:
                if res.needs_attention:
                    await quarantine_gpu(m, gpu.id, f"move bind failed and could not be undone: {res.error}", actor)
                await _undo(m, lease_id, new, f"binding it to vfio-pci failed: {res.error}", give_back=False,
                            actor=actor)
                raise Conflict(f"the move failed: binding {gpu.id} to vfio-pci failed ({res.error}); the guest "
                               f"keeps {old.gpu_id}", field="to")
            crash_point("move:bound")
            xml = await m.hv.domain_xml(lease.domain_uuid, live=True)
            slots = list(free_guest_slots(xml, m.policy.guest_bus,
                                          guest_slots_needed(m.policy.guest_layout, len(new.functions))))
            await m._timed_hv("attach", m.hv.attach_hostdevs(lease.domain_uuid, render_hostdevs(
                new.functions, m.policy.guest_bus, slots, m.policy)))
            crash_point("move:attached")
        except HostAgentError as exc:
            if isinstance(exc, Conflict):
                raise
            if exc.details.get("rollback_confirmed") is False:  # the guest may hold it: it stays, the move ends
                current = m.leases.get(lease_id) or lease
                await m._write(current.with_changes(move=()), S.ACTIVE, actor,
                               f"move: attaching {gpu.id} failed and its undo was not confirmed; kept in the lease")
                raise Conflict(f"the move failed: {exc.message}; {gpu.id} stays with the lease", field="to") from exc
            await _undo(m, lease_id, new, exc.message, give_back=True, actor=actor)
            raise Conflict(f"the move failed: {exc.message}; the guest keeps {old.gpu_id}", field="to") from exc
        live = await m.hv.attached_hostdevs(lease.domain_uuid)
        current = m.leases.get(lease_id) or lease
        devices = with_live_addresses(current.devices, live)  # the addresses libvirt gave the new device
        deadline = m.clock() + deadline_s
        return await m._write(_with_move(current.with_changes(devices=devices), **{
            "from": old.gpu_id, "to": gpu.id, "phase": "waiting", "deadline": deadline}), S.ACTIVE, actor,
            f"move: {gpu.id} attached beside {old.gpu_id}; the guest has until {deadline:.0f} to move its work")
    finally:
        lock.release()


async def _undo(m: LeaseCore, lease_id: str, dev: LeaseDevice, why: str, *, give_back: bool, actor: str) -> Lease:
    """A failed make: the target back to its host drivers (unless its bind undid itself), out of the lease."""
    lease = m.leases[lease_id]
    note = f"move to {dev.gpu_id} failed: {why}"
    if give_back:
        async with m._group_lock(dev.iommu_group):
            res = await m._run(m.host.give_back, m.gpus[dev.gpu_id], dict(zip(dev.functions, dev.original_drivers)),
                               None)
        if not res.ok:
            await quarantine_gpu(m, dev.gpu_id, f"a failed move could not return it to the host: {res.error}", actor)
            note += f"; give-back failed: {res.error} (quarantined)"
    if m.claims.get(dev.gpu_id) == lease.id:
        del m.claims[dev.gpu_id]
    log.warning("lease %s: %s", lease.id, note, extra={"lease_id": lease.id})
    return await m._write(lease.with_changes(devices=tuple(d for d in lease.devices if d.gpu_id != dev.gpu_id),
                                             move=()), S.ACTIVE, actor, note + "; the guest keeps its device")


async def finish(m: LeaseCore, lease_id: str, *, actor: str, why: str, domain_uuid: str | None = None) -> Lease:
    """Break: the old device detached (the guest's DEVICE_REMOVED) and given back; the lease keeps the new one.
    A detach the guest does not acknowledge leaves the move `breaking` (retried by `due`)."""
    lease = m.get(lease_id, domain_uuid=domain_uuid)
    async with m.lease_lock(lease_id):
        lease = m.leases.get(lease_id) or lease
        mv = move_of(lease)
        if mv.get("phase") not in ("waiting", "breaking"):
            raise Conflict(f"lease {lease_id} has no move waiting to finish", field="id")
        old = next(d for d in lease.devices if d.gpu_id == mv["from"])
        if mv["phase"] == "waiting":
            lease = await m._write(_with_move(lease, **{**mv, "phase": "breaking"}), S.ACTIVE, actor,
                                   f"move: breaking ({why}): detaching {old.gpu_id}")
        crash_point("move:breaking")
        how = await detach(m, dataclasses.replace(lease, devices=(old,)))
        if how is None:
            log.warning("lease %s: the guest has not let go of %s yet; the move keeps waiting for it", lease.id,
                        old.gpu_id, extra={"lease_id": lease.id})
            return lease
        crash_point("move:detached")
        async with m._group_lock(old.iommu_group):
            res = await m._run(m.host.give_back, m.gpus[old.gpu_id], dict(zip(old.functions, old.original_drivers)),
                               None)
        note = f"moved from {old.gpu_id} to {mv['to']} ({why}; the old device's detach: {how})"
        if not res.ok:
            await quarantine_gpu(m, old.gpu_id, f"did not return to its host driver after a move: {res.error}", actor)
            note += f"; {old.gpu_id} did not return to its host driver: {res.error} (quarantined)"
        if m.claims.get(old.gpu_id) == lease.id:
            del m.claims[old.gpu_id]
        done = await m._write(lease.with_changes(devices=tuple(d for d in lease.devices if d.gpu_id != old.gpu_id),
                                                 move=(), reasons=(*lease.reasons, note)), S.ACTIVE, actor, note)
        m._wake_queue.set()  # the old GPU is free
        log.info("lease %s: %s", lease.id, note, extra={"lease_id": lease.id})
        return done


async def due(m: LeaseCore) -> None:
    """Moves whose deadline passed (the guest did not confirm) break now; breaks the guest held up are retried."""
    now = m.clock()
    for lease in list(m.leases.values()):
        mv = move_of(lease)
        if lease.state is S.ACTIVE and (mv.get("phase") == "breaking" or (
                mv.get("phase") == "waiting" and mv.get("deadline", 0) <= now)):
            try:
                await finish(m, lease.id, actor="agent", why="the deadline passed" if mv["phase"] == "waiting"
                             else "retry")
            except HostAgentError as exc:
                log.warning("lease %s: finishing its move failed: %s", lease.id, exc.message,
                            extra={"lease_id": lease.id})


async def settle_after_crash(m: LeaseCore, lease: Lease, live: Sequence[HostdevPci] | None,
                             actor: str) -> list[str]:
    """Reconcile of an ACTIVE lease stopped mid-move: a make whose target the domain holds (`live`: the lease's
    hostdevs in the live domain) goes on waiting (a new deadline; the guest addresses libvirt gave it recorded), one
    it does not hold is undone; a break resumes on the next `due`. Unknown (libvirt unreachable): left for the next
    reconcile."""
    mv = move_of(lease)
    if mv.get("phase") != "making" or live is None:
        return []
    new = next((d for d in lease.devices if d.gpu_id == mv["to"]), None)
    if new is not None and set(new.functions) <= {str(h.source) for h in live}:
        placed = lease.with_changes(devices=with_live_addresses(lease.devices, live))
        await m._write(_with_move(placed, **{**mv, "phase": "waiting", "deadline": m.clock() + DEFAULT_DEADLINE_S}),
                       S.ACTIVE, actor, f"reconcile: the move to {mv['to']} had attached; waiting for the guest")
        return [f"the move to {mv['to']} had attached: waiting for the guest"]
    if new is not None:
        await _undo(m, lease.id, new, "the agent stopped before it was attached", give_back=True, actor=actor)
    else:
        await m._write(lease.with_changes(move=()), S.ACTIVE, actor, "reconcile: a move with no target device")
    return [f"undid the move to {mv['to']} (not attached): given back, the guest keeps {mv['from']}"]


def warning(lease: Lease) -> dict[str, Any] | None:
    """The heartbeat reply's and lease JSON's `move` warning while the guest is to move its work."""
    mv = move_of(lease)
    if mv.get("phase") != "waiting":
        return None
    return {"code": "move", "from": mv["from"], "to": mv["to"], "deadline": mv.get("deadline"),
            "message": f"move the work from {mv['from']} to {mv['to']} (attached now), then confirm with POST "
                       f"/v1/leases/{lease.id}/move/done; {mv['from']} is detached at the deadline otherwise"}


__all__ = ["DEFAULT_DEADLINE_S", "check", "due", "finish", "settle_after_crash", "start", "warning"]
