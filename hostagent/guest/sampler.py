"""GPU sampling inside the guest: NVML (pynvml) first, the amdgpu sysfs counters next, else nothing but the PCI list.

Run standalone to see what this guest can report: `python -m hostagent.guest.sampler --once --json`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger("hostagent.guest.sampler")

PCI_IDS_PATHS = ("/usr/share/misc/pci.ids", "/usr/share/hwdata/pci.ids", "/usr/share/pci.ids")


def normalize_bus_id(bus_id: str | bytes) -> str:
    """`00000000:3B:00.0` (NVML) or `0000:3b:00.0` (sysfs) -> `0000:3b:00.0`."""
    text = bus_id.decode() if isinstance(bus_id, bytes) else bus_id
    text = text.strip().lower()
    dom, sep, rest = text.rpartition(":")  # rest = "00.0"
    dom, sep2, bus = dom.rpartition(":")
    if not sep or not sep2:
        return text
    try:
        return f"{int(dom or '0', 16) & 0xFFFF:04x}:{int(bus, 16):02x}:{rest}"
    except ValueError:
        return text


@dataclass(frozen=True, slots=True)
class GpuInfo:
    """One GPU the guest sees."""

    index: int
    bus_id: str  # normalized PCI address in the guest
    name: str
    uuid: str | None = None
    memory_total_bytes: int | None = None
    source: str = "nvml"


@dataclass(frozen=True, slots=True)
class Reading:
    """One sample of one GPU; None where the source cannot tell."""

    ts: float
    index: int
    bus_id: str
    util_pct: float | None
    mem_used_bytes: int | None
    mem_total_bytes: int | None = None
    processes: tuple[int, ...] | None = None  # PIDs using the GPU, when the driver tells
    work_rate: float | None = None


@dataclass(frozen=True, slots=True)
class PciDisplay:
    """A display controller found in /sys/bus/pci/devices (the `lspci`-style fallback listing)."""

    address: str
    class_hex: str
    vendor_id: str
    device_id: str
    driver: str | None
    name: str

    def line(self) -> str:
        """One `lspci`-like line."""
        drv = f" [driver: {self.driver}]" if self.driver else " [no driver]"
        return f"{self.address} {self.class_hex} {self.vendor_id}:{self.device_id} {self.name}{drv}"


# ---- NVML -------------------------------------------------------------------------------------------------------


class NvmlUnavailable(Exception):
    """NVML cannot be used here (no pynvml, no NVIDIA driver, no GPU)."""


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


class NvmlBackend:
    """Utilization, memory and processes through pynvml (nvidia-ml-py). Each call is a few microseconds."""

    source = "nvml"
    blocks = True  # a wedged driver can stall a call: read from a thread (Sampler.blocks)

    def __init__(self) -> None:
        try:
            import pynvml
        except ImportError as exc:
            raise NvmlUnavailable("pynvml is not installed (pip install 'hostagent[guest]' or nvidia-ml-py)") from exc
        self.nvml = pynvml
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            raise NvmlUnavailable(f"NVML did not initialise: {exc} (no NVIDIA driver or GPU in this guest?)") from None
        try:
            self.driver = _text(pynvml.nvmlSystemGetDriverVersion())
        except pynvml.NVMLError:
            self.driver = "unknown"
        self.handles: list[Any] = []
        self.devices: list[GpuInfo] = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            pci = pynvml.nvmlDeviceGetPciInfo(h)
            self.handles.append(h)
            self.devices.append(GpuInfo(
                index=i, bus_id=normalize_bus_id(pci.busId), name=_text(pynvml.nvmlDeviceGetName(h)),
                uuid=self._maybe(pynvml.nvmlDeviceGetUUID, h),
                memory_total_bytes=int(pynvml.nvmlDeviceGetMemoryInfo(h).total), source="nvml"))
        self.note = f"NVML: driver {self.driver}, {len(self.devices)} GPU(s)"

    def _maybe(self, fn: Callable[..., Any], *args: Any) -> Any:
        """A value NVML may refuse (NotSupported in some guests) without losing the rest of the sample."""
        try:
            value = fn(*args)
        except self.nvml.NVMLError:
            return None
        return _text(value) if isinstance(value, bytes) else value

    def _pids(self, h: Any) -> tuple[int, ...] | None:
        """Compute (and graphics) processes; unknown when the compute list is refused, never a false zero."""
        compute = self._maybe(self.nvml.nvmlDeviceGetComputeRunningProcesses, h)
        if compute is None:
            return None
        graphics = self._maybe(self.nvml.nvmlDeviceGetGraphicsRunningProcesses, h) or []
        return tuple(sorted({int(p.pid) for p in [*compute, *graphics]}))

    def read(self, ts: float) -> list[Reading]:
        """One reading per GPU; a GPU that stops answering reports None values rather than failing the rest."""
        out = []
        for info, h in zip(self.devices, self.handles):
            util = self._maybe(self.nvml.nvmlDeviceGetUtilizationRates, h)
            mem = self._maybe(self.nvml.nvmlDeviceGetMemoryInfo, h)
            out.append(Reading(ts, info.index, info.bus_id, None if util is None else float(util.gpu),
                               None if mem is None else int(mem.used),
                               None if mem is None else int(mem.total), self._pids(h)))
        return out

    def close(self) -> None:
        """Release NVML."""
        try:
            self.nvml.nvmlShutdown()
        except self.nvml.NVMLError:
            pass


# ---- sysfs (amdgpu exposes busy percent and VRAM use) and the PCI listing ---------------------------------------


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def pci_names(vendor_id: str, device_id: str, paths: Sequence[str] = PCI_IDS_PATHS) -> str:
    """`Vendor Device` from pci.ids when installed, else the bare ids."""
    for p in paths:
        try:
            fh = open(p, encoding="utf-8", errors="replace")
        except OSError:
            continue
        vendor = device = None
        with fh:
            for line in fh:
                if line.startswith("C "):  # device classes follow the vendor list
                    break
                if not line.startswith("\t") and line[:4].lower() == vendor_id:
                    vendor = line[4:].strip()
                elif vendor is not None and not line.startswith("\t"):
                    break
                elif vendor is not None and line.startswith("\t") and not line.startswith("\t\t") \
                        and line[1:5].lower() == device_id:
                    device = line[5:].strip()
                    break
        if vendor:
            return f"{vendor} {device or 'device ' + device_id}"
    return f"PCI device {vendor_id}:{device_id}"


def scan_display_devices(sys_root: str | Path = "/sys") -> list[PciDisplay]:
    """Every PCI display controller (class 0x03xxxx) and 3D/processing accelerator (0x12) the guest sees."""
    base = Path(sys_root) / "bus/pci/devices"
    out = []
    try:
        entries = sorted(os.listdir(base))
    except OSError:
        return []
    for name in entries:
        d = base / name
        cls = _read(d / "class") or ""
        if not cls.startswith(("0x03", "0x12")):
            continue
        vendor = (_read(d / "vendor") or "0x????")[2:].lower()
        device = (_read(d / "device") or "0x????")[2:].lower()
        drv = d / "driver"
        driver = os.path.basename(os.readlink(drv)) if drv.is_symlink() else None
        out.append(PciDisplay(normalize_bus_id(name), cls, vendor, device, driver, pci_names(vendor, device)))
    return out


class SysfsBackend:
    """GPUs whose kernel driver publishes `gpu_busy_percent` (amdgpu): utilization and VRAM from sysfs."""

    source = "sysfs"
    blocks = True  # sysfs reads of a wedged driver can stall: read from a thread (Sampler.blocks)

    def __init__(self, sys_root: str | Path = "/sys") -> None:
        base = Path(sys_root) / "bus/pci/devices"
        self.paths: list[Path] = []
        self.devices: list[GpuInfo] = []
        for dev in scan_display_devices(sys_root):
            d = base / dev.address
            if (d / "gpu_busy_percent").exists():
                total = _read(d / "mem_info_vram_total")
                self.devices.append(GpuInfo(len(self.devices), dev.address, dev.name, None,
                                            int(total) if total and total.isdigit() else None, "sysfs"))
                self.paths.append(d)
        if not self.devices:
            raise NvmlUnavailable("no GPU in this guest publishes utilization in sysfs")
        self.note = f"sysfs: {len(self.devices)} GPU(s) with gpu_busy_percent (no NVML)"

    def read(self, ts: float) -> list[Reading]:
        """One reading per GPU from its sysfs counters."""
        out = []
        for info, d in zip(self.devices, self.paths):
            busy, used = _read(d / "gpu_busy_percent"), _read(d / "mem_info_vram_used")
            out.append(Reading(ts, info.index, info.bus_id, float(busy) if busy and busy.isdigit() else None,
                               int(used) if used and used.isdigit() else None, info.memory_total_bytes, None))
        return out

    def close(self) -> None:
        """Nothing to release."""


# ---- the workload's own throughput --------------------------------------------------------------------------------


def parse_work_rate(text: str) -> dict[str, float] | float | None:
    """`123.4` (every GPU) or a JSON object of GPU index / guest bus id -> rate."""
    text = text.strip()
    if not text:
        return None
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0:
        return float(value)
    if isinstance(value, dict):
        out = {}
        for key, rate in value.items():
            if isinstance(rate, (int, float)) and not isinstance(rate, bool) and rate >= 0:
                out[str(key).lower()] = float(rate)
        return out or None
    return None


class WorkRateSource:
    """The work-rate hook: a file the job rewrites, or `unix:/path`, a datagram socket it sends to.

    A value older than `stale_s` is ignored: a job that stopped reporting is not still working.
    """

    def __init__(self, spec: str, *, stale_s: float = 60.0, clock: Callable[[], float] = time.time) -> None:
        self.spec = spec
        self.stale_s = stale_s
        self.clock = clock
        self._sock: socket.socket | None = None
        self._last: tuple[float, dict[str, float] | float] | None = None
        if spec.startswith("unix:"):
            path = spec[len("unix:"):]
            if os.path.exists(path):
                os.unlink(path)  # a socket left by an earlier run
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            self._sock.bind(path)
            self._sock.setblocking(False)
            os.chmod(path, 0o666)  # the job may run as another user than the agent

    def _poll(self) -> None:
        if self._sock is not None:
            while True:
                try:
                    data = self._sock.recv(65536)
                except (BlockingIOError, InterruptedError):
                    break
                value = parse_work_rate(data.decode(errors="replace"))
                if value is not None:
                    self._last = (self.clock(), value)
            return
        try:
            st = os.stat(self.spec)
            with open(self.spec, encoding="utf-8", errors="replace") as fh:
                value = parse_work_rate(fh.read(65536))
        except OSError:
            return
        if value is not None:
            self._last = (st.st_mtime, value)

    def rate_for(self, reading: Reading) -> float | None:
        """The latest fresh rate for this GPU (by index or guest bus id), or None."""
        if self._last is None or self.clock() - self._last[0] > self.stale_s:
            return None
        value = self._last[1]
        if isinstance(value, float):
            return value
        return value.get(str(reading.index), value.get(reading.bus_id))

    def apply(self, readings: list[Reading]) -> list[Reading]:
        """Readings with the current work rate filled in."""
        self._poll()
        out = []
        for r in readings:
            rate = self.rate_for(r)
            out.append(r if rate is None else Reading(r.ts, r.index, r.bus_id, r.util_pct, r.mem_used_bytes,
                                                      r.mem_total_bytes, r.processes, rate))
        return out

    def close(self) -> None:
        """Close and remove the socket."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None
            path = self.spec[len("unix:"):]
            if os.path.exists(path):
                os.unlink(path)


# ---- the facade -------------------------------------------------------------------------------------------------


@dataclass
class Sampler:
    """Whatever this guest can sample with: NVML, sysfs, or nothing (and why)."""

    backend: NvmlBackend | SysfsBackend | None
    note: str
    work_rate: WorkRateSource | None = None
    sys_root: str = "/sys"
    reasons: list[str] = field(default_factory=list)

    @classmethod
    def open(cls, *, sys_root: str = "/sys", work_rate: str | None = None, stale_s: float = 60.0) -> Sampler:
        """Try NVML, then sysfs; say clearly when neither works."""
        reasons = []
        backend: NvmlBackend | SysfsBackend | None = None
        for kind in (NvmlBackend, lambda: SysfsBackend(sys_root)):
            try:
                backend = kind()
                break
            except NvmlUnavailable as exc:
                reasons.append(str(exc))
        note = backend.note if backend is not None else "no GPU utilization source: " + "; ".join(reasons)
        wr = WorkRateSource(work_rate, stale_s=stale_s) if work_rate else None
        return cls(backend, note, wr, sys_root, reasons)

    @property
    def available(self) -> bool:
        """True when some source reports utilization."""
        return self.backend is not None

    @property
    def devices(self) -> list[GpuInfo]:
        """The GPUs the backend sees (empty without one)."""
        return list(self.backend.devices) if self.backend is not None else []

    @property
    def blocks(self) -> bool:
        """Whether a read may block (NVML and sysfs can stall on a wedged driver: read them from a thread); a backend
        that says `blocks = False` (the demo's simulated GPUs, read from memory) is read on the caller's thread."""
        return self.backend is None or self.backend.blocks

    def read(self, ts: float | None = None) -> list[Reading]:
        """One reading per GPU (blocking unless `blocks` is False: call it from a thread in async code)."""
        if self.backend is None:
            return []
        readings = self.backend.read(time.time() if ts is None else ts)
        return self.work_rate.apply(readings) if self.work_rate is not None else readings

    def close(self) -> None:
        """Release NVML and the work-rate socket."""
        if self.backend is not None:
            self.backend.close()
        if self.work_rate is not None:
            self.work_rate.close()


def snapshot(sampler: Sampler) -> dict[str, Any]:
    """What the sampler reports now, as JSON-ready data."""
    readings = sampler.read()
    return {
        "source": sampler.backend.source if sampler.backend is not None else None,
        "available": sampler.available,
        "note": sampler.note,
        "devices": [asdict(d) for d in sampler.devices],
        "readings": [dict(asdict(r), process_count=None if r.processes is None else len(r.processes))
                     for r in readings],
        "pci_display_devices": [asdict(p) for p in scan_display_devices(sampler.sys_root)],
    }


def _human(snap: dict[str, Any]) -> str:
    lines = [snap["note"]]
    for r in snap["readings"]:
        util = "?" if r["util_pct"] is None else f"{r['util_pct']:.0f}%"
        mem = "?" if r["mem_used_bytes"] is None else f"{r['mem_used_bytes'] / 2**20:.0f} MiB"
        if r["mem_total_bytes"]:
            mem += f" / {r['mem_total_bytes'] / 2**20:.0f} MiB"
        procs = "?" if r["process_count"] is None else str(r["process_count"])
        rate = "" if r["work_rate"] is None else f" work_rate {r['work_rate']:g}"
        lines.append(f"  gpu {r['index']} {r['bus_id']}: util {util}, memory {mem}, processes {procs}{rate}")
    if snap["pci_display_devices"]:
        lines.append("PCI display devices:")
        lines += ["  " + PciDisplay(**p).line() for p in snap["pci_display_devices"]]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m hostagent.guest.sampler`: print what NVML (or sysfs) reports; exit 1 when nothing can sample."""
    ap = argparse.ArgumentParser(prog="python -m hostagent.guest.sampler", description=__doc__)
    ap.add_argument("--once", action="store_true", help="one sample and exit (default: every --interval)")
    ap.add_argument("--json", action="store_true", help="print JSON")
    ap.add_argument("--interval", type=float, default=1.0)
    ap.add_argument("--count", type=int, default=0, help="stop after N samples (0: forever)")
    ap.add_argument("--sys-root", default="/sys")
    ap.add_argument("--work-rate", default=None, help="work-rate file or unix:/socket")
    args = ap.parse_args(argv)
    sampler = Sampler.open(sys_root=args.sys_root, work_rate=args.work_rate)
    n = 0
    try:
        while True:
            snap = snapshot(sampler)
            print(json.dumps(snap, sort_keys=True) if args.json else _human(snap), flush=True)
            n += 1
            if args.once or (args.count and n >= args.count):
                break
            time.sleep(args.interval)
    except KeyboardInterrupt:
        pass
    finally:
        sampler.close()
    return 0 if sampler.available else 1


if __name__ == "__main__":
    sys.exit(main())
