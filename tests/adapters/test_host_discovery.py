"""Discovery over the fake scenarios: GPUs, groups, viability, names, memory, topology; and it never writes."""

from __future__ import annotations

from hostagent.domain.pci import PciAddress
from hostagent.host.discovery import discover
from hostagent.host.sysfs import Sysfs
from tests.support.host import fake_host, tree_digest

P = PciAddress.parse


def test_dgx8_shape(tmp_path) -> None:
    _, _, inv = fake_host(tmp_path, "dgx8")
    assert inv.iommu_enabled
    assert len(inv.gpus) == 8
    assert {g.model for g in inv.gpus} == {"GA100 [A100 SXM4 40GB]"}
    assert all(g.viable and len(g.functions) == 1 for g in inv.gpus)
    assert [g.numa_node for g in inv.gpus] == [0, 0, 0, 0, 1, 1, 1, 1]
    switches = [g.extra["switch"] for g in inv.gpus]
    assert len(set(switches)) == 4 and all(switches.count(s) == 2 for s in switches)
    assert all(g.memory_bytes == 40 * 1024**3 and g.memory_source == "name" for g in inv.gpus)
    g0 = inv.gpus[0]
    assert g0.id == "gpu-0000-03-00-0"
    assert g0.primary.parent_chain == (P("0000:02:00.0"), P("0000:01:00.0"), P("0000:00:01.0"))
    assert g0.primary.bar_sizes == (16 * 1024**2, 64 * 1024**3, 32 * 1024**2)
    assert g0.primary.link_speed == "16.0 GT/s PCIe" and g0.primary.link_width == 16
    assert g0.vendor == "NVIDIA Corporation"
    # the switch ports sit in their own groups, each GPU alone in its own
    assert inv.groups[g0.iommu_group].functions == (g0.primary,)
    nic = inv.function("0000:09:00.0")
    assert nic is not None and nic.driver == "mlx5_core" and nic.device_name == "MT2892 Family [ConnectX-6 Dx]"


def test_workstation_cards_are_whole_groups(tmp_path) -> None:
    _, _, inv = fake_host(tmp_path, "workstation")
    by_addr = {str(g.address): g for g in inv.gpus}
    assert set(by_addr) == {"0000:01:00.0", "0000:02:00.0", "0000:03:00.0"}
    turing = by_addr["0000:02:00.0"]
    assert [(str(f.address), f.driver) for f in turing.functions] == [
        ("0000:02:00.0", "nvidia"), ("0000:02:00.1", "snd_hda_intel"),
        ("0000:02:00.2", "xhci_hcd"), ("0000:02:00.3", "nvidia-gpu")]
    ada = by_addr["0000:01:00.0"]
    assert ada.viable and [str(b.address) for b in ada.group.bridges] == ["0000:00:01.0"]
    assert len(ada.functions) == 2
    amd = by_addr["0000:03:00.0"]
    assert (amd.memory_bytes, amd.memory_source) == (16 * 1024**3, "sysfs")
    assert amd.numa_node is None


def test_shared_rootport_is_not_viable_with_reason(tmp_path) -> None:
    _, _, inv = fake_host(tmp_path, "shared-rootport")
    bad, good = inv.gpus
    assert not bad.viable
    assert bad.unviable_reason == (
        f"group {bad.iommu_group} also holds 0000:04:00.0 Ethernet controller (mlx5_core), a host device")
    assert good.viable


def test_allow_list_makes_the_group_viable(tmp_path) -> None:
    host, k, _ = fake_host(tmp_path, "shared-rootport")
    inv = discover(k, allow_list=frozenset({(0x15B3, 0x101D)}))
    assert inv.gpus[0].viable and inv.gpus[0].unviable_reason is None


def test_iommu_off(tmp_path) -> None:
    _, _, inv = fake_host(tmp_path, "iommu-off")
    assert not inv.iommu_enabled and inv.groups == {}
    assert len(inv.gpus) == 2 and not any(g.viable for g in inv.gpus)
    assert "IOMMU is off" in (inv.gpus[0].unviable_reason or "")


def test_vendor_filter_and_hex_fallback(tmp_path) -> None:
    host, k, _ = fake_host(tmp_path, "workstation")
    inv = discover(k, vendors=("1002",), pci_ids_path=str(tmp_path / "missing.ids"))
    assert [str(g.address) for g in inv.gpus] == ["0000:03:00.0"]
    assert inv.gpus[0].model == "1002:73bf"


def test_discovery_never_writes(tmp_path) -> None:
    host, kernel, _ = fake_host(tmp_path, "workstation")
    before = tree_digest(tmp_path)
    # Both the plain Sysfs and the fake kernel (whose writes would leave a lock file) read the same inventory.
    inv = discover(Sysfs(host.sys_root))
    assert inv.gpus == discover(kernel).gpus
    assert tree_digest(tmp_path) == before
