"""Requests in the tenant's terms, turned into GPU counts: `total_memory_gib` (the fewest GPUs that hold it between
them) and `requires` (features every GPU must have), checked against what this host has before anything is
decided, so a request no GPU here could ever serve is refused at once with what the host has instead; and what the
records say of a task type's scaling (`Scaling`: past how many GPUs it stops gaining).
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from hostagent.domain.capabilities import Capabilities
from hostagent.domain.errors import Conflict
from hostagent.domain.inventory import Gpu
from hostagent.domain.lease import MAX_GPUS_PER_REQUEST, LeaseRequest

GIB = 1024**3


def _gib(x: float) -> str:
    return f"{x:.1f} GiB"


def check_requires(request: LeaseRequest, gpus: Sequence[Gpu], caps: Callable[[Gpu], Capabilities]) -> None:
    """Conflict (field `requires`) when no GPU of `gpus` (those the request's other filters admit) has every
    required feature: what the host's models have instead."""
    if not request.requires or any(not caps(g).lacks(request.requires) for g in gpus):
        return
    seen: dict[str, str] = {}
    for g in gpus:
        c = caps(g)
        seen.setdefault(g.model, "unknown" if c.features is None else (", ".join(sorted(c.features)) or "none"))
    have = "; ".join(f"{model}: {feats}" for model, feats in sorted(seen.items())) or "no GPU passes the other filters"
    raise Conflict(f"no GPU on this host has {', '.join(request.requires)} (its GPUs have: {have})",
                   field="requires")


def resolve_memory(request: LeaseRequest, gpus: Sequence[Gpu]) -> tuple[LeaseRequest, str | None]:
    """A `total_memory_gib` request as a GPU count: the fewest n GPUs of `gpus` (those the request's other filters
    admit, free or not) of which each holds at least total / n (a model sharded evenly), and at least the
    request's `min_memory_gib`. Returns the request with `gpus` and `min_memory_gib` set, and the note saying so;
    Conflict (field `total_memory_gib`) when no set of this host's GPUs holds it."""
    total = request.total_memory_gib
    if total is None:
        return request, None
    mems = sorted((g.memory_bytes / GIB for g in gpus if g.memory_bytes), reverse=True)
    for n in range(1, min(len(mems), MAX_GPUS_PER_REQUEST) + 1):
        share = max(total / n, request.min_memory_gib)
        if mems[n - 1] + 1e-9 >= share:
            note = (f"total_memory_gib {total:g}: {n} GPU(s) of at least {_gib(share)} each, the fewest that hold it "
                    "sharded evenly")
            return dataclasses.replace(request, gpus=n, min_memory_gib=round(share, 6)), note
    unknown = sum(1 for g in gpus if not g.memory_bytes)
    raise Conflict(f"no set of this host's GPUs holds {total:g} GiB sharded evenly: the {len(mems)} that could serve "
                   f"hold {_gib(sum(mems))} in all, the largest {_gib(mems[0]) if mems else '-'}"
                   + (f" ({unknown} more of unknown memory)" if unknown else ""), field="total_memory_gib")


def resolve_throughput(request: LeaseRequest, rates: Sequence[float], model: str,
                       scaling: Scaling | None) -> tuple[LeaseRequest, str]:
    """A `target_work_rate` request as a GPU count: the fewest n whose n fastest of `rates` (each GPU's predicted
    work rate for the task type, among those the request's filters admit, free or not) sum to the target, no more
    than where the records show the task type stops gaining (`scaling`). Conflict (field `target_work_rate`) when
    no set reaches it."""
    target, task = request.target_work_rate or 0.0, request.task_type
    ranked = sorted(rates, reverse=True)
    limit = scaling.limit if scaling is not None else None
    most = min(len(ranked), MAX_GPUS_PER_REQUEST, limit or MAX_GPUS_PER_REQUEST)
    total = 0.0
    for n in range(1, most + 1):
        total += ranked[n - 1]
        if total >= target:
            return dataclasses.replace(request, gpus=n), (
                f"target_work_rate {target:g}/s of {task}: {n} GPU(s), the fewest that model {model} predicts reach "
                f"it ({total:.4g}/s on the fastest {n} here)")
    why = (f"; {scaling.say()}" if scaling is not None and limit is not None and limit < len(ranked) else "")
    raise Conflict(f"no set of this host's GPUs is predicted to reach {target:g}/s of {task}: model {model} predicts at "
                   f"most {total:.4g}/s, with {most} GPU(s){why}", field="target_work_rate")


MIN_GAIN = 0.10  # a GPU count gains over the next smaller one recorded when its median total rate is this much higher
MIN_LEASES = 3  # finished leases of one GPU count a task type needs before that count's median is believed


@dataclass(frozen=True, slots=True)
class Scaling:
    """What the records say of a task type's total work rate by GPU count: for each count with at least MIN_LEASES
    finished leases that reported work, the median of (per-GPU work rate x GPUs) over them."""

    task_type: str
    totals: Mapping[int, float]  # GPU count -> median total work rate (the tenant's unit per second)

    @property
    def limit(self) -> int | None:
        """The count past which the next recorded count gains less than MIN_GAIN; None where every recorded count
        gained (or fewer than two are recorded)."""
        counts = sorted(self.totals)
        for a, b in zip(counts, counts[1:]):
            if self.totals[b] / self.totals[a] < 1 + MIN_GAIN - 1e-9:
                return a
        return None

    def say(self) -> str:
        """The finding, with its figures."""
        figures = ", ".join(f"{n} GPU(s) {self.totals[n]:.3g}/s" for n in sorted(self.totals))
        return (f"the records show {self.task_type} gains less than {MIN_GAIN:.0%} past {self.limit} GPU(s) "
                f"(median total work rate: {figures})")


def scaling_totals(leases: Sequence[tuple[str, int, float]]) -> dict[str, dict[int, float]]:
    """Per task type, the median total work rate by GPU count from (task type, GPUs, per-GPU work rate) of finished
    leases; counts with fewer than MIN_LEASES leases are left out, and task types with fewer than two counts."""
    by: dict[str, dict[int, list[float]]] = {}
    for task, n, rate in leases:
        by.setdefault(task, {}).setdefault(n, []).append(rate * n)
    out: dict[str, dict[int, float]] = {}
    for task, counts in by.items():
        kept = {n: statistics.median(v) for n, v in counts.items() if len(v) >= MIN_LEASES}
        if len(kept) >= 2:
            out[task] = kept
    return out
