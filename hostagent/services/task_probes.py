"""A task type's own probe (`[probes] task_probes`): a short representative kernel the operator registers for a task
type, run first on a new task type, once per GPU model, on a free GPU on its host driver.

Its figure (the task's work rate on that model, in the unit the task's guests report) joins each GPU's measured
figures (`LeaseManager.measured`, key `work_rate:<task>`), where the cold-start rule's speed term reads it before any
model has records of the task type (domain.placement.measured_speed). When: for every registered task type at start
(unless the agent's automatic probes are off), and whenever a lease of it is asked for while some GPU model of the host still lacks its
figure. Results are journaled (`probe` events) and stored with the other probe results (`details.kind = "task"`),
so a restart keeps them. A failing probe is the operator's command failing, not the GPU: nothing is quarantined.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Mapping
from typing import Any

from hostagent.domain.capabilities import Measured
from hostagent.domain.errors import HostAgentError
from hostagent.domain.lease import Lease
from hostagent.host.probes import RunnerResult, TaskProbeRunner, task_metric
from hostagent.services.probes import ProbeService

log = logging.getLogger("hostagent.probes")

TASK_BUDGET_S = 30.0  # seconds a task probe may measure for (HOSTAGENT_PROBE_BUDGET_S); killed at 30 + 2x this


class TaskProbes:
    """Runs the registered task probes and keeps their figures, by task type and GPU model."""

    def __init__(self, probes: ProbeService, runners: Mapping[str, TaskProbeRunner]) -> None:
        self.probes = probes
        self.manager = probes.manager
        self.runners = dict(runners)
        self.rates: dict[str, dict[str, float]] = {}  # task type -> GPU model -> work rate
        self.errors: dict[str, dict[str, str]] = {}  # task type -> GPU model -> its last probe's error
        self._running: dict[tuple[str, str], asyncio.Task[Any]] = {}  # (task, model) -> the probe measuring it
        probes.extra_figures = self.figures_for  # a new compute probe keeps these figures

    def figures_for(self, model: str) -> dict[str, float]:
        """The task figures measured on this GPU model."""
        return {task_metric(task): by[model] for task, by in self.rates.items() if model in by}

    def _apply(self, model: str) -> None:
        figures = self.figures_for(model)
        for gid, g in self.manager.gpus.items():
            if g.model == model:
                m = self.manager.measured.get(gid) or Measured()
                self.manager.measured[gid] = dataclasses.replace(m, figures={**m.figures, **figures})

    def missing(self, task: str) -> list[str]:
        """The host's GPU models without a figure for the task (and no probe measuring it now)."""
        models = sorted({g.model for g in self.manager.gpus.values() if g.viable})
        return [m for m in models if m not in self.rates.get(task, {}) and (task, m) not in self._running]

    def schedule(self, task: str) -> list[str]:
        """Probe the task on one free GPU of each model that lacks its figure (in the background); the GPU ids."""
        m = self.manager
        chosen = []
        for model in self.missing(task):
            gid = next((g.id for g in m.gpus.values() if g.model == model and g.viable and g.id not in m.claims
                        and g.id not in m.quarantined and g.id not in m.attention), None)
            if gid is None:
                continue  # every GPU of the model is busy: the next request of the task type tries again
            t = asyncio.get_running_loop().create_task(self.probe(task, gid))
            self._running[(task, model)] = t
            t.add_done_callback(lambda _t, key=(task, model): self._running.pop(key, None))
            chosen.append(gid)
        return chosen

    async def probe(self, task: str, gpu_id: str, *, actor: str = "task-probe") -> RunnerResult:
        """Run the task's probe on one GPU now (claimed like any probe) and keep, journal and store its figure."""
        gpu = self.manager.gpus[gpu_id]
        runner = self.runners[task]
        async with self.probes._one_at_a_time:
            try:
                claim = await self.probes._claim(gpu)
            except HostAgentError as exc:
                return RunnerResult(runner.name, error=exc.message)
            try:
                result: RunnerResult = await self.probes._run(runner.run, gpu, TASK_BUDGET_S)
            finally:
                self.probes._unclaim(gpu_id, claim)
        rate = result.metrics.get(task_metric(task))
        if rate is not None:
            self.rates.setdefault(task, {})[gpu.model] = rate
            self.errors.get(task, {}).pop(gpu.model, None)
            self._apply(gpu.model)
            detail = f"task probe {task}: {rate:.4g}/s on {gpu.model}"
        else:
            self.errors.setdefault(task, {})[gpu.model] = result.error or "no figure"
            detail = f"task probe {task} failed on {gpu.model}: {result.error}"
            log.warning("%s (%s)", detail, gpu_id)
        with contextlib.suppress(Exception):
            await self.probes._run(self.manager.journal.event, "probe", actor=actor, gpu_id=gpu_id, detail=detail[:1000])
        if self.probes.store is not None:
            try:
                await self.probes.store.add_probe_result(
                    gpu_id, score=None, spread=None, ok=rate is not None, ts=self.probes.clock(),
                    details={"kind": "task", "task_type": task, "model": gpu.model, "metrics": dict(result.metrics),
                             "error": result.error})
            except HostAgentError as exc:
                log.warning("task probe result of %s not stored: %s", gpu_id, exc.message)
        return result

    async def load_history(self) -> int:
        """Restore the task figures from the stored probe results (the newest per task and model wins)."""
        if self.probes.store is None:
            return 0
        try:
            rows = await self.probes.store.list_probe_results(limit=1000)
        except HostAgentError as exc:
            log.warning("task probe history not loaded: %s", exc.message)
            return 0
        for row in sorted(rows, key=lambda r: r["ts"]):
            d = row.get("details") or {}
            rate = (d.get("metrics") or {}).get(task_metric(str(d.get("task_type"))))
            if d.get("kind") == "task" and isinstance(rate, (int, float)) and d.get("model"):
                self.rates.setdefault(str(d["task_type"]), {})[str(d["model"])] = float(rate)
        for model in {g.model for g in self.manager.gpus.values()}:
            self._apply(model)
        return sum(len(v) for v in self.rates.values())

    def on_lease_change(self, lease: Lease | None, detail: str | None) -> None:
        """Lease listener: a request of a registered task type probes the models that still lack its figure."""
        if lease is not None and lease.request.task_type in self.runners and self.missing(lease.request.task_type):
            self.schedule(lease.request.task_type)

    def start(self, *, now: bool = True) -> None:
        """Listen for requests and (`now`) probe every registered task type (inside the running loop)."""
        self.manager.listeners.append(self.on_lease_change)
        for task in self.runners if now else ():
            self.schedule(task)

    async def stop(self) -> None:
        """Stop listening; cancel the probes still running."""
        with contextlib.suppress(ValueError):
            self.manager.listeners.remove(self.on_lease_change)
        for t in list(self._running.values()):
            t.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t

    def status(self) -> dict[str, Any]:
        """Each registered task probe: its command, its figure per GPU model, and its last errors."""
        return {task: {"command": r.command, "work_rate": self.rates.get(task, {}), "errors": self.errors.get(task, {}),
                       "missing": self.missing(task)} for task, r in self.runners.items()}
