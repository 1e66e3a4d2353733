"""The lease driver: arbitration, placement, journal -> act -> verify, release, queue, expiry, domain events.

Every transition is journaled (fsync'd) before the step it announces; a failure rolls back to the last safe
state; `Reconciler` (reconcile.py) repairs whatever a crash left half done.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hostagent.domain.errors import (
    Conflict,
    Forbidden,
    HostAgentError,
    HostError,
    HypervisorError,
    InvalidInput,
    InvalidTransition,
    NotFound,
)
from hostagent.domain.hostdev import HostdevPci, alias_for, free_guest_slots, hostdevs_for_gpu
from hostagent.domain.inventory import Gpu, GpuState
from hostagent.domain.lease import (
    Lease,
    LeaseDevice,
    LeaseRequest,
    LeaseState,
    Quota,
    QuotaUse,
    Step,
    Verdict,
    Waiting,
    arbitrate,
    check_quota,
    estimate_eta,
    new_lease,
    queue_order,
)
from hostagent.domain.pci import PciAddress
from hostagent.services.faults import crash_point
from hostagent.services.ports import HostOpResult, HostPort

log = logging.getLogger("hostagent.leases")

S = LeaseState
Listener = Callable[[Lease, "str | None"], None]


@dataclass(frozen=True, slots=True)
class LeasePolicy:
    """The lease settings the driver needs (built from config)."""

    default_duration_s: int = 8 * 3600
    max_duration_s: int = 7 * 24 * 3600
    queue_max: int = 1000
    keep_on_domain_stop: bool = False
    detach_timeout_s: float = 30.0
    detach_retries: int = 3
    guest_bus: int = 0
    rom_bar_off: bool = False
    driver_vfio: bool = True
    guest_layout: str = "auto"  # auto | multifunction | per-function
    vm_quota: Quota = Quota()
    project_quotas: tuple[tuple[str, Quota, tuple[str, ...]], ...] = ()  # (project, quota, domain uuids/names)
    pinned: frozenset[str] = frozenset()


@dataclass(frozen=True, slots=True)
class Placement:
    """The devices chosen for a grant and why."""

    gpu_ids: tuple[str, ...]
    reasons: tuple[str, ...]
    candidates: tuple[dict[str, Any], ...] = ()
    dropped: tuple[dict[str, Any], ...] = ()
    distance: float | None = None
    rule: str = "cold-start"


PlaceFn = Callable[[LeaseRequest, Sequence[Gpu], int, str], Placement]


def simple_place(request: LeaseRequest, candidates: Sequence[Gpu], count: int, domain_uuid: str) -> Placement:
    """Fallback placement: most memory first, then address order."""
    ordered = sorted(candidates, key=lambda g: (-(g.memory_bytes or 0), g.address))
    chosen = tuple(g.id for g in ordered[:count])
    return Placement(chosen, (f"simple rule: largest memory first, chose {', '.join(chosen)}",), rule="simple")


class TimingLog:
    """The latest step timings, bounded, with positions that stay valid as old entries drop out.

    `total` counts every entry ever appended; a reader keeps the total it has seen and asks for what came since
    (entries that already dropped out are skipped, never handed out twice).
    """

    def __init__(self, maxlen: int = 10_000) -> None:
        self._entries: deque[tuple[str, float]] = deque(maxlen=maxlen)
        self.total = 0

    def append(self, entry: tuple[str, float]) -> None:
        self._entries.append(entry)
        self.total += 1

    def since(self, mark: int, end: int | None = None) -> list[tuple[str, float]]:
        """Entries appended at positions [mark, end) (end: now) that are still kept."""
        end = self.total if end is None else min(end, self.total)
        first = self.total - len(self._entries)  # position of the oldest kept entry
        lo, hi = max(mark, first) - first, max(end, first) - first
        return [self._entries[i] for i in range(lo, hi)]

    def __len__(self) -> int:
        return len(self._entries)


VFIO_DRIVER = "vfio-pci"
ANY_HOST_DRIVER = "*"  # give-back target: whatever host driver the kernel probes for the function
HV_WAITS = frozenset({"attach", "detach"})  # hypervisor calls long enough to let background work run beside them


def _agent_side(fn: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    """Marks a lease operation as the agent's own work (see `LeaseManager.quiet`), minus its sysfs and hypervisor
    waits."""
    @functools.wraps(fn)
    async def run(self: LeaseManager, *args: Any, **kwargs: Any) -> Any:
        task = asyncio.current_task()
        self._working_in[task] = self._working_in.get(task, 0) + 1
        try:
            with self._work(+1):
                return await fn(self, *args, **kwargs)
        finally:
            if self._working_in[task] > 1:
                self._working_in[task] -= 1
            else:
                del self._working_in[task]
    return run


class LeaseManager:
    """Owns live leases and device claims; the only writer of lease state."""

    def __init__(
        self,
        *,
        gpus: Sequence[Gpu],
        host: HostPort,
        hypervisor: Any,
        journal: Any,
        policy: LeasePolicy,
        place: PlaceFn = simple_place,
        clock: Callable[[], float] = time.time,
        run_blocking: Callable[..., Awaitable[Any]] | None = None,
    ) -> None:
        self.gpus: dict[str, Gpu] = {g.id: g for g in gpus}
        self.host = host
        self.hv = hypervisor
        self.journal = journal
        self.policy = policy
        self.place = place
        self.clock = clock
        self._run = run_blocking or asyncio.to_thread
        self.leases: dict[str, Lease] = {}
        self.claims: dict[str, str] = {}  # gpu_id -> lease_id
        self.attention: dict[str, str] = {}  # gpu_id -> why an operator must look (found attached without lease)
        self._decide = asyncio.Lock()
        self._group_locks: dict[int, asyncio.Lock] = {}
        self._lease_locks: dict[str, asyncio.Lock] = {}
        self.listeners: list[Listener] = []
        self._wake_queue = asyncio.Event()
        self.quarantined: dict[str, str] = {}
        self.step_timings = TimingLog()  # (kind, seconds) of host/hypervisor calls: metrics, overhead figures
        # Set while no lease operation is doing the agent's own work (placement, journal, HTTP around it); waits
        # on sysfs and the hypervisor do not count. Background jobs that share the interpreter (the store mirror)
        # wait for it, so they run beside those waits and between requests, not beside a lease step.
        self.quiet = asyncio.Event()
        self.quiet.set()
        self._working = 0
        # per task, how many lease operations it is inside (drain_queue grants through the same steps): a wait
        # takes back exactly that task's own work, and a wait outside any (reconcile, reclaim) takes back none
        self._working_in: dict[asyncio.Task[Any] | None, int] = {}

    @contextlib.contextmanager
    def _work(self, delta: int) -> Iterator[None]:
        """+1: the agent's own work on a lease starts here; -1: it waits on sysfs or the hypervisor here."""
        self._count_work(delta)
        try:
            yield
        finally:
            self._count_work(-delta)

    def _count_work(self, delta: int) -> None:
        self._working += delta
        if self._working > 0:
            self.quiet.clear()
        else:
            self.quiet.set()

    # -- persistence ---------------------------------------------------------------------------------------------
    async def _write(self, lease: Lease, prev: LeaseState | None, actor: str, detail: str | None = None,
                     error: str | None = None, earlier: Sequence[Step] = (),
                     amend: Callable[[Lease], Lease] | None = None) -> Lease:
        """Journal (durably, `earlier` steps in the same transaction) then publish in memory and to listeners.

        `amend`: a blocking read that completes the lease (e.g. the drivers bound now), run in the write's worker
        hop just before it: one hop, not two; if it raises, nothing is written."""
        born = prev is None or (bool(earlier) and earlier[0].from_state is None)
        if not born:
            self._still_live(lease)

        def record() -> Lease:  # worker thread
            new = lease if amend is None else amend(lease)
            self.journal.record(new, from_state=prev, actor=actor, detail=detail, error=error, earlier=tuple(earlier))
            return new

        lease = await self._run(record)
        self._publish(lease, detail)
        return lease

    def _still_live(self, lease: Lease) -> None:
        """Refuse a step for a lease that ended (or was never loaded) while the step was in flight: an ended lease
        never comes back."""
        if lease.id not in self.leases:
            raise InvalidTransition(f"lease {lease.id} has already ended", field="id")

    def _publish(self, lease: Lease, detail: str | None) -> None:
        """A journaled step, in memory (an ended lease leaves, with its claims) and to the listeners."""
        if lease.state.terminal:
            self.leases.pop(lease.id, None)
            self._lease_locks.pop(lease.id, None)
            for gid in lease.gpu_ids:
                if self.claims.get(gid) == lease.id:
                    del self.claims[gid]
        else:
            self.leases[lease.id] = lease
        for listener in self.listeners:
            try:
                listener(lease, detail)
            except Exception:  # a listener (metrics, store mirror) must never break leasing
                log.exception("lease listener failed")

    async def _move(self, lease: Lease, target: LeaseState, actor: str, detail: str | None = None,
                    error: str | None = None, earlier: Sequence[Step] = (),
                    amend: Callable[[Lease], Lease] | None = None, **changes: Any) -> Lease:
        """Transition + journal + crash point named after the new state (an error is kept on the lease too).

        `earlier`: steps already taken in memory but not yet journaled, written in the same transaction.
        `amend`: see `_write`.
        """
        if error is not None:
            changes.setdefault("error", error)
        new = lease.transition(target, **changes)
        new = await self._write(new, lease.state, actor, detail, error, earlier, amend)
        crash_point(f"after-{target.value.lower()}")
        return new

    async def load(self) -> None:
        """Restore live leases and quarantines from the journal (reconcile then repairs reality)."""
        live = await self._run(self.journal.live_leases)
        self.leases = {x.id: x for x in live}
        self.claims = {gid: x.id for x in live if x.state.holds_devices for gid in x.gpu_ids}
        self.quarantined = await self._run(self.journal.quarantined)

    # -- views ---------------------------------------------------------------------------------------------------
    def gpu_state(self, gpu_id: str) -> GpuState:
        """Operator-facing state of one GPU."""
        gpu = self.gpus[gpu_id]
        if gpu_id in self.quarantined:
            return GpuState.QUARANTINED
        lid = self.claims.get(gpu_id)
        if lid is not None:
            lease = self.leases.get(lid)
            if lease is not None and lease.state is S.DETACH_PENDING:
                return GpuState.DETACH_PENDING
            if lease is not None and lease.notice:
                return GpuState.WARNED
            return GpuState.LEASED
        if not gpu.viable or gpu_id in self.attention:
            return GpuState.UNAVAILABLE
        return GpuState.FREE

    def lease_of(self, gpu_id: str) -> Lease | None:
        """The live lease holding a GPU."""
        lid = self.claims.get(gpu_id)
        return self.leases.get(lid) if lid else None

    def get(self, lease_id: str, *, domain_uuid: str | None = None) -> Lease:
        """A lease by id (live or ended); a guest sees only its own (others look absent)."""
        lease = self.leases.get(lease_id) or self.journal.get(lease_id)
        if lease is None or (domain_uuid is not None and lease.domain_uuid != domain_uuid):
            raise NotFound(f"no lease {lease_id!r}", field="id")
        return lease

    def queue(self) -> list[Lease]:
        """Queued leases in serve order."""
        waiting = {x.id: x for x in self.leases.values() if x.state is S.QUEUED}
        order = queue_order(Waiting(x.id, x.request.priority, x.queued_at or x.created_at, x.request.gpus)
                            for x in waiting.values())
        return [waiting[w.lease_id] for w in order]

    def queue_position(self, lease: Lease) -> int | None:
        """1-based position in the queue."""
        for i, x in enumerate(self.queue(), start=1):
            if x.id == lease.id:
                return i
        return None

    def eta(self, lease: Lease) -> float | None:
        """Expected grant time of a queued lease."""
        q = self.queue()
        ahead: list[int] = []
        for x in q:
            if x.id == lease.id:
                break
            ahead.append(x.request.gpus)
        feasible = self._feasible(lease.request)
        free = sum(1 for g in feasible if self._is_free(g.id))
        ends = [x.expected_end or self.clock() + self.policy.default_duration_s
                for x in self.leases.values() if x.state.holds_devices
                for gid in x.gpu_ids if gid in {g.id for g in feasible}]
        return estimate_eta(self.clock(), free, ends, ahead, lease.request.gpus)

    # -- requests ------------------------------------------------------------------------------------------------
    def _feasible(self, request: LeaseRequest) -> list[Gpu]:
        """GPUs that could ever serve the request (viable, not quarantined, memory and model fit)."""
        out = []
        for g in self.gpus.values():
            if not g.viable or g.id in self.quarantined or g.id in self.attention:
                continue
            if request.min_memory_gib and (g.memory_bytes or 0) < request.min_memory_gib * 1024**3:
                continue
            if request.vendor and request.vendor.lower() not in g.vendor.lower() and request.vendor.lower() != f"{g.primary.vendor_id:04x}":
                continue
            if request.model and request.model.lower() not in g.model.lower():
                continue
            out.append(g)
        return out

    def _is_free(self, gpu_id: str) -> bool:
        return gpu_id not in self.claims and gpu_id not in self.quarantined and gpu_id not in self.attention

    def _quota_check(self, domain_uuid: str, domain_name: str, request: LeaseRequest) -> None:
        now = self.clock()
        mine = [x for x in self.leases.values() if x.domain_uuid == domain_uuid and x.state.holds_devices]
        held = sum(len(x.devices) for x in mine)
        hours = sum(len(x.devices) * max(0.0, now - max(x.granted_at or now, now - 86400)) / 3600 for x in mine)
        check_quota(f"VM {domain_name}", self.policy.vm_quota, QuotaUse(held, hours), request)
        for project, quota, members in self.policy.project_quotas:
            if domain_uuid in members or domain_name in members:
                uuids = {x.domain_uuid for x in self.leases.values() if x.domain_uuid in members or x.domain_name in members}
                pl = [x for x in self.leases.values() if x.domain_uuid in uuids and x.state.holds_devices]
                check_quota(f"project {project}", quota, QuotaUse(sum(len(x.devices) for x in pl)), request)

    @_agent_side
    async def request(self, domain_uuid: str, request: LeaseRequest, *, actor: str) -> Lease:
        """Handle POST /v1/leases: grant (ACTIVE), queue (QUEUED) or refuse (Conflict). Idempotent by key."""
        if request.idempotency_key:
            earlier = await self._run(self.journal.by_idempotency_key, domain_uuid, request.idempotency_key)
            if earlier is not None:
                if earlier.request != request:
                    raise Conflict("idempotency_key was used before with a different request", field="idempotency_key")
                return self.leases.get(earlier.id, earlier)
        dom = await self.hv.get_domain(domain_uuid)
        if request.duration_s is not None and request.duration_s > self.policy.max_duration_s:
            raise InvalidInput(f"duration_s exceeds the maximum of {self.policy.max_duration_s}", field="duration_s")
        now = self.clock()
        async with self._decide:
            self._quota_check(dom.uuid, dom.name, request)
            # The new lease is journaled with its first real step (QUEUED, BINDING or FAILED): one fsync, and a
            # crash before it leaves nothing to repair because nothing was done yet.
            lease = new_lease(f"l-{uuid.uuid4().hex[:12]}", dom.uuid, dom.name, request, now)
            born = (Step(None, S.REQUESTED, "requested"),)
            feasible = self._feasible(request)
            free = [g for g in feasible if self._is_free(g.id)]
            waiting = [Waiting(x.id, x.request.priority, x.queued_at or x.created_at, x.request.gpus)
                       for x in self.leases.values() if x.state is S.QUEUED]
            verdict = arbitrate(request, len(free), len(feasible), waiting)
            if verdict.verdict is Verdict.REFUSE:
                raise Conflict(verdict.reason, field="gpus")
            if verdict.verdict is Verdict.DEFER:
                if len(waiting) >= self.policy.queue_max:
                    raise Conflict("the lease queue is full; retry later", field="accept_deferred")
                lease = await self._move(lease, S.QUEUED, actor, verdict.reason, earlier=born, queued_at=now,
                                         reasons=(verdict.reason,))
                self._wake_queue.set()
                return lease
            try:
                lease = await self._claim(lease, free, verdict.count, actor, verdict.reason, born)
            except Conflict as exc:  # placement found no acceptable set (e.g. numa_policy=required)
                if request.accept_deferred and len(waiting) < self.policy.queue_max:
                    lease = await self._move(lease, S.QUEUED, actor, f"placement: {exc.message}", earlier=born,
                                             queued_at=now, reasons=(exc.message,))
                    self._wake_queue.set()
                    return lease
                await self._move(lease, S.FAILED, actor, "placement refused", error=exc.message, earlier=born,
                                 ended_at=self.clock(), end_reason="refused")
                raise
        return await self._bind_and_attach(lease, actor)

    async def _claim(self, lease: Lease, free: Sequence[Gpu], count: int, actor: str, why: str,
                     earlier: Sequence[Step] = ()) -> Lease:
        """Place, claim devices in memory and journal BINDING with the original drivers (under the decide lock)."""
        placement = self.place(lease.request, free, count, lease.domain_uuid)
        chosen = [self.gpus[i] for i in placement.gpu_ids]
        for g in chosen:
            self.claims[g.id] = lease.id

        def with_drivers(new: Lease) -> Lease:  # worker thread, in the BINDING write's hop
            devices = []
            for g in chosen:
                drivers = self.host.current_drivers(g)
                devices.append(LeaseDevice(
                    gpu_id=g.id, functions=tuple(str(f.address) for f in g.functions),
                    original_drivers=tuple(drivers.get(str(f.address)) for f in g.functions),
                    iommu_group=g.iommu_group if g.iommu_group is not None else -1,
                ))
            return new.with_changes(devices=tuple(devices))

        try:
            duration = lease.request.duration_s or self.policy.default_duration_s
            reasons = (why, *placement.reasons)
            record = {"rule": placement.rule, "candidates": [dict(c) for c in placement.candidates],
                      "dropped": [dict(d) for d in placement.dropped], "distance": placement.distance}
            # the original drivers are read in the BINDING write's own worker hop (one hop for both)
            return await self._move(
                lease, S.BINDING, actor, f"placed on {', '.join(placement.gpu_ids)} ({placement.rule})",
                earlier=earlier, amend=with_drivers, granted_gpus=len(chosen), reasons=reasons,
                distance=placement.distance, expires_at=self.clock() + duration,
                placement=tuple(sorted(record.items())),
            )
        except BaseException:
            for g in chosen:
                if self.claims.get(g.id) == lease.id:
                    del self.claims[g.id]
            raise

    def _group_lock(self, group: int) -> asyncio.Lock:
        return self._group_locks.setdefault(group, asyncio.Lock())

    @contextlib.asynccontextmanager
    async def _holding_groups(self, groups: Iterable[int]) -> AsyncIterator[None]:
        """Several IOMMU groups' locks at once, always taken in the same (sorted) order."""
        async with contextlib.AsyncExitStack() as held:
            for group in sorted(set(groups)):
                await held.enter_async_context(self._group_lock(group))
            yield

    def lease_lock(self, lease_id: str) -> asyncio.Lock:
        """Serialises every operation on one lease."""
        return self._lease_locks.setdefault(lease_id, asyncio.Lock())

    @staticmethod
    def _clocked(timings: list[float], fn: Callable[..., Any], *args: Any) -> Any:
        """fn(*args), its seconds appended to `timings` (a worker thread's host step; the loop records them)."""
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            timings.append(time.perf_counter() - t0)

    def _timing(self, kind: str, seconds: float) -> None:
        self.step_timings.append((kind, seconds))

    async def _bind_and_attach(self, lease: Lease, actor: str) -> Lease:
        """BINDING -> ATTACHING -> ACTIVE, or roll back to FAILED with every device given back."""
        async with self.lease_lock(lease.id):
            bound: list[LeaseDevice] = []
            try:
                # the guest slots first (binding does not change the domain), so that the binds and the ATTACHING
                # write share one worker hop
                layout = self.policy.guest_layout
                per_dev = [0 if layout == "auto" else 1 if layout == "multifunction" else len(d.functions)
                           for d in lease.devices]
                slots: list[int] = []
                if sum(per_dev):
                    xml_live = await self._timed_hv("domain_xml", self.hv.domain_xml(lease.domain_uuid, live=True))
                    slots = list(free_guest_slots(xml_live, self.policy.guest_bus, sum(per_dev)))
                devices = []
                all_hostdevs: list[HostdevPci] = []
                for dev, n in zip(lease.devices, per_dev, strict=True):
                    mine, slots = slots[:n], slots[n:]
                    hds = render_hostdevs(dev.functions, self.policy.guest_bus, mine, self.policy)
                    all_hostdevs.extend(hds)
                    devices.append(LeaseDevice(dev.gpu_id, dev.functions, dev.original_drivers, dev.iommu_group,
                                               tuple(_guest_addr(h) for h in hds)))
                lease = await self._bind_all(lease, lease.transition(S.ATTACHING, devices=tuple(devices)), bound,
                                             actor)
                crash_point("before-attach")
                await self._timed_hv("attach", self.hv.attach_hostdevs(lease.domain_uuid, all_hostdevs))
                crash_point("after-attach-call")
                changes: dict[str, Any] = {"granted_at": self.clock()}
                if layout == "auto":  # record the guest addresses libvirt chose
                    placed = {str(h.source): _guest_addr(h)
                              for h in await self.hv.attached_hostdevs(lease.domain_uuid)}
                    changes["devices"] = tuple(LeaseDevice(d.gpu_id, d.functions, d.original_drivers, d.iommu_group,
                                                           tuple(placed.get(a, "") for a in d.functions))
                                               for d in lease.devices)
                return await self._move(lease, S.ACTIVE, actor, "attached and verified in the domain XML", **changes)
            except HostAgentError as exc:
                return await self._rollback(lease, bound, actor, exc)

    async def _bind_all(self, lease: Lease, attaching: Lease, bound: list[LeaseDevice], actor: str) -> Lease:
        """Every device of `lease` onto vfio-pci, in order, then ATTACHING (`attaching`) journaled: one worker hop,
        the same durable order as a hop each. Devices bound are appended to `bound` (the caller rolls them back on
        a HostAgentError); a failed bind quarantines its GPU when it could not be undone."""
        detail = "all functions on vfio-pci; guest addresses chosen"
        devs = [(dev, self.gpus[dev.gpu_id]) for dev in lease.devices]
        timings: list[float] = []

        def work() -> tuple[tuple[Gpu, HostOpResult] | None, Exception | None]:  # worker thread: (failed bind, error)
            try:
                for dev, gpu in devs:
                    res = self._clocked(timings, self.host.bind, gpu, _step_hook("bind"))
                    if not res.ok:
                        return (gpu, res), None
                    bound.append(dev)
                    crash_point("bind-device-done")
                self.journal.record(attaching, from_state=lease.state, actor=actor, detail=detail)
                return None, None
            except Exception as exc:  # noqa: BLE001  (raised in the loop, once `bound` says what to undo)
                return None, exc

        self._still_live(lease)
        async with self._holding_groups(dev.iommu_group for dev, _ in devs):
            failed, exc = await self._run(work)
        for seconds in timings:
            self._timing("bind", seconds)
        if exc is not None:
            raise exc
        if failed is not None:
            gpu, res = failed
            if res.needs_attention:
                await self._quarantine(gpu.id, f"bind failed and could not be undone: {res.error}", actor)
            raise HostError(f"binding {gpu.id} to vfio-pci failed: {res.error}", gpu=gpu.id)
        self._publish(attaching, detail)
        crash_point("after-attaching")
        return attaching

    async def _timed_hv(self, kind: str, aw: Awaitable[Any]) -> Any:
        t0 = time.perf_counter()
        try:
            with self._work(-self._working_in.get(asyncio.current_task(), 0) if kind in HV_WAITS else 0):
                return await aw
        finally:
            self._timing(kind, time.perf_counter() - t0)

    async def _rollback(self, lease: Lease, bound: Sequence[LeaseDevice], actor: str, exc: HostAgentError) -> Lease:
        """Undo a failed grant in reverse order; FAILED with the error. Devices that will not come back are quarantined."""
        log.warning("lease %s failed: %s; rolling back", lease.id, exc.message, extra={"lease_id": lease.id})
        notes = []
        if exc.details.get("rollback_confirmed") is False:
            # The hypervisor attached part of the set and could not confirm its undo: the guest (QEMU) may still
            # hold the functions, so they stay on vfio-pci, flagged for an operator, never given back blind.
            for dev in bound:
                self.attention[dev.gpu_id] = f"attach to {lease.domain_name} failed and its undo was not confirmed"
                notes.append(f"kept {dev.gpu_id} on vfio-pci: the undo detach was not confirmed")
                await self._run(self.journal.event, "attention", actor=actor, lease_id=lease.id, gpu_id=dev.gpu_id,
                                detail=self.attention[dev.gpu_id])
            bound = []
        for dev in reversed(bound):
            gpu = self.gpus[dev.gpu_id]
            async with self._group_lock(dev.iommu_group):
                res = await self._run(self.host.give_back, gpu, dict(zip(dev.functions, dev.original_drivers)), None)
            if res.ok:
                notes.append(f"undo: gave {dev.gpu_id} back to its host driver")
            else:
                notes.append(f"undo failed for {dev.gpu_id}: {res.error}")
                await self._quarantine(dev.gpu_id, f"rollback could not return it to the host: {res.error}", actor)
        return await self._move(lease, S.FAILED, actor, "; ".join(notes) or "nothing to undo", error=exc.message,
                                ended_at=self.clock(), end_reason="failed")

    # -- release -------------------------------------------------------------------------------------------------
    @_agent_side
    async def release(self, lease_id: str, *, actor: str, reason: str = "released", domain_uuid: str | None = None,
                      final: LeaseState = S.RELEASED) -> Lease:
        """End a lease: cancel it in the queue, or detach, wait for DEVICE_REMOVED, give back."""
        lease = self.get(lease_id, domain_uuid=domain_uuid)
        async with self.lease_lock(lease_id):
            lease = self.leases.get(lease_id) or lease
            if lease.state.terminal:
                return lease
            if lease.state in (S.QUEUED, S.REQUESTED):
                target = S.EXPIRED if final is S.EXPIRED else S.RELEASED
                return await self._move(lease, target, actor, reason, ended_at=self.clock(), end_reason=reason)
            if lease.state in (S.BINDING, S.ATTACHING):
                raise Conflict(f"lease {lease_id} is being set up ({lease.state.value}); retry in a moment",
                               field="id")
            earlier: tuple[Step, ...] = ()
            if lease.state is S.ACTIVE:  # RELEASING and DETACHING go to the journal together (one fsync)
                earlier = (Step(S.ACTIVE, S.RELEASING, reason),)
                lease = lease.transition(S.RELEASING, end_reason=reason)
            if lease.state is S.RELEASING:
                lease = await self._move(lease, S.DETACHING, actor, "detaching from the domain", earlier=earlier)
            return await self._finish_release(lease, actor, final)

    async def _finish_release(self, lease: Lease, actor: str, final: LeaseState) -> Lease:
        """From DETACHING or DETACH_PENDING: detach and wait, then give back; else DETACH_PENDING."""
        if lease.state is S.DETACH_PENDING:
            lease = await self._move(lease, S.DETACHING, actor, f"detach retry {lease.detach_attempts + 1}")
        confirmed = await self._detach(lease)
        if not confirmed:
            return await self._move(
                lease, S.DETACH_PENDING, actor,
                "the guest did not acknowledge the detach (no DEVICE_REMOVED); GPU stays on vfio-pci",
                detach_attempts=lease.detach_attempts + 1,
            )
        crash_point("after-detach-confirmed")
        return await self._give_back_all(lease, actor, final, rebind="detach confirmed by DEVICE_REMOVED")

    async def _detach(self, lease: Lease) -> bool:
        """Detach every hostdev of the lease that is still attached; True once libvirt confirmed removal."""
        try:
            attached = await self.hv.attached_hostdevs(lease.domain_uuid)
        except NotFound:
            return True  # the domain is gone: nothing can use the device
        mine = {a for d in lease.devices for a in d.functions}
        ours = [h for h in attached if str(h.source) in mine]
        if not ours:
            return True
        asyncio.get_running_loop().call_soon(crash_point, "detach:sent")  # runs at the call's first wait: sent, unacked
        try:
            result = await self._timed_hv("detach", self.hv.detach_hostdevs(lease.domain_uuid, ours,
                                                                            self.policy.detach_timeout_s))
        except NotFound:
            return True
        except HypervisorError as exc:
            log.warning("detach for lease %s failed: %s", lease.id, exc.message, extra={"lease_id": lease.id})
            return False
        return bool(result.confirmed)

    async def _give_back_all(self, lease: Lease, actor: str, final: LeaseState, rebind: str | None = None) -> Lease:
        """[REBINDING ->] every function back to its original driver -> `final`; failures quarantine the GPU.

        With `rebind` (the lease is detaching and its detach was confirmed) the REBINDING step is journaled first,
        with that detail. The journal writes and the give-backs run in their order in one worker hop: the same
        durable order as a hop each, without the trips through the event loop between them. A give-back that fails
        sends the rest back through the loop: quarantine, then the final write.
        """
        self._still_live(lease)
        rebinding = lease.transition(S.REBINDING) if rebind is not None else lease
        devs = [(d, self.gpus[d.gpu_id]) for d in lease.devices if d.gpu_id in self.gpus]
        done_detail = "every function back on its host driver"
        timings: list[float] = []
        results: list[tuple[LeaseDevice, HostOpResult]] = []

        def work() -> tuple[Lease | None, Exception | None]:  # worker thread
            if rebind is not None:
                self.journal.record(rebinding, from_state=lease.state, actor=actor, detail=rebind)
                crash_point("after-rebinding")
            try:  # from here on REBINDING is in the journal: the loop publishes it whatever happens
                for dev, gpu in devs:
                    results.append((dev, self._clocked(timings, self.host.give_back, gpu,
                                                       dict(zip(dev.functions, dev.original_drivers)),
                                                       _step_hook("give-back"))))
                if not all(res.ok for _, res in results):
                    return None, None
                done = rebinding.transition(final, ended_at=self.clock())
                self.journal.record(done, from_state=S.REBINDING, actor=actor, detail=done_detail)
                return done, None
            except Exception as exc:  # noqa: BLE001  (raised in the loop, after REBINDING is published)
                return None, exc

        async with self._holding_groups(d.iommu_group for d, _ in devs):
            done, failed = await self._run(work)
        for seconds in timings:
            self._timing("give_back", seconds)
        if rebind is not None:
            self._publish(rebinding, rebind)
        if failed is not None:
            raise failed
        if done is not None:
            self._publish(done, done_detail)
            crash_point(f"after-{final.value.lower()}")
        else:
            notes = []
            for dev, res in results:
                if not res.ok:
                    notes.append(f"{dev.gpu_id} did not return to its host driver: {res.error}")
                    await self._quarantine(dev.gpu_id, f"did not return to its host driver: {res.error}", actor)
            done = await self._move(rebinding, final, actor, "; ".join(notes) or done_detail, ended_at=self.clock())
        self._wake_queue.set()
        return done

    @_agent_side
    async def retry_pending(self, actor: str = "agent") -> None:
        """Retry detaches that the guest never acknowledged."""
        for lease in [x for x in self.leases.values() if x.state is S.DETACH_PENDING]:
            async with self.lease_lock(lease.id):
                current = self.leases.get(lease.id)
                if current is not None and current.state is S.DETACH_PENDING:
                    await self._finish_release(current, actor, S.RELEASED)

    # -- renew, expiry, queue ------------------------------------------------------------------------------------
    async def renew(self, lease_id: str, *, duration_s: int | None, actor: str, domain_uuid: str | None = None) -> Lease:
        """Extend an active lease's TTL (bounded by max_duration_s from now)."""
        lease = self.get(lease_id, domain_uuid=domain_uuid)
        if duration_s is not None and (not isinstance(duration_s, int) or isinstance(duration_s, bool)
                                       or not 1 <= duration_s <= self.policy.max_duration_s):
            raise InvalidInput(f"duration_s must be an integer 1..{self.policy.max_duration_s}", field="duration_s")
        async with self.lease_lock(lease_id):
            lease = self.leases.get(lease_id) or lease
            if lease.state not in (S.ACTIVE, S.QUEUED):
                raise Conflict(f"only ACTIVE or QUEUED leases can be renewed; this one is {lease.state.value}",
                               field="id")
            d = duration_s or lease.request.duration_s or self.policy.default_duration_s
            return await self._write(lease.with_changes(expires_at=self.clock() + d), lease.state, actor,
                                     f"renewed for {d} s")

    async def expire_due(self) -> None:
        """End leases past their TTL and queued requests past not_after."""
        now = self.clock()
        for lease in list(self.leases.values()):
            if lease.state is S.ACTIVE and lease.expires_at is not None and lease.expires_at <= now:
                await self._safe(self.release(lease.id, actor="expiry", reason="ttl expired", final=S.EXPIRED))
            elif lease.state is S.QUEUED and lease.request.not_after is not None and lease.request.not_after <= now:
                await self._safe(self.release(lease.id, actor="expiry", reason="not granted before not_after",
                                              final=S.EXPIRED))

    @_agent_side
    async def drain_queue(self) -> list[Lease]:
        """Grant queued requests, in priority-then-age order, while devices allow."""
        granted = []
        while True:
            async with self._decide:
                head = next(iter(self.queue()), None)
                if head is None:
                    return granted
                free = [g for g in self._feasible(head.request) if self._is_free(g.id)]
                need = head.request.gpus
                if len(free) < need and not (head.request.accept_partial and free):
                    return granted  # the head waits; nothing jumps it
                count = min(need, len(free))
                async with self.lease_lock(head.id):  # a concurrent release of the queued lease wins cleanly
                    current = self.leases.get(head.id)
                    if current is None or current.state is not S.QUEUED:
                        continue
                    try:
                        lease = await self._claim(current, free, count, "queue",
                                                  f"granted from the queue after {self.clock() - (current.queued_at or current.created_at):.0f} s")
                    except Conflict:
                        return granted  # no acceptable set yet (e.g. numa_policy=required): the head keeps waiting
            granted.append(await self._bind_and_attach(lease, "queue"))

    async def _safe(self, aw: Awaitable[Any]) -> Any:
        try:
            return await aw
        except HostAgentError as exc:
            log.warning("background lease step failed: %s", exc.message)
            return None

    async def run_queue(self) -> None:
        """Background task: drain the queue whenever devices may have freed."""
        while True:
            await self._wake_queue.wait()
            self._wake_queue.clear()
            try:
                await self.drain_queue()
            except Exception:
                log.exception("queue drain failed")

    # -- domain events -------------------------------------------------------------------------------------------
    async def on_domain_event(self, kind: str, domain_uuid: str, detail: str | None = None, *, actor: str = "libvirt",
                              reason: str | None = None) -> None:
        """React to a domain stopping, crashing or being undefined, and to late DEVICE_REMOVED events.

        `actor` and `reason` say how the stop was learnt: libvirt's event by default; the runtime's re-read after a
        reconnect passes its own, so the journal and the lease's end_reason tell a stop missed while disconnected
        from one libvirt reported as it happened.
        """
        if kind == "device_removed":
            for lease in [x for x in self.leases.values() if x.domain_uuid == domain_uuid
                          and x.state is S.DETACH_PENDING]:
                async with self.lease_lock(lease.id):
                    current = self.leases.get(lease.id)
                    if current is not None and current.state is S.DETACH_PENDING:
                        await self._safe(self._finish_release(current, "libvirt", S.RELEASED))
            return
        if kind not in ("stopped", "crashed", "undefined"):
            return
        if kind == "stopped" and self.policy.keep_on_domain_stop:
            return
        for lease in [x for x in self.leases.values() if x.domain_uuid == domain_uuid]:
            await self._safe(self.release(lease.id, actor=actor, reason=reason or f"domain {kind}"))

    # -- quarantine ----------------------------------------------------------------------------------------------
    async def _quarantine(self, gpu_id: str, reason: str, actor: str) -> None:
        self.quarantined[gpu_id] = reason
        await self._run(self.journal.quarantine, gpu_id, reason, actor=actor)
        for listener in self.listeners:
            try:
                listener(None, f"quarantine {gpu_id}: {reason}")  # type: ignore[arg-type]
            except Exception:
                log.exception("listener failed")

    async def clear_quarantine(self, gpu_id: str, *, actor: str) -> None:
        """Operator: put a quarantined GPU back into placement.

        A GPU that no lease holds must not come back on vfio-pci (a hung or failed give-back leaves it there): the
        clear first gives its group back to the host drivers, and refuses, keeping the quarantine, while a domain has
        one of its functions attached, while the domains cannot be listed to tell, or when the give-back fails.
        A GPU a live lease holds keeps its functions where they are (the lease gives them back when it ends).
        """
        gpu = self.gpus.get(gpu_id)
        if gpu is None:
            raise NotFound(f"no GPU {gpu_id!r}", field="id")
        if gpu_id not in self.quarantined:
            raise Conflict(f"GPU {gpu_id} is not quarantined", field="id")
        if gpu_id not in self.claims:
            await self._give_back_unleased(gpu, actor)
        if not await self._run(self.journal.clear_quarantine, gpu_id, actor=actor):
            raise Conflict(f"GPU {gpu_id} is not quarantined", field="id")
        self.quarantined.pop(gpu_id, None)
        self._wake_queue.set()

    async def _give_back_unleased(self, gpu: Gpu, actor: str) -> None:
        """Return a GPU no lease holds from vfio-pci to its host drivers, or raise Conflict saying why not."""
        async with self._group_lock(gpu.iommu_group if gpu.iommu_group is not None else -1):
            drivers, on_vfio = await self.stranded_functions(gpu)
            if not on_vfio:
                return
            try:
                where = await self.attached_anywhere()
            except HostAgentError as exc:
                raise Conflict(f"GPU {gpu.id} is on vfio-pci and the domains cannot be listed to tell whether a guest "
                               f"holds it ({exc.message}); quarantine kept", field="id") from exc
            held = sorted({where[a] for a in drivers if a in where})
            if held:
                raise Conflict(f"GPU {gpu.id} is attached to {', '.join(held)} without a lease: detach it there "
                               "first; quarantine kept", field="id")
            res = await self.give_back_to_host(gpu, drivers)
            await self._run(self.journal.event, "repair", actor=actor, gpu_id=gpu.id,
                            detail=f"clearing the quarantine: {', '.join(on_vfio)} on vfio-pci without a lease; "
                                   + ("gave back to the host drivers" if res.ok else f"give-back failed: {res.error}"))
            if not res.ok:
                raise Conflict(f"GPU {gpu.id} would not return to its host drivers ({res.error}); quarantine kept",
                               field="id")

    async def stranded_functions(self, gpu: Gpu) -> tuple[dict[str, str | None], list[str]]:
        """A GPU's functions with their drivers, and those on vfio-pci that must go back to the host when no lease
        holds the GPU: none when one of its functions is pinned to vfio-pci (policy.pinned)."""
        drivers = await self._run(self.host.current_drivers, gpu)
        if any(a in self.policy.pinned for a in drivers):
            return drivers, []
        return drivers, sorted(a for a, d in drivers.items() if d == VFIO_DRIVER)

    async def give_back_to_host(self, gpu: Gpu, drivers: Mapping[str, str | None]) -> HostOpResult:
        """Give every function of a GPU no lease holds to whatever host driver the kernel probes for it."""
        return await self._run(self.host.give_back, gpu, {a: ANY_HOST_DRIVER for a in drivers}, None)

    async def attached_anywhere(self) -> dict[str, str]:
        """PCI address -> the domain it is attached to, over every domain the hypervisor knows (a domain that
        vanished while listed is skipped); raises the hypervisor's error when the domains cannot be listed."""
        where: dict[str, str] = {}
        for dom in await self.hv.list_domains():
            try:
                for h in await self.hv.attached_hostdevs(dom.uuid):
                    where[str(h.source)] = dom.name
            except NotFound:
                continue
        return where

    def check_owner(self, lease: Lease, domain_uuid: str | None) -> None:
        """A guest may act only on its own leases."""
        if domain_uuid is not None and lease.domain_uuid != domain_uuid:
            raise Forbidden("this token may not act on another VM's lease", field="id")


def render_hostdevs(functions: Sequence[str], bus: int, slots: Sequence[int], policy: LeasePolicy) -> list[HostdevPci]:
    """Hostdevs for one GPU: guest addresses left to libvirt (auto), one multifunction slot, or a slot each."""
    addrs = [PciAddress.parse(a) for a in functions]
    if policy.guest_layout == "auto":
        return [HostdevPci(source=a, guest=None, alias=alias_for(a), driver_vfio=policy.driver_vfio,
                           rom_bar_off=policy.rom_bar_off) for a in addrs]
    if policy.guest_layout == "multifunction":
        return list(hostdevs_for_gpu(addrs, bus, slots[0], rom_bar_off=policy.rom_bar_off,
                                     driver_vfio=policy.driver_vfio))
    out: list[HostdevPci] = []
    for addr, slot in zip(addrs, slots, strict=True):
        out.extend(hostdevs_for_gpu([addr], bus, slot, rom_bar_off=policy.rom_bar_off, driver_vfio=policy.driver_vfio))
    return out


def _guest_addr(h: HostdevPci) -> str:
    g = h.guest
    return str(PciAddress(g.domain, g.bus, g.slot, g.function)) if g is not None else ""


def _step_hook(prefix: str) -> Callable[[str, str], None]:
    """A binder callback that turns each named host step into a crash point (`bind:unbind`, ...)."""

    def hook(step: str, address: str) -> None:
        crash_point(f"{prefix}:{step}")

    return hook


def lease_view(lease: Lease, manager: LeaseManager | None = None) -> dict[str, Any]:
    """The API's JSON for a lease."""
    body: dict[str, Any] = {
        "id": lease.id,
        "state": lease.state.value,
        "domain": {"uuid": lease.domain_uuid, "name": lease.domain_name},
        "request": lease.request.to_dict(),
        "granted_gpus": lease.granted_gpus,
        "devices": [
            {"gpu_id": d.gpu_id, "functions": list(d.functions), "guest_addresses": list(d.guest_addresses),
             "iommu_group": d.iommu_group}
            for d in lease.devices
        ],
        "created_at": lease.created_at,
        "granted_at": lease.granted_at,
        "expires_at": lease.expires_at,
        "ended_at": lease.ended_at,
        "end_reason": lease.end_reason,
        "reasons": list(lease.reasons),
        "distance": lease.distance,
        "placement": dict(lease.placement),
        "error": lease.error,
        "warnings": [],
        "reclaim": {"paused": lease.reclaim_paused, "strike_at": lease.strike_at, "recheck_at": lease.recheck_at,
                    "notice": lease.notice, "notice_deadline": lease.notice_deadline},
    }
    if lease.notice == "warning":
        body["warnings"].append({"code": "idle_strike_one", "message": "GPU looked idle; it will be reclaimed if "
                                 "still idle at the recheck", "recheck_at": lease.recheck_at})
    elif lease.notice == "reclaim":
        body["warnings"].append({"code": "reclaim_notice", "message": "GPU is being reclaimed for idleness; release "
                                 "it now", "deadline": lease.notice_deadline})
    if lease.state is S.DETACH_PENDING:
        body["warnings"].append({"code": "detach_pending", "message": "the guest has not acknowledged the detach; "
                                 "the GPU stays on vfio-pci until it does or the VM stops"})
    if manager is not None and lease.state is S.QUEUED:
        body["queue"] = {"position": manager.queue_position(lease), "eta": manager.eta(lease)}
    return body


def iter_live(manager: LeaseManager, states: Iterable[LeaseState]) -> list[Lease]:
    """Live leases in the given states."""
    wanted = set(states)
    return [x for x in manager.leases.values() if x.state in wanted]
