"""Boot Debian's real kernel under QEMU TCG with an emulated Intel IOMMU and run a shell script inside it.

The guest runs the HOST's userland: stage 1 (the busybox initramfs built by scripts/build-test-guest.sh) mounts
the host's / read-only over 9p under a RAM overlay and switch_roots into it; stage 2 (written here, per run)
mounts /tmp, cgroups and the kernel package's modules, then runs the caller's script with the host's Python and
this repository on PYTHONPATH. So the project's own code runs against a real sysfs, real vfio-pci and a real
/dev/vfio. A second 9p share (a fresh host directory per run, writable) carries the script in and the results
out: the script's output, its exit status and whatever it writes under $OUT.

Nothing is skipped: a missing QEMU, kernel or initramfs raises GuestUnavailable, and the test fails with the
command that fixes it. /dev/kvm is deliberately not used (TCG only), so the same run works on any CI machine.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
CACHE = REPO / ".cache" / "testguest"
SHARE_TAG = "hostagent_test"
GUEST_SHARE = "/run/hostagent-test"  # where stage 1 mounts the per-run share inside the guest
BUILD_HINT = "run `bash scripts/build-test-guest.sh` (needs apt, kmod, busybox-static, cpio)"

# Emulated devices, as `-device` arguments. Addresses are explicit so tests can name them.
NIC_ADDR = "0000:00:05.0"  # one e1000e on the root bus: a one-function IOMMU group
PAIR_ADDRS = ("0000:01:00.0", "0000:01:00.1")  # two e1000e functions behind a root port: one group, like GPU+audio
SHARED_ADDRS = ("0000:02:01.0", "0000:02:02.0")  # edu + e1000 behind a PCIe-to-PCI bridge: a non-viable group

NIC_DEVICES = ("e1000e,addr=0x5",)
PAIR_DEVICES = (
    "pcie-root-port,id=rp1,chassis=1,slot=1,addr=0x7",
    "e1000e,bus=rp1,addr=0x0.0,multifunction=on",
    "e1000e,bus=rp1,addr=0x0.1",
)
# Conventional PCI devices behind a bridge share its requester ID, so the kernel puts them in one group.
SHARED_DEVICES = (
    "pcie-pci-bridge,id=pb1,addr=0x8",
    "edu,bus=pb1,addr=0x1",
    "e1000,bus=pb1,addr=0x2",
)

# One e1000e on each NUMA node of a two-node guest (boot_guest(numa_nodes=2)): a PCIe expander bridge per node
# (its ACPI _PXM puts what is behind it on that node), a root port behind each, the NIC behind the port.
NUMA_ADDRS = ("0000:41:00.0", "0000:81:00.0")  # node 0, node 1
NUMA_DEVICES = (
    "pxb-pcie,id=pxb0,bus_nr=0x40,numa_node=0,bus=pcie.0,addr=0x9",
    "pcie-root-port,id=rpn0,bus=pxb0,chassis=10,slot=0",
    "e1000e,bus=rpn0,addr=0x0",
    "pxb-pcie,id=pxb1,bus_nr=0x80,numa_node=1,bus=pcie.0,addr=0xa",
    "pcie-root-port,id=rpn1,bus=pxb1,chassis=11,slot=0",
    "e1000e,bus=rpn1,addr=0x0",
)

# A guest script that runs libvirtd (tests/e2e): `LIBVIRTD_SCRIPT.replace("{command}", ...)` starts virtlogd and
# libvirtd from the shell (so QEMU capability probing overlaps the command's Python imports), runs the command,
# copies the inner domains' QEMU logs to $OUT and exits with the command's status. The guest's root is a RAM
# overlay: these writes never reach the host. No default network (dnsmasq, bridge).
LIBVIRTD_SCRIPT = """
cat >> /etc/libvirt/qemu.conf <<EOF
user = "root"
group = "root"
remember_owner = 0
EOF
rm -rf /etc/libvirt/qemu/networks/autostart
mkdir -p /run/libvirt /var/log/libvirt/qemu /var/lib/libvirt/qemu /var/cache/libvirt/qemu
virtlogd > "$OUT/virtlogd.log" 2>&1 &
libvirtd > "$OUT/libvirtd.log" 2>&1 &
{command}
rc=$?
for f in /var/log/libvirt/qemu/*.log; do [ -f "$f" ] && cp "$f" "$OUT/"; done
exit $rc
"""

# Stage 2: runs as PID 1 after switch_root. Placeholders are filled with shlex-quoted values.
_STAGE2 = r"""#!/bin/sh
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
export HOME=/root LANG=C.UTF-8 PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
share=@SHARE@
# No tmpfs over /tmp: the root overlay already makes it writable (in RAM), and the checkout under test, its
# .venv and the kernel's modules may live under /tmp on the host (CI clones there).
mkdir -p /dev/pts /dev/shm
mount -t devpts devpts /dev/pts
mount -t tmpfs -o mode=1777 tmpfs /dev/shm
mount -t cgroup2 cgroup2 /sys/fs/cgroup 2>/dev/null
# The guest kernel's modules, so plain `modprobe` works (the overlay makes /lib/modules creatable).
mkdir -p /lib/modules
mount --bind @MODULES@ /lib/modules
ip link set lo up 2>/dev/null
hostname hostagent-testguest
for m in @PRELOAD@; do modprobe "$m" || echo "stage2: modprobe $m failed"; done
mkdir -p "$share/out"
export OUT="$share/out" PYTHON=@PYTHON@ REPO=@REPO@ PYTHONPATH=@REPO@ @ENV@
echo "HOSTAGENT-STAGE2 $(uname -r)"
cd @REPO@
/bin/sh "$share/script.sh" > "$share/stdout" 2>&1
echo $? > "$share/status.tmp" && mv "$share/status.tmp" "$share/status"
sync
echo "HOSTAGENT-STAGE2-DONE"
/bin/busybox poweroff -f
"""


class GuestUnavailable(RuntimeError):
    """The guest cannot be booted here (QEMU, the kernel or the initramfs is missing); tests FAIL with this."""


class GuestFailed(RuntimeError):
    """The guest did not finish its script successfully (or left no expected result); carries its output.

    Not an AssertionError, so an `xfail(raises=AssertionError)` test cannot mistake a broken boot for the
    expected failure.
    """


@dataclass(frozen=True)
class GuestResult:
    """What one boot produced."""

    status: int | None  # the script's exit status; None when it never finished (boot failure, timeout)
    stdout: str  # the script's stdout and stderr, interleaved
    console: str  # the kernel's serial console (boot log, stage markers)
    files: Mapping[str, bytes] = field(default_factory=dict)  # what the script wrote under $OUT, by relative path
    wall_s: float = 0.0
    timed_out: bool = False

    def json(self, name: str) -> Any:
        """Parse one result file as JSON; GuestFailed (with the guest's output) when it is missing."""
        if name not in self.files:
            raise GuestFailed(f"the guest wrote no {name}\n{self.explain()}")
        return json.loads(self.files[name])

    def explain(self) -> str:
        """The tail of the script output and of the console, for assertion messages."""
        return (f"status={self.status} timed_out={self.timed_out} wall={self.wall_s:.1f}s\n"
                f"--- script output (tail) ---\n{self.stdout[-6000:]}\n"
                f"--- console (tail) ---\n{self.console[-3000:]}")

    def check(self) -> GuestResult:
        """Return self when the script exited 0, else raise GuestFailed with the guest's output."""
        if self.status != 0:
            raise GuestFailed(f"guest script failed\n{self.explain()}")
        return self


@dataclass(frozen=True)
class GuestImage:
    """The kernel, initramfs and module tree built by scripts/build-test-guest.sh."""

    kernel: Path
    initramfs: Path
    modules: Path  # the directory to mount on the guest's /lib/modules
    release: str


def guest_image(cache: Path = CACHE) -> GuestImage:
    """Locate the built guest image; GuestUnavailable with the fix when anything is missing."""
    for program in ("qemu-system-x86_64",):
        if shutil.which(program) is None:
            raise GuestUnavailable(f"{program} not found: apt-get install qemu-system-x86")
    release_file = cache / "kernel-release"
    if not (cache / "ready").is_file() or not release_file.is_file():
        raise GuestUnavailable(f"no test guest image under {cache}: {BUILD_HINT}")
    release = release_file.read_text().strip()
    image = GuestImage(cache / "vmlinuz", cache / "initramfs.cpio.gz", cache / "modules" / "lib" / "modules",
                       release)
    for path in (image.kernel, image.initramfs, image.modules / release / "modules.dep"):
        if not path.exists():
            raise GuestUnavailable(f"{path} is missing: {BUILD_HINT}")
    return image


def guest_vmlinux(image: GuestImage) -> Path:
    """The uncompressed ELF kernel inside the image's bzImage (xz or gzip payload), extracted once next to it.

    QEMU boots such an ELF directly through its PVH entry point (Debian's kernel has the XEN_ELFNOTE_PHYS32_ENTRY
    note), which skips the bzImage's real-mode setup and its self-decompression: a few seconds under one level of
    TCG, but ~35-45 s inside a nested guest (tests/e2e/inner_os.py, the inner domain that runs a real Linux).
    """
    import lzma
    import zlib

    dest = image.kernel.with_name("vmlinux")
    if dest.exists() and dest.stat().st_mtime >= image.kernel.stat().st_mtime:
        return dest
    data = image.kernel.read_bytes()
    # Decompressor objects, not lzma.decompress/gzip.decompress: the payload is followed by other bytes.
    for magic, decompress in ((b"\xfd7zXZ\x00", lambda b: lzma.LZMADecompressor().decompress(b)),
                              (b"\x1f\x8b\x08", lambda b: zlib.decompressobj(16 + zlib.MAX_WBITS).decompress(b))):
        at = data.find(magic)
        if at < 0:
            continue
        try:
            elf = decompress(data[at:])
        except (lzma.LZMAError, zlib.error):
            continue
        if elf[:4] == b"\x7fELF":
            tmp = dest.with_suffix(".tmp")
            tmp.write_bytes(elf)
            tmp.replace(dest)
            return dest
    raise GuestUnavailable(f"no xz or gzip ELF payload found in {image.kernel}: {BUILD_HINT}")


def qemu_command(image: GuestImage, share: Path, *, devices: Sequence[str], memory_mib: int, cpus: int,
                 kernel_args: str = "", numa_nodes: int = 1) -> list[str]:
    """The qemu-system-x86_64 command line for one boot (TCG, q35, emulated VT-d with interrupt remapping)."""
    cmd = [
        "qemu-system-x86_64", "-accel", "tcg", "-machine", "q35,kernel-irqchip=split",
        "-cpu", "max", "-smp", str(cpus), "-m", str(memory_mib), *numa_args(numa_nodes, cpus, memory_mib),
        "-nodefaults", "-no-user-config", "-display", "none", "-no-reboot",
        "-serial", f"file:{share / 'console.log'}", "-monitor", "none",
        # VT-d must come before the devices it translates.
        "-device", "intel-iommu,intremap=on",
        "-kernel", str(image.kernel), "-initrd", str(image.initramfs),
        # no_timer_check: the kernel's boot-time IO-APIC timer test races TCG on a loaded host and, with
        # interrupt remapping on, a failed test panics ("timer doesn't work through Interrupt-remapped IO-APIC").
        "-append", " ".join(["console=ttyS0 intel_iommu=on iommu=pt no_timer_check panic=-1 quiet loglevel=4",
                             kernel_args]).strip(),
        "-virtfs", "local,path=/,mount_tag=hostroot,security_model=none,readonly=on,multidevs=remap",
        "-virtfs", f"local,path={share},mount_tag={SHARE_TAG},security_model=none",
    ]
    for dev in devices:
        cmd += ["-device", dev]
    return cmd


def numa_args(nodes: int, cpus: int, memory_mib: int) -> list[str]:
    """QEMU options for a guest of `nodes` NUMA nodes (the CPUs and memory split evenly, node i holding CPUs
    i*k .. i*k+k-1); nothing for one node. A device sits on a node behind a `pxb-pcie` with `numa_node=` (NUMA_DEVICES)."""
    if nodes <= 1:
        return []
    if cpus % nodes or memory_mib % nodes:
        raise ValueError(f"{cpus} CPUs and {memory_mib} MiB do not split evenly over {nodes} nodes")
    per_cpu, per_mem = cpus // nodes, memory_mib // nodes
    out: list[str] = []
    for i in range(nodes):
        out += ["-object", f"memory-backend-ram,id=mem{i},size={per_mem}M",
                "-numa", f"node,nodeid={i},cpus={i * per_cpu}-{i * per_cpu + per_cpu - 1},memdev=mem{i}"]
    return out


def boot_guest(
    script: str,
    *,
    devices: Sequence[str] = (),
    memory_mib: int = 1024,
    cpus: int = 1,
    timeout_s: float = 240.0,
    env: Mapping[str, str] | None = None,
    preload_modules: Sequence[str] = (),
    python: str | None = None,
    keep_dir: Path | None = None,
    numa_nodes: int = 1,
) -> GuestResult:
    """Boot the test guest with `devices`, run `script` (POSIX sh) as root inside it, power off, collect results.

    Inside the script: $PYTHON (the host interpreter running the tests), $REPO (this checkout, also on
    PYTHONPATH and the working directory), $OUT (write result files here; they come back in `files`).
    `preload_modules` are modprobe'd before the script runs. The guest gets `cpus` vCPUs (TCG threads).
    """
    image = guest_image()
    python = python or sys.executable
    share = Path(tempfile.mkdtemp(prefix="hostagent-guest-", dir=keep_dir))
    try:
        env_text = " ".join(f"{k}={shlex.quote(v)}" for k, v in (env or {}).items())
        stage2 = (_STAGE2.replace("@SHARE@", shlex.quote(GUEST_SHARE))
                  .replace("@MODULES@", shlex.quote(str(image.modules)))
                  .replace("@PRELOAD@", " ".join(shlex.quote(m) for m in preload_modules))
                  .replace("@PYTHON@", shlex.quote(python))
                  .replace("@REPO@", shlex.quote(str(REPO)))
                  .replace("@ENV@", env_text))
        (share / "stage2.sh").write_text(stage2)
        (share / "script.sh").write_text(script)
        cmd = qemu_command(image, share, devices=devices, memory_mib=memory_mib, cpus=cpus, numa_nodes=numa_nodes)
        t0 = time.monotonic()
        timed_out = False
        with subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) as proc:
            try:
                qemu_out, _ = proc.communicate(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
                proc.kill()
                qemu_out, _ = proc.communicate()
        wall = time.monotonic() - t0
        console = _read(share / "console.log")
        if proc.returncode not in (0, None) and not timed_out:
            console += f"\n[qemu exited {proc.returncode}: {qemu_out.decode(errors='replace').strip()}]"
        status_text = _read(share / "status").strip()
        files = {}
        out = share / "out"
        if out.is_dir():
            for path in sorted(out.rglob("*")):
                if path.is_file():
                    files[str(path.relative_to(out))] = path.read_bytes()
        return GuestResult(
            status=int(status_text) if status_text.lstrip("-").isdigit() else None,
            stdout=_read(share / "stdout"), console=console, files=files, wall_s=wall, timed_out=timed_out,
        )
    finally:
        if keep_dir is None and not os.environ.get("HOSTAGENT_KEEP_GUEST"):
            shutil.rmtree(share, ignore_errors=True)


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""
