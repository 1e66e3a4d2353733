#!/usr/bin/env python3
"""The probes, discovery and the guest agent's sampler on a real GPU host, read-only.

    python scripts/bench_gpu.py [--budget 12] [--json FILE] [--cpu]

What it runs, each with the agent's own code:
1. discovery (`hostagent.host.discovery.discover` over /sys) and the doctor's preflight checks (`hostagent.host.doctor`);
   the capabilities placement reads from the PCI name (`hostagent.domain.capabilities`);
2. every health runner the host offers (`select_runners(default_runners(...))`: sysfs, NVML, nvidia-smi);
3. the compute runners as the agent runs them (`TorchRunner().run`, `CupyRunner().run`: a child process per probe),
   with their known-answer verdicts and capability vector;
4. the baseline in the same run: the same quantities measured at length in this process (8192-wide products, ten
   timed after three warm-ups; a 1 GiB device copy), so each quick probe figure is printed beside its reference and
   their ratio;
5. the known-answer check's discrimination on this chip: the product of the known-answer matrices with one input
   element changed must fail the check in every precision, the unchanged product must pass;
6. the guest agent's sampler (`hostagent.guest.sampler.Sampler.open()`) idle, then while a child process keeps the GPU
   busy: utilisation and memory must rise.

It never binds, unbinds or resets anything. `--cpu` runs steps 3 to 5 on CPU tensors (no GPU needed), to try the
script itself.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hostagent.domain.capabilities import Measured, capabilities  # noqa: E402
from hostagent.host import known_answer  # noqa: E402
from hostagent.host.discovery import discover  # noqa: E402
from hostagent.host.probes import (BANDWIDTH, H2D, CupyRunner, TorchRunner, default_runners,  # noqa: E402
                                   select_runners, tflops_key)
from hostagent.host.sysfs import Sysfs  # noqa: E402

PRECISIONS = ("fp16", "bf16", "fp32", "fp64")
BUSY_CHILD = """
import sys, time, torch
d = torch.device('cuda', int(sys.argv[1]))
a = torch.randn(8192, 8192, device=d, dtype=torch.float16); b = torch.randn_like(a)
x = torch.empty(int(sys.argv[2]) * 1024**3, dtype=torch.uint8, device=d)  # memory the sampler must see in use
end = time.time() + float(sys.argv[3])
while time.time() < end:
    for _ in range(50): torch.mm(a, b)
    torch.cuda.synchronize(d)
"""


def section(title: str) -> None:
    print(f"\n== {title} " + "=" * max(0, 100 - len(title)), flush=True)


def reference(torch: Any, dev: Any, n: int, copy_bytes: int) -> dict[str, float]:
    """Each precision's matmul TFLOP/s and the device copy GB/s, measured at length (the baseline)."""
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
    dtypes = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32, "fp64": torch.float64}
    out: dict[str, float] = {}
    for p in PRECISIONS:
        a = torch.randn(n, n, device=dev, dtype=torch.float32).to(dtypes[p])
        b = torch.randn(n, n, device=dev, dtype=torch.float32).to(dtypes[p])
        for _ in range(3):
            torch.mm(a, b)
        sync()
        t = time.perf_counter()
        for _ in range(10):
            torch.mm(a, b)
        sync()
        out[tflops_key(p)] = round(2 * n**3 * 10 / (time.perf_counter() - t) / 1e12, 3)
        del a, b
    src = torch.empty(copy_bytes, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    sync()
    t = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    sync()
    out[BANDWIDTH] = round(2 * copy_bytes * 10 / (time.perf_counter() - t) / 1e9, 1)
    if dev.type == "cuda":
        host = torch.empty(copy_bytes, dtype=torch.uint8).pin_memory()
        src.copy_(host)
        sync()
        t = time.perf_counter()
        for _ in range(5):
            src.copy_(host, non_blocking=True)
        sync()
        out[H2D] = round(copy_bytes * 5 / (time.perf_counter() - t) / 1e9, 1)
    return out


def discrimination(torch: Any, dev: Any) -> dict[str, dict[str, bool]]:
    """Per precision: does the check pass the true product and fail one with a single input element changed?"""
    dtypes = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32, "fp64": torch.float64}
    out = {}
    for p in PRECISIONS:
        a, b = (torch.tensor(x, dtype=dtypes[p], device=dev) for x in known_answer.inputs(p))
        ok = known_answer.check(p, torch.mm(a, b).to(torch.float64).cpu().numpy()) is None
        bad = a.clone()
        bad[3, 5] += 1  # one element off by one: what a stuck bit in one lane does
        caught = known_answer.check(p, torch.mm(bad, b).to(torch.float64).cpu().numpy()) is not None
        out[p] = {"true_product_passes": ok, "changed_product_fails": caught}
    return out


def sample(sampler: Any, seconds: float) -> list[dict[str, Any]]:
    rows = []
    end = time.time() + seconds
    while time.time() < end:
        for r in sampler.read():
            rows.append({"gpu": r.bus_id, "util": r.util_pct,
                         "mem_used_gib": None if r.mem_used_bytes is None else round(r.mem_used_bytes / 1024**3, 2),
                         "processes": None if r.processes is None else len(r.processes)})
        time.sleep(0.5)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budget", type=float, default=12.0, help="seconds per compute probe (the agent's default: 12)")
    ap.add_argument("--json", help="write every figure here as JSON")
    ap.add_argument("--pci-ids", default=None, help="pci.ids file for model names (default: the agent's default)")
    ap.add_argument("--cpu", action="store_true", help="compute steps on CPU tensors (try the script without a GPU)")
    args = ap.parse_args(argv)
    report: dict[str, Any] = {"when": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "host": os.uname().nodename}
    failures: list[str] = []

    section("discovery (read-only, /sys)")
    sysfs = Sysfs("/sys")
    inv = discover(sysfs, **({"pci_ids_path": args.pci_ids} if args.pci_ids else {}))
    report["gpus"] = []
    for g in inv.gpus:
        caps = capabilities(g.primary.vendor_id, g.primary.device_name)
        row = {"address": str(g.address), "model": g.model, "memory_gib": None if g.memory_bytes is None else
               round(g.memory_bytes / 1024**3, 1), "memory_source": g.memory_source, "numa_node": g.numa_node,
               "iommu_group": g.iommu_group, "functions": [str(f.address) for f in g.functions],
               "driver": g.primary.driver, "viable": g.viable, "capabilities": caps.to_dict()}
        report["gpus"].append(row)
        print(json.dumps(row))
    print(f"{len(inv.gpus)} GPU(s); IOMMU enabled: {inv.iommu_enabled}")
    try:
        from hostagent.host.doctor import run_checks

        checks = run_checks(sysfs, "/proc", "/dev", inv, lambda: "not checked here (libvirt-python not installed)")
        report["doctor"] = [{"name": c.name, "status": c.status, "detail": c.detail} for c in checks]
        for c in checks:
            print(f"{c.status:<4} {c.name}: {c.detail}")
    except Exception as exc:  # report and go on: the probes below do not depend on it
        print(f"doctor failed: {exc!r}")
        failures.append(f"doctor: {exc!r}")

    section("runners available here")
    chosen, status = select_runners(default_runners(sysfs))
    report["runners"] = [s.to_dict() for s in status]
    for s in status:
        print(f"{s.name:<11} {s.kind:<8} {'yes' if s.available else 'no':<4} {s.reason or ''}")

    section("health runners, each GPU")
    report["health"] = {}
    for g in inv.gpus:
        for r in chosen:
            if r.kind != "health":
                continue
            try:
                res = r.run(g, args.budget)
            except Exception as exc:  # a runner that raises is a bug to report, not a reason to stop measuring
                failures.append(f"{g.address} {r.name} raised {exc!r}")
                print(f"{g.address} {r.name}: RAISED {exc!r}")
                continue
            report["health"][f"{g.address} {r.name}"] = res.to_dict()
            print(f"{g.address} {r.name}: health={json.dumps(res.health)} problems={list(res.problems)} "
                  f"warnings={list(res.warnings)} error={res.error}")

    import torch

    section("compute probes as the agent runs them, with the baseline measured at length in this run")
    targets: list[tuple[Any, Any, str]] = []
    if args.cpu:
        from hostagent.domain.inventory import Gpu, PciFunction
        from hostagent.domain.pci import PciAddress

        fake = Gpu("cpu", PciFunction(PciAddress.parse("0000:00:00.0"), 0x10DE, 0, 0x030000), (), None)
        targets.append((fake, torch.device("cpu"), "torch-cpu"))
    else:
        for i, g in enumerate(inv.gpus):
            targets.append((g, torch.device("cuda", i), "torch"))
    report["compute"] = {}
    for g, dev, label in targets:
        t0 = time.perf_counter()
        probe = (TorchRunner("cpu") if args.cpu else TorchRunner()).run(g, args.budget)
        took = time.perf_counter() - t0
        entry: dict[str, Any] = {"torch": probe.to_dict(), "torch_wall_s": round(took, 1)}
        if probe.error:
            failures.append(f"{g.address} torch probe: {probe.error}")
            print(f"{g.address}: torch probe error: {probe.error}")
        if not args.cpu:
            cp = CupyRunner()
            why = cp.unavailable()
            entry["cupy"] = {"unavailable": why} if why else cp.run(g, args.budget / 2).to_dict()
        ref = reference(torch, dev, 1024 if args.cpu else 8192, 64 * 1024**2 if args.cpu else 1024**3)
        entry["reference"] = ref
        print(f"{g.address} ({probe.health.get('device_name', '?')}), torch probe took {took:.1f} s wall "
              f"(budget {args.budget:g} s), known answer: {probe.health.get('known_answer')}")
        print(f"  {'metric':<22}{'probe':>12}{'reference':>12}{'probe/ref':>11}")
        for k in [*(tflops_key(p) for p in PRECISIONS), BANDWIDTH, H2D]:
            got, want = probe.metrics.get(k), ref.get(k)
            ratio = f"{got / want:.2f}" if got and want else "-"
            print(f"  {k:<22}{got if got is not None else '-':>12}{want if want is not None else '-':>12}{ratio:>11}")
        if "cupy" in entry:
            print(f"  cupy: {json.dumps(entry['cupy'])}")
        entry["discrimination"] = disc = discrimination(torch, dev)
        print(f"  known-answer check on this device: {json.dumps(disc)}")
        for p, d in disc.items():
            if not (d["true_product_passes"] and d["changed_product_fails"]):
                failures.append(f"{g.address} known answer {p}: {d}")
        if probe.problems:
            failures.append(f"{g.address} probe problems: {list(probe.problems)}")
        # what placement learns from this probe (services.probes.learn): features and memory size
        health = {"torch": probe.health, **{key.split(" ", 1)[1]: h.get("health") or {}
                                             for key, h in report["health"].items() if key.startswith(f"{g.address} ")}}
        measured = Measured.from_probe(health, probe.metrics)
        learned = capabilities(g.primary.vendor_id, g.primary.device_name, measured=measured)
        before = capabilities(g.primary.vendor_id, g.primary.device_name)
        entry["learned"] = {"before": before.to_dict(), "after": learned.to_dict(),
                            "memory_before_gib": None if g.memory_bytes is None else round(g.memory_bytes / 1024**3, 1),
                            "memory_source_before": g.memory_source,
                            "memory_probe_gib": None if not measured.memory_bytes else round(measured.memory_bytes / 1024**3, 1)}
        print(f"  placement learns: features {before.to_dict()['features']} -> {learned.to_dict()['features']} "
              f"({learned.source}); memory {entry['learned']['memory_before_gib']} GiB ({g.memory_source}) -> "
              f"{entry['learned']['memory_probe_gib']} GiB (probe)")
        report["compute"][str(g.address)] = entry

    if not args.cpu and inv.gpus:
        section("guest agent's sampler: idle, then one GPU busy (8192 fp16 products, 4 GiB held)")
        from hostagent.guest.sampler import Sampler

        s = Sampler.open()
        print(f"sampler: {s.note}; devices {[d.name for d in s.devices]}")
        idle = sample(s, 3)
        child = subprocess.Popen([sys.executable, "-c", BUSY_CHILD, "0", "4", "12"])
        time.sleep(4)  # CUDA context and allocation
        busy = sample(s, 5)
        child.wait()
        s.close()
        peak = max((r["util"] or 0) for r in busy) if busy else 0
        print(f"idle: {idle[-1] if idle else None}\nbusy: {busy[-1] if busy else None}; peak utilisation {peak}%")
        report["sampler"] = {"note": s.note, "idle": idle, "busy": busy}
        if peak < 50:
            failures.append(f"sampler saw at most {peak}% while the GPU was busy")

    section("verdict")
    report["failures"] = failures
    print("OK" if not failures else "FAILED:\n  " + "\n  ".join(failures))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1, default=str))
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
