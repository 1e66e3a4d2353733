"""The lease driver's shared vocabulary: the policy it runs under (`LeasePolicy`), what placement returns (`Placement`,
`PlaceFn`, the fallback `simple_place`), the bounded step-timing log (`TimingLog`), the hostdevs rendered for a
lease's devices, the small helpers around host steps (`clocked`, `step_hook`), and `LeaseCore`, the face of
LeaseManager (state, ports, journal writes, locks, timed waits) through which the grant path, the release path, the
queue and the quarantine work. It imports no other part of the lease driver, so that every part can import it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any, Protocol

from hostagent.domain.admission import Ledger
from hostagent.domain.assignment import Fairness
from hostagent.domain.capabilities import Measured
from hostagent.domain.hostdev import HostdevPci, hostdevs_for_layout
from hostagent.domain.inventory import Gpu
from hostagent.domain.lease import DEFAULT_DURATION_S, Lease, LeaseDevice, LeaseRequest, LeaseState, Quota, Step
from hostagent.domain.numa import VmNuma
from hostagent.domain.pci import PciAddress
from hostagent.domain.terms import Scaling
from hostagent.services.faults import crash_point
from hostagent.services.ports import HostPort

LOGGER = "hostagent.leases"  # every part of the lease driver logs under this one name
VFIO_DRIVER = "vfio-pci"
ANY_HOST_DRIVER = "*"  # give-back target: whatever host driver the kernel probes for the function
HV_WAITS = frozenset({"attach", "detach"})  # hypervisor calls long enough to let background work run beside them

Listener = Callable[[Lease, "str | None"], None]


@dataclass(frozen=True, slots=True)
class LeasePolicy:
    """The lease settings the driver needs (built from config)."""

    default_duration_s: int = DEFAULT_DURATION_S
    max_duration_s: int = 7 * 24 * 3600
    queue_max: int = 1000
    keep_on_domain_stop: bool = False
    detach_timeout_s: float = 30.0
    detach_retries: int = 3  # retries of a detach the guest did not acknowledge, before the operator alert
    guest_bus: int = 0
    rom_bar_off: bool = False
    driver_vfio: bool = True
    guest_layout: str = "auto"  # auto | multifunction | per-function
    vm_quota: Quota = Quota()
    project_quotas: tuple[tuple[str, Quota, tuple[str, ...]], ...] = ()  # (project, quota, domain uuids/names)
    queue_max_per_vm: int = 0  # a VM's share of the queue (0: the whole queue)
    queue_max_wait_s: float = 0.0  # a queued request without not_after gives up after this long (0: never)
    pinned: frozenset[str] = frozenset()
    preempt_min_priority: int = 0  # a queued request of at least this priority may reclaim lower ones (0: never)
    preempt_notice_s: float = 60.0  # a preempted lease's notice window (reclaim.notice_window_s)
    cap_at_scaling_limit: bool = False  # cut a request to where its task type's records stop gaining
    fairness: Fairness = Fairness()  # how far comparative advantage may reorder the queue (domain.assignment)
    # (name, priority, task_type, project, domains, max_duration_s): a request that states no priority gets the
    # first matching rule's (config leases.priority_rules)
    priority_rules: tuple[tuple[str, int, str | None, str | None, tuple[str, ...], int | None], ...] = ()
    booking_horizon_s: float = 30 * 86400.0  # how far ahead a booking may start
    booking_lead_s: float = 30.0  # a booking binds at least this long before its start (more if grants are slower)
    consolidate: bool = False  # perform the moves that free a block for a request waiting on scattered GPUs


@dataclass(frozen=True, slots=True)
class Placement:
    """The devices chosen for a grant and why."""

    gpu_ids: tuple[str, ...]
    reasons: tuple[str, ...]
    candidates: tuple[dict[str, Any], ...] = ()
    dropped: tuple[dict[str, Any], ...] = ()
    distance: float | None = None
    rule: str = "cold-start"
    model_version: str | None = None  # the placement model that scored it (None: a rule decided)


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


class LeaseCore(Protocol):
    """What the lease driver's parts use of LeaseManager, which implements it. The parts take the manager as this,
    their first argument, instead of importing leases.py (which imports them)."""

    gpus: dict[str, Gpu]
    host: HostPort
    hv: Any
    journal: Any
    policy: LeasePolicy
    place: PlaceFn
    clock: Callable[[], float]
    leases: dict[str, Lease]
    claims: dict[str, str]
    attention: dict[str, str]
    quarantined: dict[str, str]
    missing: dict[str, float]  # PCI address -> when the kernel said it left the bus (services.out_of_band)
    listeners: list[Listener]
    _run: Callable[..., Awaitable[Any]]  # a blocking call in a worker thread
    ledger: Ledger  # ended leases of the last day (GPU-hours quotas)
    step_count: int  # journaled steps published so far: a change of any lease
    queue_cache: tuple[Any, float, dict[str, tuple[int, float | None]]] | None  # see lease_queue.view
    _decide: asyncio.Lock
    _wake_queue: asyncio.Event
    _idem_inflight: dict[tuple[str, str], asyncio.Future[Lease]]  # requests being decided, by (VM, key)
    numa_cells: dict[int, frozenset[int]]  # the host's NUMA nodes and their CPUs ({}: unknown)
    vm_numa: dict[str, VmNuma]  # domain uuid -> where the VM lives, read at its latest request
    nvlinked: frozenset[str]  # GPUs in an NVLink clique (host.nvlink_hints), set by the topology wiring
    measured: dict[str, Measured]  # gpu_id -> what its latest probe established (services.probes.learn)
    scaling: Callable[[str], Scaling | None]  # task type -> what the active model's records say of its scaling
    # each GPU's predicted work rate for a request's task type, and the model's version (None: no model covers it)
    predict_rates: Callable[[LeaseRequest, Sequence[Gpu]], tuple[list[float], str] | None]
    # each GPU's relative work rate for a request as the active model predicts it, free or not, a task type it does
    # not cover yet too (None: no active model): the queue's comparative advantage (services.lease_queue)
    relative_rates: Callable[[LeaseRequest, Sequence[Gpu]], Sequence[float] | None]
    # each GPU's log-space standard deviation of relative_rates' prediction (None: none): efficiencies within it tie
    rate_uncertainty: Callable[[LeaseRequest, Sequence[Gpu]], Sequence[float] | None]
    # (task type, how much each of its running leases has run) -> its expected run time by the model's records; run
    # times at rate 1, the task type's typical rate (a lease that ran t s at relative rate r has run t * r)
    typical_run_s: Callable[[str, Sequence[float]], float | None]
    # (task type, how much a lease of it has run) -> how much more it is expected to run by the model's records (at
    # rate 1: lease_queue.expected_free_at divides by the lease's rate)
    left_run_s: Callable[[str, float], float | None]
    # equal while relative_rates and rate_uncertainty answer the same for the same request and GPUs (None: unknown)
    rates_token: Callable[[], object]
    # a queued request -> its draw of the model's doubt in one wait-for-a-better-GPU decision (domain.assignment's
    # Candidate.doubt; 0: the prediction itself, as where the operator turned exploration off)
    doubt: Callable[[LeaseRequest], float]
    queue_passes: dict[str, tuple[int, float]]  # queued lease -> (times passed over, since when)
    queue_notes: dict[str, str]  # queued lease -> why it waits (passed over, waiting for a better GPU)
    queue_waits: dict[str, float]  # queued lease waiting for a better GPU -> when that GPU is expected to free
    queue_shapes: dict[tuple[object, ...], Any]  # request shape -> its ranked predictions (lease_queue.Ranked)
    consolidation: dict[str, dict[str, Any]]  # queued lease -> the moves that would free a block (consolidate.py)
    grant_seconds: deque[float]  # how long the latest grants took to bind and attach (a booking's lead time)

    def get(self, lease_id: str, *, domain_uuid: str | None = None) -> Lease: ...

    def lease_lock(self, lease_id: str) -> asyncio.Lock: ...

    def _group_lock(self, group: int) -> asyncio.Lock: ...

    def _holding_groups(self, groups: Iterable[int]) -> AbstractAsyncContextManager[None]: ...

    async def _move(self, lease: Lease, target: LeaseState, actor: str, detail: str | None = None,
                    error: str | None = None, earlier: Sequence[Step] = (),
                    amend: Callable[[Lease], Lease] | None = None, **changes: Any) -> Lease: ...

    async def _write(self, lease: Lease, prev: LeaseState | None, actor: str, detail: str | None = None,
                     error: str | None = None, earlier: Sequence[Step] = (),
                     amend: Callable[[Lease], Lease] | None = None) -> Lease: ...

    def _still_live(self, lease: Lease) -> None: ...

    def _publish(self, lease: Lease, detail: str | None) -> None: ...

    def _timing(self, kind: str, seconds: float) -> None: ...

    async def _timed_hv(self, kind: str, aw: Awaitable[Any]) -> Any: ...

    # the operations that count as the agent's own work: a part calls them through the manager
    async def release(self, lease_id: str, *, actor: str, reason: str = "released", domain_uuid: str | None = None,
                      final: LeaseState = LeaseState.RELEASED) -> Lease: ...

    async def drain_queue(self) -> list[Lease]: ...


def detach_retries_left(policy: LeasePolicy, lease: Lease) -> bool:
    """Whether the agent still retries this DETACH_PENDING lease's detach by itself: its first detach and at most
    `policy.detach_retries` retries went unacknowledged (`lease.detach_attempts` counts them all). Once they have,
    the operator was alerted (release_path.detach_alert) and only DEVICE_REMOVED, the domain stopping, a release
    asked again or a restart's reconcile try once more."""
    return lease.detach_attempts <= max(0, policy.detach_retries)


def clocked(timings: list[float], fn: Callable[..., Any], *args: Any) -> Any:
    """fn(*args), its seconds appended to `timings` (a worker thread's host step; the loop records them)."""
    t0 = time.perf_counter()
    try:
        return fn(*args)
    finally:
        timings.append(time.perf_counter() - t0)


def step_hook(prefix: str) -> Callable[[str, str], None]:
    """A binder callback that turns each named host step into a crash point (`bind:unbind`, ...)."""

    def hook(step: str, address: str) -> None:
        crash_point(f"{prefix}:{step}")

    return hook


def render_hostdevs(functions: Sequence[str], bus: int, slots: Sequence[int], policy: LeasePolicy) -> list[HostdevPci]:
    """Hostdevs for one GPU in the policy's guest layout (see hostdev.hostdevs_for_layout)."""
    return hostdevs_for_layout([PciAddress.parse(a) for a in functions], policy.guest_layout, bus, slots,
                               rom_bar_off=policy.rom_bar_off, driver_vfio=policy.driver_vfio)


def guest_addr(h: HostdevPci) -> str:
    """The guest PCI address of a hostdev ("" when libvirt has not chosen one)."""
    g = h.guest
    return str(PciAddress(g.domain, g.bus, g.slot, g.function)) if g is not None else ""


def with_live_addresses(devices: Iterable[LeaseDevice], live: Iterable[HostdevPci]) -> tuple[LeaseDevice, ...]:
    """`devices` with the guest address libvirt gave each function in the live domain (`live`: its hostdevs); a
    function the live XML gives no address keeps the one recorded."""
    placed = {str(h.source): addr for h in live if (addr := guest_addr(h))}
    out = []
    for d in devices:
        recorded = d.guest_addresses or ("",) * len(d.functions)
        out.append(dataclasses.replace(d, guest_addresses=tuple(
            placed.get(a, r) for a, r in zip(d.functions, recorded, strict=True))))
    return tuple(out)


def all_drivers(m: LeaseCore) -> dict[str, str | None]:
    """Every GPU function's driver now, read from sysfs (blocking: call from a worker thread)."""
    return {a: d for g in list(m.gpus.values()) for a, d in m.host.current_drivers(g).items()}
