"""Measure an inner Linux boot under NESTED TCG (#19): `.venv/bin/python -m tests.e2e.measure_inner_os`.

Boots the QEMU test guest (tests/support/qemu.py: 3 GiB, 2 vCPUs, the two-function e1000e group of PAIR_DEVICES,
vfio preloaded), starts virtlogd and libvirtd in it as the nested libvirt test does, then runs
tests/e2e/inner_os.py there, which boots inner libvirt domains running the same Debian kernel and two-stage
initramfs (one per run spec, all within this one outer boot, so the outer boot is paid once) and records their
timings. Prints the outer wall time, libvirtd's readiness, and per inner run: domain start, boot to stage 2,
the inner kernel's own uptime at stage 2, the stage-2 steps, a cold and a warm Python start and the import of
hostagent.guest.cli; with --hotplug also the live attach/detach of one e1000e function and the time from
virDomainDetachDeviceFlags to DEVICE_REMOVED. On failure: the inner console tail, the stage-2 log and the
outer guest's output.

While the outer guest runs, the last line of each inner console is echoed every 30 s (the inner consoles are
written straight into the outer guest's result share), so a slow boot shows where it is.

Examples:
  .venv/bin/python -m tests.e2e.measure_inner_os                        # one run, 1 vCPU, 512 MiB
  .venv/bin/python -m tests.e2e.measure_inner_os --run '{"vcpus": 2}' --run '{"memory_mib": 256}'
  .venv/bin/python -m tests.e2e.measure_inner_os --run '{"kernel": "pvh", "python": false}'  # ELF, no Python
  .venv/bin/python -m tests.e2e.measure_inner_os --hotplug              # + attach/detach of PAIR_ADDRS[0]
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from tests.support import qemu

SCRIPT = qemu.LIBVIRTD_SCRIPT.replace("{command}", '"$PYTHON" "$REPO/tests/e2e/inner_os.py" {runs}')


def _watch(keep: Path, stop: threading.Event, t0: float) -> None:
    """Every 30 s, print the last non-empty line of the outer console and of each inner console."""
    while not stop.wait(30):
        for share in keep.glob("hostagent-guest-*"):
            lines = [f"outer: {_last_line(share / 'console.log')}"]
            consoles = sorted((share / "out").glob("inner-os-*/console.log"))
            lines += [f"{c.parent.name}: {_last_line(c)}" for c in consoles]
            print(f"[{time.monotonic() - t0:7.1f} s] " + " | ".join(lines), flush=True)


def _last_line(path: Path) -> str:
    try:
        lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return "-"
    return lines[-1][-160:] if lines else "(empty)"


def _fmt(value: Any) -> str:
    return "-" if value is None else f"{value} s" if isinstance(value, (int, float)) else str(value)


def report(result: qemu.GuestResult, facts: dict[str, Any] | None) -> int:
    """Print the figures; the tails of whatever failed. Exit status 0 when every inner run reached DONE."""
    print(f"outer: wall {result.wall_s:.1f} s, status {result.status}, timed_out {result.timed_out}")
    if facts is None:
        print("the outer guest wrote no inner_os.json\n" + result.explain())
        return 1
    print(f"outer kernel {facts.get('outer_kernel')}, libvirtd ready {_fmt(facts['libvirtd'].get('ready_s'))}, "
          f"inner_os.py total {_fmt(facts.get('script_s'))}")
    ok = bool(facts.get("runs"))
    for i, run in enumerate(facts.get("runs", [])):
        boot, inner = run.get("boot", {}), run.get("inner") or {}
        print(f"\n--- inner run {i}: {json.dumps(run.get('spec'))}")
        if "error" in run:
            print(f"  error: {run['error']}")
            ok = False
            continue
        print(f"  cmdline: {run.get('cmdline')}")
        print(f"  user-mode NIC: {run.get('user_net')}" + (f" (refused: {run['user_net_error']})"
                                                           if run.get("user_net_error") else ""))
        print(f"  state {boot.get('state')}; domain start {_fmt(boot.get('domain_start_s'))}, "
              f"boot to stage 2 {_fmt(boot.get('boot_to_stage2_s'))} "
              f"(inner kernel uptime then {_fmt(boot.get('inner_uptime_at_stage2_s'))}), "
              f"stage 2 {_fmt(boot.get('stage2_s'))}")
        print(f"  inner: kernel {inner.get('kernel')}, python cold {_fmt(inner.get('python_cold_s'))}, "
              f"import hostagent.guest.cli {_fmt(inner.get('import_guest_cli_s'))} (rc {inner.get('import_rc')}), "
              f"python warm {_fmt(inner.get('python_warm_s'))}, stage-2 steps {_fmt(inner.get('stage2_steps_s'))}")
        if inner:
            print(f"  inner PCI: {' '.join(inner.get('pci_devices', []))}")
            print("  hot-plug: " + " / ".join(inner.get("hotplug_dmesg", [])[:3]))
        hp = run.get("hotplug")
        if hp:
            print(f"  hotplug: {json.dumps(hp, indent=1)}")
        if boot.get("state") != "done":
            ok = False
            print(f"  --- inner console (tail) ---\n{boot.get('console_tail', '')[-3000:]}")
            log = result.files.get(f"inner-os-{i}/stage2.log")
            if log:
                print(f"  --- inner stage2.log (tail) ---\n{log.decode(errors='replace')[-2000:]}")
    if not ok or result.status != 0:
        print("\n" + result.explain())
        for name, data in result.files.items():
            if name.endswith(".log") and "/" not in name:
                print(f"--- {name} (tail) ---\n{data.decode(errors='replace')[-1500:]}")
    return 0 if ok and result.status == 0 else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", action="append", default=[], metavar="JSON",
                        help='one inner run spec, e.g. \'{"vcpus": 2, "memory_mib": 384, "cmdline_extra": "..."}\'; '
                             "repeat for several runs in one outer boot (default: one run with the defaults)")
    parser.add_argument("--hotplug", action="store_true",
                        help=f"in the last run, attach and detach {qemu.PAIR_ADDRS[0]} live and time DEVICE_REMOVED")
    parser.add_argument("--timeout", type=float, default=1500, help="outer guest timeout, s (default 1500)")
    parser.add_argument("--inner-timeout", type=float, default=1200, help="per inner boot, s (default 1200)")
    parser.add_argument("--keep", metavar="DIR", help="keep the outer share (consoles, logs) under DIR")
    args = parser.parse_args(argv)
    runs = [json.loads(r) for r in args.run] or [{}]
    for run in runs:
        run.setdefault("timeout_s", args.inner_timeout)
    if args.hotplug:
        runs[-1]["hotplug"] = qemu.PAIR_ADDRS[0]
    keep = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="measure-inner-os-"))
    keep.mkdir(parents=True, exist_ok=True)
    # "kernel": "pvh" boots the uncompressed ELF instead of the bzImage; the outer guest (and so the inner QEMU)
    # sees this host path as it is, through its 9p root.
    if any(run.get("kernel") == "pvh" for run in runs):
        vmlinux = qemu.guest_vmlinux(qemu.guest_image())
        for run in runs:
            if run.get("kernel") == "pvh":
                run["kernel"] = str(vmlinux)
    stop = threading.Event()
    t0 = time.monotonic()
    threading.Thread(target=_watch, args=(keep, stop, t0), daemon=True).start()
    try:
        result = qemu.boot_guest(
            SCRIPT.format(runs=shlex.quote(json.dumps(runs))),
            devices=qemu.PAIR_DEVICES, preload_modules=("e1000e", "vfio_pci", "vfio_iommu_type1"),
            memory_mib=3072, cpus=2, timeout_s=args.timeout, keep_dir=keep,
        )
    finally:
        stop.set()
    facts = json.loads(result.files["inner_os.json"]) if "inner_os.json" in result.files else None
    rc = report(result, facts)
    if args.keep:
        print(f"\nkept under {keep}")
    else:
        shutil.rmtree(keep, ignore_errors=True)
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
