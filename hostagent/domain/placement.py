"""Placement as pure values: hard filters, the cold-start rule, a bounded exploration rule and set choice.

The services layer builds `DeviceView`s and a `PlacementRequest`, passes a `Scorer` (the learned one from
``hostagent.learn``, or None until a model is active) and gets back a `Decision` that says which rule decided,
the top candidates with their scores and why every other device was dropped. Nothing here does I/O; randomness
comes in as an injected ``random.Random``.
"""

from __future__ import annotations

import logging
import math
import random
import re
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

from hostagent.domain.capabilities import Capabilities, Measured, capabilities
from hostagent.domain.errors import InvalidInput
from hostagent.domain.inventory import Gpu
from hostagent.domain.lease import LeaseRequest

log = logging.getLogger("hostagent.placement")

GIB = 1024**3
NUMA_POLICIES = ("required", "preferred", "any")
RULE_MODEL = "model"
RULE_COLD_START = "cold-start"
RULE_EXPLORE = "explore"
RULE_NONE = "none"

# PCIe transfer rate per lane (GT/s) -> generation, as sysfs prints it ("16.0 GT/s PCIe").
_GTS_TO_GEN = {2.5: 1, 5.0: 2, 8.0: 3, 16.0: 4, 32.0: 5, 64.0: 6}
_GTS = re.compile(r"(\d+(?:\.\d+)?)\s*GT/s")


def link_gen_from_speed(speed: str | None) -> int | None:
    """PCIe generation from a sysfs link speed string such as '16.0 GT/s PCIe'; None when unknown."""
    if not speed:
        return None
    m = _GTS.search(speed)
    return _GTS_TO_GEN.get(float(m.group(1))) if m else None


@dataclass(frozen=True, slots=True)
class DeviceView:
    """What placement knows of one GPU at decision time."""

    gpu_id: str
    model: str
    vendor: str = ""
    memory_bytes: int | None = None
    numa_node: int | None = None
    link_gen: int | None = None
    link_width: int | None = None
    switch_id: str | None = None  # upstream port of the PCIe switch the GPU sits behind, if any
    root_port: str | None = None
    probe_score: float | None = None  # measured speed relative to the model's nominal speed (1.0 = nominal)
    health_flags: tuple[str, ...] = ()  # active health problems (e.g. "xid-79"); any flag keeps the device out
    free: bool = True
    quarantined: bool = False
    viable: bool = True
    recent_errors: int = 0  # failed leases, probes or rebinds in the recent window
    capabilities: Capabilities | None = None  # features (domain.capabilities), None: not worked out (tests)
    # its measured figures (capability vector, task probes), if any; not part of its identity (a view is hashed:
    # the learned scorer's encoder caches a device's row by it, and a dict cannot be hashed)
    figures: Mapping[str, float] | None = field(default=None, compare=False, hash=False)

    @property
    def memory_gib(self) -> float | None:
        """Memory in GiB, None when unknown."""
        return None if self.memory_bytes is None else self.memory_bytes / GIB

    @classmethod
    def from_gpu(cls, gpu: Gpu, *, free: bool, quarantined: bool = False, probe_score: float | None = None,
                 health_flags: tuple[str, ...] = (), recent_errors: int = 0) -> DeviceView:
        """Build the view of an inventory GPU; topology ids come from its upstream bridge chain."""
        return cls(**_gpu_fields(gpu), probe_score=probe_score, health_flags=health_flags, free=free,
                   quarantined=quarantined, recent_errors=recent_errors)


def _gpu_fields(gpu: Gpu, nvlink: bool = False, measured: Measured | None = None) -> dict[str, Any]:
    """What a view takes from the inventory GPU itself (fixed for the Gpu object's life), whether the host's
    NVLink hints put it in a clique, and what its latest probe measured (capabilities, the capability vector)."""
    chain = gpu.primary.parent_chain  # nearest bridge first, root port last
    return {
        "gpu_id": gpu.id, "model": gpu.model, "vendor": gpu.vendor, "memory_bytes": gpu.memory_bytes,
        "numa_node": gpu.numa_node, "link_gen": link_gen_from_speed(gpu.primary.link_speed),
        "link_width": gpu.primary.link_width,
        # behind a switch the chain is (downstream port, upstream port, ..., root port)
        "switch_id": str(chain[-2]) if len(chain) >= 3 else None,
        "root_port": str(chain[-1]) if chain else None,
        "viable": gpu.viable,
        "capabilities": capabilities(gpu.primary.vendor_id, gpu.primary.device_name, nvlink=nvlink,
                                     measured=measured),
        "figures": None if measured is None else measured.figures,
    }


class DeviceViews:
    """DeviceView.from_gpu for a placer that decides again and again over the same inventory: what comes from the
    Gpu object (model, link, topology ids) is worked out once per object; a Gpu is immutable, and a rescan that
    replaces one is noticed by identity, as is a new probe's `Measured`."""

    def __init__(self) -> None:
        # gpu id -> (the Gpu, nvlink, its Measured, its fields, its views by (free, quarantined, probe score))
        self._fields: dict[str, tuple[Gpu, bool, Measured | None, dict[str, Any],
                                      dict[tuple[bool, bool, float | None], DeviceView]]] = {}

    def view(self, gpu: Gpu, *, free: bool, quarantined: bool = False, probe_score: float | None = None,
             nvlink: bool = False, measured: Measured | None = None) -> DeviceView:
        """The GPU's view at this decision (a view is immutable: the same one serves every decision that sees the
        GPU alike, free or not, quarantined or not, with the same probe score)."""
        hit = self._fields.get(gpu.id)
        if hit is None or hit[0] is not gpu or hit[1] != nvlink or hit[2] is not measured:
            hit = self._fields[gpu.id] = (gpu, nvlink, measured, _gpu_fields(gpu, nvlink, measured), {})
        key = (free, quarantined, probe_score)
        got = hit[4].get(key)
        if got is None:
            if len(hit[4]) >= _VIEWS_PER_GPU:  # probe scores drift: keep a few
                hit[4].clear()
            got = hit[4][key] = DeviceView(**hit[3], free=free, quarantined=quarantined, probe_score=probe_score)
        return got


_VIEWS_PER_GPU = 8  # views kept per GPU (free or not, quarantined or not, the latest probe scores)


@dataclass(frozen=True, slots=True)
class PlacementRequest:
    """What a placement needs to know of a lease request."""

    count: int = 1
    task_type: str = "unspecified"
    data_scale: float | None = None
    precision: str | None = None
    min_memory_gib: float = 0.0
    duration_s: float | None = None
    priority: int = 0
    vendor: str | None = None
    model: str | None = None
    numa_policy: str = "any"  # required | preferred | any
    vm_numa_node: int | None = None
    requires: tuple[str, ...] = ()  # features every chosen GPU must have

    def __post_init__(self) -> None:
        if self.count < 1:
            raise InvalidInput("count must be at least 1", field="gpus")
        if self.numa_policy not in NUMA_POLICIES:
            raise InvalidInput(f"numa_policy must be one of {', '.join(NUMA_POLICIES)}", field="numa_policy")
        if self.min_memory_gib < 0 or not math.isfinite(self.min_memory_gib):
            raise InvalidInput("min_memory_gib must be a finite number >= 0", field="min_memory_gib")

    @classmethod
    def from_lease(cls, request: LeaseRequest, *, count: int | None = None,
                   vm_numa_node: int | None = None) -> PlacementRequest:
        """Placement view of a lease request (count may be lower than asked for a partial grant)."""
        return cls(
            count=count if count is not None else request.gpus, task_type=request.task_type,
            data_scale=request.data_scale, precision=request.precision, min_memory_gib=request.min_memory_gib,
            duration_s=request.duration_s, priority=request.priority, vendor=request.vendor, model=request.model,
            # unset means "preferred": keeping a VM's GPUs near its memory never hurts, refusing might
            numa_policy=request.numa_policy or "preferred", vm_numa_node=vm_numa_node, requires=request.requires,
        )


class Dropped(NamedTuple):
    """A device a hard filter kept out, and why."""

    gpu_id: str
    reason: str


class Scorer(Protocol):
    """Ranks the devices that passed the filters; higher is better. The learned scorer implements it."""

    name: str

    def covers(self, request: PlacementRequest) -> bool:
        """Has this scorer seen enough of this kind of request to be trusted with it?"""

    def score(self, request: PlacementRequest, devices: Sequence[DeviceView]) -> list[float]:
        """One score per device, in order (one batched prediction)."""


@dataclass(frozen=True, slots=True)
class Exploration:
    """Bounded exploration: now and then try a near-best device so the model keeps learning about it."""

    epsilon: float = 0.05  # probability of exploring on a decision
    max_loss: float = 0.2  # only devices predicted within this fraction of the best are explored
    max_priority: int = 0  # requests above this priority never explore


@dataclass(frozen=True, slots=True)
class Decision:
    """The outcome of one placement, with its explanation."""

    chosen: tuple[str, ...]
    rule: str  # model | cold-start | explore | none
    candidates: tuple[tuple[str, float], ...] = ()  # the top survivors with their scores, best first
    dropped: tuple[Dropped, ...] = ()
    reasons: tuple[str, ...] = ()
    distance: float | None = None  # largest topology distance inside the chosen set (multi-GPU)


def _fmt_gib(x: float) -> str:
    return f"{x:.1f} GiB"


def _device_reason(request: PlacementRequest, d: DeviceView) -> str | None:
    """The first single-device filter that keeps d out, or None (a quarantined or unviable GPU is never free, and
    says so rather than "not free")."""
    if d.quarantined:
        return "quarantined"
    if not d.viable:
        return "IOMMU group not viable"
    if request.requires:
        caps = d.capabilities or Capabilities(None, "capabilities not worked out")
        if lacks := caps.lacks(request.requires):
            return f"lacks {', '.join(lacks)} ({caps.source})"
    if not d.free:
        return "not free: leased or being released"
    if d.health_flags:
        return f"unhealthy: {', '.join(d.health_flags)}"
    if request.min_memory_gib > 0:
        mem = d.memory_gib
        if mem is None:
            return f"memory unknown, request needs {_fmt_gib(request.min_memory_gib)}"
        if mem + 1e-9 < request.min_memory_gib:
            return f"memory {_fmt_gib(mem)} < {_fmt_gib(request.min_memory_gib)} requested"
    if request.vendor and request.vendor.casefold() not in d.vendor.casefold():
        return f"vendor {d.vendor!r} does not match {request.vendor!r}"
    if request.model and request.model.casefold() not in d.model.casefold():
        return f"model {d.model!r} does not match {request.model!r}"
    if (request.numa_policy == "required" and request.vm_numa_node is not None and d.numa_node is not None
            and d.numa_node != request.vm_numa_node):
        return f"NUMA node {d.numa_node} != VM's node {request.vm_numa_node} (numa_policy=required)"
    return None


def filter_devices(request: PlacementRequest,
                   devices: Sequence[DeviceView]) -> tuple[list[DeviceView], list[Dropped]]:
    """Apply the hard filters in order; every dropped device carries the first reason that kept it out."""
    survivors: list[DeviceView] = []
    dropped: list[Dropped] = []
    for d in devices:
        why = _device_reason(request, d)
        if why is None:
            survivors.append(d)
        else:
            dropped.append(Dropped(d.gpu_id, why))
    if request.numa_policy == "required" and request.count > 1:
        # a multi-GPU request that must stay on one node can only use nodes with enough eligible devices
        per_node: dict[int | None, int] = {}
        for d in survivors:
            per_node[d.numa_node] = per_node.get(d.numa_node, 0) + 1
        kept = []
        for d in survivors:
            n = per_node[d.numa_node]
            if d.numa_node is not None and n < request.count:
                dropped.append(Dropped(d.gpu_id, f"NUMA node {d.numa_node} has {n} eligible device(s), "
                                                 f"{request.count} needed on one node (numa_policy=required)"))
            else:
                kept.append(d)
        survivors = kept
    for gpu_id, why in dropped:
        log.debug("placement: %s dropped: %s", gpu_id, why)
    return survivors, dropped


def speed_figure(request: PlacementRequest, devices: Sequence[DeviceView]) -> tuple[str, str] | None:
    """Which measured figure the cold-start speed term reads, and in words: the task type's own probe
    (`work_rate:<task>`) where one measured any of `devices`, else the request's precision in the capability vector
    (`tflops_<precision>`); None when neither was measured."""
    keys = [(f"work_rate:{request.task_type}", f"measured {request.task_type} work rate (its task probe)")]
    if request.precision:
        keys.append((f"tflops_{request.precision}", f"measured {request.precision} speed (probes' capability vectors)"))
    return next(((k, said) for k, said in keys if any((d.figures or {}).get(k) for d in devices)), None)


def measured_speed(request: PlacementRequest, devices: Sequence[DeviceView]) -> list[float] | None:
    """Each device's measured speed for the request (`speed_figure`) relative to the fastest measured among
    `devices` (0..1; 0.5 for one not measured), or None when nothing was measured for it: the prior for models the
    learned scorer has not seen, comparable across models (unlike the peer-relative probe score)."""
    figure = speed_figure(request, devices)
    if figure is None:
        return None
    got = [(d.figures or {}).get(figure[0]) for d in devices]
    best = max(v for v in got if v)
    return [0.5 if v is None else max(0.0, v) / best for v in got]


def capability_prior(request: PlacementRequest, devices: Sequence[DeviceView], scores: Sequence[float],
                     unseen: Sequence[bool]) -> tuple[list[float], str | None]:
    """Scores for the devices of GPU models the learned scorer has no records of, from their measured speed
    (`speed_figure`, else FP16 throughput) against the devices it knows: the median over known devices k of
    score(k) x figure(unseen) / figure(k). A device without the figure, or with no known device measured, keeps the
    model's score. Returns the scores and what was done, in words (None when nothing was)."""
    figure = speed_figure(request, devices) or ("tflops_fp16", "measured fp16 speed (probes' capability vectors)")
    key = figure[0]
    known = [(scores[i], v) for i, d in enumerate(devices)
             if not unseen[i] and (v := (d.figures or {}).get(key))]
    out, priced = list(scores), []
    for i, d in enumerate(devices):
        mine = (d.figures or {}).get(key)
        if unseen[i] and mine and known:
            out[i] = statistics.median(s * mine / v for s, v in known)
            priced.append(d.model)
    if not priced:
        return out, None
    return out, (f"GPU models without records ({', '.join(sorted(set(priced)))}) scored from their "
                 f"{figure[1].removeprefix('measured ')} against the models with records")


def cold_start_scores(request: PlacementRequest, devices: Sequence[DeviceView]) -> list[float]:
    """The rule used until a model is trusted: tight memory fit, probe score, NUMA locality, few recent errors; and
    for a request that names a precision the devices' probes measured, their measured speed in it."""
    numa_weight = 0.25 if request.numa_policy == "any" else 1.0
    speeds = measured_speed(request, devices)
    out: list[float] = []
    for i, d in enumerate(devices):
        mem = d.memory_gib
        if request.min_memory_gib > 0 and mem:
            # best fit keeps the big devices for the requests that need them
            fit = min(1.0, request.min_memory_gib / mem)
        else:
            fit = 0.5
        probe = 1.0 if d.probe_score is None else max(0.0, min(2.0, d.probe_score))
        if request.vm_numa_node is None or d.numa_node is None:
            numa = 0.5
        else:
            numa = 1.0 if d.numa_node == request.vm_numa_node else 0.0
        penalty = min(0.5, 0.1 * d.recent_errors)
        speed = 0.0 if speeds is None else 0.4 * speeds[i]
        out.append(0.4 * fit + 0.4 * probe + 0.2 * numa_weight * numa + speed - penalty)
    return out


def numa_distance(a: DeviceView, b: DeviceView) -> float:
    """Topology distance between two GPUs: 0 same switch, 1 same root port or NUMA node, 2 across nodes."""
    if a.switch_id is not None and a.switch_id == b.switch_id:
        return 0.0
    if a.root_port is not None and a.root_port == b.root_port:
        return 1.0
    if a.numa_node is None or b.numa_node is None or a.numa_node == b.numa_node:
        return 1.0
    return 2.0


Distance = Callable[[DeviceView, DeviceView], float]


def choose_set(devices: Sequence[DeviceView], scores: Sequence[float], count: int, *,
               distance: Distance | None = None, numa_policy: str = "any",
               distance_weight: float = 0.05) -> tuple[list[int], float | None]:
    """Pick `count` device indices: best score first, then greedily the next best, penalised by distance.

    This is the seam for topology-aware multi-GPU choice; today it is a simple greedy.
    Returns the indices (best first) and the largest pairwise distance among them (None for one device).
    """
    if count > len(devices):
        raise InvalidInput(f"need {count} devices, only {len(devices)} eligible", field="gpus")
    order = sorted(range(len(devices)), key=lambda i: -scores[i])  # stable: ties keep the caller's order
    if count == 1:
        return [order[0]], None
    dist = distance or numa_distance
    if numa_policy == "required":
        # the filters left only nodes with enough devices: take the node whose best `count` score highest
        by_node: dict[int | None, list[int]] = {}
        for i in order:
            by_node.setdefault(devices[i].numa_node, []).append(i)
        groups = [ix[:count] for node, ix in by_node.items() if node is not None and len(ix) >= count]
        if not groups:
            groups = [order[:count]]  # no NUMA information on this platform: any set is on "one node"
        best = max(groups, key=lambda ix: sum(scores[i] for i in ix))
        return best, _spread(devices, best, dist)
    chosen = [order[0]]
    rest = order[1:]
    while len(chosen) < count:
        def value(i: int) -> float:
            far = max(dist(devices[i], devices[j]) for j in chosen)
            return scores[i] - distance_weight * far * (1.0 if numa_policy == "preferred" else 0.5)
        pick = max(rest, key=value)
        chosen.append(pick)
        rest.remove(pick)
    return chosen, _spread(devices, chosen, dist)


def _spread(devices: Sequence[DeviceView], ix: Sequence[int], dist: Distance) -> float | None:
    if len(ix) < 2:
        return None
    return max(dist(devices[a], devices[b]) for a in ix for b in ix if a < b)


@dataclass(frozen=True, slots=True)
class Scored:
    """One request's filters and scores: what every choice (greedy, topology, exploration) starts from."""

    survivors: tuple[DeviceView, ...]
    scores: tuple[float, ...]  # one per survivor; empty when too few survived
    dropped: tuple[Dropped, ...]
    rule: str  # model | cold-start | none (too few survivors)
    reason: str  # the rule in words, or why too few survived

    def ranked(self, top_k: int = 5) -> tuple[tuple[str, float], ...]:
        """The best `top_k` survivors with their scores, best first (ties keep the devices' order)."""
        order = sorted(range(len(self.scores)), key=lambda i: -self.scores[i])[:top_k]
        return tuple((self.survivors[i].gpu_id, self.scores[i]) for i in order)


def score_devices(request: PlacementRequest, devices: Sequence[DeviceView], scorer: Scorer | None = None) -> Scored:
    """Filter, then score the survivors: the learned model when it covers the request, else the cold-start rule."""
    survivors, dropped = filter_devices(request, devices)
    if len(survivors) < request.count:
        why = f"{len(survivors)} of {len(devices)} device(s) passed the filters, {request.count} needed"
        return Scored(tuple(survivors), (), tuple(dropped), RULE_NONE, why)
    if scorer is not None and scorer.covers(request):
        scores = [float(s) for s in scorer.score(request, survivors)]
        reason = f"rule=model: scored by {scorer.name} (predicted relative work rate)"
        unseen = getattr(scorer, "unseen", None)  # the learned scorer says which GPU models it has no records of
        if unseen is not None and any(mask := unseen(survivors)):
            scores, said = capability_prior(request, survivors, scores, mask)
            reason += f"; {said}" if said else ""
        return Scored(tuple(survivors), tuple(scores), tuple(dropped), RULE_MODEL, reason)
    why = "no active model" if scorer is None else f"{scorer.name} has too few records for this request"
    terms = "memory fit, probe score, NUMA locality"
    if (figure := speed_figure(request, survivors)) is not None:
        terms += f", {figure[1]}"
    return Scored(tuple(survivors), tuple(cold_start_scores(request, survivors)), tuple(dropped), RULE_COLD_START,
                  f"rule=cold-start ({why}): {terms}")


def explore(request: PlacementRequest, scored: Scored, best: str, exploration: Exploration | None,
            rng: random.Random | None) -> tuple[str, str] | None:
    """Now and then (single-GPU requests at or under the priority bound) a near-best survivor other than `best`,
    the chosen one: (its id, why). Under the model never more than `max_loss` of predicted speed is traded; the
    cold-start rule predicts nothing, so there any survivor is as good a guess."""
    ex = exploration
    if (ex is None or rng is None or ex.epsilon <= 0 or request.priority > ex.max_priority or request.count != 1
            or rng.random() >= ex.epsilon):
        return None
    ids = [d.gpu_id for d in scored.survivors]
    if best not in ids:
        return None
    top = scored.scores[ids.index(best)]
    bounded = scored.rule == RULE_MODEL
    if bounded:
        floor = top * (1.0 - ex.max_loss) if top > 0 else top - ex.max_loss * abs(top)
        pool = [g for g, s in zip(ids, scored.scores) if g != best and s >= floor]
    else:
        pool = [g for g in ids if g != best]
    if not pool:
        return None
    alt = rng.choice(pool)
    return alt, (f"rule=explore: tried {alt} instead of {best} (epsilon={ex.epsilon:g}, within {ex.max_loss:.0%} "
                 "of the best)" if bounded else f"rule=explore: tried {alt} at random (epsilon={ex.epsilon:g})")


def doubt_draw(exploration: Exploration | None, rng: random.Random | None, priority: int) -> float:
    """A draw for a queued request's doubt in deciding whether to wait for a better GPU (`domain.assignment`,
    `Candidate.doubt`): standard normal where the request may explore (exploration on, `epsilon` above 0, its priority
    at or under `max_priority`), else 0 (the prediction itself: the decision is deterministic)."""
    ex = exploration
    if ex is None or rng is None or ex.epsilon <= 0 or priority > ex.max_priority:
        return 0.0
    return rng.gauss()  # (mean 0, deviation 1: the defaults)


def place(request: PlacementRequest, devices: Sequence[DeviceView], *, scorer: Scorer | None = None,
          exploration: Exploration | None = None, rng: random.Random | None = None,
          distance: Distance | None = None, top_k: int = 5) -> Decision:
    """Filter, score (learned model when it covers the request, else the cold-start rule), choose, maybe explore."""
    scored = score_devices(request, devices, scorer)
    if scored.rule == RULE_NONE:
        return Decision((), RULE_NONE, (), scored.dropped, (scored.reason,))
    ix, spread = choose_set(scored.survivors, scored.scores, request.count, distance=distance,
                            numa_policy=request.numa_policy)
    picked = tuple(scored.survivors[i].gpu_id for i in ix)
    rule, reasons = scored.rule, [scored.reason]
    alt = explore(request, scored, picked[0], exploration, rng)
    if alt is not None:
        picked, rule = (alt[0],), RULE_EXPLORE
        reasons.append(alt[1])
    reasons.append(f"chose {', '.join(picked)} from {len(scored.survivors)} eligible; {len(scored.dropped)} dropped "
                   "by filters")
    return Decision(picked, rule, scored.ranked(top_k), scored.dropped, tuple(reasons), spread)
