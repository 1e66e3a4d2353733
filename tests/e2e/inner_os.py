"""Runs INSIDE the QEMU test guest (the "outer" guest): boot an inner libvirt domain that runs a real Linux.

Why (#19): the nested tests' inner domains have no operating system, so they can never acknowledge a PCIe
hot-unplug and libvirt never emits DEVICE_REMOVED; only the DETACH_PENDING path can be tested. An inner domain
that boots Debian's kernel lets the guest's hot-plug driver acknowledge the unplug, so the confirmed path can run
over real libvirt and real vfio-pci too. The price is a second level of TCG emulation, so this module first of
all MEASURES that boot.

The inner domain reuses the test guest image built by scripts/build-test-guest.sh: the same kernel and the same
busybox initramfs, whose stage 1 mounts 9p tag `hostroot` read-only under a RAM overlay, mounts 9p tag
`hostagent_test` at /run/hostagent-test and switch_roots into `/run/hostagent-test/stage2.sh`. Here `hostroot`
is the OUTER guest's / (itself the host's / under an overlay), so the host's Python and this checkout, at the
same path, are visible in the inner guest too. Stage 2 follows the contract of tests/support/qemu.py: it runs
as PID 1, mounts what it needs, and signals progress by writing marker files into the share (STARTED on entry,
DONE after its steps), then powers off, or, with keep_running, waits for a STOP file first (so a device can be
hot-plugged and unplugged while the kernel runs).

Only the standard library and libvirt-python are imported: under TCG every project import costs seconds, and
the figures measured here should not include them.

Run as a script (`$PYTHON tests/e2e/inner_os.py '[{"vcpus": 1}]'`, with libvirtd up; see
tests/e2e/measure_inner_os.py, which boots the outer guest and does that) it boots one inner domain per run
spec, records timings and the inner guest's own figures (Python start-up, `import hostagent.guest.cli`, its PCI
devices) to $OUT/inner_os.json, and with `"hotplug": "<address>"` in a spec also binds that function's IOMMU
group to vfio-pci, attaches it live to a hot-plug root port of the running inner domain, detaches it, and times
libvirt's DEVICE_REMOVED event.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import libvirt  # type: ignore[import-untyped,unused-ignore]

URI = "qemu:///system"
REPO = Path(__file__).resolve().parents[2]
CACHE = REPO / ".cache" / "testguest"
ROOT_TAG = "hostroot"  # the tags stage 1 of the initramfs mounts (scripts/build-test-guest.sh)
SHARE_TAG = "hostagent_test"
GUEST_SHARE = "/run/hostagent-test"  # where stage 1 mounts the share inside the inner guest
STARTED, DONE, STOP = "stage2.started", "stage2.done", "stop"  # marker files in the share
RESULTS = "results.json"  # what the measuring stage 2 writes into the share

# Hot-plug root ports: controller index i (1, 2, ...) at slot PORT_SLOT + i - 1 of pcie.0. A `<hostdev>` targets
# port i with `<address type='pci' bus='i' slot='0' function='0'/>` (hostdev_xml). Every other PCI device of the
# domain gets an explicit slot on pcie.0, so libvirt's auto-placement never takes one of these ports.
FIRST_PORT = 1
PORT_SLOT = 0x08
FS_SLOTS = (0x03, 0x04)  # the two 9p shares
NET_SLOT = 0x05
QEMU_NS = "http://libvirt.org/schemas/domain/qemu/1.0"
ET.register_namespace("qemu", QEMU_NS)

# The kernel command line. Under one level of TCG (Debian 6.1, q35, 1 vCPU, 512 MiB) the kernel reaches stage 2
# after ~2.6-3.3 s of uptime with or without the speed-ups below, so at one level they are within noise; they stay
# because each removes work that nested emulation makes dearer: no TSC calibration/watchdog (tsc=reliable), no
# speculation mitigations (mitigations=off), no wait for entropy (random.trust_cpu=on), one UART probed instead
# of four (8250.nr_uarts=1), no IO-APIC timer check, which can race TCG (no_timer_check). panic=-1 reboots at
# once on a panic, and the domain's on_reboot=destroy ends it.
# Nested (measured with tests/e2e/measure_inner_os.py on a 2-CPU host): ~60-80 s of inner kernel uptime to stage
# 2, spread over ordinary initcalls (no single one above ~5 s); what the command line cannot remove is the
# bzImage's self-decompression, ~35-45 s nested, which booting the uncompressed ELF through PVH skips
# (measure_inner_os.extract_vmlinux): boot to stage 2 126 s (bzImage) vs 85 s (PVH), 1 vCPU.
BASE_CMDLINE = ("console=ttyS0 quiet loglevel=4 printk.time=1 no_timer_check panic=-1 tsc=reliable "
                "mitigations=off random.trust_cpu=on 8250.nr_uarts=1")


def _sub(parent: ET.Element, tag: str, text: str | None = None, **attrs: str) -> ET.Element:
    el = ET.SubElement(parent, tag, attrs)
    if text is not None:
        el.text = text
    return el


def _pci_address(parent: ET.Element, bus: int, slot: int, function: int = 0) -> ET.Element:
    return _sub(parent, "address", type="pci", domain="0x0000", bus=f"{bus:#04x}", slot=f"{slot:#04x}",
                function=f"{function:#x}")


def inner_os_domain_xml(name: str, *, kernel: str | Path, initrd: str | Path, root_dir: str | Path,
                        share_dir: str | Path, memory_mib: int = 512, vcpus: int = 1, hotplug_ports: int = 2,
                        cmdline_extra: str = "", console_path: str | Path | None = None,
                        user_net: bool = True, native_hotplug: bool = True) -> str:
    """A transient q35 `type='qemu'` domain that direct-boots `kernel`/`initrd` into the two-stage test guest.

    - `<os>` kernel/initrd/cmdline (BASE_CMDLINE + `cmdline_extra`; a later `loglevel=` wins over `quiet`);
    - serial console to `console_path` (default: `<share_dir>/console.log`), a plain file the caller can read
      while the guest boots and after it has gone;
    - 9p `root_dir` as tag `hostroot` (read-only) and `share_dir` as tag `hostagent_test` (writable), both
      accessmode='passthrough' with multidevs='remap' (root_dir spans several filesystems);
    - `hotplug_ports` pcie-root-port controllers, indexes FIRST_PORT.., hotplug='on', left empty for hostdevs;
    - with `user_net`, a user-mode (SLIRP) virtio NIC, so the inner guest could reach the outer at 10.0.2.2;
      its option ROM is off (SeaBIOS would load it for nothing: the kernel is booted directly);
    - with `native_hotplug`, the root ports use native PCIe hot-plug, so the kernel's pciehp driver handles them
      (attention button, 5 s to cancel, then power off the slot: the acknowledgement #19 is about). QEMU 7.2's
      q35 defaults to ACPI hot-plug on root ports (acpiphp: no 5 s wait), and this libvirt has no element for
      it, so `-global ICH9-LPC.acpi-pci-hotplug-with-bridge-support=off` goes through <qemu:commandline>;
    - no USB, no balloon, no graphics; on_poweroff/on_reboot/on_crash destroy (panic=-1 reboots, so a panic
      ends the domain instead of hanging).
    """
    share_dir = Path(share_dir)
    console = Path(console_path) if console_path is not None else share_dir / "console.log"
    root = ET.Element("domain", type="qemu")
    _sub(root, "name", name)
    _sub(root, "memory", str(memory_mib), unit="MiB")
    _sub(root, "vcpu", str(vcpus))
    os_el = _sub(root, "os")
    _sub(os_el, "type", "hvm", arch="x86_64", machine="q35")
    _sub(os_el, "kernel", str(kernel))
    _sub(os_el, "initrd", str(initrd))
    _sub(os_el, "cmdline", " ".join(f"{BASE_CMDLINE} {cmdline_extra}".split()))
    features = _sub(root, "features")
    _sub(features, "acpi")
    _sub(features, "apic")
    _sub(root, "cpu", mode="maximum", check="none")  # -cpu max, as the outer guest
    _sub(root, "clock", offset="utc")
    for event in ("on_poweroff", "on_reboot", "on_crash"):
        _sub(root, event, "destroy")
    devices = _sub(root, "devices")
    _sub(devices, "emulator", shutil.which("qemu-system-x86_64") or "/usr/bin/qemu-system-x86_64")
    _sub(devices, "controller", type="pci", index="0", model="pcie-root")
    for i in range(FIRST_PORT, FIRST_PORT + hotplug_ports):
        port = _sub(devices, "controller", type="pci", index=str(i), model="pcie-root-port")
        _sub(port, "model", name="pcie-root-port")
        _sub(port, "target", chassis=str(i), port=f"{0x10 + i:#x}", hotplug="on")
        _pci_address(port, 0, PORT_SLOT + i - FIRST_PORT)
    _sub(devices, "controller", type="usb", model="none")
    for (source, tag, readonly), slot in zip(((root_dir, ROOT_TAG, True), (share_dir, SHARE_TAG, False)), FS_SLOTS):
        fs = _sub(devices, "filesystem", type="mount", accessmode="passthrough", multidevs="remap")
        _sub(fs, "source", dir=str(source))
        _sub(fs, "target", dir=tag)
        if readonly:
            _sub(fs, "readonly")
        _pci_address(fs, 0, slot)
    if user_net:
        iface = _sub(devices, "interface", type="user")
        _sub(iface, "model", type="virtio")
        _sub(iface, "rom", enabled="no")
        _pci_address(iface, 0, NET_SLOT)
    serial = _sub(devices, "serial", type="file")
    _sub(serial, "source", path=str(console))
    _sub(serial, "target", port="0")
    _sub(devices, "memballoon", model="none")
    if native_hotplug:
        qemu_cmdline = _sub(root, f"{{{QEMU_NS}}}commandline")
        for arg in ("-global", "ICH9-LPC.acpi-pci-hotplug-with-bridge-support=off"):
            _sub(qemu_cmdline, f"{{{QEMU_NS}}}arg", value=arg)
    return ET.tostring(root, encoding="unicode")


def hostdev_xml(source: str, port_index: int = FIRST_PORT) -> str:
    """`<hostdev managed='no'>` of host function `source` (dddd:bb:ss.f) on hot-plug root port `port_index`."""
    dom, bus, rest = source.split(":")
    slot, function = rest.split(".")
    return (f"<hostdev mode='subsystem' type='pci' managed='no'><source>"
            f"<address domain='0x{dom}' bus='0x{bus}' slot='0x{slot}' function='0x{function}'/></source>"
            f"<address type='pci' domain='0x0000' bus='{port_index:#04x}' slot='0x00' function='0x0'/></hostdev>")


def stage2_script(body: str, *, modules: str | Path = CACHE / "modules" / "lib" / "modules",
                  python: str = sys.executable, repo: str | Path = REPO, keep_running: bool = False) -> str:
    """The inner guest's stage 2 (PID 1 after switch_root): write STARTED (with /proc/uptime, so the kernel's own
    share of the boot is known), mount devpts, /dev/shm and the module tree, run `body` (POSIX sh) with $PYTHON,
    $REPO, $SHARE and PYTHONPATH set and its output in stage2.log, write DONE (its exit status), then power off;
    with `keep_running`, keep the PCI devices it sees current in pci.now, a line each "address vendor device"
    (so the outer side sees a hot-plug land and leave) until a STOP file appears, save dmesg, and only then power off."""
    q = shlex.quote
    keep = f"""
while [ ! -e "$SHARE/{STOP}" ]; do
  for d in /sys/bus/pci/devices/*; do read -r v < "$d/vendor"; read -r i < "$d/device"; echo "${{d##*/}} $v $i"
  done > "$SHARE/pci.tmp" && $bb mv "$SHARE/pci.tmp" "$SHARE/pci.now"
  $bb sleep 1
done
""" if keep_running else ""
    return f"""#!/bin/sh
# Only shell builtins and the static busybox around the markers: each dynamically linked program costs seconds
# of loader and library reads over two levels of 9p under nested TCG, which would count as boot time.
bb=/bin/busybox
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
export HOME=/root LANG=C.UTF-8 PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
export SHARE={q(GUEST_SHARE)}
# First thing: the boot is over (the kernel's uptime now, so its own share of the boot is known).
read -r up _ < /proc/uptime
echo "$up" > "$SHARE/{STARTED}"
$bb mkdir -p /dev/pts /dev/shm /lib/modules
$bb mount -t devpts devpts /dev/pts
$bb mount -t tmpfs -o mode=1777 tmpfs /dev/shm
$bb mount -o bind {q(str(modules))} /lib/modules
export PYTHON={q(python)} REPO={q(str(repo))} PYTHONPATH={q(str(repo))}
cd "$REPO"
( {body}
) > "$SHARE/stage2.log" 2>&1
echo $? > "$SHARE/{DONE}"
$bb sync
{keep}$bb dmesg > "$SHARE/dmesg.txt" 2>&1
$bb sync
$bb poweroff -f
"""


# The measuring body: entry time and kernel, a cold and a warm interpreter start around the import of the guest
# CLI (skipped when $MEASURE_PYTHON is not 1: they take minutes nested, and a hot-plug test needs none of them),
# the PCI devices and hot-plug slots the kernel found, and the hot-plug driver's boot messages.
MEASURE_BODY = r"""
t_entry=$(date +%s.%N)
krel=$(uname -r)
secs() { echo "$1 $2" | awk '{printf "%.3f", $1 - $2}'; }
py_cold=null py_import=null py_warm=null rc_import=null
if [ "${MEASURE_PYTHON:-1}" = 1 ]; then
  t0=$(date +%s.%N); "$PYTHON" -c 'print(1)' >/dev/null; t1=$(date +%s.%N)
  "$PYTHON" -c "import hostagent.guest.cli"; rc_import=$?; t2=$(date +%s.%N)
  "$PYTHON" -c 'print(1)' >/dev/null; t3=$(date +%s.%N)
  py_cold=$(secs "$t1" "$t0") py_import=$(secs "$t2" "$t1") py_warm=$(secs "$t3" "$t2")
fi
quoted() { sed 's/["\\]/_/g; s/.*/"&"/' | paste -sd, -; }
pci=$(ls /sys/bus/pci/devices | quoted)
slots=$(ls /sys/bus/pci/slots 2>/dev/null | quoted)
hp=$(dmesg | grep -iE 'pciehp|acpiphp|shpchp' | tail -n 8 | quoted)
cat > "$SHARE/results.tmp" <<EOF
{"kernel": "$krel", "t_entry": $t_entry, "python_cold_s": $py_cold, "import_guest_cli_s": $py_import,
 "import_rc": $rc_import, "python_warm_s": $py_warm, "pci_devices": [$pci], "pci_slots": [$slots],
 "hotplug_dmesg": [$hp], "stage2_steps_s": $(secs "$(date +%s.%N)" "$t_entry")}
EOF
mv "$SHARE/results.tmp" "$SHARE/results.json"
"""


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def _first_number(path: Path, wait_s: float = 5.0) -> float | None:
    """The number a marker file holds. A marker is written with one shell redirection, not renamed into place,
    so it can exist a moment before its content lands: read again briefly until it does."""
    deadline = time.monotonic() + wait_s
    while True:
        words = _read(path).split()
        if words or time.monotonic() > deadline:
            try:
                return float(words[0]) if words else None
            except ValueError:
                return None
        time.sleep(0.1)


def console_of(xml: str) -> Path | None:
    """The file the domain's serial console writes to, if it is a `<serial type='file'>`."""
    source = ET.fromstring(xml).find("./devices/serial[@type='file']/source")
    return Path(source.get("path", "")) if source is not None else None


def _wait_file(path: Path, dom: Any, deadline: float) -> tuple[bool, str]:
    """Poll until `path` exists ('ok'), the domain stops ('stopped') or the deadline passes ('timeout')."""
    while time.monotonic() < deadline:
        if path.exists():
            return True, "ok"
        try:
            if not dom.isActive():
                return path.exists(), "stopped"
        except libvirt.libvirtError:
            return path.exists(), "stopped"
        time.sleep(0.25)
    return path.exists(), "timeout"


def boot_inner(conn: Any, name: str, xml: str, share_dir: str | Path, stage2: str,
               timeout_s: float) -> dict[str, Any]:
    """Write `stage2` as the share's stage2.sh, start the transient domain and wait for its markers.

    Timings, measured here (outer clock): `domain_start_s` (virDomainCreateXML until it returns: QEMU started,
    CPUs running), `boot_to_stage2_s` (from then until STARTED appears: firmware, kernel, stage 1, 9p mounts),
    `stage2_s` (STARTED until DONE: the script's own steps, including its mounts). Also the inner kernel's
    uptime at stage 2 (`inner_uptime_at_stage2_s`: the part after the kernel took over), `state` ('done',
    'stopped' when the domain ended first, 'timeout', 'start-failed'), `uuid` (the domain keeps running when the
    script keeps it running) and, unless done, the console tail.
    """
    share = Path(share_dir)
    share.mkdir(parents=True, exist_ok=True)
    for marker in (STARTED, DONE, STOP, RESULTS):
        (share / marker).unlink(missing_ok=True)
    (share / "stage2.sh").write_text(stage2)
    (share / "stage2.sh").chmod(0o755)
    console = console_of(xml)
    rec: dict[str, Any] = {"name": name}
    t0 = time.monotonic()
    try:
        dom = conn.createXML(xml, 0)
    except libvirt.libvirtError as exc:
        rec.update(state="start-failed", error=str(exc), domain_start_s=round(time.monotonic() - t0, 2))
        return rec
    t_started = time.monotonic()
    rec["domain_start_s"] = round(t_started - t0, 2)
    rec["uuid"] = dom.UUIDString()
    deadline = t_started + timeout_s
    found, state = _wait_file(share / STARTED, dom, deadline)
    t_stage2 = time.monotonic()
    if found:
        rec["boot_to_stage2_s"] = round(t_stage2 - t_started, 2)
        rec["inner_uptime_at_stage2_s"] = _first_number(share / STARTED)
        found, state = _wait_file(share / DONE, dom, deadline)
        if found:
            rec["stage2_s"] = round(time.monotonic() - t_stage2, 2)
            rec["stage2_status"] = _first_number(share / DONE)
            state = "done"
    rec["state"] = state
    rec["elapsed_s"] = round(time.monotonic() - t0, 2)
    if state != "done" and console is not None:
        rec["console_tail"] = _read(console)[-4000:]
    return rec


def wait_libvirtd(timeout_s: float = 180.0) -> dict[str, Any]:
    """Wait until the outer guest's libvirtd (started by the shell script) answers, QEMU probing included."""
    t0 = time.monotonic()
    last = ""
    while time.monotonic() - t0 < timeout_s:
        try:
            conn = libvirt.open(URI)
            conn.getCapabilities()  # the first call also waits for QEMU capability probing
            conn.close()
            return {"ready_s": round(time.monotonic() - t0, 2)}
        except libvirt.libvirtError as exc:
            last = str(exc)
            time.sleep(0.5)
    return {"ready_s": None, "error": last}


def _event_loop() -> None:
    """libvirt's default event loop, in a daemon thread: delivers DEVICE_REMOVED and answers keepalives (libvirtd
    drops a client that does not within ~25 s, and under TCG one blocking call can take longer than that)."""
    libvirt.virEventRegisterDefaultImpl()

    def run() -> None:
        while True:
            libvirt.virEventRunDefaultImpl()

    threading.Thread(target=run, name="libvirt-events", daemon=True).start()


def _mirror(src: Path, dst: Path, stop: threading.Event, every_s: float = 10.0) -> None:
    """Copy the inner console (written to the outer's RAM) into $OUT every `every_s`, so the host can watch a slow
    boot. The console is not written into $OUT directly: the inner QEMU writes it a byte at a time, and each write
    to the outer's 9p share is a round trip to the host, which would slow the very boot being measured."""
    while not stop.wait(every_s):
        try:
            shutil.copy(src, dst)
        except OSError:
            pass


def drivers(addresses: list[str]) -> dict[str, str | None]:
    """The driver bound to each address now, from sysfs."""
    out = {}
    for a in addresses:
        link = Path("/sys/bus/pci/devices", a, "driver")
        out[a] = os.path.basename(os.readlink(link)) if link.is_symlink() else None
    return out


def _cli(*argv: str) -> dict[str, Any]:
    """`python -m hostagent ARGV --json` in a subprocess (this module stays free of project imports)."""
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "hostagent", *argv, "--json"], capture_output=True, text=True,
                          cwd=REPO, check=False)
    return {"argv": list(argv), "rc": proc.returncode, "stdout": proc.stdout[-2000:], "stderr": proc.stderr[-2000:],
            "seconds": round(time.monotonic() - t0, 2)}


def pci_now(share: Path) -> list[str]:
    """The inner guest's PCI devices as its stage 2 last listed them: "address vendor device" each."""
    return [line for line in _read(share / "pci.now").splitlines() if line.strip()]


def _live(call: Any, xml: str) -> str | None:
    """A live attach or detach of `xml`: None, or libvirt's error."""
    try:
        call(xml, libvirt.VIR_DOMAIN_AFFECT_LIVE)
        return None
    except libvirt.libvirtError as exc:
        return str(exc)


def hotplug_cycle(conn: Any, uuid: str, share: Path, source: str, removed: list[tuple[float, str]],
                  wait_s: float = 300.0) -> dict[str, Any]:
    """Bind `source`'s IOMMU group to vfio-pci (`hostagent vfio bind`), attach it live to the running inner domain's
    first hot-plug port, wait for the inner kernel to list it, detach it and time DEVICE_REMOVED from the call of
    virDomainDetachDeviceFlags; then give the group back (`hostagent vfio release`)."""
    rec: dict[str, Any] = {"source": source}
    group = Path("/sys/bus/pci/devices", source, "iommu_group", "devices")
    members = sorted(os.listdir(group)) if group.is_dir() else [source]
    rec["drivers_before"] = drivers(members)
    rec["bind"] = _cli("vfio", "bind", source)
    rec["drivers_after_bind"] = drivers(members)
    dom = conn.lookupByUUIDString(uuid)
    xml = hostdev_xml(source)
    before = pci_now(share)
    t0 = time.monotonic()
    rec["attach_error"] = _live(dom.attachDeviceFlags, xml)
    if rec["attach_error"] is not None:
        return rec
    rec["attach_s"] = round(time.monotonic() - t0, 2)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and len(pci_now(share)) <= len(before):
        time.sleep(0.5)
    rec["inner_sees_it_s"] = round(time.monotonic() - t0, 2) if len(pci_now(share)) > len(before) else None
    rec["inner_new_devices"] = sorted(set(pci_now(share)) - set(before))
    seen = len(removed)
    t0 = time.monotonic()
    rec["detach_error"] = _live(dom.detachDeviceFlags, xml)
    rec["detach_call_s"] = round(time.monotonic() - t0, 2)
    deadline = t0 + wait_s
    while time.monotonic() < deadline and len(removed) == seen:
        time.sleep(0.1)
    rec["device_removed"] = [alias for _, alias in removed[seen:]]
    rec["device_removed_after_s"] = round(removed[seen][0] - t0, 2) if len(removed) > seen else None
    later = time.monotonic() + 30
    while time.monotonic() < later and len(pci_now(share)) > len(before):
        time.sleep(0.5)
    rec["inner_pci_after_detach"] = pci_now(share)
    rec["live_hostdevs_after"] = dom.XMLDesc(0).count("<hostdev ")
    rec["release"] = _cli("vfio", "release", source)
    rec["drivers_after_release"] = drivers(members)
    return rec


def measure(conn: Any, index: int, spec: dict[str, Any], out: Path, removed: list[tuple[float, str]]) -> dict[str, Any]:
    """One inner boot per `spec` (keys: vcpus, memory_mib, cmdline_extra, user_net, native_hotplug, timeout_s,
    kernel: another kernel file, python: false to skip the Python steps, hotplug: an address): timings, the inner
    guest's results, and with `hotplug` the hot-plug cycle; the console, stage-2 log, dmesg and domain XML go to
    $OUT/inner-os-<index>/."""
    name = f"inner-os-{index}"
    share = Path("/tmp") / name  # outer RAM overlay, exported to the inner guest as its writable share
    shutil.rmtree(share, ignore_errors=True)
    logs = out / name
    logs.mkdir(parents=True, exist_ok=True)
    keep = bool(spec.get("hotplug"))
    kw = dict(kernel=spec.get("kernel", CACHE / "vmlinuz"), initrd=CACHE / "initramfs.cpio.gz", root_dir="/",
              share_dir=share,
              memory_mib=int(spec.get("memory_mib", 512)), vcpus=int(spec.get("vcpus", 1)),
              cmdline_extra=str(spec.get("cmdline_extra", "")), console_path=Path("/tmp") / f"{name}.console.log",
              native_hotplug=bool(spec.get("native_hotplug", True)))
    rec: dict[str, Any] = {"spec": spec}
    user_net = bool(spec.get("user_net", True))
    xml = inner_os_domain_xml(name, user_net=user_net, **kw)  # type: ignore[arg-type]
    python = "1" if spec.get("python", True) else "0"
    script = stage2_script(f"export MEASURE_PYTHON={python}\n{MEASURE_BODY}", keep_running=keep)
    (Path("/tmp") / f"{name}.console.log").unlink(missing_ok=True)
    stop_mirror = threading.Event()
    threading.Thread(target=_mirror, args=(Path("/tmp") / f"{name}.console.log", logs / "console.log", stop_mirror),
                     daemon=True).start()
    boot = boot_inner(conn, name, xml, share, script, float(spec.get("timeout_s", 1200)))
    if boot["state"] == "start-failed" and user_net and "interface" in boot.get("error", "").lower():
        rec["user_net_error"] = boot["error"]
        user_net = False
        xml = inner_os_domain_xml(name, user_net=False, **kw)  # type: ignore[arg-type]
        boot = boot_inner(conn, name, xml, share, script, float(spec.get("timeout_s", 1200)))
    rec["user_net"] = user_net
    rec["cmdline"] = ET.fromstring(xml).findtext("./os/cmdline")
    rec["boot"] = boot
    results = _read(share / RESULTS)
    try:
        rec["inner"] = json.loads(results) if results else None
    except ValueError as exc:
        rec["inner"] = {"unparsed": results, "error": str(exc)}
    if keep and boot["state"] == "done":
        try:
            rec["hotplug"] = hotplug_cycle(conn, boot["uuid"], share, str(spec["hotplug"]), removed)
        except Exception as exc:  # a fact to report, like the rest
            rec["hotplug"] = {"error": f"{type(exc).__name__}: {exc}"}
        (share / STOP).write_text("stop\n")
        t0 = time.monotonic()
        while time.monotonic() - t0 < 120:
            try:
                if not conn.lookupByUUIDString(boot["uuid"]).isActive():
                    break
            except libvirt.libvirtError:
                break
            time.sleep(0.5)
        rec["poweroff_after_stop_s"] = round(time.monotonic() - t0, 2)
    if boot.get("uuid"):
        try:
            conn.lookupByUUIDString(boot["uuid"]).destroy()
        except libvirt.libvirtError:
            pass  # already gone: the normal case
    stop_mirror.set()
    shutil.copy(Path("/tmp") / f"{name}.console.log", logs / "console.log")
    for f in ("stage2.log", "dmesg.txt", RESULTS, "stage2.sh"):
        if (share / f).is_file():
            shutil.copy(share / f, logs / f)
    (logs / "domain.xml").write_text(xml)
    return rec


def main(argv: list[str]) -> int:
    """Boot one inner domain per run spec (argv[1]: a JSON list of objects; default one run with the defaults)."""
    specs: list[dict[str, Any]] = json.loads(argv[1]) if len(argv) > 1 else [{}]
    out = Path(os.environ.get("OUT", "."))
    t0 = time.monotonic()
    facts: dict[str, Any] = {"outer_kernel": os.uname().release, "libvirtd": wait_libvirtd(), "runs": []}

    def save() -> None:
        facts["script_s"] = round(time.monotonic() - t0, 2)
        (out / "inner_os.json").write_text(json.dumps(facts, indent=1))

    save()
    if facts["libvirtd"]["ready_s"] is None:
        return 1
    libvirt.registerErrorHandler(lambda _ctx, _err: None, None)  # errors are raised anyway; no stderr copies
    _event_loop()
    conn = libvirt.open(URI)
    conn.setKeepAlive(10, 6)
    removed: list[tuple[float, str]] = []
    conn.domainEventRegisterAny(None, libvirt.VIR_DOMAIN_EVENT_ID_DEVICE_REMOVED,
                                lambda _c, _d, alias, _o: removed.append((time.monotonic(), alias)), None)
    try:
        for i, spec in enumerate(specs):
            try:
                facts["runs"].append(measure(conn, i, spec, out, removed))
            except Exception as exc:  # keep the other runs' figures
                facts["runs"].append({"spec": spec, "error": f"{type(exc).__name__}: {exc}"})
            save()
    finally:
        conn.close()
    return 0 if all(r.get("boot", {}).get("state") == "done" for r in facts["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
