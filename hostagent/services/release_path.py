"""The release path: how a lease ends. A queued lease is cancelled; a granted one goes RELEASING -> DETACHING -> the
detach and its DEVICE_REMOVED -> REBINDING -> every function back on its original host driver (`release_lease`,
`finish_release`, `detach`, `give_back_all`), or DETACH_PENDING while the guest does not acknowledge, retried later
(`retry_pending`) up to `libvirt.detach_retries` times, then left to the operator with an alert (`detach_alert`);
a give-back that fails quarantines the GPU. It also ends leases nobody asked to release: those
past their TTL or not_after (`expire_due`), and those of a domain that stopped, crashed or was undefined, with late
DEVICE_REMOVED events finishing pending detaches (`on_domain_event`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Awaitable
from typing import Any

from hostagent.domain.errors import Conflict, HostAgentError, HypervisorError, NotFound
from hostagent.domain.hostdev import HostdevPci, alias_for
from hostagent.domain.lease import Lease, LeaseDevice, LeaseState, Step
from hostagent.domain.pci import PciAddress
from hostagent.services.admission import queue_deadline
from hostagent.services.faults import crash_point
from hostagent.services.lease_types import LOGGER, LeaseCore, clocked, detach_retries_left, step_hook
from hostagent.services.ports import HostOpResult
from hostagent.services.quarantine import quarantine_gpu

log = logging.getLogger(LOGGER)

S = LeaseState
DETACH_ALERT = "detach-alert"  # journal event: a detach still unacknowledged after libvirt.detach_retries retries
DETACH_REJECTED = "detach-rejected"  # journal event: the guest rejected an unplug (libvirt's DEVICE_REMOVAL_FAILED)


async def release_lease(m: LeaseCore, lease_id: str, *, actor: str, reason: str = "released",
                        domain_uuid: str | None = None, final: LeaseState = S.RELEASED) -> Lease:
    """End a lease: cancel it in the queue, or detach, wait for DEVICE_REMOVED, give back."""
    lease = m.get(lease_id, domain_uuid=domain_uuid)
    async with m.lease_lock(lease_id):
        lease = m.leases.get(lease_id) or lease
        if lease.state.terminal:
            return lease
        if lease.state in (S.QUEUED, S.REQUESTED, S.BOOKED):  # nothing bound: out of the queue or the calendar
            target = S.EXPIRED if final is S.EXPIRED else S.RELEASED
            if lease.state is S.BOOKED and final is not S.EXPIRED:
                reason = f"booking cancelled ({reason})"
            done = await m._move(lease, target, actor, reason, ended_at=m.clock(), end_reason=reason)
            if lease.state is S.BOOKED:
                m._wake_queue.set()  # its GPUs are free again in the calendar: a queued request may fit now
            return done
        if lease.state in (S.BINDING, S.ATTACHING):
            raise Conflict(f"lease {lease_id} is being set up ({lease.state.value}); retry in a moment",
                           field="id")
        earlier: tuple[Step, ...] = ()
        if lease.state is S.ACTIVE and lease.notice == "reclaim" and actor.startswith("guest"):
            # the guest answers a reclaim notice: the lease ended by the reclaim (accounting and the model's
            # outcome labels say so), the guest's own release only its cooperative part
            reason = f"{reason} on the reclaim notice ({why_noticed(lease)})"
        if lease.state is S.ACTIVE:  # RELEASING and DETACHING go to the journal together (one fsync)
            earlier = (Step(S.ACTIVE, S.RELEASING, reason),)
            lease = lease.transition(S.RELEASING, end_reason=reason)
        if lease.state is S.RELEASING:
            lease = await m._move(lease, S.DETACHING, actor, "detaching from the domain", earlier=earlier)
        return await finish_release(m, lease, actor, final)


def why_noticed(lease: Lease) -> str:
    """Why a lease under a reclaim notice got it: preemption by a named request, or idleness."""
    return f"preempted by {lease.preempted_by}" if lease.preempted_by else "idle"


async def finish_release(m: LeaseCore, lease: Lease, actor: str, final: LeaseState) -> Lease:
    """From DETACHING or DETACH_PENDING: detach and wait, then give back; else DETACH_PENDING.

    A retry of a pending detach stays DETACH_PENDING while it runs and after it (a crash mid-retry is repaired the
    same: the lease is DETACH_PENDING either way), so the GPU's state holds still instead of flapping between
    leased and detach-pending with every retry, and each retry the guest ignores is one `detach retry N` step
    (the dashboard shows them as one line with a count)."""
    retry = lease.state is S.DETACH_PENDING
    how = await detach(m, lease)
    if how is None:
        if retry:
            n = lease.detach_attempts
            pending = await m._write(lease.with_changes(detach_attempts=n + 1), S.DETACH_PENDING, actor,
                                     f"detach retry {n}: still not acknowledged (no DEVICE_REMOVED); GPU stays on "
                                     "vfio-pci")
        else:
            pending = await m._move(
                lease, S.DETACH_PENDING, actor,
                "the guest did not acknowledge the detach (no DEVICE_REMOVED); GPU stays on vfio-pci",
                detach_attempts=lease.detach_attempts + 1,
            )
        if pending.detach_attempts == max(0, m.policy.detach_retries) + 1:  # the last automatic try: once per lease
            await detach_alert(m, pending, actor)
        return pending
    crash_point("after-detach-confirmed")
    return await give_back_all(m, lease, actor, final, rebind=f"detach ended: {how}")


async def detach_alert(m: LeaseCore, lease: Lease, actor: str) -> None:
    """The operator alert of a detach still unacknowledged after its first try and `libvirt.detach_retries` retries:
    an ERROR in the log and a `detach-alert` journal event (GET /v1/events, the dashboard, the usage store); the
    `hostagent_detach_alerts` gauge counts such leases while they last. The agent retries no more by itself
    (`retry_pending` skips the lease); the GPU stays on vfio-pci, held by the lease."""
    gpus = ", ".join(lease.gpu_ids)
    detail = (f"the guest of {lease.domain_name} has not acknowledged the detach of {gpus} after "
              f"{lease.detach_attempts} attempt(s) (libvirt.detach_retries = {m.policy.detach_retries}); automatic "
              "retries stopped, the GPU stays on vfio-pci held by the lease until the guest lets go (DEVICE_REMOVED), "
              "the VM stops, or an operator releases the lease again")
    log.error("lease %s: %s", lease.id, detail, extra={"lease_id": lease.id})
    await m._run(m.journal.event, DETACH_ALERT, actor=actor, lease_id=lease.id, gpu_id=",".join(lease.gpu_ids),
                 detail=detail)


GONE = "the domain is gone: nothing holds the device"


async def detach(m: LeaseCore, lease: Lease) -> str | None:
    """Detach every hostdev of the lease that is still attached. How the detach ended, for the journal (the guest
    acknowledged it with DEVICE_REMOVED; the domain had stopped or was gone; the device had already left), or None
    while the guest has not acknowledged it."""
    stopped = lease.end_reason if (lease.end_reason or "").startswith("domain ") else None
    loop = asyncio.get_running_loop()
    deadline = loop.time() + m.policy.detach_timeout_s  # the whole detach, its first read included
    try:
        attached = await asyncio.wait_for(m.hv.attached_hostdevs(lease.domain_uuid), m.policy.detach_timeout_s)
    except NotFound:
        return GONE
    except TimeoutError:
        log.warning("detach for lease %s: the hypervisor did not say what the domain holds within %gs",
                    lease.id, m.policy.detach_timeout_s, extra={"lease_id": lease.id})
        return None
    mine = {a for d in lease.devices for a in d.functions}
    ours = [h for h in attached if str(h.source) in mine]
    # What left the running domain (the guest let go of it) may still be in its persistent definition, where the
    # next boot would take a GPU the host has back: it goes from there too (nothing to wait for).
    left = [HostdevPci(source=PciAddress.parse(a)) for a in sorted(mine - {str(h.source) for h in ours})]
    if not ours:
        try:
            await m.hv.detach_hostdevs(lease.domain_uuid, left, max(0.0, deadline - loop.time()))
        except NotFound:
            return GONE
        except HypervisorError as exc:
            log.warning("lease %s: removing its devices from the definition of %s failed: %s", lease.id,
                        lease.domain_name, exc.message, extra={"lease_id": lease.id})
        return f"nothing to detach ({stopped})" if stopped else "nothing to detach: the device had left the domain"
    asyncio.get_running_loop().call_soon(crash_point, "detach:sent")  # runs at the call's first wait: sent, unacked
    try:
        result = await m._timed_hv("detach", m.hv.detach_hostdevs(lease.domain_uuid, ours + left,
                                                                  max(0.0, deadline - loop.time())))
    except NotFound:
        return GONE
    except HypervisorError as exc:
        log.warning("detach for lease %s failed: %s", lease.id, exc.message, extra={"lease_id": lease.id})
        return None
    if not result.confirmed:
        return None
    return f"{stopped}: removed from its configuration" if stopped else "confirmed by DEVICE_REMOVED"


async def give_back_all(m: LeaseCore, lease: Lease, actor: str, final: LeaseState, rebind: str | None = None) -> Lease:
    """[REBINDING ->] every function back to its original driver -> `final`; failures quarantine the GPU.

    With `rebind` (the lease is detaching and its detach was confirmed) the REBINDING step is journaled first,
    with that detail. The journal writes and the give-backs run in their order in one worker hop: the same
    durable order as a hop each, without the trips through the event loop between them. A give-back that fails
    sends the rest back through the loop: quarantine, then the final write.
    """
    m._still_live(lease)
    rebinding = lease.transition(S.REBINDING) if rebind is not None else lease
    devs = [(d, m.gpus[d.gpu_id]) for d in lease.devices if d.gpu_id in m.gpus]
    done_detail = "every function back on its host driver"
    timings: list[float] = []
    results: list[tuple[LeaseDevice, HostOpResult]] = []

    def work() -> tuple[Lease | None, Exception | None]:  # worker thread
        if rebind is not None:
            m.journal.record(rebinding, from_state=lease.state, actor=actor, detail=rebind)
            crash_point("after-rebinding")
        try:  # from here on REBINDING is in the journal: the loop publishes it whatever happens
            for dev, gpu in devs:
                results.append((dev, clocked(timings, m.host.give_back, gpu,
                                             dict(zip(dev.functions, dev.original_drivers)),
                                             step_hook("give-back"))))
            if not all(res.ok for _, res in results):
                return None, None
            done = rebinding.transition(final, ended_at=m.clock())
            m.journal.record(done, from_state=S.REBINDING, actor=actor, detail=done_detail)
            return done, None
        except Exception as exc:  # noqa: BLE001  (raised in the loop, after REBINDING is published)
            return None, exc

    async with m._holding_groups(d.iommu_group for d, _ in devs):
        done, failed = await m._run(work)
    for seconds in timings:
        m._timing("give_back", seconds)
    if rebind is not None:
        m._publish(rebinding, rebind)
    if failed is not None:
        raise failed
    if done is not None:
        m._publish(done, done_detail)
        crash_point(f"after-{final.value.lower()}")
    else:
        notes = []
        for dev, res in results:
            if not res.ok:
                notes.append(f"{dev.gpu_id} did not return to its host driver: {res.error}")
                await quarantine_gpu(m, dev.gpu_id, f"did not return to its host driver: {res.error}", actor)
        done = await m._move(rebinding, final, actor, "; ".join(notes) or done_detail, ended_at=m.clock())
    m._wake_queue.set()
    return done


async def retry_pending(m: LeaseCore, actor: str = "agent") -> None:
    """Retry detaches that the guest never acknowledged, each lease's at most `libvirt.detach_retries` times (the
    last one alerts the operator; see `detach_alert`)."""
    for lease in [x for x in m.leases.values() if x.state is S.DETACH_PENDING and detach_retries_left(m.policy, x)]:
        async with m.lease_lock(lease.id):
            current = m.leases.get(lease.id)
            if current is not None and current.state is S.DETACH_PENDING and detach_retries_left(m.policy, current):
                await finish_release(m, current, actor, S.RELEASED)


async def expire_due(m: LeaseCore) -> None:
    """End leases past their TTL, and queued requests past not_after or the queue's longest wait."""
    now = m.clock()
    for lease in list(m.leases.values()):
        if lease.state is S.ACTIVE and lease.expires_at is not None and lease.expires_at <= now:
            await safe(m.release(lease.id, actor="expiry", reason="ttl expired", final=S.EXPIRED))
        elif lease.state is S.QUEUED and (deadline := queue_deadline(m.policy, lease)) is not None \
                and deadline <= now:
            why = ("not granted before not_after" if lease.request.not_after is not None
                   and lease.request.not_after <= deadline else
                   f"not granted within leases.queue_max_wait_s ({m.policy.queue_max_wait_s:g} s)")
            await safe(m.release(lease.id, actor="expiry", reason=why, final=S.EXPIRED))


async def on_domain_event(m: LeaseCore, kind: str, domain_uuid: str, detail: str | None = None, *,
                          actor: str = "libvirt", reason: str | None = None) -> None:
    """React to a domain stopping, crashing or being undefined, and to late DEVICE_REMOVED events.

    `actor` and `reason` say how the stop was learnt: libvirt's event by default; the runtime's re-read after a
    reconnect passes its own, so the journal and the lease's end_reason tell a stop missed while disconnected
    from one libvirt reported as it happened.
    """
    if kind == "device_removal_failed":
        await detach_rejected(m, domain_uuid, detail)
        return
    if kind == "device_removed":
        for lease in [x for x in m.leases.values() if x.domain_uuid == domain_uuid
                      and x.state is S.DETACH_PENDING]:
            async with m.lease_lock(lease.id):
                current = m.leases.get(lease.id)
                if current is not None and current.state is S.DETACH_PENDING:
                    await safe(finish_release(m, current, "libvirt", S.RELEASED))
        # A device that leaves an ACTIVE lease's running domain without a detach asked for (the guest ejected it
        # itself, or QEMU let go of it): the lease cannot serve any more and nothing holds the device, so the lease
        # ends and its GPU goes back to the host (the rest of its functions detached first), rather than staying
        # ACTIVE without its device and the GPU stranded on vfio-pci.
        for lease in [x for x in m.leases.values() if x.domain_uuid == domain_uuid and x.state is S.ACTIVE
                      and detail is not None and detail in _aliases(x) and detail not in _moving_away(x)]:
            reason = f"the guest let go of {detail} without a detach asked for (DEVICE_REMOVED)"
            log.warning("lease %s: %s; ending the lease", lease.id, reason, extra={"lease_id": lease.id})
            await safe(m.release(lease.id, actor="libvirt", reason=reason))
        return
    if kind not in ("stopped", "crashed", "undefined"):
        return
    if kind == "stopped" and m.policy.keep_on_domain_stop:
        return
    for lease in [x for x in m.leases.values() if x.domain_uuid == domain_uuid]:
        await safe(m.release(lease.id, actor=actor, reason=reason or f"domain {kind}"))


def _moving_away(lease: Lease) -> set[str]:
    """The aliases of the device a make-before-break move takes away (services.moves): its DEVICE_REMOVED is the
    move's own, or the guest letting go of it early, never a reason to end the lease."""
    mv = dict(lease.move)
    if mv.get("phase") not in ("waiting", "breaking"):
        return set()
    return _aliases(dataclasses.replace(lease, devices=tuple(d for d in lease.devices if d.gpu_id == mv.get("from"))))


def _aliases(lease: Lease) -> set[str]:
    """The libvirt aliases the agent gives the lease's hostdevs (one per function)."""
    return {alias_for(PciAddress.parse(a)) for d in lease.devices for a in d.functions}


async def detach_rejected(m: LeaseCore, domain_uuid: str, alias: str | None) -> None:
    """The guest rejected the unplug of `alias` (QEMU's DEVICE_UNPLUG_GUEST_ERROR, libvirt's DEVICE_REMOVAL_FAILED):
    journal it on the lease detaching that device, so the lease's history says why it stays DETACH_PENDING. The
    device stays in the guest, on vfio-pci, held by the lease; the next retry asks again."""
    for lease in m.leases.values():
        if lease.domain_uuid != domain_uuid or lease.state not in (S.DETACHING, S.DETACH_PENDING):
            continue
        if alias is not None and alias not in _aliases(lease):
            continue
        detail = (f"the guest of {lease.domain_name} rejected the unplug of {alias or 'a device'} "
                  "(DEVICE_REMOVAL_FAILED); the GPU stays on vfio-pci, held by the lease, and the next detach retry "
                  "asks again")
        log.warning("lease %s: %s", lease.id, detail, extra={"lease_id": lease.id})
        await m._run(m.journal.event, DETACH_REJECTED, actor="libvirt", lease_id=lease.id,
                     gpu_id=",".join(lease.gpu_ids), detail=detail)


async def safe(aw: Awaitable[Any]) -> Any:
    """Await a background lease step; a HostAgentError is logged, not raised (None then)."""
    try:
        return await aw
    except HostAgentError as exc:
        log.warning("background lease step failed: %s", exc.message)
        return None
