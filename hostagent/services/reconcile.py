"""Startup reconciliation: the journal says what was intended, sysfs and libvirt say what is true; repair.

Each repair is journaled as a `repair` event and returned, so operators see what the agent did after a crash.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from hostagent.domain.errors import HostAgentError, HypervisorUnavailable, NotFound
from hostagent.domain.hostdev import HostdevPci
from hostagent.domain.lease import Lease, LeaseDevice, LeaseState
from hostagent.domain.pci import PciAddress
from hostagent.services.lease_types import VFIO_DRIVER as VFIO
from hostagent.services.lease_types import render_hostdevs, with_live_addresses
from hostagent.services import moves, top_up
from hostagent.services.leases import LeaseManager

log = logging.getLogger("hostagent.reconcile")
S = LeaseState
MISSED_WHILE_AWAY = "missed while disconnected from libvirt; found on reconnect"  # end_reason suffix of such stops


@dataclass(frozen=True, slots=True)
class Repair:
    """One thing reconciliation found and did."""

    subject: str  # lease id or gpu id
    found: str
    action: str

    def to_dict(self) -> dict[str, str]:
        """JSON form."""
        return {"subject": self.subject, "found": self.found, "action": self.action}


class Reconciler:
    """Brings journal, sysfs and libvirt back into agreement after a start or a reconnect."""

    ACTOR = "reconcile"

    def __init__(self, manager: LeaseManager, actor: str = ACTOR) -> None:
        self.m = manager
        self.actor = actor
        self.repairs: list[Repair] = []

    async def _note(self, subject: str, found: str, action: str, *, lease_id: str | None = None,
                    gpu_id: str | None = None) -> None:
        r = Repair(subject, found, action)
        self.repairs.append(r)
        log.warning("repair %s: %s -> %s", subject, found, action, extra={"lease_id": lease_id, "gpu_id": gpu_id})
        await self.m._run(self.m.journal.event, "repair", actor=self.actor, lease_id=lease_id, gpu_id=gpu_id,
                          detail=f"found {found}; {action}")

    async def run(self) -> list[Repair]:
        """Reconcile every live lease, then orphans. Returns the repairs made."""
        await self.m.load()
        for lease in sorted(self.m.leases.values(), key=lambda x: x.created_at):
            try:
                await self._lease(lease)
            except HostAgentError as exc:
                await self._note(lease.id, f"{lease.state.value} lease could not be repaired: {exc.message}",
                                 "left for retry", lease_id=lease.id)
        await self._orphans()
        return list(self.repairs)

    async def _drivers(self, dev: LeaseDevice) -> dict[str, str | None]:
        gpu = self.m.gpus.get(dev.gpu_id)
        if gpu is None:
            return {}
        return await self.m._run(self.m.host.current_drivers, gpu)

    async def _on_vfio(self, lease: Lease) -> list[LeaseDevice]:
        out = []
        for dev in lease.devices:
            drivers = await self._drivers(dev)
            if any(drivers.get(a) == VFIO for a in dev.functions):
                out.append(dev)
        return out

    async def _disturbed(self, lease: Lease) -> list[LeaseDevice]:
        """Devices with any function not on its original driver (on vfio-pci, or left with none mid-bind)."""
        out = []
        for dev in lease.devices:
            drivers = await self._drivers(dev)
            if any(drivers.get(a) != orig for a, orig in zip(dev.functions, dev.original_drivers)):
                out.append(dev)
        return out

    async def _attached(self, lease: Lease) -> set[str] | None:
        """PCI sources of this lease attached to its domain; None when the domain no longer exists."""
        hds = await self._attached_hostdevs(lease)
        return None if hds is None else {str(h.source) for h in hds}

    async def _attached_hostdevs(self, lease: Lease) -> list[HostdevPci] | None:
        """The hostdevs of this lease's functions in its live domain; None when the domain no longer exists."""
        try:
            hds = await self.m.hv.attached_hostdevs(lease.domain_uuid)
        except NotFound:
            return None
        mine = {a for d in lease.devices for a in d.functions}
        return [h for h in hds if str(h.source) in mine]

    async def _give_back_devices(self, lease: Lease, devices: list[LeaseDevice]) -> list[str]:
        notes = []
        for dev in devices:
            gpu = self.m.gpus[dev.gpu_id]
            res = await self.m._run(self.m.host.give_back, gpu, dict(zip(dev.functions, dev.original_drivers)), None)
            if res.ok:
                notes.append(f"gave {dev.gpu_id} back to its host driver")
            else:
                notes.append(f"{dev.gpu_id} would not return: {res.error}; quarantined")
                await self.m._quarantine(dev.gpu_id, f"did not return to host during reconcile: {res.error}", self.actor)
        return notes

    async def _fail(self, lease: Lease, found: str) -> None:
        """A half-done grant: undo what is on vfio-pci (after detaching anything attached) and mark FAILED."""
        attached = await self._attached(lease)
        if attached:
            if await self.m._detach(lease) is None:
                # Still attached and unacknowledged: the lease must hold the device until the guest lets go.
                lease = await self.m._move(lease, S.ACTIVE, self.actor, "reconcile: attach had completed")
                lease = await self.m._move(lease, S.RELEASING, self.actor, "reconcile: undo half-done grant")
                lease = await self.m._move(lease, S.DETACHING, self.actor, "detaching")
                await self.m._finish_release(lease, self.actor, S.RELEASED)
                await self._note(lease.id, found, "detach not acknowledged: lease kept DETACH_PENDING", lease_id=lease.id)
                return
        notes = await self._give_back_devices(lease, await self._disturbed(lease))
        await self.m._move(lease, S.FAILED, self.actor, "; ".join(notes) or "nothing was bound",
                           error="agent stopped mid-grant", ended_at=self.m.clock(), end_reason="failed")
        await self._note(lease.id, found, "rolled back to FAILED: " + ("; ".join(notes) or "nothing to undo"),
                         lease_id=lease.id)

    async def _lease(self, lease: Lease) -> None:
        st = lease.state
        if st in (S.QUEUED, S.BOOKED):  # nothing bound yet: the queue and the calendar take them up again
            return
        if st is S.REQUESTED:
            await self.m._move(lease, S.FAILED, self.actor, "agent stopped before placement",
                               error="agent restarted", ended_at=self.m.clock(), end_reason="failed")
            await self._note(lease.id, "REQUESTED lease (never placed)", "marked FAILED", lease_id=lease.id)
            return
        if st is S.BINDING:
            await self._fail(lease, "lease stopped in BINDING")
            return
        if st is S.ATTACHING:
            hds = await self._attached_hostdevs(lease)
            want = {a for d in lease.devices for a in d.functions}
            on_vfio = await self._on_vfio(lease)
            if hds is not None and {str(h.source) for h in hds} == want and len(on_vfio) == len(lease.devices) \
                    and all(d.guest_addresses for d in lease.devices):
                # the guest addresses libvirt gave (guest_layout=auto chooses them at the attach the crash cut off)
                await self.m._move(lease, S.ACTIVE, self.actor, "reconcile: attach had completed",
                                   granted_at=self.m.clock(), devices=with_live_addresses(lease.devices, hds))
                await self._note(lease.id, "ATTACHING lease fully attached", "finished to ACTIVE", lease_id=lease.id)
            else:
                await self._fail(lease, "lease stopped in ATTACHING")
            return
        if st is S.ACTIVE:
            await self._active(lease)
            return
        if st in (S.RELEASING, S.DETACHING, S.DETACH_PENDING):
            if st is S.RELEASING:
                lease = await self.m._move(lease, S.DETACHING, self.actor, "reconcile: continue release")
            done = await self.m._finish_release(lease, self.actor, S.RELEASED)
            await self._note(lease.id, f"lease stopped in {st.value}", f"continued release: now {done.state.value}",
                             lease_id=lease.id)
            return
        if st is S.REBINDING:
            done = await self.m._give_back_all(lease, self.actor, S.RELEASED)
            await self._note(lease.id, "lease stopped in REBINDING", f"gave devices back: now {done.state.value}",
                             lease_id=lease.id)

    async def _active(self, lease: Lease) -> None:
        """An ACTIVE lease: its domain must exist, its devices must be on vfio-pci and attached."""
        try:
            dom = await self.m.hv.get_domain(lease.domain_uuid)
        except NotFound:
            lease = await self.m._move(lease, S.RELEASING, self.actor, "domain no longer exists",
                                       end_reason="domain undefined")
            lease = await self.m._move(lease, S.DETACHING, self.actor, "nothing to detach")
            done = await self.m._finish_release(lease, self.actor, S.RELEASED)
            await self._note(lease.id, "ACTIVE lease whose domain is gone", f"released: {done.state.value}",
                             lease_id=lease.id)
            return
        if dom.state != "running" and not self.m.policy.keep_on_domain_stop:
            await self.m.release(lease.id, actor=self.actor, reason=f"domain {dom.state} while the agent was away")
            await self._note(lease.id, f"ACTIVE lease whose domain is {dom.state}", "released", lease_id=lease.id)
            return
        if lease.adding:  # stopped in a top-up: finish it (attached) or undo it (not), before anything else
            hds = await self._attached_hostdevs(lease)
            if hds is not None:
                for note in await top_up.settle_after_crash(self.m, lease, hds, self.actor):
                    await self._note(lease.id, "ACTIVE lease stopped in a top-up", note, lease_id=lease.id)
                lease = self.m.leases.get(lease.id, lease)
        if dict(lease.move).get("phase") == "making":  # stopped making a move: go on (attached) or undo (not)
            hds = await self._attached_hostdevs(lease)
            for note in await moves.settle_after_crash(self.m, lease, hds, self.actor):
                await self._note(lease.id, "ACTIVE lease stopped making a move", note, lease_id=lease.id)
            lease = self.m.leases.get(lease.id, lease)
        if dict(lease.move).get("phase") == "breaking":  # stopped breaking a move: the old device goes on going
            lease = await moves.finish(self.m, lease.id, actor=self.actor, why="resumed after a restart")
            await self._note(lease.id, "ACTIVE lease stopped breaking a move",
                             "finished the move" if not lease.move else "the guest still holds the old device: "
                             "the move keeps waiting for it", lease_id=lease.id)
        # Re-bind devices that lost vfio-pci (host reboot), then re-attach what is missing.
        for dev in lease.devices:
            drivers = await self._drivers(dev)
            if not all(drivers.get(a) == VFIO for a in dev.functions):
                gpu = self.m.gpus[dev.gpu_id]
                res = await self.m._run(self.m.host.bind, gpu, None)
                await self._note(lease.id, f"{dev.gpu_id} not on vfio-pci", "re-bound" if res.ok else
                                 f"re-bind failed: {res.error}", lease_id=lease.id, gpu_id=dev.gpu_id)
        attached = await self._attached(lease)
        if attached is not None:
            await self.restore_devices(lease, attached)

    async def restore_devices(self, lease: Lease, attached: set[str]) -> bool:
        """An ACTIVE lease whose domain lacks some of its functions (`attached`: the lease's functions the domain
        holds now, as libvirt answered: live when it runs, else its configuration): attach them again, or end the
        lease.

        A lease is never left ACTIVE without its device (the crash matrix's invariant; the guest could not use the
        GPU, and nothing would give it back). So when libvirt refuses the re-attach, the lease ends: the release
        detaches whatever of it is still attached (waiting for DEVICE_REMOVED as always) and gives the GPU back.
        Only an unreachable libvirt, which says nothing about the guest, keeps the lease as it is for the next
        reconcile or reconnect to look again: False then (True once settled)."""
        missing = [d for d in lease.devices if not set(d.functions) <= attached]
        if not missing:
            return True
        found = f"{len(missing)} device(s) of an ACTIVE lease not attached to its domain"
        hds = []
        for d in missing:
            guest = [PciAddress.parse(a) for a in d.guest_addresses if a] or [PciAddress(0, self.m.policy.guest_bus, 1, 0)]
            slots = sorted({g.slot for g in guest})
            hds.extend(h for h in render_hostdevs(d.functions, guest[0].bus, slots, self.m.policy)
                       if str(h.source) not in attached)
        try:
            await self.m.hv.attach_hostdevs(lease.domain_uuid, hds)
        except HypervisorUnavailable as exc:
            await self._note(lease.id, found, f"re-attach failed: {exc.message}; lease kept until libvirt answers",
                             lease_id=lease.id)
            return False
        except HostAgentError as exc:
            await self._note(lease.id, found, f"re-attach refused: {exc.message}; lease ended", lease_id=lease.id)
            done = await self.m.release(lease.id, actor=self.actor,
                                        reason=f"device missing from the domain; re-attach refused: "
                                               f"{exc.message}")
            log.warning("lease %s ended %s: its device could not be attached again", lease.id, done.state.value,
                        extra={"lease_id": lease.id})
            return True
        await self._note(lease.id, found, "re-attached", lease_id=lease.id)
        return True

    async def _orphans(self) -> None:
        """GPUs on vfio-pci that no live lease owns: give back unless pinned or attached to some domain."""
        owned = {gid for x in self.m.leases.values() if x.state.holds_devices for gid in x.gpu_ids}
        try:
            attached_anywhere = await self.m.attached_anywhere()
        except HostAgentError as exc:
            log.warning("cannot list domains for the orphan scan: %s", exc.message)
            return
        for gpu in self.m.gpus.values():
            if gpu.id in owned or not gpu.viable:
                continue
            drivers, on_vfio = await self.m.stranded_functions(gpu)
            if not on_vfio:
                continue
            where = {attached_anywhere[a] for a in drivers if a in attached_anywhere}
            if where:
                self.m.attention[gpu.id] = f"attached to {', '.join(sorted(where))} without a lease"
                await self._note(gpu.id, f"on vfio-pci and attached to {', '.join(sorted(where))} without a lease",
                                 "left bound (a guest may use it); needs an operator", gpu_id=gpu.id)
                continue
            res = await self.m.give_back_to_host(gpu, drivers)
            await self._note(gpu.id, f"on vfio-pci without a lease ({', '.join(on_vfio)})",
                             "gave back to the host driver" if res.ok else f"give-back failed: {res.error}; quarantined",
                             gpu_id=gpu.id)
            if not res.ok:
                await self.m._quarantine(gpu.id, f"orphan would not return to host: {res.error}", self.actor)


def summarize(repairs: list[Repair]) -> dict[str, Any]:
    """Counts for logs and /readyz."""
    return {"repairs": len(repairs), "items": [r.to_dict() for r in repairs]}


async def reread_domains(manager: LeaseManager, hypervisor: Any, lease_ids: list[str]
                         ) -> tuple[list[str], list[Repair]]:
    """One pass of the re-read after libvirt's connection came back: end the leases whose domain stopped or
    vanished meanwhile, attach again (or end) what a running domain lost; return the leases whose domain could not
    be read (the caller reads them again later) and the repairs made.

    Only a definite answer counts: NotFound (the domain is gone) or a state. Any other error, the connection
    dropping again mid-read included, says nothing about the guest, which may still be running with the GPU: its
    lease is left as it is, never given back on a guess."""
    unread: list[str] = []
    repairs: list[Repair] = []
    for lease_id in lease_ids:
        lease = manager.leases.get(lease_id)
        if lease is None or lease.state is not S.ACTIVE:
            continue  # ended meanwhile (an event, a release): nothing to find out
        try:
            state = (await hypervisor.get_domain(lease.domain_uuid)).state
        except NotFound:
            kind = "undefined"
        except HostAgentError as exc:
            log.warning("cannot re-read domain %s of lease %s after the reconnect: %s; lease kept",
                        lease.domain_name, lease.id, exc.message, extra={"lease_id": lease.id})
            unread.append(lease_id)
            continue
        else:
            # A paused guest still holds its devices: only a domain that is down has let go of them.
            kind = {"shut-off": "stopped", "crashed": "crashed"}.get(str(state), "")
        if kind:
            await manager.on_domain_event(kind, lease.domain_uuid, actor="reconnect",
                                          reason=f"domain {kind} ({MISSED_WHILE_AWAY})")
            continue
        # Still up: a device it gave up while the agent was away (the guest's own eject; its DEVICE_REMOVED
        # lost) is attached again, or the lease ends, as the start-up reconcile does.
        repair = Reconciler(manager, actor="reconnect")
        try:
            attached = {str(h.source) for h in await hypervisor.attached_hostdevs(lease.domain_uuid)}
            settled = await repair.restore_devices(lease, attached)
        except HostAgentError as exc:
            log.warning("cannot re-read the devices of domain %s (lease %s) after the reconnect: %s; lease kept",
                        lease.domain_name, lease.id, exc.message, extra={"lease_id": lease.id})
            settled = False
        repairs.extend(repair.repairs)
        if not settled:
            unread.append(lease_id)
    return unread, repairs
