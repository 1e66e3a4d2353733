"""Leases as data: the request, the lease, its state machine, and arbitration (priority, deferral, partial grants)."""

from __future__ import annotations

import enum
import math
import operator
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from hostagent.domain.capabilities import FEATURES
from hostagent.domain.errors import Conflict, InvalidInput, InvalidTransition


class LeaseState(str, enum.Enum):
    """Where a lease is in its life."""

    REQUESTED = "REQUESTED"
    BOOKED = "BOOKED"  # a booking: GPUs held in the calendar for [start_at, start_at + duration_s)
    QUEUED = "QUEUED"
    BINDING = "BINDING"
    ATTACHING = "ATTACHING"
    ACTIVE = "ACTIVE"
    RELEASING = "RELEASING"
    DETACHING = "DETACHING"
    DETACH_PENDING = "DETACH_PENDING"
    REBINDING = "REBINDING"
    RELEASED = "RELEASED"
    EXPIRED = "EXPIRED"
    FAILED = "FAILED"

    @property
    def terminal(self) -> bool:
        """No further transitions."""
        return self in TERMINAL

    @property
    def holds_devices(self) -> bool:
        """The lease's devices are (or may be) on vfio-pci and owned by it."""
        return self in HOLDING


S = LeaseState
TRANSITIONS: Mapping[LeaseState, frozenset[LeaseState]] = {
    S.REQUESTED: frozenset({S.BOOKED, S.QUEUED, S.BINDING, S.FAILED}),
    # at its start a booking binds its GPUs, or waits first in its priority when they are not free; cancelled,
    # displaced by a booking of higher priority, or past its end unstarted
    S.BOOKED: frozenset({S.BINDING, S.QUEUED, S.RELEASED, S.EXPIRED, S.FAILED}),
    S.QUEUED: frozenset({S.BINDING, S.EXPIRED, S.RELEASED, S.FAILED}),
    S.BINDING: frozenset({S.ATTACHING, S.FAILED}),
    S.ATTACHING: frozenset({S.ACTIVE, S.FAILED}),
    S.ACTIVE: frozenset({S.RELEASING}),
    S.RELEASING: frozenset({S.DETACHING}),
    S.DETACHING: frozenset({S.REBINDING, S.DETACH_PENDING}),
    S.DETACH_PENDING: frozenset({S.DETACHING, S.REBINDING}),
    S.REBINDING: frozenset({S.RELEASED, S.EXPIRED}),
    S.RELEASED: frozenset(),
    S.EXPIRED: frozenset(),
    S.FAILED: frozenset(),
}
TERMINAL = frozenset(s for s, nxt in TRANSITIONS.items() if not nxt)
HOLDING = frozenset({S.BINDING, S.ATTACHING, S.ACTIVE, S.RELEASING, S.DETACHING, S.DETACH_PENDING, S.REBINDING})


def check_transition(current: LeaseState, target: LeaseState) -> None:
    """Raise InvalidTransition unless the table allows current -> target."""
    if target not in TRANSITIONS[current]:
        allowed = ", ".join(sorted(s.value for s in TRANSITIONS[current])) or "none (terminal)"
        raise InvalidTransition(
            f"lease cannot go from {current.value} to {target.value}; allowed: {allowed}",
            field="state",
            current=current.value,
            target=target.value,
        )


@dataclass(frozen=True, slots=True)
class Step:
    """One transition of a lease's history (None -> REQUESTED for a new lease), as the journal records it."""

    from_state: LeaseState | None
    to_state: LeaseState
    detail: str | None = None


PRECISIONS = ("fp32", "fp16", "bf16", "int8", "fp8", "fp64", "tf32")
NUMA_POLICIES = ("required", "preferred", "any")
MAX_GPUS_PER_REQUEST = 64
DEFAULT_DURATION_S = 8 * 3600  # a lease that names no duration_s lasts this long (`leases.default_duration_s`)
# Free-text labels of a request (task_type, project, vendor, model, idempotency_key): any text, non-ASCII included,
# but no control characters (C0, DEL, C1) and no invisible or bidirectional formatting (soft hyphen, zero-width and
# direction marks, embeddings and overrides, line/paragraph separators, BOM). One pattern for the parser and the
# OpenAPI document, so both accept the same strings. The parser also refuses lone surrogates (a JSON escape such as
# "\\ud800" alone), which no database stores as UTF-8; they are not Unicode scalar values, so no schema validator's
# regex can name them and the document leaves them out. Blank fillers that render as nothing (combining grapheme
# joiner, Hangul fillers, Khmer inherent vowels) are refused too, and so are the tag characters (U+E0000-U+E007F,
# invisible); those lie outside the BMP, where JSON Schema patterns differ between validators (UTF-16 code units
# or code points), so the document declares that check as a runtime one (`x-runtime-checks`).
LABEL_PATTERN = ("^[^\\x00-\\x1f\\x7f-\\x9f\\u00ad\\u034f\\u061c\\u115f\\u1160\\u17b4\\u17b5\\u180e"
                 "\\u200b-\\u200f\\u2028-\\u202e\\u2060-\\u206f\\u3164\\ufeff\\uffa0\\ufff9-\\ufffb]*$")
_LABEL = re.compile(LABEL_PATTERN[:-1] + "\\Z")  # \Z: Python's $ also matches before a trailing newline
_NOT_IN_PATTERN = re.compile("[\\ud800-\\udfff\\U000e0000-\\U000e007f]")  # lone surrogates; tag characters
LABEL_FIELDS = ("task_type", "idempotency_key", "vendor", "model", "project")


@dataclass(frozen=True, slots=True)
class LeaseRequest:
    """What a VM asks for."""

    gpus: int = 1
    task_type: str = "unspecified"
    data_scale: float | None = None
    precision: str | None = None
    min_memory_gib: float = 0.0
    duration_s: int | None = None
    priority: int = 0
    accept_partial: bool = False
    accept_deferred: bool = False
    not_after: float | None = None  # unix seconds
    idempotency_key: str | None = None
    vendor: str | None = None
    model: str | None = None
    numa_policy: str | None = None
    project: str | None = None
    requires: tuple[str, ...] = ()  # features every GPU must have (domain.capabilities.FEATURES), sorted
    total_memory_gib: float | None = None  # instead of gpus: the fewest GPUs holding this much, evenly
    target_work_rate: float | None = None  # instead of gpus: the fewest GPUs the model predicts do this much work/s
    start_at: float | None = None  # a booking: the GPUs from this time (unix seconds) for duration_s
    top_up: bool = True  # a partial grant is topped up as GPUs free (false: keep what was granted)
    movable: bool = False  # the guest can move its work to another GPU on a move notice (consolidation may move it)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields (read in one C call: a listing of a thousand leases makes a thousand of these)."""
        d = dict(zip(_REQUEST_SLOTS, _request_values(self)))
        d["requires"] = list(self.requires)  # JSON's form, as it reads back
        return d


_REQUEST_SLOTS: tuple[str, ...] = tuple(LeaseRequest.__slots__)
_request_values = operator.attrgetter(*_REQUEST_SLOTS)
_REQUEST_FIELDS = frozenset(LeaseRequest.__slots__)


def _num(body: Mapping[str, Any], key: str, *, integer: bool, lo: float, hi: float) -> Any:
    value = body[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and not isinstance(value, int)):
        raise InvalidInput(f"{key} must be {'an integer' if integer else 'a number'}", field=key)
    if isinstance(value, float) and not math.isfinite(value):
        raise InvalidInput(f"{key} must be finite", field=key)
    if not lo <= value <= hi:
        raise InvalidInput(f"{key} must be between {lo:g} and {hi:g}, got {value}", field=key)
    return value


def _text(body: Mapping[str, Any], key: str, max_len: int = 64) -> str:
    value = body[key]
    if (not isinstance(value, str) or not value or len(value) > max_len or not _LABEL.match(value)
            or _NOT_IN_PATTERN.search(value)):
        raise InvalidInput(f"{key} must be 1..{max_len} characters without control or invisible formatting "
                           "characters", field=key)
    return value


def _flag(body: Mapping[str, Any], key: str) -> bool:
    value = body[key]
    if not isinstance(value, bool):
        raise InvalidInput(f"{key} must be true or false", field=key)
    return value


def parse_lease_request(body: Any, *, now: float, max_duration_s: int) -> LeaseRequest:
    """Validate a POST /v1/leases body into a LeaseRequest; unknown fields are rejected."""
    if not isinstance(body, dict):
        raise InvalidInput("request body must be a JSON object")
    unknown = sorted(set(body) - _REQUEST_FIELDS)
    if unknown:
        raise InvalidInput(f"unknown field {unknown[0]!r}", field=unknown[0])
    kw: dict[str, Any] = {}
    if "gpus" in body:
        kw["gpus"] = _num(body, "gpus", integer=True, lo=1, hi=MAX_GPUS_PER_REQUEST)
    if "task_type" in body:
        kw["task_type"] = _text(body, "task_type")
    if "data_scale" in body and body["data_scale"] is not None:
        kw["data_scale"] = float(_num(body, "data_scale", integer=False, lo=0, hi=1e18))
    if "precision" in body and body["precision"] is not None:
        p = body["precision"]
        if p not in PRECISIONS:
            raise InvalidInput(f"precision must be one of {', '.join(PRECISIONS)}", field="precision")
        kw["precision"] = p
    if "min_memory_gib" in body:
        kw["min_memory_gib"] = float(_num(body, "min_memory_gib", integer=False, lo=0, hi=4096))
    if "duration_s" in body and body["duration_s"] is not None:
        kw["duration_s"] = _num(body, "duration_s", integer=True, lo=1, hi=max_duration_s)
    if "priority" in body:
        kw["priority"] = _num(body, "priority", integer=True, lo=-1000, hi=1000)
    for flag in ("accept_partial", "accept_deferred", "top_up", "movable"):
        if flag in body:
            kw[flag] = _flag(body, flag)
    if "start_at" in body and body["start_at"] is not None:
        at = float(_num(body, "start_at", integer=False, lo=0, hi=1e11))
        if at <= now:
            raise InvalidInput("start_at is not in the future: a lease that starts now leaves start_at out",
                               field="start_at")
        if body.get("duration_s") is None:
            raise InvalidInput("a booking (start_at) states its length: duration_s is required", field="start_at")
        kw["start_at"] = at
    if "not_after" in body and body["not_after"] is not None:
        na = float(_num(body, "not_after", integer=False, lo=0, hi=1e11))
        if na <= now:
            raise InvalidInput("not_after is already in the past", field="not_after")
        kw["not_after"] = na
    if "idempotency_key" in body and body["idempotency_key"] is not None:
        kw["idempotency_key"] = _text(body, "idempotency_key", 128)
    for key in ("vendor", "model", "project"):
        if key in body and body[key] is not None:
            kw[key] = _text(body, key, 128)
    if "numa_policy" in body and body["numa_policy"] is not None:
        if body["numa_policy"] not in NUMA_POLICIES:
            raise InvalidInput(f"numa_policy must be one of {', '.join(NUMA_POLICIES)}", field="numa_policy")
        kw["numa_policy"] = body["numa_policy"]
    if "requires" in body and body["requires"] is not None:
        req = body["requires"]
        if (not isinstance(req, list) or len(req) > 2 * len(FEATURES)
                or not all(isinstance(f, str) and f in FEATURES for f in req)):
            raise InvalidInput(f"requires must be a list of features from: {', '.join(FEATURES)}", field="requires")
        kw["requires"] = tuple(sorted(set(req)))
    if "total_memory_gib" in body and body["total_memory_gib"] is not None:
        if "gpus" in body:
            raise InvalidInput("ask for gpus or for total_memory_gib, not both (total_memory_gib takes the fewest "
                               "GPUs that hold it)", field="total_memory_gib")
        kw["total_memory_gib"] = float(_num(body, "total_memory_gib", integer=False, lo=0.001,
                                            hi=4096 * MAX_GPUS_PER_REQUEST))
    if "target_work_rate" in body and body["target_work_rate"] is not None:
        if "gpus" in body or kw.get("total_memory_gib") is not None:
            raise InvalidInput("ask for gpus, total_memory_gib or target_work_rate, one of them (target_work_rate "
                               "takes the fewest GPUs predicted to reach it)", field="target_work_rate")
        if kw.get("task_type", "unspecified") == "unspecified":
            raise InvalidInput("target_work_rate needs the task_type whose work rate it is (the unit the guest "
                               "agent reports as work_rate)", field="task_type")
        kw["target_work_rate"] = float(_num(body, "target_work_rate", integer=False, lo=1e-6, hi=1e15))
    return LeaseRequest(**kw)


@dataclass(frozen=True, slots=True)
class LeaseDevice:
    """One GPU held by a lease: its functions, their original host drivers and guest addresses."""

    gpu_id: str
    functions: tuple[str, ...]  # PCI addresses as text
    original_drivers: tuple[str | None, ...]
    iommu_group: int
    guest_addresses: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {
            "gpu_id": self.gpu_id,
            "functions": list(self.functions),
            "original_drivers": list(self.original_drivers),
            "iommu_group": self.iommu_group,
            "guest_addresses": list(self.guest_addresses),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> LeaseDevice:
        """Inverse of to_dict."""
        return cls(
            gpu_id=d["gpu_id"],
            functions=tuple(d["functions"]),
            original_drivers=tuple(d["original_drivers"]),
            iommu_group=int(d["iommu_group"]),
            guest_addresses=tuple(d.get("guest_addresses", ())),
        )


@dataclass(frozen=True, slots=True)
class Lease:
    """A lease and everything needed to finish or undo it after a crash."""

    id: str
    domain_uuid: str
    domain_name: str
    request: LeaseRequest
    state: LeaseState
    created_at: float
    devices: tuple[LeaseDevice, ...] = ()
    granted_gpus: int = 0
    granted_at: float | None = None
    expires_at: float | None = None
    ended_at: float | None = None
    end_reason: str | None = None
    reasons: tuple[str, ...] = ()
    distance: float | None = None
    queued_at: float | None = None
    reclaim_paused: bool = False
    strike_at: float | None = None  # time of strike one, None when clear
    recheck_at: float | None = None
    notice: str | None = None  # "warning" | "reclaim" | None
    notice_deadline: float | None = None
    error: str | None = None
    detach_attempts: int = 0
    placement: tuple[tuple[str, Any], ...] = ()  # the placement decision: rule, candidates, dropped (as items)
    last_check_at: float | None = None  # reaper's last idle check
    irq_baseline: tuple[tuple[str, int], ...] = ()  # vfio interrupt counts per function at the last check
    preempted_by: str | None = None  # the queued lease of higher priority this one's reclaim notice is for
    booked_gpus: tuple[str, ...] = ()  # a booking's GPUs in the calendar (BOOKED; what it binds at its start)
    adding: tuple[str, ...] = ()  # GPUs a top-up is adding to this ACTIVE lease (in devices, not yet attached)
    move: tuple[tuple[str, Any], ...] = ()  # a make-before-break move under way: from, to, phase, deadline (items)

    def transition(self, target: LeaseState, **changes: Any) -> Lease:
        """A copy in the target state; raises InvalidTransition if the table forbids it."""
        check_transition(self.state, target)
        return replace(self, state=target, **changes)

    def with_changes(self, **changes: Any) -> Lease:
        """A copy with non-state fields changed."""
        if "state" in changes:
            raise InvalidTransition("use transition() to change state", field="state")
        return replace(self, **changes)

    @property
    def gpu_ids(self) -> tuple[str, ...]:
        """GPUs held."""
        return tuple(d.gpu_id for d in self.devices)

    @property
    def expected_end(self) -> float | None:
        """When this lease is expected to free its GPUs (for ETAs)."""
        return self.expires_at

    def to_dict(self) -> dict[str, Any]:
        """JSON form for the journal."""
        return {
            "id": self.id,
            "domain_uuid": self.domain_uuid,
            "domain_name": self.domain_name,
            "request": self.request.to_dict(),
            "state": self.state.value,
            "created_at": self.created_at,
            "devices": [d.to_dict() for d in self.devices],
            "granted_gpus": self.granted_gpus,
            "granted_at": self.granted_at,
            "expires_at": self.expires_at,
            "ended_at": self.ended_at,
            "end_reason": self.end_reason,
            "reasons": list(self.reasons),
            "distance": self.distance,
            "queued_at": self.queued_at,
            "reclaim_paused": self.reclaim_paused,
            "strike_at": self.strike_at,
            "recheck_at": self.recheck_at,
            "notice": self.notice,
            "notice_deadline": self.notice_deadline,
            "error": self.error,
            "detach_attempts": self.detach_attempts,
            "placement": dict(self.placement),
            "last_check_at": self.last_check_at,
            "irq_baseline": [list(x) for x in self.irq_baseline],
            "preempted_by": self.preempted_by,
            "booked_gpus": list(self.booked_gpus),
            "adding": list(self.adding),
            "move": dict(self.move),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Lease:
        """Inverse of to_dict."""
        return cls(
            id=d["id"],
            domain_uuid=d["domain_uuid"],
            domain_name=d["domain_name"],
            request=LeaseRequest(**{**d["request"], "requires": tuple(d["request"].get("requires", ()))}),
            state=LeaseState(d["state"]),
            created_at=d["created_at"],
            devices=tuple(LeaseDevice.from_dict(x) for x in d.get("devices", ())),
            granted_gpus=d.get("granted_gpus", 0),
            granted_at=d.get("granted_at"),
            expires_at=d.get("expires_at"),
            ended_at=d.get("ended_at"),
            end_reason=d.get("end_reason"),
            reasons=tuple(d.get("reasons", ())),
            distance=d.get("distance"),
            queued_at=d.get("queued_at"),
            reclaim_paused=d.get("reclaim_paused", False),
            strike_at=d.get("strike_at"),
            recheck_at=d.get("recheck_at"),
            notice=d.get("notice"),
            notice_deadline=d.get("notice_deadline"),
            error=d.get("error"),
            detach_attempts=d.get("detach_attempts", 0),
            placement=tuple(sorted((d.get("placement") or {}).items())),
            last_check_at=d.get("last_check_at"),
            irq_baseline=tuple((str(a), int(n)) for a, n in d.get("irq_baseline", ())),
            preempted_by=d.get("preempted_by"),
            booked_gpus=tuple(d.get("booked_gpus", ())),
            adding=tuple(d.get("adding", ())),
            move=tuple(sorted((d.get("move") or {}).items())),
        )


# ---- arbitration -------------------------------------------------------------------------------------------


class Verdict(str, enum.Enum):
    """What arbitration decided for a request."""

    GRANT = "grant"
    PARTIAL = "partial"
    DEFER = "defer"
    REFUSE = "refuse"


@dataclass(frozen=True, slots=True)
class Arbitration:
    """Arbitration's answer: how many GPUs now, or queue, or refuse, and why."""

    verdict: Verdict
    count: int
    reason: str


@dataclass(frozen=True, slots=True)
class Waiting:
    """A queued request, as arbitration sees it."""

    lease_id: str
    priority: int
    queued_at: float
    gpus: int


def queue_order(waiting: Iterable[Waiting]) -> list[Waiting]:
    """Serve order: higher priority first, then older; equal times keep the order given (request order)."""
    return sorted(waiting, key=lambda w: (-w.priority, w.queued_at))


def arbitrate(request: LeaseRequest, free: int, feasible_total: int, waiting: Sequence[Waiting]) -> Arbitration:
    """Decide grant / partial / defer / refuse. Never preempts; a request never jumps a queued one of >= priority."""
    if feasible_total < request.gpus and not request.accept_partial:
        return Arbitration(
            Verdict.REFUSE, 0,
            f"this host has only {feasible_total} GPU(s) matching the request, {request.gpus} asked",
        )
    ahead = [w for w in waiting if w.priority >= request.priority]
    if ahead:
        if request.accept_deferred:
            return Arbitration(Verdict.DEFER, 0, f"{len(ahead)} request(s) of equal or higher priority are waiting")
        return Arbitration(
            Verdict.REFUSE, 0,
            f"{len(ahead)} request(s) of equal or higher priority are waiting; set accept_deferred to queue",
        )
    if free >= request.gpus:
        return Arbitration(Verdict.GRANT, request.gpus, f"{free} matching GPU(s) free")
    if request.accept_partial and free > 0:
        return Arbitration(Verdict.PARTIAL, free, f"only {free} of {request.gpus} GPU(s) free; partial grant accepted")
    if request.accept_deferred:
        return Arbitration(Verdict.DEFER, 0, f"only {free} of {request.gpus} GPU(s) free; queued")
    return Arbitration(
        Verdict.REFUSE, 0,
        f"only {free} of {request.gpus} matching GPU(s) free; set accept_deferred to queue or accept_partial",
    )


def estimate_eta(now: float, free: int, busy_until: Sequence[float], ahead: Sequence[int], need: int) -> float | None:
    """When `need` GPUs should be free for a request behind `ahead` (their GPU counts), from active leases' ends.

    Devices free in order of their expected end; each request ahead takes what it needs first. None when the
    active leases cannot free enough (unknown ends).
    """
    ends = sorted(max(now, t) for t in busy_until)
    pool = [now] * free + ends
    pool.sort()
    cursor = 0
    t = now
    for n in list(ahead) + [need]:
        if cursor + n > len(pool):
            return None
        t = max(t, pool[cursor + n - 1])
        cursor += n
    return t


@dataclass(frozen=True, slots=True)
class Quota:
    """Per-VM / per-project limits (0 means none). `max_priority`: the highest priority a guest in this class may
    ask for itself (None: the class sets none; a higher request is capped to the highest any of its classes allows)."""

    max_gpus: int = 0
    max_gpu_hours_per_day: float = 0.0
    max_priority: int | None = None

    @property
    def caps(self) -> bool:
        """Whether it limits how many GPUs its class may take (GPUs held, or GPU-hours a day)."""
        return bool(self.max_gpus or self.max_gpu_hours_per_day)


def new_lease(lease_id: str, domain_uuid: str, domain_name: str, request: LeaseRequest, now: float) -> Lease:
    """A fresh lease in REQUESTED."""
    return Lease(id=lease_id, domain_uuid=domain_uuid, domain_name=domain_name, request=request,
                 state=LeaseState.REQUESTED, created_at=now)


__all__ = [
    "DEFAULT_DURATION_S", "Arbitration", "Lease", "LeaseDevice", "LeaseRequest", "LeaseState", "Quota", "TRANSITIONS",
    "Verdict", "Waiting", "arbitrate", "check_transition", "estimate_eta", "new_lease",
    "parse_lease_request", "queue_order",
]
