"""Guest-agent test helpers: a fake NVML (patches pynvml's functions, a third-party boundary), a fake guest sysfs,
and the real host agent served on a loopback port (stoppable and restartable on the same port)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pynvml
import pytest
from aiohttp import web

from hostagent.runtime import Runtime, build_runtime, make_app
from tests.support.agent import AgentRig


@dataclass
class FakeGpu:
    """What the fake driver reports for one GPU; tests change util/used/pids as they go."""

    bus_id: str  # NVML style: 00000000:00:05.0
    name: str = "NVIDIA H100 80GB HBM3"
    uuid: str = "GPU-00000000-0000-0000-0000-000000000000"
    total: int = 80 * 2**30
    util: float = 0.0
    used: int = 0
    pids: list[int] = field(default_factory=list)
    broken: bool = False  # NVML answers GPU_IS_LOST for this one


class FakeNvml:
    """pynvml's module functions over a list of FakeGpu, read again at every nvmlInit (hot-plug)."""

    def __init__(self, gpus: list[FakeGpu] | Callable[[], list[FakeGpu]] | None = None, *,
                 init_error: int | None = None, processes_supported: bool = True) -> None:
        self._source = gpus if callable(gpus) else (lambda: list(gpus or []))
        self.gpus: list[FakeGpu] = []
        self.init_error = init_error
        self.processes_supported = processes_supported
        self.inits = 0
        self.reads = 0

    def _gpu(self, handle: Any) -> FakeGpu:
        gpu = self.gpus[handle.index]
        if gpu.broken:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
        return gpu

    def install(self, monkeypatch: pytest.MonkeyPatch) -> FakeNvml:
        """Patch every pynvml function the sampler calls."""

        def init(*_: Any) -> None:
            if self.init_error is not None:
                raise pynvml.NVMLError(self.init_error)
            self.inits += 1
            self.gpus = list(self._source())

        def util(h: Any) -> Any:
            self.reads += 1
            return SimpleNamespace(gpu=self._gpu(h).util, memory=0)

        def procs(h: Any) -> list[Any]:
            if not self.processes_supported:
                raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
            return [SimpleNamespace(pid=p, usedGpuMemory=None) for p in self._gpu(h).pids]

        fns: dict[str, Callable[..., Any]] = {
            "nvmlInit": init,
            "nvmlShutdown": lambda: None,
            "nvmlSystemGetDriverVersion": lambda: "550.54.15",
            "nvmlDeviceGetCount": lambda: len(self.gpus),
            "nvmlDeviceGetHandleByIndex": lambda i: SimpleNamespace(index=i),
            # The real binding returns a ctypes struct whose busId is bytes.
            "nvmlDeviceGetPciInfo": lambda h: SimpleNamespace(busId=self.gpus[h.index].bus_id.encode()),
            "nvmlDeviceGetName": lambda h: self.gpus[h.index].name,
            "nvmlDeviceGetUUID": lambda h: self.gpus[h.index].uuid,
            "nvmlDeviceGetMemoryInfo": lambda h: SimpleNamespace(total=self._gpu(h).total, used=self._gpu(h).used,
                                                                 free=self._gpu(h).total - self._gpu(h).used),
            "nvmlDeviceGetUtilizationRates": util,
            "nvmlDeviceGetComputeRunningProcesses": procs,
            "nvmlDeviceGetGraphicsRunningProcesses": lambda h: [],
        }
        for name, fn in fns.items():
            monkeypatch.setattr(pynvml, name, fn)
        return self


def nvml_bus_id(address: str) -> str:
    """`0000:00:05.0` -> NVML's `00000000:00:05.0`."""
    dom, rest = address.split(":", 1)
    return f"{int(dom, 16):08X}:{rest.upper()}"


def attached_gpus(rig: AgentRig, vm: str = "vm-a", *, util: float = 55.0, used: int = 2**30) -> Callable[[], list[FakeGpu]]:
    """The GPUs a VM's guest would see now: one per ACTIVE lease device, at its guest address (the hot-plug)."""

    def gpus() -> list[FakeGpu]:
        rt = rig.extra["runtime"]
        out = []
        for lease in sorted(rt.manager.leases.values(), key=lambda x: x.created_at):
            if lease.domain_uuid != rig.uuids[vm] or lease.state.value != "ACTIVE":
                continue
            for n, d in enumerate(lease.devices):
                out.append(FakeGpu(nvml_bus_id(d.guest_addresses[0]), uuid=f"GPU-{lease.id}-{n}", util=util,
                                   used=used))
        return out

    return gpus


def guest_sysfs(root: Path, devices: dict[str, tuple[str, str, str]]) -> Path:
    """A guest /sys with PCI devices: address -> (class, vendor, device)."""
    base = root / "bus/pci/devices"
    base.mkdir(parents=True, exist_ok=True)
    for addr, (cls, vendor, device) in devices.items():
        d = base / addr
        d.mkdir()
        (d / "class").write_text(cls + "\n")
        (d / "vendor").write_text(vendor + "\n")
        (d / "device").write_text(device + "\n")
    return root


class LiveAgent:
    """The real host agent (runtime + aiohttp app) on a real 127.0.0.1 port; `stop()` / `start()` keep the port."""

    def __init__(self, rig: AgentRig) -> None:
        self.rig = rig
        self.runtime: Runtime = rig.runtime
        self.port = 0
        self.runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        """Base URL of the API."""
        return f"http://127.0.0.1:{self.port}"

    async def start(self, *, fresh_runtime: bool = False) -> None:
        """Serve; with fresh_runtime, a new agent process's worth of state from the same state dir (a restart)."""
        if fresh_runtime:
            self.runtime = build_runtime(self.rig.settings)
        self.rig.extra["runtime"] = self.runtime
        self.runner = web.AppRunner(make_app(self.runtime))
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", self.port)
        await site.start()
        if not self.port:
            self.port = self.runner.addresses[0][1]

    async def stop(self) -> None:
        """Stop listening and shut the runtime down (as when the agent exits)."""
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None


def write_guest_config(path: Path, url: str, token_file: Path, **extra: Any) -> Path:
    """A guest.toml for the CLI."""
    values: dict[str, Any] = {"url": url, "token_file": str(token_file), "sample_interval_s": 0.1,
                              "heartbeat_interval_s": 0.25, "retries": 1, "backoff_max_s": 0.2,
                              "request_timeout_s": 5.0, "state_dir": str(path.parent / "run")}
    values.update(extra)
    lines = []
    for k, v in values.items():
        if isinstance(v, bool):
            lines.append(f"{k} = {'true' if v else 'false'}")
        elif isinstance(v, (int, float)):
            lines.append(f"{k} = {v}")
        else:
            lines.append(f"{k} = {str(v)!r}".replace("'", '"'))
    path.write_text("\n".join(lines) + "\n")
    return path
