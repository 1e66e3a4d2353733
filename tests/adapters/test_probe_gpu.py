"""The real probe runners on a real NVIDIA GPU (marker `gpu`): skipped, with the reason, where there is none."""

from __future__ import annotations

import re

import pytest

from hostagent.domain.capabilities import Measured, capabilities
from hostagent.host.discovery import discover
from hostagent.host.probes import BANDWIDTH, MATMUL, CupyRunner, NvidiaSmiRunner, NvmlRunner, TorchRunner
from hostagent.host.sysfs import Sysfs

pytestmark = pytest.mark.gpu


def _nvidia_gpu():  # type: ignore[no-untyped-def]
    why = NvmlRunner().unavailable()
    if why is not None:
        pytest.skip(f"no NVIDIA GPU here: {why}")
    inv = discover(Sysfs("/sys"), vendors=("10de",))
    gpus = [g for g in inv.gpus if g.primary.driver == "nvidia"]
    if not gpus:
        pytest.skip("NVML works but no GPU in sysfs is on the nvidia driver")
    return gpus[0]


def _available(runner):  # type: ignore[no-untyped-def]
    """The runner, or a skip with the reason it cannot run here."""
    why = runner.unavailable()
    if why is not None:
        pytest.skip(why)
    return runner


def test_nvml_reads_health_signals() -> None:
    gpu = _nvidia_gpu()
    res = NvmlRunner().run(gpu, 1.0)
    assert res.error is None, res.error
    assert 0 < res.health["temperature_c"] < 120
    assert res.health["pcie_max_width"] >= res.health["pcie_width"] >= 1
    assert isinstance(res.problems, tuple)


def test_nvidia_smi_agrees_with_nvml() -> None:
    gpu = _nvidia_gpu()
    res = _available(NvidiaSmiRunner()).run(gpu, 1.0)
    assert res.error is None, res.error
    assert res.health["pcie.link.width.max"] == NvmlRunner().run(gpu, 1.0).health["pcie_max_width"]


@pytest.mark.parametrize("runner", [TorchRunner(), CupyRunner()], ids=["torch", "cupy"])
def test_compute_runner_measures_throughput(runner) -> None:  # type: ignore[no-untyped-def]
    gpu = _nvidia_gpu()
    res = _available(runner).run(gpu, 1.0)
    assert res.error is None, res.error
    assert res.metrics[MATMUL] > 1.0  # TFLOP/s: any datacenter GPU does far more in FP16
    assert res.metrics[BANDWIDTH] > 50.0  # GB/s


def test_the_driver_tells_what_pci_ids_may_not() -> None:
    """Name, memory size and compute capability from NVML; with them a card pci.ids does not name has features."""
    gpu = _nvidia_gpu()
    nv = NvmlRunner().run(gpu, 1.0).health
    assert nv["name"] and nv["memory_total_bytes"] > 1024**3 and re.fullmatch(r"\d+\.\d+", nv["compute_capability"])
    caps = capabilities(gpu.primary.vendor_id, None, measured=Measured.from_probe({"nvml": nv}, {}))
    assert caps.features and "fp16" in caps.features, caps


def test_torch_checks_every_precision_and_reports_the_board() -> None:
    gpu = _nvidia_gpu()
    res = _available(TorchRunner()).run(gpu, 4.0)
    assert res.error is None and not res.problems, (res.error, res.problems)
    assert set(res.health["known_answer"].values()) == {"ok"} and {"fp16", "fp32", "fp64"} <= set(res.health["known_answer"])
    assert res.health["compute_capability"] == NvmlRunner().run(gpu, 1.0).health["compute_capability"]
    assert res.metrics["tflops_fp16"] > res.metrics["tflops_fp32"] > 0 and res.metrics["h2d_gbps"] > 1.0
