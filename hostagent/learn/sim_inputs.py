"""The simulator's inputs: the throughput table (ground truth), the host's GPUs and the job trace, read from CSV
and checked (`hostagent.learn.simulate` replays them; `hostagent.learn.evaluate` and `datasets` build them)."""

from __future__ import annotations

import csv
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from hostagent.domain.errors import InvalidInput


@dataclass(frozen=True, slots=True)
class Table:
    """Ground truth: throughput of each job type on each GPU model, and each job type's memory need. A pair the table
    leaves out (or gives a throughput of 0) is one the job type cannot run on: published benchmark tables have such
    holes where a model ran out of memory or was not measured on a card."""

    thr: dict[tuple[str, str], float]
    need_gib: dict[str, float]
    # the job types the table has no throughput for on some of its GPU models
    holed: frozenset[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        models = {m for _, m in self.thr}
        object.__setattr__(self, "holed", frozenset(j for j, _ in self.thr
                                                    if any((j, m) not in self.thr for m in models)))

    def runs(self, job_type: str, model: str) -> bool:
        """Whether the job type can run on the GPU model (the table has its throughput)."""
        return (job_type, model) in self.thr

    def fits(self, job_type: str, gpu: SimGpu) -> bool:
        """Whether a job of the type can run on the device: it has the memory the type needs, and the table the
        type's throughput on its model."""
        return gpu.memory_gib + 1e-9 >= self.need_gib.get(job_type, 0.0) and self.runs(job_type, gpu.model)

    @property
    def job_types(self) -> list[str]:
        """Job types, sorted."""
        return sorted({j for j, _ in self.thr})

    @property
    def models(self) -> list[str]:
        """GPU models, sorted."""
        return sorted({m for _, m in self.thr})


@dataclass(frozen=True, slots=True)
class SimGpu:
    """One simulated device."""

    gpu_id: str
    model: str
    memory_gib: float
    numa_node: int | None
    health: float = 1.0


@dataclass(frozen=True, slots=True)
class Job:
    """One trace entry."""

    index: int
    arrival_s: float
    job_type: str
    work: float
    num_gpus: int
    priority: int = 0


def _rows(path: Path | str, required: Sequence[str]) -> list[dict[str, str]]:
    p = Path(path)
    if not p.is_file():
        raise InvalidInput(f"{p}: no such file", field=str(p))
    with p.open(newline="") as fh:
        reader = csv.DictReader(fh)
        missing = [c for c in required if c not in (reader.fieldnames or [])]
        if missing:
            raise InvalidInput(f"{p}: missing column(s) {', '.join(missing)}; header is {reader.fieldnames}",
                               field=missing[0])
        return list(reader)


def _float(row: dict[str, str], key: str, where: str, default: float | None = None) -> float:
    raw = (row.get(key) or "").strip()
    if not raw:
        if default is None:
            raise InvalidInput(f"{where}: {key} is empty", field=key)
        return default
    try:
        v = float(raw)
    except ValueError as exc:
        raise InvalidInput(f"{where}: {key}={raw!r} is not a number", field=key) from exc
    if not math.isfinite(v):
        raise InvalidInput(f"{where}: {key} must be finite", field=key)
    return v


def load_table(path: Path | str) -> Table:
    """Read ``job_type,gpu_model,throughput[,memory_gib]``; a job type needs the most memory any of its rows says. A
    throughput of 0, like a row left out, says the job type cannot run on that GPU model."""
    thr: dict[tuple[str, str], float] = {}
    need: dict[str, float] = {}
    for i, r in enumerate(_rows(path, ("job_type", "gpu_model", "throughput")), start=2):
        where = f"{path}:{i}"
        try:
            t = _float(r, "throughput", where)
        except InvalidInput as exc:
            raise InvalidInput(f"{exc}; where the job type cannot run on that GPU model (out of memory, not "
                               "measured), write 0 or leave the row out", field="throughput") from exc
        if t < 0:
            raise InvalidInput(f"{where}: throughput must be >= 0 (0: cannot run there)", field="throughput")
        key = (r["job_type"].strip(), r["gpu_model"].strip())
        if t > 0:
            thr[key] = t
            need[key[0]] = max(need.get(key[0], 0.0), _float(r, "memory_gib", where, 0.0))
    if not thr:
        raise InvalidInput(f"{path}: empty throughput table", field="throughputs")
    return Table(thr, need)


def load_host(path: Path | str) -> list[SimGpu]:
    """Read ``gpu_id,gpu_model,memory_gib,numa_node[,health_factor]``."""
    out = []
    for i, r in enumerate(_rows(path, ("gpu_id", "gpu_model", "memory_gib", "numa_node")), start=2):
        where = f"{path}:{i}"
        node = (r.get("numa_node") or "").strip()
        h = _float(r, "health_factor", where, 1.0)
        if h <= 0:
            raise InvalidInput(f"{where}: health_factor must be > 0", field="health_factor")
        out.append(SimGpu(r["gpu_id"].strip(), r["gpu_model"].strip(), _float(r, "memory_gib", where),
                          int(node) if node not in ("", "-1") else None, h))
    if not out:
        raise InvalidInput(f"{path}: a host needs at least one GPU", field="host")
    if len({g.gpu_id for g in out}) != len(out):
        raise InvalidInput(f"{path}: duplicate gpu_id", field="gpu_id")
    return out


def load_trace(path: Path | str) -> list[Job]:
    """Read ``arrival_s,job_type,work,num_gpus[,priority]``, sorted by arrival."""
    jobs = []
    for i, r in enumerate(_rows(path, ("arrival_s", "job_type", "work", "num_gpus")), start=2):
        where = f"{path}:{i}"
        n = int(_float(r, "num_gpus", where))
        work = _float(r, "work", where)
        if n < 1 or work <= 0:
            raise InvalidInput(f"{where}: num_gpus must be >= 1 and work > 0", field="num_gpus")
        jobs.append((_float(r, "arrival_s", where), r["job_type"].strip(), work, n,
                     int(_float(r, "priority", where, 0.0))))
    jobs.sort(key=lambda j: j[0])
    return [Job(k, *j) for k, j in enumerate(jobs)]


def check_inputs(table: Table, host: Sequence[SimGpu], jobs: Sequence[Job]) -> tuple[list[Job], list[str]]:
    """Refuse inputs the table cannot score (a GPU model or a job type it has no row for: most often a name spelt
    two ways); drop (and say so) jobs no set of devices on this host could run: too many GPUs, too much memory, or
    too few of the GPU models the table lets their type run on."""
    models = set(table.models)
    if unknown := sorted({g.model for g in host} - models):
        raise InvalidInput(f"the throughput table has no row for GPU model {unknown[0]} ({len(unknown)} of the host's "
                           f"GPU model(s) unknown; the table's are {', '.join(sorted(models))})", field="throughputs")
    types = set(table.job_types)
    if unknown := sorted({j.job_type for j in jobs} - types):
        raise InvalidInput(f"the throughput table has no row for job type {unknown[0]} ({len(unknown)} of the "
                           "trace's job type(s) unknown)", field="throughputs")
    kept, notes = [], []
    for j in jobs:
        fits = sum(1 for g in host if table.fits(j.job_type, g))
        if fits >= j.num_gpus:
            kept.append(j)
    if len(kept) < len(jobs):
        notes.append(f"{len(jobs) - len(kept)} job(s) dropped: more GPUs or memory than this host has (of the GPU "
                     "models the table lets them run on)")
    return [replace(j, index=k) for k, j in enumerate(kept)], notes


__all__ = ["Job", "SimGpu", "Table", "check_inputs", "load_host", "load_table", "load_trace"]
