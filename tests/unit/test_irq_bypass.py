"""Detecting posted interrupts (IRQ bypass), which make the host's vfio interrupt counters blind to a busy GPU."""

from __future__ import annotations

from pathlib import Path

import pytest

from hostagent.host.fakesysfs import build_tree
from hostagent.host.interrupts import irq_bypass


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_the_fake_host_has_apicv_but_no_posted_interrupts(tmp_path: Path) -> None:
    tree = build_tree(tmp_path, "dgx8")
    assert (tree.sys_root / "module/kvm_intel/parameters/enable_apicv").read_text().strip() == "Y"
    assert irq_bypass(tree.sys_root) is None


@pytest.mark.parametrize(("apicv", "cap", "bypass"), [
    ("Y", "d2008c40660462", False),  # no PI bit
    ("Y", "8d2078c106f0466", True),  # bit 59 set (a Skylake-SP DMAR unit)
    ("N", "8d2078c106f0466", False),  # APICv off: KVM does not post
])
def test_intel(tmp_path: Path, apicv: str, cap: str, bypass: bool) -> None:
    write(tmp_path / "module/kvm_intel/parameters/enable_apicv", apicv + "\n")
    write(tmp_path / "class/iommu/dmar0/intel-iommu/cap", "d2008c40660462\n")
    write(tmp_path / "class/iommu/dmar1/intel-iommu/cap", cap + "\n")
    why = irq_bypass(tmp_path)
    assert (why is not None) is bypass
    if bypass:
        assert "dmar1" in why and "APICv" in why


@pytest.mark.parametrize(("avic", "features", "bypass"), [
    ("1", "58f77ef22294ade:5d", True),  # GASup (bit 7) in the EFR, newer kernels print EFR:EFR2
    ("0", "58f77ef22294ade:5d", False),
    ("Y", "58f77ef22294a5e", False),  # bit 7 clear
])
def test_amd(tmp_path: Path, avic: str, features: str, bypass: bool) -> None:
    write(tmp_path / "module/kvm_amd/parameters/avic", avic + "\n")
    write(tmp_path / "class/iommu/ivhd0/amd-iommu/features", features + "\n")
    assert (irq_bypass(tmp_path) is not None) is bypass


def test_nothing_readable_means_no_bypass(tmp_path: Path) -> None:
    assert irq_bypass(tmp_path) is None
