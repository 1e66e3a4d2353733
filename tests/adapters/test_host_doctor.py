"""Doctor: the exact OK/WARN/FAIL lines for each fake scenario."""

from __future__ import annotations

import os

from hostagent.host.discovery import discover
from hostagent.host.doctor import run_checks
from tests.support.host import fake_host

KERNEL = "6.1.0-18-amd64"
COMMON_OK = [
    "OK    interrupt-remapping: supported by every VT-d unit",
    f"OK    vfio_pci: available for kernel {KERNEL}, loaded on first bind",
    f"OK    vfio_iommu_type1: available for kernel {KERNEL}, loaded on first bind",
]


def _lines(tmp_path, scenario, probe=lambda: None):
    host, k, inv = fake_host(tmp_path, scenario)
    checks = run_checks(k, host.proc_root, host.dev_root, inv, probe)
    assert all(c.hint for c in checks if c.status != "OK")
    return [c.line() for c in checks]


def test_dgx8_all_ok(tmp_path) -> None:
    lines = _lines(tmp_path, "dgx8")
    assert lines[:6] == ["OK    iommu: 30 IOMMU groups", "OK    kernel-cmdline: intel_iommu=on iommu=pt",
                         *COMMON_OK, "OK    libvirt: reachable"]
    assert lines[6] == "OK    gpu 0000:03:00.0: GA100 [A100 SXM4 40GB]: group 8 viable (1 function)"
    assert lines[14] == "OK    pci-ids: every GPU is named in pci.ids"
    assert len(lines) == 6 + 8 + 3 and all(ln.startswith("OK") for ln in lines)


def test_workstation_warns_about_pt_xorg_and_efifb(tmp_path) -> None:
    assert _lines(tmp_path, "workstation", lambda: "cannot connect to qemu:///system") == [
        "OK    iommu: 10 IOMMU groups",
        "WARN  kernel-cmdline: intel_iommu=on without iommu=pt (host DMA goes through the IOMMU)",
        *COMMON_OK,
        "FAIL  libvirt: cannot connect to qemu:///system",
        "OK    gpu 0000:01:00.0: AD102 [GeForce RTX 4090]: group 1 viable (2 functions)",
        "OK    gpu 0000:02:00.0: TU102 [GeForce RTX 2080 Ti Rev. A]: group 6 viable (4 functions)",
        "OK    gpu 0000:03:00.0: Navi 21 [Radeon RX 6800/6800 XT / 6900 XT]: group 7 viable (2 functions)",
        "OK    pci-ids: every GPU is named in pci.ids",
        "WARN  host-processes: pid 1234 (Xorg) holds /dev/nvidia0, /dev/nvidiactl",
        "WARN  framebuffer: efifb uses 0000:01:00.0's BAR",
    ]


def test_shared_rootport_fails_the_gpu_with_reason(tmp_path) -> None:
    lines = _lines(tmp_path, "shared-rootport")
    assert ("FAIL  gpu 0000:03:00.0: GA102GL [A10]: group 1 also holds 0000:04:00.0 Ethernet controller (mlx5_core),"
            " a host device") in lines
    assert "OK    gpu 0000:05:00.0: TU104GL [Tesla T4]: group 3 viable (1 function)" in lines


def test_iommu_off(tmp_path) -> None:
    reason = "IOMMU is off or the device has no IOMMU group: enable intel_iommu=on / amd_iommu=on"
    assert _lines(tmp_path, "iommu-off") == [
        "FAIL  iommu: no IOMMU groups: the IOMMU is off",
        "FAIL  kernel-cmdline: no intel_iommu=on / amd_iommu=on",
        "WARN  interrupt-remapping: unknown (no readable intel-iommu capability)",
        *COMMON_OK[1:],
        "OK    libvirt: reachable",
        f"FAIL  gpu 0000:01:00.0: GA100 [A100 PCIe 40GB]: {reason}",
        f"FAIL  gpu 0000:02:00.0: GA100 [A100 PCIe 40GB]: {reason}",
        "OK    pci-ids: every GPU is named in pci.ids",
        "OK    host-processes: no host process holds a GPU device node",
        "OK    framebuffer: no boot framebuffer on a GPU",
    ]


def test_missing_vfio_modules_and_loaded_ones(tmp_path) -> None:
    host, k, inv = fake_host(tmp_path, "dgx8")
    (host.root / f"lib/modules/{KERNEL}/modules.dep").write_text("")
    checks = {c.name: c for c in run_checks(k, host.proc_root, host.dev_root, inv, lambda: None)}
    assert checks["vfio_pci"].status == "FAIL" and checks["vfio_iommu_type1"].status == "FAIL"
    k.load_module("vfio-pci")
    k.load_module("vfio_iommu_type1")
    checks = {c.name: c for c in run_checks(k, host.proc_root, host.dev_root, inv, lambda: None)}
    assert checks["vfio_pci"].line() == "OK    vfio_pci: loaded"
    assert checks["vfio_iommu_type1"].line() == "OK    vfio_iommu_type1: loaded"


def test_a_raising_probe_is_a_fail_line(tmp_path) -> None:
    def probe() -> str | None:
        raise RuntimeError("boom")

    assert "FAIL  libvirt: RuntimeError: boom" in _lines(tmp_path, "dgx8", probe)
    assert os.path.exists(tmp_path / "sys")


def test_gpus_pci_ids_does_not_name_are_warned_about(tmp_path) -> None:
    """What a Debian 12 host with H100 or H200 boards sees: pci.ids (2023) names the vendor, not the card."""
    host, k, _ = fake_host(tmp_path, "shared-rootport")
    ids = tmp_path / "pci.ids"
    ids.write_text("10de  NVIDIA Corporation\n\t1eb8  TU104GL [Tesla T4]\n")
    inv = discover(k, pci_ids_path=str(ids))
    check = {c.name: c for c in run_checks(k, host.proc_root, host.dev_root, inv, lambda: None)}["pci-ids"]
    assert check.status == "WARN" and check.detail.startswith("not in pci.ids: 10de:2236;"), check
    assert "update-pciids" in check.hint and "host.pci_ids_path" in check.hint and "hostagent probe" in check.hint
