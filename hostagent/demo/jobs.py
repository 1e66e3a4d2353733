"""What the demo's simulated guests run: a mix of jobs, each with a utilisation curve, a memory plateau and a work
rate that depends on the GPU it got.

A job's work rate on a GPU comes from the roofline model over the vendor's datasheet figures
(:mod:`hostagent.learn.datasets`): memory-bound task types gain little from a faster GPU, compute-bound ones a lot,
so the placement model has something real to learn from the demo's own records. Nothing here talks to the agent:
:mod:`hostagent.demo.guests` carries these figures to it through the guest agent's own code.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from hostagent.learn.datasets import ROOFLINE_GPUS, ROOFLINE_JOBS, roofline_throughput

GIB = 1024**3

# The datasheet model a GPU's pci.ids name stands for (most specific first).
MODEL_KEYS = (("A100", "A100"), ("V100", "V100"), ("T4", "T4"), ("RTX 6000", "RTX6000"), ("2080 Ti", "RTX2080Ti"),
              ("A10", "A10"), ("L4", "L4"), ("P100", "P100"))


@dataclass(frozen=True)
class JobKind:
    """A task type as the demo's guests run it."""

    task_type: str  # one of learn.datasets.ROOFLINE_JOBS
    weight: float  # how often it is drawn
    util_pct: float  # steady utilisation
    mem_fraction: float  # of the GPU's memory, at the plateau


KINDS = (
    JobKind("transformer-train-fp16", 3.0, 92.0, 0.85),
    JobKind("cnn-train-fp16", 2.0, 88.0, 0.6),
    JobKind("llm-decode-fp16", 2.0, 55.0, 0.7),
    JobKind("gemm-fp32", 1.0, 97.0, 0.3),
    JobKind("recsys-embedding-fp32", 1.0, 70.0, 0.75),
    JobKind("stencil-fp32", 1.0, 80.0, 0.25),
)
SIZES = ((1, 0.45), (2, 0.3), (4, 0.2), (8, 0.05))  # GPUs per request, and how often


def model_key(gpu_model: str | None) -> str | None:
    """The datasheet model of a GPU named as discovery names it ("GA100 [A100 PCIe 40GB]" -> "A100")."""
    for needle, key in MODEL_KEYS:
        if gpu_model and needle in gpu_model:
            return key
    return None


def work_rate(task_type: str, gpu_model: str | None) -> float:
    """Units of work per second of `task_type` on one GPU of this model at full use (1.0 for a model not listed)."""
    key = model_key(gpu_model)
    intensity, precision, _ = ROOFLINE_JOBS[task_type]
    return roofline_throughput(ROOFLINE_GPUS[key], intensity, precision) if key else 1.0


@dataclass(frozen=True)
class Job:
    """One job a guest runs: what it asks for, how long it works, and whether it forgets to give its GPUs back."""

    kind: JobKind
    gpus: int
    priority: int
    busy_s: float  # how long it keeps the GPUs busy
    forgets: bool  # after busy_s it idles without releasing (the two-strike detector's case)
    accept_partial: bool
    seed: int

    def request(self, *, duration_s: float) -> dict[str, object]:
        """The lease request the guest sends."""
        return {"gpus": self.gpus, "task_type": self.kind.task_type, "priority": self.priority,
                "accept_partial": self.accept_partial, "accept_deferred": True, "duration_s": int(duration_s)}

    def util(self, t: float, gpu_index: int) -> float:
        """Utilisation `t` seconds after the job started on its GPUs: a warm-up ramp, the steady level with noise and
        a dip at each periodic evaluation/checkpoint, then idle once the work is done."""
        if t < 0:
            return 0.0
        if t >= self.busy_s:
            return 0.4 * _noise(self.seed, gpu_index, t)  # idle: a flicker, well under any idle threshold
        ramp = min(1.0, 0.3 + t / 120.0)
        period = 600.0 + 60.0 * (self.seed % 7)
        dip = 0.25 if (t % period) < 45.0 else 1.0
        level = self.kind.util_pct * ramp * dip + 6.0 * (_noise(self.seed, gpu_index, t) - 0.5)
        return max(0.0, min(100.0, level))

    def mem_bytes(self, t: float, memory_bytes: int | None) -> int:
        """Memory in use `t` seconds in: rising to the plateau over the first minute, kept while the job runs; a job
        that forgets its GPUs has ended (its process is gone), so nothing is held while the lease idles on."""
        if self.forgets and t >= self.busy_s:
            return 0
        total = memory_bytes or 16 * GIB
        return int(total * self.kind.mem_fraction * min(1.0, 0.2 + max(0.0, t) / 75.0))

    def rate(self, t: float, gpu_index: int, gpu_model: str | None) -> float | None:
        """The job's own throughput counter on one GPU (None while it is not working)."""
        u = self.util(t, gpu_index)
        if t >= self.busy_s or u <= 1.0:
            return None
        noise = math.exp(random.Random(self.seed * 1009 + gpu_index).gauss(0.0, 0.03))
        return work_rate(self.kind.task_type, gpu_model) * (u / self.kind.util_pct) * noise


def _noise(seed: int, index: int, t: float) -> float:
    """A smooth-ish value in [0, 1) that is the same for the same job, GPU and minute."""
    return random.Random(hash((seed, index, int(t // 20)))).random()


def draw_job(rng: random.Random, *, busy_s: tuple[float, float], forget_chance: float, priority_chance: float) -> Job:
    """A job of the demo's mix; `busy_s` bounds how long it works (log-uniform)."""
    kind = rng.choices(KINDS, weights=[k.weight for k in KINDS])[0]
    gpus = rng.choices([n for n, _ in SIZES], weights=[w for _, w in SIZES])[0]
    lo, hi = busy_s
    return Job(kind=kind, gpus=gpus, priority=10 if rng.random() < priority_chance else 0,
               busy_s=math.exp(rng.uniform(math.log(lo), math.log(hi))), forgets=rng.random() < forget_chance,
               accept_partial=gpus > 1 and rng.random() < 0.5, seed=rng.randrange(1 << 30))
