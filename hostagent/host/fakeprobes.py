"""A simulated compute probe runner for the fake hosts (the demo, the test rigs): what `TorchRunner` reports on a
real GPU, from each model's nominal figures, with the known-answer check run on the numbers it returns.

Composed only with the fake kernel (`host.kernel = "fake"`); a real adapter never imports it. A GPU of the fake tree
can be told to misbehave through a file beside its sysfs attributes, `sim_compute` (the demo's operator or a test
writes it): `wrong` (its fp16 product is off in one entry: the probe quarantines it), `throttle <factor>` (every
figure times the factor: the peer score catches it), anything else or no file: healthy.
"""

from __future__ import annotations

from typing import Any

from hostagent.domain.inventory import Gpu
from hostagent.host import known_answer
from hostagent.host.probes import BANDWIDTH, COMPUTE, H2D, MATMUL, RunnerResult, tflops_key
from hostagent.host.sysfs import Sysfs

# Nominal figures by chip (dense tensor-core TFLOP/s where the chip has them, memory and PCIe GB/s).
FIGURES: dict[str, dict[str, float]] = {
    "GA100": {"fp16": 312.0, "bf16": 312.0, "fp32": 19.5, "fp64": 9.7, BANDWIDTH: 1555.0, H2D: 25.0},
    "GV100": {"fp16": 125.0, "fp32": 15.7, "fp64": 7.8, BANDWIDTH: 900.0, H2D: 12.0},
    "TU104": {"fp16": 65.0, "fp32": 8.1, "fp64": 0.25, BANDWIDTH: 320.0, H2D: 12.0},
    "TU102": {"fp16": 130.0, "fp32": 16.3, "fp64": 0.51, BANDWIDTH: 672.0, H2D: 12.0},
    "AD102": {"fp16": 165.0, "bf16": 165.0, "fp32": 82.6, "fp64": 1.3, BANDWIDTH: 1008.0, H2D: 25.0},
}
JITTER = (1.0, 0.985, 1.015)  # run-to-run noise, cycled
# What the driver says of each simulated board, by PCI device id (the fake tree's cards): its chip (the figures
# above), compute capability, name and memory, as NVML reports them. Keyed by the id, not the pci.ids name, so a
# host whose pci.ids is older than its cards still measures them (and learns their capabilities and memory).
BOARDS: dict[int, tuple[str, str, str, float]] = {
    0x20B0: ("GA100", "8.0", "NVIDIA A100-SXM4-40GB", 40.0),
    0x20F1: ("GA100", "8.0", "NVIDIA A100-PCIE-40GB", 40.0),
    0x1DB6: ("GV100", "7.0", "Tesla V100-PCIE-32GB", 32.0),
    0x1EB8: ("TU104", "7.5", "Tesla T4", 15.0),
    0x1E30: ("TU102", "7.5", "Quadro RTX 6000", 24.0),
    0x1E07: ("TU102", "7.5", "NVIDIA GeForce RTX 2080 Ti", 11.0),
    0x2684: ("AD102", "8.9", "NVIDIA GeForce RTX 4090", 24.0),
}


def answer(precision: str, *, wrong: bool = False) -> str | None:
    """The known-answer check of a simulated device's product in `precision`: the exact one as the device rounds
    it, or (`wrong`) one entry off by a flipped high bit's worth; None when it passes, else the problem."""
    product = known_answer.rounded(known_answer.expected(precision), precision)
    if wrong:
        product[7, 11] += 0.5
    return known_answer.check(precision, product)


class SimulatedComputeRunner:
    """Per-model figures for the fake tree's GPUs, checked by the same known-answer test as the real runner."""

    name = "sim-compute"
    kind = COMPUTE

    def __init__(self, sysfs: Sysfs) -> None:
        self.sysfs = sysfs
        self.runs = 0

    def unavailable(self) -> str | None:
        """Always available on a fake host."""
        return None

    def run(self, gpu: Gpu, budget_s: float) -> RunnerResult:
        """The GPU model's nominal figures (times its `sim_compute` throttle and a little noise), and the known-answer
        check of the fp16 product it 'computed'."""
        board = BOARDS.get(gpu.primary.device_id) if gpu.primary.vendor_id == 0x10DE else None
        figures = FIGURES.get(board[0]) if board else None
        if board is None or figures is None:
            return RunnerResult(self.name, error=f"no simulated figures for {gpu.model!r}")
        _, cc, name, memory_gib = board
        mode = (self.sysfs.read_str(f"bus/pci/devices/{gpu.address}/sim_compute") or "").split()
        factor = float(mode[1]) if mode[:1] == ["throttle"] and len(mode) > 1 else 1.0
        factor *= JITTER[self.runs % len(JITTER)]
        self.runs += 1
        metrics = {tflops_key(k) if k in known_answer.TOLERANCE else k: round(v * factor, 3) for k, v in figures.items()}
        metrics[MATMUL] = metrics[tflops_key("fp16")]
        verdicts: dict[str, Any] = {}
        problems = []
        for p in (k for k in figures if k in known_answer.TOLERANCE):
            wrong = answer(p, wrong=mode[:1] == ["wrong"] and p == "fp16")
            verdicts[p] = "wrong" if wrong else "ok"
            if wrong:
                problems.append(wrong)
        return RunnerResult(self.name, metrics=metrics, problems=tuple(problems),
                            health={"device_name": name, "compute_capability": cc,
                                    "memory_total_bytes": int(memory_gib * 1024**3), "simulated": True,
                                    "known_answer": verdicts})
