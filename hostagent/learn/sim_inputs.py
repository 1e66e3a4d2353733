"""The simulator's inputs: the throughput table (ground truth), the host's GPUs and the job trace, read from CSV
and checked (`hostagent.learn.simulate` replays them; `hostagent.learn.evaluate` and `datasets` build them)."""

from __future__ import annotations

import csv
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from hostagent.domain.errors import InvalidInput


@dataclass(frozen=True, slots=True)
class Table:
    """Ground truth: throughput of each job type on each GPU model, and each job type's memory need."""

    thr: dict[tuple[str, str], float]
    need_gib: dict[str, float]

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
    """Read ``job_type,gpu_model,throughput[,memory_gib]``; a job type needs the most memory any of its rows says."""
    thr: dict[tuple[str, str], float] = {}
    need: dict[str, float] = {}
    for i, r in enumerate(_rows(path, ("job_type", "gpu_model", "throughput")), start=2):
        where = f"{path}:{i}"
        t = _float(r, "throughput", where)
        if t <= 0:
            raise InvalidInput(f"{where}: throughput must be > 0", field="throughput")
        key = (r["job_type"].strip(), r["gpu_model"].strip())
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
    """Refuse inputs the table cannot score; drop (and say so) jobs no set of devices on this host could run."""
    missing = sorted({(j, g.model) for j in {x.job_type for x in jobs} for g in host if (j, g.model) not in table.thr})
    if missing:
        raise InvalidInput(f"the throughput table has no row for {missing[0][0]} on {missing[0][1]} "
                           f"({len(missing)} missing pair(s))", field="throughputs")
    kept, notes = [], []
    for j in jobs:
        fits = sum(1 for g in host if g.memory_gib + 1e-9 >= table.need_gib.get(j.job_type, 0.0))
        if fits >= j.num_gpus:
            kept.append(j)
    if len(kept) < len(jobs):
        notes.append(f"{len(jobs) - len(kept)} job(s) dropped: more GPUs or memory than this host has")
    return [replace(j, index=k) for k, j in enumerate(kept)], notes


__all__ = ["Job", "SimGpu", "Table", "check_inputs", "load_host", "load_table", "load_trace"]
