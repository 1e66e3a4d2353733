"""The lease driver's public face: LeaseManager owns the live leases, device claims, quarantines and attention marks,
is the only writer of lease state (journal durably, then publish in memory and to listeners), holds the per-lease and
per-IOMMU-group locks, and accounts the agent's own work against its waits on sysfs and the hypervisor (`quiet`);
`lease_view` is the API's JSON for a lease. Every transition is journaled (fsync'd) before the step it announces; a
failure rolls back to the last safe state; `Reconciler` (reconcile.py) repairs whatever a crash left half done. The
paths themselves live beside it and work through the manager: grant_path.py (request -> ACTIVE, rollback),
release_path.py (-> RELEASED or EXPIRED, expiry, domain events), lease_queue.py (the queue), quarantine.py, and
lease_types.py (the policy, placement and timing types they share, still importable from here).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

from hostagent.domain.capabilities import Measured
from hostagent.domain.terms import Scaling
from hostagent.domain.errors import Conflict, Forbidden, InvalidInput, InvalidTransition, NotFound
from hostagent.domain.inventory import PROBE_CLAIM_PREFIX, Gpu, GpuState
from hostagent.domain.admission import DAY_S, LEDGER_MAX, Ledger
from hostagent.domain.numa import VmNuma
from hostagent.domain.lease import Lease, LeaseRequest, LeaseState, Step
from hostagent.services import (
    admission,
    bookings,
    consolidate,
    grant_path,
    lease_queue,
    moves,
    quarantine,
    release_path,
    top_up,
)
from hostagent.services.admission import queue_deadline
from hostagent.services.faults import crash_point
from hostagent.services.lease_types import (
    ANY_HOST_DRIVER,
    HV_WAITS,
    LOGGER,
    VFIO_DRIVER,
    LeasePolicy,
    Listener,
    PlaceFn,
    Placement,
    TimingLog,
    detach_retries_left,
    render_hostdevs,
    simple_place,
)
from hostagent.services.ports import HostOpResult, HostPort

log = logging.getLogger(LOGGER)

S = LeaseState

__all__ = [
    "ANY_HOST_DRIVER", "HV_WAITS", "VFIO_DRIVER", "LeaseManager", "LeasePolicy", "Listener", "PlaceFn", "Placement",
    "TimingLog", "iter_live", "lease_view", "render_hostdevs", "simple_place",
]


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
        self._idem_inflight: dict[tuple[str, str], asyncio.Future[Lease]] = {}
        self.numa_cells: dict[int, frozenset[int]] = {}  # the runtime sets the host's (host.discovery.numa_cells)
        self.vm_numa: dict[str, VmNuma] = {}
        self.nvlinked: frozenset[str] = frozenset()  # the topology wiring sets it from host.nvlink_hints
        self.measured: dict[str, Measured] = {}  # gpu_id -> what its latest probe established (services.probes)
        # what the active model's records say of a task type's scaling (the runtime sets the placer's)
        self.scaling: Callable[[str], Scaling | None] = lambda task_type: None
        self.predict_rates: Callable[[LeaseRequest, Sequence[Gpu]], tuple[list[float], str] | None] = (
            lambda request, gpus: None)  # the runtime sets the placer's
        self.relative_rates: Callable[[LeaseRequest, Sequence[Gpu]], Sequence[float] | None] = (
            lambda request, gpus: None)  # the runtime sets the placer's: without it the queue keeps strict order
        self.rate_uncertainty: Callable[[LeaseRequest, Sequence[Gpu]], Sequence[float] | None] = (
            lambda request, gpus: None)  # the runtime sets the placer's: without it every prediction counts as exact
        self.typical_run_s: Callable[[str, Sequence[float]], float | None] = (
            lambda task_type, running: None)  # the runtime sets the placer's
        self.left_run_s: Callable[[str, float], float | None] = lambda task_type, done: None  # (the placer's)
        # what relative_rates' answers depend on besides the request and GPUs (None: unknown, the queue asks again
        # at every decision); the runtime sets the placer's
        self.rates_token: Callable[[], object] = lambda: None
        self.doubt: Callable[[LeaseRequest], float] = lambda request: 0.0  # the runtime sets the placer's
        self.queue_passes: dict[str, tuple[int, float]] = {}
        self.queue_notes: dict[str, str] = {}
        self.queue_waits: dict[str, float] = {}
        self.queue_shapes: dict[tuple[object, ...], Any] = {}
        self.consolidation: dict[str, dict[str, Any]] = {}  # queued lease -> the moves that would free a block for it
        self.grant_seconds: collections.deque[float] = collections.deque(maxlen=20)
        self.ledger = Ledger()
        self.step_count = 0
        self.queue_cache: tuple[Any, float, dict[str, tuple[int, float | None]]] | None = None
        self._group_locks: dict[int, asyncio.Lock] = {}
        self._lease_locks: dict[str, asyncio.Lock] = {}
        self.listeners: list[Listener] = []
        self._wake_queue = asyncio.Event()
        self.quarantined: dict[str, str] = {}
        self.missing: dict[str, float] = {}  # PCI address -> when it left the bus (services.out_of_band)
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
        self.step_count += 1
        if lease.state.terminal:
            if lease.id in self.leases:
                self.ledger.add(lease)
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
        self.leases = {x.id: x for x in reversed(live)}  # oldest first: the queue's order among equal times
        self.claims = {gid: x.id for x in live if x.state.holds_devices for gid in x.gpu_ids}
        self.quarantined = await self._run(self.journal.quarantined)
        ended = await self._run(functools.partial(self.journal.leases, states=[s for s in S if s.terminal],
                                                  since=self.clock() - DAY_S, limit=LEDGER_MAX))
        self.ledger.load(ended)

    # -- views ---------------------------------------------------------------------------------------------------
    def gpu_state(self, gpu_id: str) -> GpuState:
        """Operator-facing state of one GPU."""
        gpu = self.gpus[gpu_id]
        if gpu_id in self.quarantined:
            return GpuState.QUARANTINED
        lid = self.claims.get(gpu_id)
        if lid is not None and lid.startswith(PROBE_CLAIM_PREFIX):
            return GpuState.PROBING  # not leased: a probe holds it between leases (it once read "leased")
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
        return lease_queue.in_order(self)

    def queue_position(self, lease: Lease) -> int | None:
        """1-based position in the queue."""
        return lease_queue.position(self, lease)

    def eta(self, lease: Lease) -> float | None:
        """Expected grant time of a queued lease."""
        return lease_queue.eta(self, lease)

    def check_owner(self, lease: Lease, domain_uuid: str | None) -> None:
        """A guest may act only on its own leases."""
        if domain_uuid is not None and lease.domain_uuid != domain_uuid:
            raise Forbidden("this token may not act on another VM's lease", field="id")

    # -- locks and timed waits -----------------------------------------------------------------------------------
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

    def _timing(self, kind: str, seconds: float) -> None:
        self.step_timings.append((kind, seconds))

    async def _timed_hv(self, kind: str, aw: Awaitable[Any]) -> Any:
        t0 = time.perf_counter()
        try:
            with self._work(-self._working_in.get(asyncio.current_task(), 0) if kind in HV_WAITS else 0):
                return await aw
        finally:
            self._timing(kind, time.perf_counter() - t0)

    # -- the grant path (grant_path.py) --------------------------------------------------------------------------
    @_agent_side
    async def request(self, domain_uuid: str, request: LeaseRequest, *, actor: str, trusted: bool = False,
                      stated: bool = True) -> Lease:
        """Handle POST /v1/leases: grant (ACTIVE), queue (QUEUED) or refuse (Conflict). Idempotent by key, also
        for concurrent duplicates. `trusted`: an operator asks, so the guests' priority policy does not cap it;
        `stated`: the request carried a priority (else the operator's priority rules give it one)."""
        return await grant_path.request_lease(self, domain_uuid, request, actor=actor, trusted=trusted, stated=stated)

    # -- the release path (release_path.py) ----------------------------------------------------------------------
    @_agent_side
    async def release(self, lease_id: str, *, actor: str, reason: str = "released", domain_uuid: str | None = None,
                      final: LeaseState = S.RELEASED) -> Lease:
        """End a lease: cancel it in the queue, or detach, wait for DEVICE_REMOVED, give back."""
        return await release_path.release_lease(self, lease_id, actor=actor, reason=reason, domain_uuid=domain_uuid,
                                                final=final)

    async def _finish_release(self, lease: Lease, actor: str, final: LeaseState) -> Lease:
        """From DETACHING or DETACH_PENDING: detach and wait, then give back; else DETACH_PENDING (the reconciler)."""
        return await release_path.finish_release(self, lease, actor, final)

    async def _detach(self, lease: Lease) -> str | None:
        """Detach every hostdev of the lease that is still attached: how it ended, or None while unacknowledged."""
        return await release_path.detach(self, lease)

    async def _give_back_all(self, lease: Lease, actor: str, final: LeaseState, rebind: str | None = None) -> Lease:
        """[REBINDING ->] every function back to its original driver -> `final` (see release_path.give_back_all)."""
        return await release_path.give_back_all(self, lease, actor, final, rebind)

    @_agent_side
    async def retry_pending(self, actor: str = "agent") -> None:
        """Retry detaches that the guest never acknowledged."""
        await release_path.retry_pending(self, actor)

    async def expire_due(self) -> None:
        """End leases past their TTL and queued requests past not_after; break the moves past their deadline."""
        await release_path.expire_due(self)
        await moves.due(self)

    async def move(self, lease_id: str, to_gpu: str, from_gpu: str | None = None, *,
                   deadline_s: int = moves.DEFAULT_DEADLINE_S, actor: str) -> Lease:
        """Make-before-break: attach `to_gpu` beside `from_gpu` and tell the guest (services.moves)."""
        return await moves.start(self, lease_id, to_gpu, from_gpu, deadline_s=deadline_s, actor=actor)

    async def move_done(self, lease_id: str, *, actor: str, domain_uuid: str | None = None) -> Lease:
        """The guest moved its work: detach and give back the old device now."""
        return await moves.finish(self, lease_id, actor=actor, why="the guest confirmed", domain_uuid=domain_uuid)

    async def on_domain_event(self, kind: str, domain_uuid: str, detail: str | None = None, *, actor: str = "libvirt",
                              reason: str | None = None) -> None:
        """React to a domain stopping, crashing or being undefined, and to late DEVICE_REMOVED events (see
        release_path.on_domain_event for `actor` and `reason`)."""
        await release_path.on_domain_event(self, kind, domain_uuid, detail, actor=actor, reason=reason)

    # -- renew and the queue (lease_queue.py) --------------------------------------------------------------------
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
            d: float = duration_s or lease.request.duration_s or self.policy.default_duration_s
            cut = None
            if lease.state is S.ACTIVE:  # no longer than its GPU-hours quotas leave (the renewal is refused at none)
                d, cut = admission.cap_length(self, lease, len(lease.devices), d)
            until, booked = bookings.renewal_cap(self, lease, self.clock() + d)  # never into a booking of its GPUs
            if booked:
                if until <= (lease.expires_at or 0):
                    raise Conflict(f"cannot renew: {booked}", field="duration_s")
                cut = "; ".join(c for c in (cut, booked) if c)
                d = until - self.clock()
            renewed = await self._write(lease.with_changes(expires_at=until), lease.state, actor,
                                        f"renewed for {d:g} s" + (f" ({cut})" if cut else ""))
        if renewed.state is S.ACTIVE and any(x.state is S.QUEUED for x in self.leases.values()):
            # its GPUs free at another time now: a queued request waiting in line for them weighs its wait again
            self._wake_queue.set()
        return renewed

    @_agent_side
    async def drain_queue(self) -> list[Lease]:
        """Grant queued requests, in priority-then-age order, while devices allow; then, for a head that waits only
        because the free GPUs are scattered, propose (or perform) the moves that free a block (consolidate.py)."""
        granted = await lease_queue.drain(self)
        await consolidate.consider(self)
        return granted

    async def run_queue(self) -> None:
        """Background task: drain the queue whenever devices may have freed."""
        await lease_queue.run(self)

    # -- quarantine (quarantine.py) ------------------------------------------------------------------------------
    async def _quarantine(self, gpu_id: str, reason: str, actor: str) -> None:
        await quarantine.quarantine_gpu(self, gpu_id, reason, actor)

    async def clear_quarantine(self, gpu_id: str, *, actor: str) -> None:
        """Operator: put a quarantined GPU back into placement (see quarantine.clear_quarantine)."""
        await quarantine.clear_quarantine(self, gpu_id, actor=actor)

    async def stranded_functions(self, gpu: Gpu) -> tuple[dict[str, str | None], list[str]]:
        """A GPU's functions with their drivers, and those on vfio-pci that must go back to the host when no lease
        holds the GPU: none when one of its functions is pinned to vfio-pci (policy.pinned)."""
        return await quarantine.stranded_functions(self, gpu)

    async def give_back_to_host(self, gpu: Gpu, drivers: Mapping[str, str | None]) -> HostOpResult:
        """Give every function of a GPU no lease holds to whatever host driver the kernel probes for it."""
        return await quarantine.give_back_to_host(self, gpu, drivers)

    async def attached_anywhere(self) -> dict[str, str]:
        """PCI address -> the domain it is attached to, over every domain the hypervisor knows (a domain that
        vanished while listed is skipped); raises the hypervisor's error when the domains cannot be listed."""
        return await quarantine.attached_anywhere(self)


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
                    "notice": lease.notice, "notice_deadline": lease.notice_deadline,
                    "preempted_by": lease.preempted_by},
    }
    if lease.state is S.ACTIVE and lease.request.gpus > lease.granted_gpus:
        body["partial"] = {"asked": lease.request.gpus, "granted": lease.granted_gpus,
                           "top_up": lease.request.top_up, "adding": list(lease.adding),
                           "rest_expected_at": (top_up.rest_expected_at(manager, lease, manager.clock())
                                                if manager is not None else None)}
    if lease.request.start_at is not None and lease.request.duration_s is not None:
        body["booking"] = {"start_at": lease.request.start_at,
                           "end_at": lease.request.start_at + lease.request.duration_s,
                           "gpus": list(lease.booked_gpus),
                           "binds_at": (lease.request.start_at - bookings.lead_s(manager)
                                        if manager is not None and lease.state is S.BOOKED else None)}
    if lease.notice == "warning":
        body["warnings"].append({"code": "idle_strike_one", "message": "GPU looked idle; it will be reclaimed if "
                                 "still idle at the recheck", "recheck_at": lease.recheck_at})
    elif lease.notice == "reclaim" and lease.preempted_by:
        body["warnings"].append({"code": "reclaim_notice", "reason": "preempted",
                                 "message": f"GPU is being reclaimed for a request of higher priority "
                                 f"({lease.preempted_by}); release it now", "deadline": lease.notice_deadline})
    elif lease.notice == "reclaim":
        body["warnings"].append({"code": "reclaim_notice", "reason": "idle", "message": "GPU is being reclaimed for "
                                 "idleness; release it now", "deadline": lease.notice_deadline})
    moving = moves.warning(lease)
    if moving is not None:
        body["warnings"].append(moving)
    if lease.move:
        body["move"] = dict(lease.move)
    if lease.state is S.DETACH_PENDING:
        body["warnings"].append({"code": "detach_pending", "message": "the guest has not acknowledged the detach; "
                                 "the GPU stays on vfio-pci until it does or the VM stops"})
        if manager is not None and not detach_retries_left(manager.policy, lease):
            body["warnings"].append({"code": "detach_alert", "attempts": lease.detach_attempts,
                                     "message": "the agent has stopped retrying the detach (libvirt.detach_retries); "
                                     "an operator must look: release the lease again, or stop the VM"})
    if manager is not None and lease.state is S.QUEUED:
        body["queue"] = {"position": manager.queue_position(lease), "eta": manager.eta(lease),
                         "deadline": queue_deadline(manager.policy, lease), "note": manager.queue_notes.get(lease.id),
                         "consolidation": manager.consolidation.get(lease.id)}
    return body


def iter_live(manager: LeaseManager, states: Iterable[LeaseState]) -> list[Lease]:
    """Live leases in the given states."""
    wanted = set(states)
    return [x for x in manager.leases.values() if x.state in wanted]
