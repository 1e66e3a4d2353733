"""GPU probe runners: short measurements on a GPU that is on its host driver, between leases.

Each runner measures what its library can reach and nothing else; `unavailable()` says why it cannot run on this
host, so a probe with no runner reports that instead of inventing numbers. Runners are blocking: the probe
service calls them from a worker thread.

- `SysfsHealthRunner`: PCIe link negotiated vs capable, AER error counters (always available).
- `NvmlRunner` (nvidia-ml-py): temperature, ECC errors, retired pages / row remapping, throttle reasons, PCIe link.
- `NvidiaSmiRunner`: the same signals from `nvidia-smi` when the NVML binding cannot load.
- `TorchRunner`: the capability vector: matrix-multiply TFLOP/s per precision (fp16, bf16, fp32, fp64), device
  memory and host-to-device bandwidth (GB/s), every precision's product checked against a known answer
  (`hostagent.host.known_answer`); `CupyRunner`: FP16 TFLOP/s (checked the same way) and memory bandwidth.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from hostagent.domain.inventory import Gpu
from hostagent.domain.placement import link_gen_from_speed
from hostagent.host import known_answer
from hostagent.host.sysfs import Sysfs

log = logging.getLogger("hostagent.probes")

COMPUTE = "compute"
HEALTH = "health"
MATMUL = "matmul_tflops"
BANDWIDTH = "mem_bandwidth_gbps"


@dataclass(frozen=True)
class RunnerResult:
    """One run of one runner on one GPU."""

    runner: str
    metrics: dict[str, float] = field(default_factory=dict)  # measured throughputs (higher is better)
    health: dict[str, Any] = field(default_factory=dict)  # raw signals as read
    problems: tuple[str, ...] = ()  # uncorrectable conditions: the GPU must not be leased
    warnings: tuple[str, ...] = ()  # worth an operator's look, not a reason to quarantine
    error: str | None = None  # the runner could not measure this GPU

    def to_dict(self) -> dict[str, Any]:
        """JSON form."""
        return {"runner": self.runner, "metrics": self.metrics, "health": self.health,
                "problems": list(self.problems), "warnings": list(self.warnings), "error": self.error}


class ProbeRunner(Protocol):
    """A pluggable probe: what it measures (`kind`), whether it can run here, and one short run."""

    name: str
    kind: str  # compute | health

    def unavailable(self) -> str | None:
        """Why this runner cannot run on this host, or None when it can."""

    def run(self, gpu: Gpu, budget_s: float) -> RunnerResult:
        """Measure one GPU within about `budget_s` seconds (blocking)."""


def _nvml_bus_id(gpu: Gpu) -> str:
    a = gpu.address
    return f"{a.domain:08x}:{a.bus:02x}:{a.slot:02x}.{a.function:x}"


# -- sysfs -------------------------------------------------------------------------------------------------------

def _decoded(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _aer_counts(text: str | None) -> dict[str, int]:
    """Parse an `aer_dev_*` file: 'NAME COUNT' lines, TOTAL_ERR_* included."""
    out: dict[str, int] = {}
    for line in (text or "").splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].isdigit():
            out[parts[0]] = int(parts[1])
    return out


class SysfsHealthRunner:
    """PCIe link and AER counters from sysfs: available on every host, fake trees included."""

    name = "sysfs"
    kind = HEALTH

    def __init__(self, sysfs: Sysfs) -> None:
        self.sysfs = sysfs

    def unavailable(self) -> str | None:
        """Always available (it reads what the kernel exports)."""
        return None

    def run(self, gpu: Gpu, budget_s: float) -> RunnerResult:
        """Read the primary function's link and AER counters."""
        base = f"bus/pci/devices/{gpu.address}"
        speed, max_speed = self.sysfs.read_str(f"{base}/current_link_speed"), self.sysfs.read_str(f"{base}/max_link_speed")
        width, max_width = self.sysfs.read_int(f"{base}/current_link_width"), self.sysfs.read_int(f"{base}/max_link_width")
        health: dict[str, Any] = {"link_speed": speed, "max_link_speed": max_speed, "link_width": width,
                                  "max_link_width": max_width}
        warnings: list[str] = []
        problems: list[str] = []
        if width is not None and max_width is not None and width < max_width:
            warnings.append(f"PCIe link trained at x{width}, capable of x{max_width}")
        gen, max_gen = link_gen_from_speed(speed), link_gen_from_speed(max_speed)
        if gen is not None and max_gen is not None and gen < max_gen:
            # NVIDIA boards drop the link speed when idle, so this alone is only a note
            warnings.append(f"PCIe link at gen {gen}, capable of gen {max_gen} (normal while the GPU idles)")
        for kind in ("fatal", "nonfatal", "correctable"):
            counts = _aer_counts(self.sysfs.read_str(f"{base}/aer_dev_{kind}"))
            if counts:
                total = counts.get(f"TOTAL_ERR_{'COR' if kind == 'correctable' else kind.upper()}", sum(counts.values()))
                health[f"aer_{kind}"] = total
                if kind == "fatal" and total:
                    problems.append(f"PCIe AER reports {total} fatal error(s)")
                elif kind == "nonfatal" and total:
                    warnings.append(f"PCIe AER reports {total} non-fatal error(s)")
        return RunnerResult(self.name, health=health, problems=tuple(problems), warnings=tuple(warnings))


# -- NVML --------------------------------------------------------------------------------------------------------

class NvmlRunner:
    """Health signals through NVML (the nvidia-ml-py binding); needs the NVIDIA driver's libnvidia-ml.

    NVML is initialised for each call and shut down after it: while initialised it holds the GPUs' device files
    open, and the next lease could not unbind the host driver.
    """

    name = "nvml"
    kind = HEALTH

    def unavailable(self) -> str | None:
        """None when NVML initialises."""
        try:
            import pynvml
        except ImportError:
            return "the NVML binding is not installed (pip install nvidia-ml-py)"
        try:
            pynvml.nvmlInit()
        except Exception as exc:  # pynvml raises NVMLError subclasses named after the NVML status
            return f"NVML did not initialise: {exc} (is the NVIDIA driver installed and loaded?)"
        pynvml.nvmlShutdown()
        return None

    def run(self, gpu: Gpu, budget_s: float) -> RunnerResult:
        """Initialise NVML, read one GPU, shut NVML down."""
        import pynvml

        pynvml.nvmlInit()
        try:
            return self._read(pynvml, gpu)
        finally:
            pynvml.nvmlShutdown()

    def _read(self, nv: Any, gpu: Gpu) -> RunnerResult:
        """Read temperature, ECC, retired pages or remapped rows, throttle reasons and the PCIe link."""
        try:
            h = nv.nvmlDeviceGetHandleByPciBusId(_nvml_bus_id(gpu).encode())
        except nv.NVMLError as exc:
            return RunnerResult(self.name, error=f"NVML does not see {gpu.address}: {exc} (is it on vfio-pci?)")
        health: dict[str, Any] = {}
        problems: list[str] = []
        warnings: list[str] = []

        def read(key: str, fn: Callable[[], Any]) -> Any:
            try:
                health[key] = fn()
            except nv.NVMLError:  # not supported on this board or driver: leave the signal out
                return None
            return health[key]

        # what the driver knows of the board (placement's capabilities and memory where pci.ids is older than the card)
        read("name", lambda: _decoded(nv.nvmlDeviceGetName(h)))
        read("memory_total_bytes", lambda: int(nv.nvmlDeviceGetMemoryInfo(h).total))
        read("compute_capability", lambda: "{}.{}".format(*nv.nvmlDeviceGetCudaComputeCapability(h)))
        read("temperature_c", lambda: nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU))
        unc = read("ecc_uncorrected_volatile", lambda: nv.nvmlDeviceGetTotalEccErrors(
            h, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_VOLATILE_ECC))
        read("ecc_uncorrected_aggregate", lambda: nv.nvmlDeviceGetTotalEccErrors(
            h, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_AGGREGATE_ECC))
        read("ecc_corrected_volatile", lambda: nv.nvmlDeviceGetTotalEccErrors(
            h, nv.NVML_MEMORY_ERROR_TYPE_CORRECTED, nv.NVML_VOLATILE_ECC))
        if unc:
            problems.append(f"{unc} uncorrectable ECC error(s) since the driver loaded")
        pending = read("retired_pages_pending", lambda: bool(nv.nvmlDeviceGetRetiredPagesPendingStatus(h)))
        if pending:
            problems.append("retired pages are pending: the GPU needs a reset before it is trusted again")
        rows = read("remapped_rows", lambda: dict(zip(("correctable", "uncorrectable", "pending", "failure"),
                                                      nv.nvmlDeviceGetRemappedRows(h))))
        if rows and rows.get("failure"):
            problems.append("row remapping failed: the GPU's memory has uncorrectable faults")
        elif rows and rows.get("pending"):
            problems.append("row remapping is pending: the GPU needs a reset before it is trusted again")
        reasons = read("throttle_reasons", lambda: int(nv.nvmlDeviceGetCurrentClocksThrottleReasons(h)))
        if reasons:
            names = [n for n, bit in (("hw-slowdown", nv.nvmlClocksThrottleReasonHwSlowdown),
                                      ("hw-thermal", nv.nvmlClocksThrottleReasonHwThermalSlowdown),
                                      ("sw-thermal", nv.nvmlClocksThrottleReasonSwThermalSlowdown),
                                      ("power-brake", nv.nvmlClocksThrottleReasonHwPowerBrakeSlowdown))
                     if reasons & bit]
            if names:
                warnings.append(f"clocks throttled: {', '.join(names)}")
            health["throttle_names"] = names
        gen, max_gen = (read("pcie_gen", lambda: nv.nvmlDeviceGetCurrPcieLinkGeneration(h)),
                        read("pcie_max_gen", lambda: nv.nvmlDeviceGetMaxPcieLinkGeneration(h)))
        width, max_width = (read("pcie_width", lambda: nv.nvmlDeviceGetCurrPcieLinkWidth(h)),
                            read("pcie_max_width", lambda: nv.nvmlDeviceGetMaxPcieLinkWidth(h)))
        if width and max_width and width < max_width:
            warnings.append(f"PCIe link trained at x{width}, capable of x{max_width}")
        if gen and max_gen and gen < max_gen:
            warnings.append(f"PCIe link at gen {gen}, capable of gen {max_gen} (normal while the GPU idles)")
        return RunnerResult(self.name, health=health, problems=tuple(problems), warnings=tuple(warnings))


# -- nvidia-smi --------------------------------------------------------------------------------------------------

SMI_FIELDS = ("pci.bus_id", "temperature.gpu", "ecc.errors.uncorrected.volatile.total", "retired_pages.pending",
              "clocks_throttle_reasons.hw_slowdown", "pcie.link.gen.current", "pcie.link.gen.max",
              "pcie.link.width.current", "pcie.link.width.max")


def parse_smi_row(row: str) -> dict[str, Any]:
    """One `nvidia-smi --query-gpu=SMI_FIELDS --format=csv,noheader,nounits` line as typed values."""
    values = [v.strip() for v in row.split(",")]
    out: dict[str, Any] = {}
    for key, v in zip(SMI_FIELDS, values):
        if v in ("[N/A]", "N/A", "[Not Supported]", ""):
            continue
        if key == "pci.bus_id":
            out[key] = v.lower()
        elif v.isdigit():
            out[key] = int(v)
        else:
            out[key] = v
    return out


class NvidiaSmiRunner:
    """The NVML signals through the `nvidia-smi` tool, for hosts where the Python binding cannot load."""

    name = "nvidia-smi"
    kind = HEALTH

    def __init__(self, executable: str = "nvidia-smi", timeout_s: float = 15.0) -> None:
        self.executable = executable
        self.timeout_s = timeout_s

    def unavailable(self) -> str | None:
        """None when nvidia-smi is on PATH."""
        return None if shutil.which(self.executable) else f"{self.executable} is not installed"

    def run(self, gpu: Gpu, budget_s: float) -> RunnerResult:
        """Query one GPU by bus id."""
        cmd = [self.executable, f"--query-gpu={','.join(SMI_FIELDS)}", "--format=csv,noheader,nounits",
               f"--id={_nvml_bus_id(gpu)}"]
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=self.timeout_s, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return RunnerResult(self.name, error=f"nvidia-smi failed: {exc}")
        if out.returncode != 0 or not out.stdout.strip():
            return RunnerResult(self.name, error=f"nvidia-smi: {(out.stderr or out.stdout).strip()[:200]}")
        row = parse_smi_row(out.stdout.strip().splitlines()[0])
        problems, warnings = [], []
        if row.get("ecc.errors.uncorrected.volatile.total"):
            problems.append(f"{row['ecc.errors.uncorrected.volatile.total']} uncorrectable ECC error(s) since the driver loaded")
        if str(row.get("retired_pages.pending", "")).lower() == "yes":
            problems.append("retired pages are pending: the GPU needs a reset before it is trusted again")
        if str(row.get("clocks_throttle_reasons.hw_slowdown", "")).lower() == "active":
            warnings.append("clocks throttled: hw-slowdown")
        w, mw = row.get("pcie.link.width.current"), row.get("pcie.link.width.max")
        if isinstance(w, int) and isinstance(mw, int) and w < mw:
            warnings.append(f"PCIe link trained at x{w}, capable of x{mw}")
        return RunnerResult(self.name, health=row, problems=tuple(problems), warnings=tuple(warnings))


# -- compute (torch / cupy) --------------------------------------------------------------------------------------

MATMUL_N = 4096
COPY_BYTES = 256 * 1024**2


def _timed_loop(step: Callable[[], None], sync: Callable[[], None], budget_s: float, min_iters: int = 3) -> tuple[int, float]:
    """Run `step` until about budget_s has passed (at least min_iters); returns (iterations, seconds)."""
    step()
    sync()  # warm-up: kernels compiled, clocks up
    n, t0 = 0, time.perf_counter()
    while n < min_iters or time.perf_counter() - t0 < budget_s:
        step()
        n += 1
        if n % 4 == 0:
            sync()
    sync()
    return n, time.perf_counter() - t0


def tflops_key(precision: str) -> str:
    """The capability vector's metric for matrix-multiply throughput in one precision."""
    return f"tflops_{precision}"


H2D = "h2d_gbps"  # host-to-device copy bandwidth (pinned memory)


class TorchRunner:
    """The capability vector through PyTorch: matrix-multiply TFLOP/s in each precision the device supports (fp16,
    bf16, fp32, fp64), device memory bandwidth and host-to-device bandwidth; each precision's product of the
    known-answer matrices is checked (hostagent.host.known_answer). `device="cpu"` runs the same code on CPU
    tensors (smaller matrices): the tests run it so, and a host without a GPU library can try it."""

    name = "torch"
    kind = COMPUTE

    def __init__(self, device: str = "cuda") -> None:
        self.device = device

    def unavailable(self) -> str | None:
        """None when PyTorch is installed and sees a CUDA device (or runs on the CPU). The CUDA check runs in a
        child process (`cuda_check_in_child`): in the agent it would import PyTorch (seconds, hundreds of MB) and
        initialise CUDA, whose driver handles stay open for the process's life."""
        if importlib.util.find_spec("torch") is None:
            return "PyTorch is not installed"
        return None if self.device == "cpu" else cuda_check_in_child(self.name)

    @staticmethod
    def cuda_check() -> str | None:
        """In the child: why PyTorch cannot measure a CUDA device here, or None."""
        import torch

        return None if torch.cuda.is_available() else "PyTorch sees no CUDA device"

    def _index(self, torch: Any, gpu: Gpu) -> int | None:
        a = gpu.address
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            if (getattr(p, "pci_domain_id", 0), getattr(p, "pci_bus_id", -1), getattr(p, "pci_device_id", -1)) == (
                    a.domain, a.bus, a.slot):
                return i
        return None

    def run(self, gpu: Gpu, budget_s: float) -> RunnerResult:
        """Measure in a child process (its CUDA context must not outlive the probe: it would pin the driver)."""
        if self.device == "cpu":
            return self.measure(gpu, budget_s)
        return run_in_child(self.name, gpu, budget_s)

    def measure(self, gpu: Gpu, budget_s: float) -> RunnerResult:
        """Measure on the CUDA device at the GPU's address (or the CPU), in this process."""
        import torch

        facts: dict[str, Any] = {}
        if self.device == "cpu":
            dev, n, copy_bytes, label = torch.device("cpu"), 256, 16 * 1024**2, "cpu"
            precisions = ["fp16", "bf16", "fp32", "fp64"]
        else:
            idx = self._index(torch, gpu)
            if idx is None:
                return RunnerResult(self.name, error=f"no CUDA device at {gpu.address} (is it on its host driver?)")
            dev, n, copy_bytes, label = torch.device("cuda", idx), MATMUL_N, COPY_BYTES, torch.cuda.get_device_name(idx)
            props = torch.cuda.get_device_properties(idx)
            facts = {"compute_capability": f"{props.major}.{props.minor}", "memory_total_bytes": int(props.total_memory)}
            precisions = ["fp16", *(["bf16"] if torch.cuda.is_bf16_supported() else []), "fp32", "fp64"]
        dtypes = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32, "fp64": torch.float64}
        sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
        metrics: dict[str, float] = {}
        problems: list[str] = []
        iters: dict[str, int] = {}
        verdicts: dict[str, str] = {}  # precision -> ok | wrong (the known-answer check)
        share = budget_s / (len(precisions) + 2)
        ctx = torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext()
        with ctx:
            if dev.type == "cuda":  # full-rate FP32 is what the vector reports, not TF32
                torch.backends.cuda.matmul.allow_tf32 = False
            for p in precisions:
                dt = dtypes[p]
                ka, kb = (torch.tensor(x, dtype=dt, device=dev) for x in known_answer.inputs(p))
                wrong = known_answer.check(p, torch.mm(ka, kb).to(torch.float64).cpu().numpy())
                verdicts[p] = "wrong" if wrong else "ok"
                if wrong:
                    problems.append(wrong)
                a = torch.randn(n, n, device=dev, dtype=torch.float32).to(dt)
                b = torch.randn(n, n, device=dev, dtype=torch.float32).to(dt)
                k, secs = _timed_loop(lambda: torch.mm(a, b), sync, share)
                metrics[tflops_key(p)] = round(2 * n**3 * k / secs / 1e12, 4)
                iters[p] = k
            src = torch.empty(copy_bytes, dtype=torch.uint8, device=dev)
            dst = torch.empty_like(src)
            m, csecs = _timed_loop(lambda: dst.copy_(src), sync, share)
            metrics[BANDWIDTH] = round(2 * copy_bytes * m / csecs / 1e9, 2)  # a copy reads and writes every byte
            if dev.type == "cuda":
                host = torch.empty(copy_bytes, dtype=torch.uint8).pin_memory()
                h, hsecs = _timed_loop(lambda: src.copy_(host, non_blocking=True), sync, share)
                metrics[H2D] = round(copy_bytes * h / hsecs / 1e9, 2)
        metrics[MATMUL] = metrics[tflops_key("fp16")]  # what the peer score has always compared
        return RunnerResult(self.name, metrics=metrics, problems=tuple(problems),
                            health={"device_name": label, "matmul_iters": iters, "copy_iters": m,
                                    "known_answer": verdicts, **facts})


class CupyRunner:
    """FP16 matrix-multiply throughput (with its known-answer check) and memory bandwidth through CuPy."""

    name = "cupy"
    kind = COMPUTE

    def unavailable(self) -> str | None:
        """None when CuPy is installed and sees a CUDA device (checked in a child process, as for PyTorch)."""
        if importlib.util.find_spec("cupy") is None:
            return "CuPy is not installed"
        return cuda_check_in_child(self.name)

    @staticmethod
    def cuda_check() -> str | None:
        """In the child: why CuPy cannot measure a CUDA device here, or None."""
        import cupy

        try:
            if cupy.cuda.runtime.getDeviceCount() < 1:
                return "CuPy sees no CUDA device"
        except Exception as exc:  # CUDARuntimeError when the driver is missing
            return f"CuPy cannot reach CUDA: {exc}"
        return None

    def run(self, gpu: Gpu, budget_s: float) -> RunnerResult:
        """Measure in a child process (its CUDA context must not outlive the probe: it would pin the driver)."""
        return run_in_child(self.name, gpu, budget_s)

    def measure(self, gpu: Gpu, budget_s: float) -> RunnerResult:
        """Measure TFLOP/s and GB/s on the CUDA device at the GPU's address (in this process)."""
        import cupy

        want = f"{gpu.address.domain:04x}:{gpu.address.bus:02x}:{gpu.address.slot:02x}"
        idx = next((i for i in range(cupy.cuda.runtime.getDeviceCount())
                    if cupy.cuda.Device(i).pci_bus_id.lower().startswith(want)), None)
        if idx is None:
            return RunnerResult(self.name, error=f"no CUDA device at {gpu.address} (is it on its host driver?)")
        with cupy.cuda.Device(idx) as d:
            ka, kb = (cupy.asarray(x).astype(cupy.float16) for x in known_answer.inputs("fp16"))
            wrong = known_answer.check("fp16", cupy.asnumpy(cupy.matmul(ka, kb)).astype("float64"))
            a = cupy.random.standard_normal((MATMUL_N, MATMUL_N), dtype=cupy.float32).astype(cupy.float16)
            b = cupy.random.standard_normal((MATMUL_N, MATMUL_N), dtype=cupy.float32).astype(cupy.float16)
            n, secs = _timed_loop(lambda: cupy.matmul(a, b), d.synchronize, budget_s / 2)
            src = cupy.empty(COPY_BYTES, dtype=cupy.uint8)
            dst = cupy.empty_like(src)
            m, csecs = _timed_loop(lambda: dst.__setitem__(slice(None), src), d.synchronize, budget_s / 2)
        tflops = round(2 * MATMUL_N**3 * n / secs / 1e12, 3)
        return RunnerResult(self.name, metrics={MATMUL: tflops, tflops_key("fp16"): tflops,
                                                BANDWIDTH: round(2 * COPY_BYTES * m / csecs / 1e9, 2)},
                            problems=(wrong,) if wrong else (),
                            health={"matmul_iters": n, "copy_iters": m, "known_answer": {"fp16": "wrong" if wrong else "ok"}})


CUDA_CHECK_TIMEOUT_S = 60.0  # importing PyTorch and initialising CUDA on a loaded host takes seconds, not minutes


def cuda_check_in_child(runner: str, timeout_s: float = CUDA_CHECK_TIMEOUT_S) -> str | None:
    """Why a compute runner cannot reach a CUDA device here, or None: asked of
    `python -m hostagent.host.probes --check RUNNER`, so the agent never imports the library nor initialises CUDA."""
    answer = _ask_child(["--check", runner], timeout_s, f"the {runner} check", failed="did not finish")
    if isinstance(answer, str):
        return answer
    if "unavailable" not in answer:
        return f"the {runner} check printed no answer: {json.dumps(answer)[-300:]}"
    why = answer["unavailable"]
    return None if why is None else str(why)


def _ask_child(args: Sequence[str], timeout_s: float, who: str, *, failed: str = "failed") -> dict[str, Any] | str:
    """The JSON object `python -m hostagent.host.probes ARGS` printed on its last line, or what went wrong, in words
    beginning with `who`."""
    cmd = [sys.executable, "-m", "hostagent.host.probes", *args]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{who} {failed}: {exc}"
    lines = out.stdout.strip().splitlines()
    if out.returncode != 0 or not lines:
        return f"{who} exited {out.returncode}: {(out.stderr or out.stdout).strip()[-300:]}"
    try:
        answer = json.loads(lines[-1])
    except ValueError:
        answer = None
    return answer if isinstance(answer, dict) else f"{who} printed no answer: {lines[-1][-300:]}"


def run_in_child(runner: str, gpu: Gpu, budget_s: float, timeout_s: float | None = None) -> RunnerResult:
    """Run a compute runner's `measure` in `python -m hostagent.host.probes RUNNER ADDRESS BUDGET` and read its JSON.

    A CUDA context in the agent itself would keep the host driver busy, and the next lease could not unbind it.
    """
    d = _ask_child([runner, str(gpu.address), f"{budget_s:g}"],
                   timeout_s if timeout_s is not None else 60 + 4 * budget_s, f"{runner} probe process")
    if isinstance(d, str):
        return RunnerResult(runner, error=d)
    return RunnerResult(d["runner"], metrics=d["metrics"], health=d["health"], problems=tuple(d["problems"]),
                        warnings=tuple(d["warnings"]), error=d["error"])


def _child_main(argv: Sequence[str]) -> int:
    """The child side of `run_in_child` (measure one GPU, found by address under /sys) and of `cuda_check_in_child`
    (`--check RUNNER`: why it cannot reach CUDA here); prints JSON."""
    from hostagent.host.discovery import discover
    from hostagent.host.sysfs import Sysfs as RealSysfs

    runners: dict[str, type[TorchRunner] | type[CupyRunner]] = {"torch": TorchRunner, "cupy": CupyRunner}
    if argv[0] == "--check":  # `cuda_check_in_child`
        print(json.dumps({"unavailable": runners[argv[1]].cuda_check()}))
        return 0
    runner_name, address, budget = argv[0], argv[1], float(argv[2])
    inv = discover(RealSysfs("/sys"), vendors=("10de", "1002"))
    gpu = next((g for g in inv.gpus if str(g.address) == address), None)
    if gpu is None:
        res = RunnerResult(runner_name, error=f"no GPU at {address} in /sys")
    else:
        res = runners[runner_name]().measure(gpu, budget)
    print(json.dumps(res.to_dict()))
    return 0


# -- a task type's own probe ------------------------------------------------------------------------------------

def task_metric(task_type: str) -> str:
    """The figure a task type's own probe measures: its work rate (the unit its guests report) on one GPU."""
    return f"work_rate:{task_type}"


class TaskProbeRunner:
    """A task type's own probe (`[probes] task_probes`): the operator's command, run on one free GPU on its host
    driver with HOSTAGENT_PROBE_GPU (the PCI address), HOSTAGENT_PROBE_TASK, HOSTAGENT_PROBE_BUDGET_S and
    CUDA_DEVICE_ORDER=PCI_BUS_ID in its environment; its last line of output is JSON `{"work_rate": N}`, N per
    second in the unit the task's guests report."""

    kind = "task"

    def __init__(self, task_type: str, command: Sequence[str]) -> None:
        self.task_type = task_type
        self.command = list(command)
        self.name = f"task:{task_type}"

    def run(self, gpu: Gpu, budget_s: float) -> RunnerResult:
        """Run the command once on `gpu`; the work rate it printed, or the error."""
        env = {**os.environ, "HOSTAGENT_PROBE_GPU": str(gpu.address), "HOSTAGENT_PROBE_TASK": self.task_type,
               "HOSTAGENT_PROBE_BUDGET_S": f"{budget_s:g}", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
        try:
            out = subprocess.run(self.command, capture_output=True, text=True, check=False, env=env,
                                 timeout=30 + 2 * budget_s)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return RunnerResult(self.name, error=f"task probe {self.command[0]} failed: {exc}")
        lines = out.stdout.strip().splitlines()
        try:
            rate = json.loads(lines[-1])["work_rate"] if out.returncode == 0 and lines else None
            ok = isinstance(rate, (int, float)) and not isinstance(rate, bool) and 0 < rate < 1e15
        except (ValueError, KeyError, TypeError):
            ok = False
        if not ok:
            tail = (out.stderr or out.stdout).strip()[-300:]
            return RunnerResult(self.name, error=f"task probe exited {out.returncode} without a work rate on its last "
                                                 f'line (JSON {{"work_rate": N}}): {tail}')
        return RunnerResult(self.name, metrics={task_metric(self.task_type): float(rate)})


# -- choosing runners --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class RunnerStatus:
    """Whether a runner can run here, for operators."""

    name: str
    kind: str
    available: bool
    reason: str | None

    def to_dict(self) -> dict[str, Any]:
        """JSON form."""
        return {"name": self.name, "kind": self.kind, "available": self.available, "reason": self.reason}


def select_runners(candidates: Sequence[ProbeRunner]) -> tuple[list[ProbeRunner], list[RunnerStatus]]:
    """The runners to use (every available health runner except nvidia-smi when NVML works; the first available
    compute runner) and the status of every candidate."""
    chosen: list[ProbeRunner] = []
    status: list[RunnerStatus] = []
    have_compute = have_nvml = False
    for r in candidates:
        if r.kind == COMPUTE and have_compute:  # not asked: a compute runner's check costs a child process
            why: str | None = "another compute runner was chosen first"
        else:
            why = r.unavailable()
        if why is None and r.name == "nvidia-smi" and have_nvml:
            why = "NVML is available; nvidia-smi would read the same signals"
        status.append(RunnerStatus(r.name, r.kind, why is None, why))
        if why is None:
            chosen.append(r)
            have_compute = have_compute or r.kind == COMPUTE
            have_nvml = have_nvml or r.name == "nvml"
    return chosen, status


def default_runners(sysfs: Sysfs) -> list[ProbeRunner]:
    """Every runner this module knows, in order of preference."""
    return [SysfsHealthRunner(sysfs), NvmlRunner(), NvidiaSmiRunner(), TorchRunner(), CupyRunner()]


def median_or_none(values: Sequence[float]) -> float | None:
    """Median, None for no values."""
    return statistics.median(values) if values else None


if __name__ == "__main__":
    raise SystemExit(_child_main(sys.argv[1:]))
