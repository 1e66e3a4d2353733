"""Multi-trace evaluation: the simulator's policies over many traces at several offered loads, with confidence.

One trace is one draw: heavy-tailed Philly durations queued FIFO make one trace's mean JCT swing by tens of percent
with a single early choice. So this runs every policy on N traces per offered load (generated from the shared
Philly data with trace seeds S..S+N-1, ``datasets.philly_trace``) or on given trace files (each grouped by the
offered load measured from it, as the generator defines it), one (trace, policy, seed) per process, and reports per
load and policy, over the traces that every policy ran:

- mean JCT averaged over traces, with a 95 % confidence interval across traces (Student t, n - 1 degrees of
  freedom: ``t * stdev / sqrt(n)``); the mean over traces of p99 JCT, of mean and p99 queue wait, of mean regret;
  memory violations (summed);
- ratios of the means: JCT / ``matching-oracle``'s, JCT / the best simple rule's (the lowest mean JCT of
  random, first-fit, best-fit-memory, fastest-model at that load), p99 wait / ``first-fit``'s;
- paired ratios: the policy's JCT over ``matching-oracle``'s (and over the best simple rule's) on each trace, then
  their mean and 95 % CI: traces differ far more than policies do, so the paired figure is the sharper one;
- a "targets" block (issue #21): at loads >= 0.85, ``model`` has the lowest mean JCT of the non-oracle policies,
  is within 5 % of ``matching-oracle``, and, where task types' speedups differ across GPU models (some pair of
  models whose speedup differs by more than 25 % between task types), is at least 10 % below the best simple rule;
  at lower loads it is no worse than the best simple rule; at every load its p99 queue wait is at most 20 % above
  ``first-fit``'s. Each is stated met / not met with the figures, for the policies present.

``model-warm`` (run only when named in ``--policies``) is the learned policy on a host with a past: before each
trace, ``model`` runs a history trace on the same host (generated at the same load and size with trace seed
``HISTORY_SEED + s``, or the one ``--history-trace`` names), and the trace starts with the store holding its records
and its model. Beside ``model`` it shows what the cold start costs; it is not one of the "non-oracle policies" that
``model`` must beat (it is the same learner). ``matching-oracle-cold`` is an oracle: ``model``'s first day (the same
decisions until ``model`` first trains), then the table; how far it is behind ``matching-oracle`` is what the cold
start alone costs, and the "within 5 %" target's detail says it.

Usage: ``python -m hostagent.learn.evaluate --throughputs T.csv --host H.csv (--traces N --jobs J
[--loads 0.7,0.85,0.95] [--trace-seed S] [--data DIR] | --trace-files a.csv,b.csv) [--policies a,b] [--seeds K]
[--warmup-jobs W] [--jobs-parallel P] [--save-runs F.jsonl] [--load-runs F.jsonl,...] [--progress] [--json]``.
``--save-runs`` appends each run's figures as it finishes; ``--load-runs`` aggregates saved runs (with or without
new ones), so a long evaluation can be run in parts.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from hostagent.domain.assignment import Fairness
from hostagent.domain.errors import InvalidInput
from hostagent.domain.placement import Exploration
from hostagent.learn import datasets
from hostagent.learn.simulate import (
    COLD_ORACLE,
    LEARNED,
    POLICIES,
    WARM,
    add_run_options,
    fairness_meta,
    fairness_of,
    Job,
    SimGpu,
    Table,
    check_inputs,
    load_host,
    load_table,
    load_trace,
    run_policy,
    summarise,
)

SIMPLE_RULES = ("random", "first-fit", "best-fit-memory", "fastest-model")
ORACLES = ("oracle", "matching-oracle", "noisy-oracle", COLD_ORACLE)
DEFAULT_LOADS = (0.7, 0.85, 0.95)
HISTORY_SEED = 1_000_000  # `model-warm`'s history of trace seed s is generated with trace seed HISTORY_SEED + s
HIGH_LOAD = 0.85  # from this offered load on, the "lowest JCT, within 5 % of matching-oracle" targets apply
SPREAD_HETEROGENEOUS = 1.25  # speedups "differ by task type" when some pair of models' speedup varies this much
# two-sided 95 % Student t quantiles by degrees of freedom, for when scipy is missing (normal beyond 30)
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
         2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


# -- statistics ---------------------------------------------------------------------------------------------------

def t975(df: int) -> float:
    """The 97.5 % quantile of Student's t with `df` degrees of freedom."""
    try:
        from scipy import stats  # type: ignore[import-untyped]  # scikit-learn's dependency
        return float(stats.t.ppf(0.975, df))
    except ImportError:  # pragma: no cover - scipy comes with scikit-learn
        return _T975[df - 1] if df <= len(_T975) else 1.96


def mean_ci(values: Sequence[float]) -> tuple[float, float | None]:
    """(mean, half-width of its 95 % confidence interval); the half-width is None with fewer than 2 values."""
    m = statistics.fmean(values)
    if len(values) < 2:
        return m, None
    return m, t975(len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))


def speedup_spread(table: Table, models: Sequence[str]) -> float:
    """How much task types' speedups differ: the largest, over pairs of GPU models, of max/min across task types of
    one model's throughput over the other's (1.0: every task type gains the same from every model)."""
    spread = 1.0
    for a in models:
        for b in models:
            ratios = [table.thr[(j, a)] / table.thr[(j, b)] for j in table.job_types
                      if (j, a) in table.thr and (j, b) in table.thr]
            if a < b and ratios:
                spread = max(spread, max(ratios) / min(ratios))
    return spread


def capacity_headroom(table: Table, host: Sequence[SimGpu]) -> tuple[float, float] | None:
    """How much comparative advantage there is to trade on this host: (a type-blind FIFO's capacity, the best
    assignment's), in jobs' work per second at each type's typical rate, for a uniform mix of the job types (as the
    generated traces draw them) of single-GPU jobs. FIFO keeps every GPU busy with whatever comes next, so each GPU
    serves the mix of the types that fit it: the harmonic mean of its rates over them. The best assignment splits
    each GPU's time among the types to serve the mix fastest (a linear program). Their ratio bounds what assigning by
    comparative advantage can gain in throughput (None: scipy missing, or no job type fits any GPU)."""
    try:
        from scipy.optimize import linprog  # type: ignore[import-untyped]  # scikit-learn's dependency
    except ImportError:  # pragma: no cover - scipy comes with scikit-learn
        return None
    types = table.job_types
    rates = [[table.thr[(j, g.model)] * g.health if table.fits(j, g) else 0.0 for g in host] for j in types]
    norm: list[list[float]] = []
    for row in rates:
        fit = [r for r in row if r > 0]
        if not fit:
            return None
        typical = statistics.harmonic_mean(fit)  # the generator's unit of work
        norm.append([r / typical for r in row])
    fifo = 0.0
    for i in range(len(host)):
        fit = [row[i] for row in norm if row[i] > 0]
        fifo += statistics.harmonic_mean(fit) if fit else 0.0
    n_t, n_g = len(types), len(host)
    # variables: x[t, g] (share of GPU g's time on type t), then lam; maximise lam with every type served lam / n_t
    cost = [0.0] * (n_t * n_g) + [-1.0]
    a_ub: list[list[float]] = []
    b_ub: list[float] = []
    for t in range(n_t):
        row = [0.0] * (n_t * n_g + 1)
        for i in range(n_g):
            row[t * n_g + i] = -norm[t][i]
        row[-1] = 1.0 / n_t
        a_ub.append(row)
        b_ub.append(0.0)
    for i in range(n_g):
        row = [0.0] * (n_t * n_g + 1)
        for t in range(n_t):
            row[t * n_g + i] = 1.0
        a_ub.append(row)
        b_ub.append(1.0)
    res = linprog(cost, A_ub=a_ub, b_ub=b_ub, bounds=[(0, None)] * (n_t * n_g + 1), method="highs")
    return (fifo, float(-res.fun)) if res.success else None


# -- traces ---------------------------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class TraceSpec:
    """One trace to run: its load group, a name, its jobs (checked against the table and host)."""

    load: float
    name: str
    jobs: list[Job]
    history: list[Job] = field(default_factory=list)  # what `model-warm` runs first (see simulate.run_policy)


def jobs_from_rows(rows: Sequence[dict[str, object]]) -> list[Job]:
    """Trace rows (as ``datasets.philly_trace`` makes them) as jobs, sorted by arrival, like ``load_trace``."""
    raw = sorted((float(str(r["arrival_s"])), str(r["job_type"]), float(str(r["work"])), int(str(r["num_gpus"])),
                  int(str(r.get("priority") or 0))) for r in rows)
    return [Job(k, *r) for k, r in enumerate(raw)]


def offered_load(table: Table, host: Sequence[SimGpu], jobs: Sequence[Job]) -> float:
    """GPU-seconds asked (at each job type's harmonic-mean rate over the fitting devices) over the GPU-seconds the
    host offers during the arrival span: the generator's definition, measured back from a trace."""
    busy = 0.0
    for j in jobs:
        fits = [g for g in host if table.fits(j.job_type, g)]
        rate = len(fits) / sum(1.0 / (table.thr[(j.job_type, g.model)] * g.health) for g in fits) if fits else 1.0
        busy += j.work / rate * j.num_gpus
    span = (jobs[-1].arrival_s - jobs[0].arrival_s) if jobs else 0.0
    return busy / (span * len(host)) if span > 0 else math.inf


def generated_traces(data: Path, table_csv: Path, host_csv: Path, table: Table, host: Sequence[SimGpu],
                     loads: Sequence[float], traces: int, jobs: int, trace_seed: int, *,
                     history: bool = False) -> list[TraceSpec]:
    """`traces` Philly-derived traces per load, trace seeds trace_seed .. trace_seed + traces - 1. With ``history``
    each has one for `model-warm` too: the same load and size, trace seed ``HISTORY_SEED + s`` (never evaluated)."""
    trows, hrows = datasets.read_csv(table_csv), datasets.read_csv(host_csv)

    def make(load: float, seed: int) -> list[Job]:
        rows = datasets.philly_trace(data, trows, hrows, jobs=jobs, load=load, seed=seed)
        return check_inputs(table, host, jobs_from_rows(rows))[0]
    return [TraceSpec(load, f"philly seed {s}", make(load, s), make(load, HISTORY_SEED + s) if history else [])
            for load in loads for s in range(trace_seed, trace_seed + traces)]


def file_traces(paths: Sequence[str], table: Table, host: Sequence[SimGpu]) -> list[TraceSpec]:
    """Given trace files, each in the group of the offered load measured from it (to 2 decimals)."""
    out = []
    for p in paths:
        kept, _ = check_inputs(table, host, load_trace(p))
        out.append(TraceSpec(round(offered_load(table, host, kept), 2), str(p), kept))
    return out


# -- running ----------------------------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Task:
    """One (trace, policy, seed) run: everything a worker process needs."""

    load: float
    trace: str
    policy: str
    seed: int
    table: Table
    host: list[SimGpu]
    jobs: list[Job]
    warmup_jobs: int
    retrain_every: int
    min_records: int
    epsilon: float
    history: list[Job] = field(default_factory=list)
    fairness: Fairness = Fairness()


def run_task(task: Task) -> dict[str, Any]:
    """Run one task (in a worker process); simulate's summary plus where it came from."""
    t0 = time.perf_counter()
    fig = run_policy(task.policy, task.table, task.host, task.jobs, seed=task.seed, warmup_jobs=task.warmup_jobs,
                     retrain_every=task.retrain_every, min_records=task.min_records,
                     exploration=Exploration(epsilon=task.epsilon), fairness=task.fairness, history=task.history)
    return {"load": task.load, "trace": task.trace, **summarise(task.policy, task.seed, fig, task.jobs,
                                                                 task.warmup_jobs),
            "jobs": len(task.jobs), "evaluated_jobs": len(task.jobs) - task.warmup_jobs,
            "wall_s": round(time.perf_counter() - t0, 3)}


_LIMITS: list[Any] = []  # the worker's thread-pool limits, kept alive for the worker's life


def one_thread_each() -> Any:
    """A worker process's initializer: its native thread pools (scikit-learn's OpenMP, BLAS) run one thread each.
    The harness already runs one worker per CPU, and each worker's trees would otherwise start a thread per CPU:
    on two CPUs two workers ran 30 times slower, their threads spinning against each other. One thread also makes a
    run's figures the same on any machine: the trees' split finding sums in an order that depends on the threads,
    and near saturation a queue turns a different split into a different trace (runs in this process, with
    `--jobs-parallel 1`, are limited alike)."""
    from threadpoolctl import threadpool_limits

    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):  # libraries loaded from now on
        os.environ[var] = "1"
    limits = threadpool_limits(limits=1)  # the ones loaded already (the forkserver preloads the simulator)
    _LIMITS.append(limits)
    return limits


def worker_pool(processes: int) -> Any:
    """`processes` worker processes for the runs, each started with `one_thread_each`."""
    method = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
    ctx = multiprocessing.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload([__name__])  # the server imports the simulator (and scikit-learn) once
    return ctx.Pool(processes, initializer=one_thread_each)


def run_tasks(tasks: Sequence[Task], processes: int, *, progress: bool = False,
              save: Path | None = None) -> list[dict[str, Any]]:
    """Run the tasks, `processes` at a time (in this process when 1); the slow `model` runs are started first."""
    order = sorted(tasks, key=lambda t: (t.policy not in LEARNED, t.policy != WARM, t.load, t.trace,
                                         t.policy, t.seed))
    out: list[dict[str, Any]] = []

    def done(run: dict[str, Any]) -> None:
        out.append(run)
        if save is not None:
            with save.open("a") as fh:
                fh.write(json.dumps(run) + "\n")
        if progress:
            print(f"[{len(out)}/{len(order)}] load {run['load']} {run['trace']} {run['policy']} seed {run['seed']}: "
                  f"mean JCT {run['mean_jct_s']:.0f} s ({run['wall_s']:.1f} s)", file=sys.stderr, flush=True)
    if processes <= 1 or len(order) <= 1:
        from threadpoolctl import threadpool_limits

        with threadpool_limits(limits=1):  # as in a worker: the trees' figures depend on their threads' sums
            for t in order:
                done(run_task(t))
        return out
    with worker_pool(min(processes, len(order))) as pool:
        for run in pool.imap_unordered(run_task, order, chunksize=1):
            done(run)
    return out


def load_runs(paths: Sequence[str]) -> list[dict[str, Any]]:
    """Runs saved by ``--save-runs`` (JSON lines)."""
    out = []
    for p in paths:
        f = Path(p)
        if not f.is_file():
            raise InvalidInput(f"{f}: no such file", field="load_runs")
        for n, line in enumerate(f.read_text().splitlines(), start=1):
            if line.strip():
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise InvalidInput(f"{f}:{n}: not a JSON line ({exc.msg})", field="load_runs") from exc
    return out


# -- aggregation ------------------------------------------------------------------------------------------------------

METRICS = ("mean_jct_s", "p99_jct_s", "mean_wait_s", "p99_wait_s", "mean_regret", "makespan_s")


def _ratio(a: float, b: float) -> float | None:
    return a / b if b > 0 else None


def _paired(per: dict[str, dict[str, float]], other: dict[str, dict[str, float]] | None,
            traces: Sequence[str]) -> dict[str, Any] | None:
    if other is None:
        return None
    vals = [per[t]["mean_jct_s"] / other[t]["mean_jct_s"] for t in traces if other[t]["mean_jct_s"] > 0]
    if not vals:
        return None
    m, h = mean_ci(vals)
    # the per-trace ratios are heavy-tailed near saturation (most traces near 1, a few far off): the median and the
    # worst say which
    return {"mean": m, "ci95": h, "n": len(vals), "median": statistics.median(vals), "max": max(vals)}


def aggregate_load(load: float, runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The figures of one load group: per policy, over the traces every policy present ran (seeds averaged)."""
    by: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for r in runs:
        by.setdefault(r["policy"], {}).setdefault(r["trace"], []).append(r)
    policies = [p for p in POLICIES if p in by] + sorted(p for p in by if p not in POLICIES)
    all_traces = sorted({r["trace"] for r in runs})
    common = [t for t in all_traces if all(t in by[p] for p in policies)]
    per: dict[str, dict[str, dict[str, float]]] = {
        p: {t: {m: statistics.fmean(float(r.get(m, 0.0)) for r in by[p][t]) for m in METRICS} for t in common}
        for p in policies}
    mean = {p: {m: statistics.fmean(per[p][t][m] for t in common) for m in METRICS} for p in policies} if common else {}
    simple = [p for p in SIMPLE_RULES if p in mean]
    best_simple = min(simple, key=lambda p: mean[p]["mean_jct_s"]) if simple else None
    rows = []
    for p in policies if common else []:
        _, ci = mean_ci([per[p][t]["mean_jct_s"] for t in common])
        rows.append({
            "policy": p, "traces": len(common), "seeds": max(len(by[p][t]) for t in common),
            **{m: mean[p][m] for m in METRICS}, "mean_jct_ci95_s": ci,
            "memory_violations": sum(int(r["memory_violations"]) for t in common for r in by[p][t]),
            "jct_vs_matching_oracle": (_ratio(mean[p]["mean_jct_s"], mean["matching-oracle"]["mean_jct_s"])
                                       if "matching-oracle" in mean else None),
            "jct_vs_best_simple": (_ratio(mean[p]["mean_jct_s"], mean[best_simple]["mean_jct_s"])
                                   if best_simple else None),
            "p99_wait_vs_first_fit": (_ratio(mean[p]["p99_wait_s"], mean["first-fit"]["p99_wait_s"])
                                      if "first-fit" in mean else None),
            "paired_vs_matching_oracle": _paired(per[p], per.get("matching-oracle"), common),
            "paired_vs_best_simple": _paired(per[p], per[best_simple] if best_simple else None, common),
        })
    evaluated = sorted({int(r.get("evaluated_jobs", 0)) for r in runs})
    return {"load": load, "traces": len(common), "dropped_traces": len(all_traces) - len(common),
            "evaluated_jobs": evaluated, "best_simple": best_simple, "policies": rows}


def aggregate(runs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One group per load, ascending."""
    loads = sorted({float(r["load"]) for r in runs})
    return [aggregate_load(x, [r for r in runs if float(r["load"]) == x]) for x in loads]


def _fmt_ci(p: dict[str, Any] | None) -> str:
    if p is None:
        return "-"
    return f"{p['mean']:.3f}" + (f" ± {p['ci95']:.3f}" if p["ci95"] is not None else "")


def targets(groups: Sequence[dict[str, Any]], heterogeneous: bool, spread: float) -> list[dict[str, Any]]:
    """Issue #21's targets for `model`, per load: met / not met with the figures (None: cannot be assessed)."""
    out: list[dict[str, Any]] = []

    def add(load: float, target: str, met: bool | None, detail: str) -> None:
        out.append({"load": load, "target": target, "met": met, "detail": detail})
    for g in groups:
        rows = {r["policy"]: r for r in g["policies"]}
        load = g["load"]
        model = rows.get("model")
        if model is None:
            add(load, "model policy evaluated", None, "model was not run at this load")
            continue
        jct = model["mean_jct_s"]
        best = g["best_simple"]
        if load >= HIGH_LOAD - 1e-9:
            others = {p: r["mean_jct_s"] for p, r in rows.items() if p not in ORACLES and p not in LEARNED}
            if others:
                rival = min(others, key=lambda p: others[p])
                add(load, "lowest mean JCT of the non-oracle policies", jct < others[rival],
                    f"model {jct:.0f} s vs {rival} {others[rival]:.0f} s")
            mo = rows.get("matching-oracle")
            if mo is not None:
                ratio = model["jct_vs_matching_oracle"]
                noisy = rows.get("noisy-oracle")
                # how far a few per cent of error in the table alone puts the same assignment behind it
                floor = (f"; noisy-oracle {noisy['jct_vs_matching_oracle']:.3f}x, paired "
                         f"{_fmt_ci(noisy['paired_vs_matching_oracle'])}") if noisy is not None else ""
                # how far model's first day alone puts a learner that then knows the table exactly behind it
                cold = rows.get(COLD_ORACLE)
                if cold is not None:
                    floor += (f"; matching-oracle-cold (model's first day, then the table) "
                              f"{cold['jct_vs_matching_oracle']:.3f}x")
                paired = model["paired_vs_matching_oracle"]
                tails = (f" (median {paired['median']:.3f}, worst {paired['max']:.3f})"
                         if paired is not None and "median" in paired else "")
                add(load, "within 5 % of matching-oracle", ratio is not None and ratio <= 1.05,
                    f"{ratio:.3f}x; paired per trace {_fmt_ci(paired)}{tails}{floor}")
            else:
                add(load, "within 5 % of matching-oracle", None, "matching-oracle was not run")
            if best is None:
                add(load, "at least 10 % below the best simple rule", None, "no simple rule was run")
            elif not heterogeneous:
                add(load, "at least 10 % below the best simple rule", None,
                    f"not applicable: speedups do not differ by task type (spread {spread:.2f})")
            else:
                ratio = model["jct_vs_best_simple"]
                add(load, "at least 10 % below the best simple rule", ratio is not None and ratio <= 0.90,
                    f"{ratio:.3f}x {best}; paired per trace {_fmt_ci(model['paired_vs_best_simple'])}")
        elif best is not None:
            ratio = model["jct_vs_best_simple"]
            add(load, "no worse than the best simple rule", ratio is not None and ratio <= 1.0,
                f"{ratio:.3f}x {best}; paired per trace {_fmt_ci(model['paired_vs_best_simple'])}")
        ff = rows.get("first-fit")
        if ff is None:
            add(load, "p99 queue wait at most 20 % above first-fit's", None, "first-fit was not run")
        else:
            ratio = model["p99_wait_vs_first_fit"]
            add(load, "p99 queue wait at most 20 % above first-fit's",
                ratio is not None and ratio <= 1.2 if ff["p99_wait_s"] > 0 else model["p99_wait_s"] <= 0,
                f"model {model['p99_wait_s']:.0f} s vs first-fit {ff['p99_wait_s']:.0f} s"
                + (f", {ratio:.3f}x" if ratio is not None else ""))
    return out


def _opt(x: float | None, spec: str) -> str:
    """A figure that may be missing ("-")."""
    return "-" if x is None else format(x, spec)


def format_report(out: dict[str, Any]) -> str:
    """Readable tables, one per load, then the targets."""
    meta = out["meta"]
    lines = [(f"table {meta['throughputs']}  host {meta['host']} ({meta['gpus']} GPUs)  speedup spread "
              f"{meta['speedup_spread']:.2f} ({'differs' if meta['heterogeneous'] else 'does not differ'} "
              f"by task type)")]
    if meta.get("capacity_fifo") and meta.get("capacity_best"):
        lines.append(f"capacity for a uniform mix of single-GPU jobs: {meta['capacity_fifo']:.2f} serving in FIFO order, "
                     f"{meta['capacity_best']:.2f} assigned by comparative advantage "
                     f"({meta['capacity_best'] / meta['capacity_fifo']:.2f}x: the most it can gain in throughput)")
    width = max([16] + [len(r["policy"]) + 1 for g in out["loads"] for r in g["policies"]])
    head = (f"{'policy':<{width}}{'n':>3}{'mean_jct_s':>11}{'±95%':>8}{'p99_jct_s':>10}{'p99_wait_s':>11}"
            f"{'regret':>8}{'mem':>4}{'/m-orc':>8}{'/simple':>8}{'wait/ff':>8}  {'paired /m-oracle':<18}"
            f"{'paired /simple':<16}")

    for g in out["loads"]:
        jobs = "/".join(str(n) for n in g["evaluated_jobs"])
        lines += ["", f"load {g['load']}: {g['traces']} trace(s), {jobs} evaluated jobs each"
                  + (f", {g['dropped_traces']} trace(s) left out (not run by every policy)" if g["dropped_traces"]
                     else "") + f"; best simple rule: {g['best_simple'] or '-'}", head]
        for r in g["policies"]:
            lines.append(f"{r['policy']:<{width}}{r['traces']:>3}{r['mean_jct_s']:>11.0f}"
                         f"{_opt(r['mean_jct_ci95_s'], '.0f'):>8}"
                         f"{r['p99_jct_s']:>10.0f}{r['p99_wait_s']:>11.0f}{r['mean_regret']:>8.4f}"
                         f"{r['memory_violations']:>4}{_opt(r['jct_vs_matching_oracle'], '.3f'):>8}"
                         f"{_opt(r['jct_vs_best_simple'], '.3f'):>8}{_opt(r['p99_wait_vs_first_fit'], '.3f'):>8}  "
                         f"{_fmt_ci(r['paired_vs_matching_oracle']):<18}{_fmt_ci(r['paired_vs_best_simple']):<16}")
    lines += ["", "targets (model):"]
    for t in out["targets"]:
        verdict = "n/a" if t["met"] is None else ("met" if t["met"] else "NOT met")
        lines.append(f"  load {t['load']}: {t['target']}: {verdict} ({t['detail']})")
    return "\n".join(lines)

def format_markdown(out: dict[str, Any]) -> str:
    """The per-load tables as docs/placement.md's "Results" shows them (one Markdown table, every load), then the
    targets as a list: what the report says, in the form the docs paste."""
    lines = ["| load | policy | mean JCT s ± 95 % CI | p99 JCT s | p99 wait s | mean regret | mem. viol. | "
             "JCT / m-oracle | JCT / best simple | p99 wait / first-fit | paired JCT / m-oracle |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for g in out["loads"]:
        for i, r in enumerate(g["policies"]):
            name = f"**{r['policy']}**" if r["policy"] == "model" else r["policy"]
            if r["policy"] == g["best_simple"]:
                name += " (best simple)"
            ci = f" ± {r['mean_jct_ci95_s']:.0f}" if r["mean_jct_ci95_s"] is not None else ""
            lines.append(f"| {g['load'] if i == 0 else ''} | {name} | {r['mean_jct_s']:.0f}{ci} | {r['p99_jct_s']:.0f} | "
                         f"{r['p99_wait_s']:.0f} | {r['mean_regret']:.4f} | {r['memory_violations']} | "
                         f"{_opt(r['jct_vs_matching_oracle'], '.3f')} | {_opt(r['jct_vs_best_simple'], '.3f')} | "
                         f"{_opt(r['p99_wait_vs_first_fit'], '.3f')} | {_fmt_ci(r['paired_vs_matching_oracle'])} |")
    lines += ["", "Targets (`model`):", ""]
    for t in out["targets"]:
        verdict = "n/a" if t["met"] is None else ("met" if t["met"] else "**not met**")
        lines.append(f"- {t['load']}: {t['target']}: {verdict} ({t['detail']})")
    return "\n".join(lines)


# -- CLI ------------------------------------------------------------------------------------------------------------

def _parse_loads(text: str) -> list[float]:
    try:
        loads = [float(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise InvalidInput(f"--loads {text!r}: not a comma-separated list of numbers", field="loads") from exc
    bad = [x for x in loads if not 0 < x <= 1.5]
    if not loads or bad:
        raise InvalidInput(f"--loads: each offered load must be in (0, 1.5], got {bad[0] if bad else text!r}",
                           field="loads")
    return loads


def evaluate(args: argparse.Namespace) -> dict[str, Any]:
    """Check the arguments, run what they ask, aggregate; InvalidInput on bad input."""
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    unknown = [p for p in policies if p not in POLICIES]
    if unknown or not policies:
        raise InvalidInput(f"unknown policy {(unknown or [''])[0]!r}; choose from {', '.join(POLICIES)}",
                           field="policies")
    for name in ("seeds", "jobs_parallel"):
        if getattr(args, name) < 1:
            raise InvalidInput(f"--{name.replace('_', '-')} must be >= 1", field=name)
    if args.traces is not None and args.trace_files:
        raise InvalidInput("give --traces (generated) or --trace-files, not both", field="traces")
    if args.traces is None and not args.trace_files and not args.load_runs:
        raise InvalidInput("give --traces N (generated from the shared data), --trace-files or --load-runs",
                           field="traces")
    if args.traces is not None and args.traces < 1:
        raise InvalidInput("--traces must be >= 1", field="traces")
    if args.warmup_jobs < 0:
        raise InvalidInput("--warmup-jobs must be >= 0", field="warmup_jobs")
    fairness = fairness_of(args)
    loads = _parse_loads(args.loads)
    table, host = load_table(args.throughputs), load_host(args.host)
    runs = load_runs([p for p in (args.load_runs or "").split(",") if p.strip()])
    if args.traces is not None:
        if args.jobs <= args.warmup_jobs:
            raise InvalidInput(f"--jobs {args.jobs} leaves no job after --warmup-jobs {args.warmup_jobs}",
                               field="jobs")
        specs = generated_traces(datasets.data_dir(args.data), Path(args.throughputs), Path(args.host), table, host,
                                 loads, args.traces, args.jobs, args.trace_seed,
                                 history=WARM in policies and not args.history_trace)
    else:
        specs = file_traces([p for p in (args.trace_files or "").split(",") if p.strip()], table, host)
    if WARM in policies and args.history_trace:
        history = check_inputs(table, host, load_trace(args.history_trace))[0]
        specs = [replace(s, history=history) for s in specs]
    elif WARM in policies and specs and not specs[0].history:
        raise InvalidInput("model-warm with --trace-files needs --history-trace: the trace whose records its store "
                           "starts with", field="history_trace")
    for s in specs:
        if args.warmup_jobs >= len(s.jobs):
            raise InvalidInput(f"{s.name}: --warmup-jobs {args.warmup_jobs} leaves no job to evaluate "
                               f"({len(s.jobs)} jobs)", field="warmup_jobs")
    tasks = [Task(s.load, s.name, p, seed, table, host, s.jobs, args.warmup_jobs, args.retrain_every,
                  args.min_records, args.epsilon, s.history if p == WARM else [], fairness)
             for s in specs for p in policies for seed in range(args.seeds)]
    save = Path(args.save_runs) if args.save_runs else None
    runs += run_tasks(tasks, args.jobs_parallel, progress=args.progress, save=save)
    # a run loaded and run again (same load, trace, policy, seed) counts once: the latest
    runs = list({(float(r["load"]), r["trace"], r["policy"], int(r["seed"])): r for r in runs}.values())
    groups = aggregate(runs)
    models = sorted({g.model for g in host})
    spread = speedup_spread(table, models)
    heterogeneous = spread > SPREAD_HETEROGENEOUS
    headroom = capacity_headroom(table, host)
    return {"loads": groups, "targets": targets(groups, heterogeneous, spread),
            "runs": sorted(runs, key=lambda r: (r["load"], r["trace"], r["policy"], r["seed"])),
            "meta": {"throughputs": str(args.throughputs), "host": str(args.host), "gpus": len(host),
                     "models": models, "speedup_spread": spread, "heterogeneous": heterogeneous,
                     "capacity_fifo": headroom[0] if headroom else None,
                     "capacity_best": headroom[1] if headroom else None,
                     "policies": policies, "seeds": args.seeds, "warmup_jobs": args.warmup_jobs,
                     "fairness": fairness_meta(fairness),
                     "traces": args.traces, "jobs": args.jobs if args.traces is not None else None,
                     "trace_seed": args.trace_seed, "trace_files": args.trace_files,
                     "history": (None if WARM not in policies else args.history_trace
                                 or f"generated, trace seed {HISTORY_SEED} + the trace's")}}


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point (``python -m hostagent.learn.evaluate``)."""
    ap = argparse.ArgumentParser(prog="python -m hostagent.learn.evaluate", description=__doc__.split("\n\n")[0])

    def traces() -> None:
        ap.add_argument("--traces", type=int, help="traces per load, generated from the shared Philly data")
        ap.add_argument("--jobs", type=int, default=2000, help="jobs per generated trace (default 2000)")
        ap.add_argument("--loads", default=",".join(str(x) for x in DEFAULT_LOADS),
                        help="offered loads of the generated traces (default 0.7,0.85,0.95)")
        ap.add_argument("--trace-seed", type=int, default=0, help="first trace seed (default 0)")
        ap.add_argument("--data", help=f"shared data directory (default {datasets.DEFAULT_DATA})")
        ap.add_argument("--trace-files", help="comma-separated trace CSVs instead of generated traces")
    add_run_options(ap, seeds=1, seeds_help="policy seeds per trace (default 1)", trace=traces)
    ap.add_argument("--jobs-parallel", type=int, default=os.cpu_count() or 1,
                    help="worker processes, one (trace, policy, seed) each (default the CPU count)")
    ap.add_argument("--save-runs", help="append each run's figures to this JSON-lines file as it finishes")
    ap.add_argument("--load-runs", help="comma-separated JSON-lines files of runs saved earlier, aggregated too")
    ap.add_argument("--progress", action="store_true", help="a line on stderr per finished run")
    out_form = ap.add_mutually_exclusive_group()
    out_form.add_argument("--json", action="store_true", help="machine-readable JSON output")
    out_form.add_argument("--markdown", action="store_true",
                          help="the tables and targets as Markdown, as docs/placement.md shows them")
    args = ap.parse_args(argv)
    try:
        out = evaluate(args)
    except InvalidInput as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return 2
    print(json.dumps(out) if args.json else format_markdown(out) if args.markdown else format_report(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
