"""The grant path: from a request to an ACTIVE lease. Which GPUs could serve a request (`feasible`, `is_free`); the
decision, under the decide lock, into a grant, the queue or a refusal, idempotent by key even for concurrent
duplicates, capped by the tenant's quotas and priority policy (:mod:`hostagent.services.admission`), a request
starting ahead of queued ones only where it cannot delay the head (`backfill_room`, `head_shadow`);
placement and the BINDING claim with the original drivers (`claim`); every device onto vfio-pci with the ATTACHING
write, the attach and its verification (`bind_and_attach`, `bind_all`); and the rollback of a failed grant to
FAILED, every device given back or else quarantined (`rollback`). The queue grants through the same `claim` and
`bind_and_attach`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from hostagent.domain.admission import Shadow, backfill_share, shadow
from hostagent.domain.capabilities import Capabilities, capabilities
from hostagent.domain.errors import Conflict, HostAgentError, HostError, InvalidInput
from hostagent.domain.hostdev import HostdevPci, free_guest_slots, guest_slots_needed
from hostagent.domain.inventory import Gpu
from hostagent.domain.numa import VmNuma, vm_numa
from hostagent.domain.lease import (
    Arbitration,
    Lease,
    LeaseDevice,
    LeaseRequest,
    LeaseState,
    Step,
    Verdict,
    Waiting,
    arbitrate,
    estimate_eta,
    new_lease,
)
from hostagent.domain.terms import check_requires, resolve_memory, resolve_throughput
from hostagent.services import bookings
from hostagent.services.admission import (any_caps, apply_priority_policy, cap_length, check_queue_share,
                                         quota_cap_for)
from hostagent.services.faults import crash_point
from hostagent.services.lease_types import (LOGGER, LeaseCore, clocked, guest_addr, render_hostdevs, step_hook,
                                           with_live_addresses)
from hostagent.services.ports import HostOpResult
from hostagent.services.quarantine import mark_attention, quarantine_gpu

log = logging.getLogger(LOGGER)
BACKFILL_DEPTH = 64  # queued requests looked at per decision (the head, then backfill candidates): bounded work

S = LeaseState


def feasible(m: LeaseCore, request: LeaseRequest, *, in_service: bool = True) -> list[Gpu]:
    """GPUs that could ever serve the request (viable, not quarantined, memory and model fit); `in_service=False`
    counts quarantined GPUs and those awaiting an operator too (the host's inventory, as it stands when whole)."""
    out = []
    for g in m.gpus.values():
        if not g.viable or (in_service and (g.id in m.quarantined or g.id in m.attention)):
            continue
        if request.min_memory_gib and (g.memory_bytes or 0) < request.min_memory_gib * 1024**3:
            continue
        if request.vendor and request.vendor.lower() not in g.vendor.lower() and request.vendor.lower() != f"{g.primary.vendor_id:04x}":
            continue
        if request.model and request.model.lower() not in g.model.lower():
            continue
        if request.requires and gpu_capabilities(m, g).lacks(request.requires):
            continue
        out.append(g)
    return out


def gpu_capabilities(m: LeaseCore, g: Gpu) -> Capabilities:
    """What the GPU can do (domain.capabilities): NVLink as the topology wiring found it (`m.nvlinked`), adjusted by
    what its latest probe measured (`m.measured`)."""
    return capabilities(g.primary.vendor_id, g.primary.device_name, nvlink=g.id in m.nvlinked,
                        measured=m.measured.get(g.id))


def in_tenant_terms(m: LeaseCore, request: LeaseRequest) -> tuple[LeaseRequest, str | None]:
    """A request's `requires` checked against this host's GPUs (Conflict naming what they have when none has
    them), its `total_memory_gib` or `target_work_rate` made a GPU count (domain.terms; the latter from the active
    model's predictions, `m.predict_rates`), and its count held against where the records say its task type stops
    gaining (`m.scaling`: said, and cut there under `placement.cap_at_scaling_limit`); with the note that says how."""
    notes: list[str] = []
    scaling = m.scaling(request.task_type)
    if request.requires or request.total_memory_gib is not None or request.target_work_rate is not None:
        # Against the whole inventory (a quarantine comes and goes): the same request resolves the same way each
        # time, so a retry with its idempotency key finds the lease it made.
        admitted = feasible(m, dataclasses.replace(
            request, requires=(),
            min_memory_gib=0.0 if request.total_memory_gib is not None else request.min_memory_gib), in_service=False)
        caps = {g.id: gpu_capabilities(m, g) for g in admitted}
        check_requires(request, admitted, lambda g: caps[g.id])
        able = [g for g in admitted if not caps[g.id].lacks(request.requires)]
        request, note = resolve_memory(request, able)
        notes += [note] if note else []
        if request.target_work_rate is not None:
            predicted = m.predict_rates(request, able)
            if predicted is None:
                raise Conflict(f"no model predicts the work rate of {request.task_type} yet (a work-rate model needs "
                               "5 finished leases of it that reported work): ask for gpus", field="target_work_rate")
            request, note = resolve_throughput(request, predicted[0], predicted[1], scaling)
            notes.append(note)
    limit = scaling.limit if scaling is not None else None
    if scaling is not None and limit is not None and request.gpus > limit:
        if m.policy.cap_at_scaling_limit:
            notes.append(f"{scaling.say()}: cut from {request.gpus} to {limit} GPU(s) (placement.cap_at_scaling_limit)")
            request = dataclasses.replace(request, gpus=limit)
        else:
            notes.append(scaling.say())
    return request, "; ".join(notes) or None


async def read_vm_numa(m: LeaseCore, domain_uuid: str) -> VmNuma | None:
    """Where the VM lives on a host of several NUMA nodes, from its domain XML (live when it runs: pinning changed
    at run time counts), kept for placement (`m.vm_numa`, read by the placer) until its next request. A domain
    that cannot be read is unknown, with the reason; a host of one node (or none listed) has nothing to choose."""
    if len(m.numa_cells) < 2:
        return None
    try:
        found = vm_numa(await m.hv.domain_xml(domain_uuid, live=True), m.numa_cells)
    except HostAgentError as exc:
        found = VmNuma(None, f"its domain XML could not be read: {exc.message}")
    m.vm_numa[domain_uuid] = found
    return found


def is_free(m: LeaseCore, gpu_id: str) -> bool:
    """Neither claimed by a lease, quarantined, nor waiting for an operator's attention."""
    return gpu_id not in m.claims and gpu_id not in m.quarantined and gpu_id not in m.attention


async def request_lease(m: LeaseCore, domain_uuid: str, request: LeaseRequest, *, actor: str,
                        trusted: bool = False, stated: bool = True) -> Lease:
    """POST /v1/leases: grant (ACTIVE), queue (QUEUED) or refuse (Conflict). `trusted`: an operator asks (the
    priority policy does not cap it).

    Idempotent by key, under concurrency: the key is looked up under the decide lock, and a request whose key is
    being decided right now waits for that decision and answers with the same lease, or the same refusal."""
    dom = await m.hv.get_domain(domain_uuid)
    if request.duration_s is not None and request.duration_s > m.policy.max_duration_s:
        raise InvalidInput(f"duration_s exceeds the maximum of {m.policy.max_duration_s}", field="duration_s")
    await read_vm_numa(m, dom.uuid)
    request, terms = in_tenant_terms(m, request)
    request, capped = apply_priority_policy(m, dom.uuid, dom.name, request, trusted=trusted, stated=stated)
    notes = tuple(n for n in (terms, capped) if n)
    key = (dom.uuid, request.idempotency_key) if request.idempotency_key else None
    if key is None:
        return await _decide_and_grant(m, dom.uuid, dom.name, request, actor, notes)
    async with m._decide:
        pending = m._idem_inflight.get(key)
        if pending is None:
            earlier = await m._run(m.journal.by_idempotency_key, dom.uuid, request.idempotency_key)
            if earlier is not None:
                return _same_request(m, earlier, request)
            decided: asyncio.Future[Lease] = asyncio.get_running_loop().create_future()
            m._idem_inflight[key] = decided
    if pending is not None:
        try:
            return _same_request(m, await asyncio.shield(pending), request)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if pending.cancelled() and not (task is not None and task.cancelling()):
                # the first request was cancelled before it decided: this one decides instead
                return await request_lease(m, domain_uuid, request, actor=actor, trusted=trusted, stated=stated)
            raise
    try:
        lease = await _decide_and_grant(m, dom.uuid, dom.name, request, actor, notes)
    except Exception as exc:
        decided.set_exception(exc)
        decided.exception()  # retrieved: a key nobody else waits on must not log "never retrieved"
        raise
    except BaseException:
        decided.cancel()
        raise
    else:
        decided.set_result(lease)
    finally:
        m._idem_inflight.pop(key, None)
    return lease


def _same_request(m: LeaseCore, earlier: Lease, request: LeaseRequest) -> Lease:
    """The lease an earlier request with the same key made, if it asked the same; else a Conflict."""
    if earlier.request != request:
        raise Conflict("idempotency_key was used before with a different request", field="idempotency_key")
    return m.leases.get(earlier.id, earlier)


async def _decide_and_grant(m: LeaseCore, domain_uuid: str, domain_name: str, request: LeaseRequest, actor: str,
                            notes: tuple[str, ...]) -> Lease:
    """Arbitrate under the decide lock (quotas, the queue, backfilling), then bind and attach outside it; `notes`:
    what became of the request before (its terms as a GPU count, a priority the policy capped)."""
    now = m.clock()
    async with m._decide:
        cap = quota_cap_for(m, domain_uuid, domain_name, request)
        # The new lease is journaled with its first real step (QUEUED, BINDING or FAILED): one fsync, and a
        # crash before it leaves nothing to repair because nothing was done yet.
        lease = new_lease(f"l-{uuid.uuid4().hex[:12]}", domain_uuid, domain_name, request, now)
        born = (Step(None, S.REQUESTED, "requested"),)
        candidates = feasible(m, request)
        if request.start_at is not None:  # a booking: into the calendar, bound at its start (services.bookings)
            return await bookings.book(m, domain_uuid, domain_name, request, candidates, actor, notes)
        free = [g for g in candidates if is_free(m, g.id)]
        # never a GPU it would still hold when a booking of it starts (a lease that ends in time backfills the gap)
        free = bookings.clear_for_run(m, free, request, now)
        queued = [x for x in m.leases.values() if x.state is S.QUEUED]
        waiting = [Waiting(x.id, x.request.priority, x.queued_at or x.created_at, x.request.gpus) for x in queued]
        # A queued request its own tenant's quota holds back (GPU-hours spent) waits without holding anyone up:
        # only those that could start now are ahead of this one.
        allows = quota_view(m)
        ahead = [w for w, x in zip(waiting, queued) if allows(x)]
        asked = request if cap == request.gpus else dataclasses.replace(request, gpus=cap)
        verdict = arbitrate(asked, len(free), len(candidates), ahead)
        why = verdict.reason if cap == request.gpus else f"{verdict.reason} (the quota leaves {cap})"
        if ahead and verdict.verdict in (Verdict.DEFER, Verdict.REFUSE):
            room = backfill_room(m, asked, free, now, head_shadow(m, now, allows=allows))
            if room is not None:
                free, why = room
                count = min(cap, len(free))
                verdict = Arbitration(Verdict.GRANT if count == request.gpus else Verdict.PARTIAL, count, why)
        if verdict.verdict is Verdict.REFUSE:
            wait = refusal_wait(m, asked, candidates, ahead, now) if len(candidates) >= asked.gpus else None
            raise Conflict(verdict.reason + ("" if wait is None else f"; expected to be available in about "
                                             f"{wait:.0f} s"), field="gpus", available_in_s=wait)
        if verdict.verdict is Verdict.DEFER:
            return await _enqueue(m, lease, born, actor, why, waiting, (*notes, why))
        try:
            lease = await claim(m, lease, free, verdict.count, actor, why, born, notes=notes)
        except Conflict as exc:  # placement found no acceptable set (e.g. numa_policy=required)
            if request.accept_deferred and len(waiting) < m.policy.queue_max:
                return await _enqueue(m, lease, born, actor, f"placement: {exc.message}", waiting,
                                      (*notes, exc.message))
            await m._move(lease, S.FAILED, actor, "placement refused", error=exc.message, earlier=born,
                          ended_at=m.clock(), end_reason="refused")
            raise
    return await bind_and_attach(m, lease, actor)


async def _enqueue(m: LeaseCore, lease: Lease, born: Sequence[Step], actor: str, why: str,
                   waiting: Sequence[Waiting], reasons: Sequence[str]) -> Lease:
    """QUEUED, within the queue's bounds: the whole queue's, and this VM's share of it."""
    if len(waiting) >= m.policy.queue_max:
        raise Conflict("the lease queue is full; retry later", field="accept_deferred")
    check_queue_share(m, lease.domain_uuid, lease.domain_name)
    lease = await m._move(lease, S.QUEUED, actor, why, earlier=born, queued_at=m.clock(), reasons=tuple(reasons))
    m._wake_queue.set()
    return lease


def refusal_wait(m: LeaseCore, request: LeaseRequest, candidates: Sequence[Gpu], ahead: Sequence[Waiting],
                 now: float) -> float | None:
    """Seconds until a refused request's GPUs are expected free: the GPUs it could use, busy until their leases'
    ends (or reclaim deadlines), taken first by the requests ahead of it of equal or higher priority, as the
    queue's ETAs reckon (`estimate_eta`); None when not enough of them have a known end (quarantined ones never
    do)."""
    usable = [g for g in candidates if g.id not in m.quarantined and g.id not in m.attention]
    free = sum(1 for g in usable if is_free(m, g.id))
    ends = [busy_until(m, g.id, now) for g in usable if not is_free(m, g.id)]
    first = [w.gpus for w in ahead if w.priority >= request.priority]
    at = estimate_eta(now, free, ends, first, request.gpus)
    return None if at is None else round(max(0.0, at - now), 1)


def backfill_room(m: LeaseCore, request: LeaseRequest, free: Sequence[Gpu], now: float,
                  hs: tuple[Lease, frozenset[str], Shadow] | None) -> tuple[list[Gpu], str] | None:
    """The free GPUs a request may start on now although requests are queued, without delaying the head of the
    queue (EASY backfilling), and the reason; None when it must wait. It may use every free GPU the head could
    never use; of those the head could use, all when it ends before the head's predicted start, else only those
    the head will not need then. `hs`: the head and its shadow (:func:`head_shadow`)."""
    if hs is None:
        return None
    head, head_ids, sh = hs
    outside = [g for g in free if g.id not in head_ids]
    inside = [g for g in free if g.id in head_ids]
    room, ends_first = backfill_share(sh, now, request.duration_s or m.policy.default_duration_s, inside, outside)
    how = (f"ends before the head of the queue ({head.id}) can start" if ends_first
           else f"on GPUs the head of the queue ({head.id}) will not need")
    if not room or (len(room) < request.gpus and not request.accept_partial):
        return None
    return room, f"backfilled: {how}"


def queued_in_order(m: LeaseCore) -> list[Lease]:
    """Queued leases in serve order: higher priority first, then older; among equal times, the one requested
    first (`m.leases` keeps request order, and the sort is stable)."""
    return sorted((x for x in m.leases.values() if x.state is S.QUEUED),
                  key=lambda x: (-x.request.priority, x.queued_at or x.created_at))


def quota_allows(m: LeaseCore, lease: Lease) -> int:
    """How many GPUs a queued lease's quotas let it take now (0: its tenant is at a quota; it waits without
    holding anyone up)."""
    try:
        return quota_cap_for(m, lease.domain_uuid, lease.domain_name, lease.request, exclude=lease.id)
    except Conflict:
        return 0


def quota_view(m: LeaseCore) -> Callable[[Lease], int]:
    """`quota_allows` for the queued leases of one decision, each answer worked out once per tenant and request
    shape: a queued lease's answer depends only on its tenant's use less its own share (which its size and
    accept_partial fix) and on that size, so equal leases of one VM share it. A queue of one VM's hundreds of
    requests then costs a few quota reckonings, not one walk of every lease each."""
    if not any_caps(m):  # no quota limits anything: each asks its own size (quota_cap_for's answer, without a walk)
        return lambda lease: lease.request.gpus
    memo: dict[tuple[str, str, int, bool], int] = {}

    def allows(lease: Lease) -> int:
        key = (lease.domain_uuid, lease.domain_name, lease.request.gpus, lease.request.accept_partial)
        if key not in memo:
            memo[key] = quota_allows(m, lease)
        return memo[key]

    return allows


def head_shadow(m: LeaseCore, now: float, order: Sequence[Lease] | None = None,
                allows: Callable[[Lease], int] | None = None) -> tuple[Lease, frozenset[str], Shadow] | None:
    """The head of the queue (the first queued lease its quotas let start, however many quota-blocked ones are
    before it), the GPUs it could use, and its shadow (predicted start, spare GPUs then); None when no queued
    lease could start."""
    allows = allows or quota_view(m)
    head = next((x for x in (queued_in_order(m) if order is None else order) if allows(x)), None)
    if head is None:
        return None
    usable = feasible(m, head.request)
    ids = frozenset(g.id for g in usable)
    free = sum(1 for g in usable if is_free(m, g.id))
    ends = [busy_until(m, g.id, now) for g in usable if not is_free(m, g.id)]
    return head, ids, shadow(now, free, ends, head.request.gpus)


def busy_until(m: LeaseCore, gpu_id: str, now: float) -> float:
    """When a claimed GPU is expected to be free: its lease's end, or its reclaim notice's deadline when sooner; for
    a lease still being granted (its devices not yet journaled) its asked duration from now; for a claim that is no
    lease's (a probe, a quarantine), the default duration. Every claimed GPU is dated, so one caught mid-grant never
    leaves the head of the queue without a shadow. The queue's ETAs and its backfilling both use it."""
    lease = m.leases.get(m.claims.get(gpu_id, ""))
    if lease is None:
        return now + m.policy.default_duration_s
    end = lease.expected_end or now + (lease.request.duration_s or m.policy.default_duration_s)
    if lease.notice == "reclaim" and lease.notice_deadline is not None:  # reclaimed (idle or preempted) by then
        end = min(end, lease.notice_deadline)
    return end


def granted_forecast(m: LeaseCore, request: LeaseRequest, chosen: Sequence[Gpu]) -> str | None:
    """For a `target_work_rate` request: the model's prediction for the GPUs granted, against the target."""
    target = request.target_work_rate
    if target is None:
        return None
    predicted = m.predict_rates(request, chosen)
    if predicted is None:
        return "no model predicts this task type's work rate any more (retrained or rolled back since the request)"
    total = sum(predicted[0])
    if total >= target:
        return f"model {predicted[1]} predicts {total:.4g}/s on the GPUs granted: meets the target of {target:g}/s"
    return (f"model {predicted[1]} predicts {total:.4g}/s on the GPUs granted: short of the target of {target:g}/s "
            "(the faster GPUs are taken)")


async def claim(m: LeaseCore, lease: Lease, free: Sequence[Gpu], count: int, actor: str, why: str,
                earlier: Sequence[Step] = (), *, notes: Sequence[str] = (), until: float | None = None) -> Lease:
    """Place, claim devices in memory and journal BINDING with the original drivers (under the decide lock);
    `until`: its expiry (a booking's end), else its length from now."""
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
        length = (until - m.clock()) if until is not None else (lease.request.duration_s or m.policy.default_duration_s)
        duration, cut = cap_length(m, lease, len(chosen), length)
        vm = m.vm_numa.get(lease.domain_uuid)
        forecast = granted_forecast(m, lease.request, chosen)
        reasons = (*notes, why, *((vm.reason,) if vm else ()), *placement.reasons, *((cut,) if cut else ()),
                   *((forecast,) if forecast else ()))
        record = {"rule": placement.rule, "candidates": [dict(c) for c in placement.candidates],
                  "dropped": [dict(d) for d in placement.dropped], "distance": placement.distance,
                  "model_version": placement.model_version}
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
        began = time.monotonic()
        try:
            # the guest slots first (binding does not change the domain), so that the binds and the ATTACHING
            # write share one worker hop
            layout = m.policy.guest_layout
            per_dev = [guest_slots_needed(layout, len(d.functions)) for d in lease.devices]
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
                changes["devices"] = with_live_addresses(lease.devices,
                                                         await m.hv.attached_hostdevs(lease.domain_uuid))
            m.grant_seconds.append(time.monotonic() - began)  # what a booking's lead time is measured on
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
    warned: list[tuple[str, str]] = []  # (gpu, what the host preflight let pass but the operator should know)

    def work() -> tuple[tuple[Gpu, HostOpResult] | None, Exception | None]:  # worker thread: (failed bind, error)
        try:
            for dev, gpu in devs:
                res = clocked(timings, m.host.bind, gpu, step_hook("bind"))
                if not res.ok:
                    return (gpu, res), None
                warned.extend((gpu.id, w) for w in res.warnings)
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
    for gpu_id, warning in warned:
        log.warning("lease %s: %s", lease.id, warning, extra={"lease_id": lease.id})
        await m._run(m.journal.event, "host-warning", actor=actor, lease_id=lease.id, gpu_id=gpu_id, detail=warning)
    if exc is not None:
        raise exc
    if failed is not None:
        gpu, res = failed
        if res.needs_attention:
            await quarantine_gpu(m, gpu.id, f"bind failed and could not be undone: {res.error}", actor)
        if res.refused:  # the host uses it: out of placement until an operator has fixed that and cleared it
            await mark_attention(m, gpu.id, res.error or "refused by the host preflight", actor, lease_id=lease.id)
            raise HostError(f"{res.error}", gpu=gpu.id)
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
            notes.append(f"kept {dev.gpu_id} on vfio-pci: the undo detach was not confirmed")
            await mark_attention(m, dev.gpu_id, f"attach to {lease.domain_name} failed and its undo was not confirmed",
                                 actor, lease_id=lease.id)
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
