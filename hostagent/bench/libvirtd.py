"""A private libvirtd + virtlogd for tests and benchmarks, without systemd and without touching the system instance.

The daemons run as root inside their own mount and network namespaces (`unshare -m -n`): a holder process
keeps the namespaces alive, and /etc/libvirt, /run/libvirt, /var/lib/libvirt, /var/log/libvirt and
/var/cache/libvirt are bind mounts of directories under a private base directory. So the real system paths are
never written, no bridge or firewall rule reaches the host's network, and the client reaches the daemon through
`qemu:///system?socket=<base>/run/libvirt-sock`. qemu.conf sets user/group root (otherwise every define waits
about a minute on ownership changes) and turns off per-domain /dev namespaces and security drivers, which a
container does not support.

Tests get one through the `libvirtd` fixture of tests/support/libvirtd.py; scripts/bench_overhead.py starts one to
time real CONFIG attaches beside the agent's overhead.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
import uuid as uuidlib
from dataclasses import dataclass, field
from pathlib import Path

from lxml import etree

QEMU_CONF = """
user = "root"
group = "root"
namespaces = [ ]
security_driver = "none"
remember_owner = 0
"""

_MOUNTS = {
    "etc": "/etc/libvirt",
    "run": "/run/libvirt",
    "lib": "/var/lib/libvirt",
    "log": "/var/log/libvirt",
    "cache": "/var/cache/libvirt",
}


class LibvirtdUnavailable(RuntimeError):
    """The private libvirtd could not be started (tests FAIL with this message, they never skip)."""


@dataclass
class PrivateLibvirtd:
    """One private libvirtd (+ virtlogd) under `base`; `start()`, `kill_libvirtd()`, `start_libvirtd()`, `stop()`."""

    base: Path
    holder: subprocess.Popen[bytes] | None = None
    virtlogd: subprocess.Popen[bytes] | None = None
    libvirtd: subprocess.Popen[bytes] | None = None
    _logs: list[object] = field(default_factory=list)

    @property
    def socket(self) -> Path:
        """The daemon's read-write socket."""
        return self.base / "run" / "libvirt-sock"

    @property
    def uri(self) -> str:
        """URI for clients outside the namespace."""
        return f"qemu:///system?socket={self.socket}"

    def start(self) -> None:
        """Prepare directories, enter namespaces, start virtlogd and libvirtd; raise LibvirtdUnavailable."""
        missing = [b for b in ("libvirtd", "virtlogd", "unshare", "nsenter", "qemu-system-x86_64")
                   if not shutil.which(b) and not Path("/usr/sbin", b).exists()]
        if missing:
            raise LibvirtdUnavailable(f"missing programs {missing}: apt-get install libvirt-daemon-system "
                                      "libvirt-daemon-driver-qemu qemu-system-x86 util-linux")
        if os.geteuid() != 0:
            raise LibvirtdUnavailable("the private libvirtd needs root (mount namespaces, qemu:///system)")
        for sub in _MOUNTS:
            (self.base / sub).mkdir(parents=True, exist_ok=True)
        etc = self.base / "etc"
        if Path("/etc/libvirt").is_dir():
            shutil.copytree("/etc/libvirt", etc, dirs_exist_ok=True, symlinks=True)
        # Never autostart the host's default network (a bridge + dnsmasq) in a test daemon.
        shutil.rmtree(etc / "qemu" / "networks" / "autostart", ignore_errors=True)
        with open(etc / "qemu.conf", "a", encoding="utf-8") as f:
            f.write(QEMU_CONF)
        for target in _MOUNTS.values():
            os.makedirs(target, exist_ok=True)  # an empty mount point on the host; the content stays private
        binds = " && ".join(f"mount --bind {self.base / sub} {target}" for sub, target in _MOUNTS.items())
        self.holder = subprocess.Popen(
            ["unshare", "--mount", "--net", "--propagation", "private", "sh", "-c",
             f"{binds} && ip link set lo up 2>/dev/null; echo ready; exec sleep 86400"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )
        assert self.holder.stdout is not None
        if self.holder.stdout.readline().strip() != b"ready":
            err = self.holder.stderr.read().decode() if self.holder.stderr else ""
            self.stop()
            raise LibvirtdUnavailable(f"cannot create the private mount namespace: {err.strip()}")
        self.virtlogd = self._spawn("virtlogd")
        self.start_libvirtd()

    def _spawn(self, program: str) -> subprocess.Popen[bytes]:
        assert self.holder is not None
        log = open(self.base / f"{program}.out", "ab")  # noqa: SIM115 - kept open for the daemon's life
        self._logs.append(log)
        # A pid file of our own: the default /run/<daemon>.pid is shared with any other instance on the machine.
        pid_file = self.base / f"{program}.pid"
        return subprocess.Popen(["nsenter", "-t", str(self.holder.pid), "-m", "-n", "--", program,
                                 "--pid-file", str(pid_file)], stdout=log, stderr=subprocess.STDOUT)

    def start_libvirtd(self, timeout_s: float = 90.0) -> None:
        """(Re)start libvirtd in the namespace and wait until its socket answers. Its first answer waits for QEMU
        capability probing, which takes a minute on a 2-CPU machine busy with a TCG guest: a probe that times out
        is asked again until `timeout_s`."""
        with contextlib.suppress(FileNotFoundError):
            self.socket.unlink()
        self.libvirtd = self._spawn("libvirtd")
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.libvirtd.poll() is not None:
                break
            if self.socket.exists():
                try:
                    probe = subprocess.run(["virsh", "-c", self.uri, "version"], capture_output=True,
                                           timeout=max(1.0, min(30.0, deadline - time.monotonic())))
                except subprocess.TimeoutExpired:
                    continue
                if probe.returncode == 0:
                    return
            time.sleep(0.1)
        tail = (self.base / "libvirtd.out").read_text(errors="replace")[-2000:]
        raise LibvirtdUnavailable(f"private libvirtd did not come up within {timeout_s}s:\n{tail}")

    def kill_libvirtd(self) -> None:
        """SIGKILL libvirtd (running domains survive it, as they would a real daemon crash)."""
        if self.libvirtd is not None and self.libvirtd.poll() is None:
            self.libvirtd.send_signal(signal.SIGKILL)
            self.libvirtd.wait(timeout=10)

    def virsh(self, *args: str) -> str:
        """Run virsh against the private daemon; raise on failure."""
        res = subprocess.run(["virsh", "-c", self.uri, *args], capture_output=True, text=True, timeout=60)
        if res.returncode != 0:
            raise RuntimeError(f"virsh {' '.join(args)} failed: {res.stderr.strip()}")
        return res.stdout

    def stop(self) -> None:
        """Destroy every domain, stop the daemons and the namespace holder."""
        if self.libvirtd is not None and self.libvirtd.poll() is None:
            with contextlib.suppress(Exception):
                for name in self.virsh("list", "--name").split():
                    self.virsh("destroy", name)
        # QEMU processes outlive a killed libvirtd: end the ones this daemon started, by their pid files.
        for pidfile in (self.base / "run" / "qemu").glob("*.pid"):
            with contextlib.suppress(ValueError, OSError):
                os.kill(int(pidfile.read_text().strip()), signal.SIGKILL)
        for proc in (self.libvirtd, self.virtlogd, self.holder):
            if proc is not None and proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=10)
        for log in self._logs:
            log.close()  # type: ignore[attr-defined]
        self._logs.clear()


def tiny_domain_xml(name: str, *, uuid: str | None = None, root_ports: int = 2) -> str:
    """A q35 `type='qemu'` domain: 64 MiB, no disk, no kernel, no USB/balloon, `root_ports` free PCIe ports."""
    root = etree.Element("domain", type="qemu")
    etree.SubElement(root, "name").text = name
    etree.SubElement(root, "uuid").text = uuid or str(uuidlib.uuid4())
    etree.SubElement(root, "memory", unit="MiB").text = "64"
    etree.SubElement(root, "vcpu").text = "1"
    os_el = etree.SubElement(root, "os")
    etree.SubElement(os_el, "type", arch="x86_64", machine="q35").text = "hvm"
    etree.SubElement(root, "on_reboot").text = "destroy"
    devices = etree.SubElement(root, "devices")
    etree.SubElement(devices, "emulator").text = shutil.which("qemu-system-x86_64") or "/usr/bin/qemu-system-x86_64"
    etree.SubElement(devices, "controller", type="pci", model="pcie-root")
    for _ in range(root_ports):
        etree.SubElement(devices, "controller", type="pci", model="pcie-root-port")
    etree.SubElement(devices, "controller", type="usb", model="none")
    etree.SubElement(devices, "memballoon", model="none")
    return str(etree.tostring(root, encoding="unicode"))
