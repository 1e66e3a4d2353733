"""Generators of the simulator's three CSVs from real public data (and one synthetic table, labelled as such).

- ``sia-table``: Sia (SOSP'23) measured best samples/s of 6 workloads on one GPU of each of 5 models
  (``sia/sia_single_gpu_summary.csv``; A100 takes the better of the ``dgx``/``dgx-ext`` measurements).
- ``host``: a host CSV from an explicit mix (``T4:2,V100:2``) or drawn from the Alibaba v2023 fleet's GPU-model
  mix (``alibaba_v2023/openb_node_list_gpu_node.csv``, weighted by GPU count).
- ``trace``: inter-arrival gaps (reshuffled), durations and GPU counts of a seeded window of real Philly jobs (``sia/philly_jobs.csv``);
  job types drawn uniformly from the table; ``work = duration * harmonic-mean rate of the job type on this
  host``, so a Philly duration is what the job takes, on average, on a device picked at random; gaps scaled to a target offered load.
- ``synthetic-table``: seeded synthetic throughputs (per-model base speed x per-(job, model) log-normal affinity)
  and memory needs (4..20 GiB), to show the harness on a table that is not Sia's; ``--holes`` leaves a share of the
  pairs out (job types that cannot run on some GPU models, as in published benchmark tables).
- ``roofline-table``: throughputs from the roofline model over vendor spec-sheet figures (`ROOFLINE_GPUS`: peak
  FP32 and dense FP16-tensor TFLOP/s, memory bandwidth, memory size) for job types defined by their arithmetic
  intensity (`ROOFLINE_JOBS`: FLOPs per byte of memory traffic, FP16-tensor or FP32, memory need). One unit of
  work is 1 TFLOP, moving ``1 / intensity`` TB; it takes ``1 / peak + (1 / intensity) / bandwidth`` seconds (compute
  and memory traffic not overlapped), so ``throughput = 1 / (1 / peak + 1 / (intensity * bandwidth))`` units/s
  (peak in TFLOP/s, bandwidth in TB/s). Memory-bound jobs rank the GPUs by bandwidth, compute-bound ones by peak:
  a third table whose task types' speedups differ for a reason, not by a random draw.
- ``all``: every file of the three scenarios into one directory.

Data comes from ``--data`` (default ``../shared/data`` relative to the repository).
"""

from __future__ import annotations

import argparse
import csv
import math
import random
import sys
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path

from hostagent.domain.errors import InvalidInput
from hostagent.domain.inventory import memory_from_name

REPO = Path(__file__).resolve().parents[2]
DEFAULT_DATA = REPO.parent / "shared" / "data"
SIA_GPU = {"aws": "T4", "azure": "V100", "dgx": "A100", "dgx-ext": "A100", "quad": "RTX6000", "rtx": "RTX2080Ti"}
# Memory of the GPU models named in the data sets (vendor specs). Alibaba anonymises G2/G3: the values here are
# assumptions for the synthetic scenario only.
MEMORY_GIB = {"T4": 16, "V100": 32, "A100": 40, "RTX6000": 24, "RTX2080Ti": 11, "P100": 16, "V100M16": 16,
              "V100M32": 32, "A10": 24, "L4": 24, "G2": 24, "G3": 32}
SIA_HOST_MIX = "T4:2,V100:2,A100:2,RTX6000:1,RTX2080Ti:1"

# GPU model -> (peak FP32 TFLOP/s, peak dense FP16 tensor TFLOP/s, memory bandwidth GB/s, memory GB), each figure
# from the vendor's own datasheet (NVIDIA; "with sparsity" figures halved to dense):
#   P100:      Tesla P100 PCIe 16 GB datasheet: FP32 9.3, FP16 18.7 (no tensor cores: its FP16 peak), 732 GB/s
#   T4:        NVIDIA T4 datasheet: FP32 8.1, mixed precision (FP16/FP32) 65, 320 GB/s, 16 GB
#   V100:      Tesla V100 datasheet, SXM2: FP32 15.7, tensor 125, 900 GB/s, 32 GB
#   RTX6000:   Quadro RTX 6000 datasheet: FP32 16.3, tensor 130.5, 672 GB/s, 24 GB
#   RTX2080Ti: NVIDIA Turing architecture whitepaper, GeForce RTX 2080 Ti reference board: FP32 13.4, FP16 tensor
#              with FP32 accumulate (what training uses) 53.8, 616 GB/s, 11 GB
#   A100:      A100 Tensor Core GPU datasheet, A100 40 GB: FP32 19.5, FP16 tensor 312, 1555 GB/s
#   A10:       A10 Tensor Core GPU datasheet: FP32 31.2, FP16 tensor 125, 600 GB/s, 24 GB
#   L4:        L4 Tensor Core GPU datasheet: FP32 30.3, FP16 tensor 242 with sparsity (121 dense), 300 GB/s, 24 GB
# (Not Gavel's simulation throughputs nor Lambda's benchmark tables: those are reserved for an independent evaluation.)
ROOFLINE_GPUS: dict[str, tuple[float, float, float, float]] = {
    "P100": (9.3, 18.7, 732.0, 16), "T4": (8.1, 65.0, 320.0, 16), "V100": (15.7, 125.0, 900.0, 32),
    "RTX6000": (16.3, 130.5, 672.0, 24), "RTX2080Ti": (13.4, 53.8, 616.0, 11), "A100": (19.5, 312.0, 1555.0, 40),
    "A10": (31.2, 125.0, 600.0, 24), "L4": (30.3, 121.0, 300.0, 24),
}
# job type -> (arithmetic intensity in FLOPs per byte of memory traffic, precision, memory need GiB): a spread from
# memory-bound (embedding lookups, small-batch decoding, stencils) to compute-bound (large GEMMs, convolutions)
ROOFLINE_JOBS: dict[str, tuple[float, str, float]] = {
    "transformer-train-fp16": (150.0, "fp16", 20), "cnn-train-fp16": (60.0, "fp16", 12),
    "llm-decode-fp16": (4.0, "fp16", 20), "gemm-fp32": (100.0, "fp32", 4), "cnn-train-fp32": (40.0, "fp32", 8),
    "rnn-fp32": (10.0, "fp32", 6), "recsys-embedding-fp32": (1.5, "fp32", 14), "stencil-fp32": (0.5, "fp32", 4),
}
ROOFLINE_HOST_MIX = "P100:2,T4:2,V100:2,RTX6000:1,RTX2080Ti:1,A100:1,A10:2,L4:1"


def data_dir(path: str | Path | None) -> Path:
    """The shared data directory, or a clear error naming where it was looked for."""
    p = Path(path) if path else DEFAULT_DATA
    if not (p / "sia").is_dir():
        raise InvalidInput(f"data directory {p} has no sia/ folder: pass --data DIR (the shared data set, "
                           f"see its README.md)", field="data")
    return p


def sia_table(data: Path) -> list[dict[str, object]]:
    """Rows job_type,gpu_model,throughput from Sia's single-GPU summary (best samples/s per model)."""
    best: dict[tuple[str, str], float] = {}
    with (data / "sia" / "sia_single_gpu_summary.csv").open(newline="") as fh:
        for r in csv.DictReader(fh):
            model = SIA_GPU.get(r["gpu_type"])
            if model is None:
                continue
            key = (r["model"], model)
            best[key] = max(best.get(key, 0.0), float(r["best_samples_per_sec"]))
    # Sia measured every workload on the 11 GB RTX 2080 Ti, so no workload needs more memory than every GPU has:
    # the table carries no memory_gib column rather than an invented one
    return [{"job_type": j, "gpu_model": m, "throughput": round(t, 6)} for (j, m), t in sorted(best.items())]


def synthetic_table(seed: int, models: Sequence[str], job_types: int = 8, holes: float = 0.0) -> list[dict[str, object]]:
    """A seeded synthetic table: base speed per model x log-normal affinity per (job, model); memory needs 4..20 GiB.
    ``holes``: the share of (job, model) pairs left out (the job type cannot run on that model, as where a published
    benchmark ran out of memory), drawn from a stream of their own, so the rows kept are those of the table without
    holes; every job type keeps at least one model."""
    if not 0.0 <= holes < 1.0:
        raise InvalidInput(f"--holes must be in [0, 1), not {holes}", field="holes")
    rows = _synthetic_rows(random.Random(seed), models, job_types)
    if holes <= 0.0:
        return rows
    drop = random.Random(seed * 7919 + 5)
    out: list[dict[str, object]] = []
    for k in range(job_types):
        mine = [r for r in rows if r["job_type"] == f"job{k}"]
        kept = [r for r in mine if drop.random() >= holes]
        out += kept or [max(mine, key=lambda r: float(str(r["throughput"])))]
    return out


def _synthetic_rows(rng: random.Random, models: Sequence[str], job_types: int) -> list[dict[str, object]]:
    """Every (job, model) row of the synthetic table."""
    base = {m: math.exp(rng.gauss(0.0, 0.5)) for m in models}
    rows: list[dict[str, object]] = []
    for k in range(job_types):
        job = f"job{k}"
        scale = 10 ** rng.uniform(1, 4)  # job types count work in very different units
        need = rng.choice([4, 8, 12, 20])
        for m in models:
            rows.append({"job_type": job, "gpu_model": m,
                         "throughput": round(scale * base[m] * math.exp(rng.gauss(0.0, 0.6)), 6),
                         "memory_gib": need})
    return rows


def roofline_throughput(gpu: tuple[float, float, float, float], intensity: float, precision: str) -> float:
    """Units of work (1 TFLOP each) per second: ``1 / (1 / peak + 1 / (intensity * bandwidth))``."""
    fp32, fp16, bw_gbs, _ = gpu
    peak = fp16 if precision == "fp16" else fp32
    return 1.0 / (1.0 / peak + 1.0 / (intensity * bw_gbs / 1000.0))


def roofline_table(models: Sequence[str] | None = None) -> list[dict[str, object]]:
    """Rows job_type,gpu_model,throughput,memory_gib from the roofline model over the spec-sheet figures."""
    names = list(models) if models else list(ROOFLINE_GPUS)
    unknown = [m for m in names if m not in ROOFLINE_GPUS]
    if unknown:
        raise InvalidInput(f"no spec-sheet figures for {unknown[0]!r}; known: {', '.join(ROOFLINE_GPUS)}",
                           field="models")
    return [{"job_type": job, "gpu_model": m,
             "throughput": round(roofline_throughput(ROOFLINE_GPUS[m], intensity, precision), 6), "memory_gib": need}
            for job, (intensity, precision, need) in ROOFLINE_JOBS.items() for m in names]


def host_from_mix(mix: str, *, numa_nodes: int = 2, degrade: Sequence[tuple[int, float]] = ()) -> list[dict[str, object]]:
    """Host rows from 'MODEL:COUNT[:MEMORY_GIB],...'; devices split evenly over NUMA nodes in order. A model's
    memory is the one given, else the data sets' figure (`MEMORY_GIB`), else the size its name carries or the agent
    knows it by ('A100 80GB', 'Tesla P40': `domain.inventory.memory_from_name`); a model with none of these must
    give it."""
    models: list[tuple[str, float]] = []
    for part in mix.split(","):
        fields = [f.strip() for f in part.split(":")]
        name, count, memory = (fields + ["", ""])[:3]
        count = count or "1"
        if not name or len(fields) > 3:
            raise InvalidInput(f"bad host mix entry {part.strip()!r}: give MODEL:COUNT or MODEL:COUNT:MEMORY_GIB",
                               field="mix")
        try:
            n = int(count)
            gib = float(memory) if memory else _memory_gib(name)
        except ValueError:
            raise InvalidInput(f"bad host mix entry {part.strip()!r}: COUNT is a whole number and MEMORY_GIB a "
                               f"number", field="mix") from None
        if gib is None:
            raise InvalidInput(f"no memory figure for GPU model {name!r}: give it as {name}:{count}:MEMORY_GIB "
                               f"(known without it: {', '.join(sorted(MEMORY_GIB))}, and names that carry their "
                               f"size, e.g. 'A100 80GB')", field="mix")
        if n < 1 or not gib > 0 or not math.isfinite(gib):
            raise InvalidInput(f"bad host mix entry {part.strip()!r}: COUNT and MEMORY_GIB must be above 0",
                               field="mix")
        models += [(name, gib)] * n
    health = dict(degrade)
    total = len(models)
    return [{"gpu_id": f"gpu{i}", "gpu_model": m, "memory_gib": int(gib) if gib == int(gib) else gib,
             "numa_node": i * numa_nodes // total, "health_factor": health.get(i, 1.0)}
            for i, (m, gib) in enumerate(models)]


def _memory_gib(model: str) -> float | None:
    """A GPU model's memory in GiB without a figure given: the data sets' (`MEMORY_GIB`), else the agent's own
    (`domain.inventory.memory_from_name`: a size in the name, or a model it knows); None when neither has one."""
    if model in MEMORY_GIB:
        return float(MEMORY_GIB[model])
    got = memory_from_name(model)
    return None if got is None else got / 1024**3


def alibaba_mix(data: Path, n: int, seed: int) -> str:
    """A host mix of n GPUs drawn from the Alibaba v2023 fleet's model distribution (weighted by GPU count)."""
    weights: dict[str, int] = {}
    with (data / "alibaba_v2023" / "openb_node_list_gpu_node.csv").open(newline="") as fh:
        for r in csv.DictReader(fh):
            weights[r["model"]] = weights.get(r["model"], 0) + int(r["gpu"])
    rng = random.Random(seed)
    names = sorted(weights)
    drawn = rng.choices(names, weights=[weights[k] for k in names], k=n)
    counts = {m: drawn.count(m) for m in names if m in drawn}
    return ",".join(f"{m}:{c}" for m, c in sorted(counts.items()))


def philly_trace(data: Path, table: list[dict[str, object]], host: list[dict[str, object]], *, jobs: int,
                 load: float, seed: int, max_gpus: int = 2, min_duration_s: float = 60.0,
                 max_duration_s: float = 2 * 3600.0, high_priority: float = 0.1,
                 consecutive: bool = False) -> list[dict[str, object]]:
    """A trace from a seeded window of consecutive Philly jobs, scaled to the offered load on this host."""
    raw = []
    with (data / "sia" / "philly_jobs.csv").open(newline="") as fh:
        for r in csv.DictReader(fh):
            n = int(float(r["num_gpus"]))
            if 1 <= n <= max_gpus and float(r["duration"]) > 0:
                raw.append((datetime.fromisoformat(r["timestamp"]).timestamp(), float(r["duration"]), n))
    raw.sort()
    if len(raw) < jobs:
        raise InvalidInput(f"only {len(raw)} Philly jobs fit --max-gpus {max_gpus}", field="jobs")
    rng = random.Random(seed)
    start = rng.randrange(0, len(raw) - jobs + 1)
    window = raw[start:start + jobs]
    if not consecutive:
        # Keep the window's own inter-arrival gaps but shuffle their order: the gap distribution (bursts of
        # sweeps included) stays Philly's, while month-long swings in submission rate, which would make a
        # fixed "offered load" meaningless (2x over capacity one week, idle the next), are spread evenly.
        gaps = [b[0] - a[0] for a, b in zip(window, window[1:])]
        rng.shuffle(gaps)
        t = window[0][0]
        times = [t]
        for g in gaps:
            t += g
            times.append(t)
        window = [(ts, d, n) for ts, (_, d, n) in zip(times, window)]
    # a pair the table leaves out (or gives 0) is one the job type cannot run on (sim_inputs.Table)
    thr = {(str(r["job_type"]), str(r["gpu_model"])): float(str(r["throughput"])) for r in table
           if float(str(r["throughput"])) > 0}
    models = {str(g["gpu_model"]) for g in host}
    if unknown := sorted(models - {m for _, m in thr}):
        raise InvalidInput(f"the table has no throughput for GPU model {unknown[0]}", field="table")
    # harmonic mean: the rate at which a job type's work gets done on a device picked at random from this host
    # (the mean *time* per unit of work), so that "offered load" is the load that random placement would see
    need = {j: max(float(r.get("memory_gib") or 0.0) for r in table if r["job_type"] == j) for j, _ in thr}  # type: ignore[arg-type]
    mean_rate: dict[str, float] = {}
    for j in sorted(need):
        fits = [g for g in host if float(str(g["memory_gib"])) + 1e-9 >= need[j] and (j, str(g["gpu_model"])) in thr]
        slowness = [1.0 / (thr[(j, str(g["gpu_model"]))] * float(str(g.get("health_factor", 1.0)))) for g in fits]
        if fits:  # a job type no GPU of this host can run is not drawn
            mean_rate[j] = len(fits) / sum(slowness)
    types = sorted(mean_rate)
    if not types:
        raise InvalidInput("no job type of the table can run on any GPU of this host (memory, or no throughput "
                           "for the host's GPU models)", field="table")
    durations = [min(max_duration_s, max(min_duration_s, d)) for _, d, _ in window]
    gpu_seconds = sum(d * n for d, (_, _, n) in zip(durations, window))
    span = window[-1][0] - window[0][0] or 1.0
    # offered load = GPU-seconds asked / (GPU-seconds the host offers over the arrival span)
    scale = gpu_seconds / (load * span * len(host))
    t0 = window[0][0]
    rows: list[dict[str, object]] = []
    for (ts, _, n), d in zip(window, durations):
        job = rng.choice(types)
        rows.append({"arrival_s": round((ts - t0) * scale, 3), "job_type": job,
                     "work": round(d * mean_rate[job], 6), "num_gpus": n,
                     "priority": 1 if rng.random() < high_priority else 0})
    return rows


def write_csv(path: Path, rows: list[dict[str, object]]) -> None:
    """Write rows (dicts with the same keys) to a CSV file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def read_csv(path: Path) -> list[dict[str, object]]:
    """Read a CSV written by this module."""
    with path.open(newline="") as fh:
        return list(csv.DictReader(fh))


def main(argv: Sequence[str] | None = None) -> int:
    """CLI: ``python -m hostagent.learn.datasets {sia-table,synthetic-table,roofline-table,host,trace,all} ...``."""
    ap = argparse.ArgumentParser(prog="python -m hostagent.learn.datasets", description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", help=f"shared data directory (default {DEFAULT_DATA})")
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("sia-table")
    s.add_argument("--out", required=True, type=Path)
    s = sub.add_parser("synthetic-table")
    s.add_argument("--out", required=True, type=Path)
    s.add_argument("--models", default="P100,T4,V100M16,V100M32,A10,G2,G3")
    s.add_argument("--job-types", type=int, default=8)
    s.add_argument("--seed", type=int, default=1)
    s.add_argument("--holes", type=float, default=0.0,
                   help="share of (job type, GPU model) pairs left out: the job type cannot run there (default 0)")
    s = sub.add_parser("roofline-table")
    s.add_argument("--out", required=True, type=Path)
    s.add_argument("--models", default=",".join(ROOFLINE_GPUS))
    s = sub.add_parser("host")
    s.add_argument("--out", required=True, type=Path)
    s.add_argument("--mix", help=f"MODEL:COUNT[:MEMORY_GIB],... (e.g. {SIA_HOST_MIX}; roofline: {ROOFLINE_HOST_MIX}; "
                                 f"K80:4:12 for a model with no memory figure here)")
    s.add_argument("--alibaba", type=int, metavar="N", help="draw N GPUs from the Alibaba v2023 fleet mix")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--numa-nodes", type=int, default=2)
    s = sub.add_parser("trace")
    s.add_argument("--out", required=True, type=Path)
    s.add_argument("--table", required=True, type=Path)
    s.add_argument("--host", required=True, type=Path)
    s.add_argument("--jobs", type=int, default=3000)
    s.add_argument("--load", type=float, default=0.85)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--max-gpus", type=int, default=2)
    s.add_argument("--max-duration-s", type=float, default=2 * 3600.0)
    s.add_argument("--consecutive", action="store_true", help="keep Philly's gap order (bursty, non-stationary)")
    s = sub.add_parser("all")
    s.add_argument("--out", required=True, type=Path)
    s.add_argument("--jobs", type=int, default=3000)
    s.add_argument("--load", type=float, default=0.85)
    s.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    try:
        if args.cmd == "sia-table":
            write_csv(args.out, sia_table(data_dir(args.data)))
        elif args.cmd == "synthetic-table":
            write_csv(args.out, synthetic_table(args.seed, args.models.split(","), args.job_types, args.holes))
        elif args.cmd == "roofline-table":
            write_csv(args.out, roofline_table(args.models.split(",")))
        elif args.cmd == "host":
            if bool(args.mix) == bool(args.alibaba):
                raise InvalidInput("give exactly one of --mix or --alibaba", field="mix")
            mix = args.mix or alibaba_mix(data_dir(args.data), args.alibaba, args.seed)
            write_csv(args.out, host_from_mix(mix, numa_nodes=args.numa_nodes))
        elif args.cmd == "trace":
            write_csv(args.out, philly_trace(data_dir(args.data), read_csv(args.table), read_csv(args.host),
                                             jobs=args.jobs, load=args.load, seed=args.seed, max_gpus=args.max_gpus,
                                             max_duration_s=args.max_duration_s, consecutive=args.consecutive))
        else:
            data = data_dir(args.data)
            out: Path = args.out
            table = sia_table(data)
            host = host_from_mix(SIA_HOST_MIX)
            write_csv(out / "sia_table.csv", table)
            write_csv(out / "sia_host.csv", host)
            write_csv(out / "sia_trace.csv", philly_trace(data, table, host, jobs=args.jobs, load=args.load,
                                                          seed=args.seed))
            models = ["P100", "T4", "V100M16", "V100M32", "A10", "G2", "G3"]
            syn = synthetic_table(args.seed + 1, models)
            ahost = host_from_mix(alibaba_mix(data, 16, args.seed))
            write_csv(out / "synthetic_table.csv", syn)
            write_csv(out / "alibaba_host.csv", ahost)
            write_csv(out / "synthetic_trace.csv", philly_trace(data, syn, ahost, jobs=args.jobs, load=args.load,
                                                                seed=args.seed + 1))
            roof = roofline_table()
            rhost = host_from_mix(ROOFLINE_HOST_MIX)
            write_csv(out / "roofline_table.csv", roof)
            write_csv(out / "roofline_host.csv", rhost)
            write_csv(out / "roofline_trace.csv", philly_trace(data, roof, rhost, jobs=args.jobs, load=args.load,
                                                               seed=args.seed + 2))
    except InvalidInput as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
