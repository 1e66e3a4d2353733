"""The fake tree mirrors the real sysfs layout, and the fake kernel behaves like Linux's PCI core."""

from __future__ import annotations

import errno
import os
import subprocess
import sys

import pytest

from hostagent.config import settings_from_dict
from hostagent.domain.errors import HostError
from hostagent.host.fakekernel import FakeKernel
from hostagent.host.fakesysfs import SCENARIOS, build_tree
from hostagent.host.sysfs import Sysfs
from hostagent.adapters import open_kernel
from tests.support.host import drivers, fake_host

GPU = "0000:02:00.0"  # workstation's Turing card, function 0


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_every_scenario_builds_a_tree(tmp_path, scenario) -> None:
    host = build_tree(tmp_path, scenario)
    assert (host.proc_root / "interrupts").exists() and (host.proc_root / "cmdline").exists()
    assert (host.dev_root / "vfio").is_dir()
    assert host.gpus


def test_layout_matches_real_sysfs(tmp_path) -> None:
    host = build_tree(tmp_path, "dgx8")
    s = Sysfs(host.sys_root)
    resolved = s.resolve("bus/pci/devices/0000:03:00.0")
    assert resolved is not None
    assert resolved.relative_to(host.sys_root.resolve()).as_posix() == (
        "devices/pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:00.0/0000:03:00.0")
    assert s.read_str("bus/pci/devices/0000:03:00.0/vendor") == "0x10de"
    assert s.read_str("bus/pci/devices/0000:03:00.0/class") == "0x030200"
    assert s.read_str("bus/pci/devices/0000:03:00.0/driver_override") == "(null)"
    assert s.read_str("bus/pci/devices/0000:03:00.0/current_link_speed") == "16.0 GT/s PCIe"
    assert s.read_link("bus/pci/devices/0000:03:00.0/driver") == "nvidia"
    group = s.read_link("bus/pci/devices/0000:03:00.0/iommu_group")
    assert s.listdir(f"kernel/iommu_groups/{group}/devices") == ["0000:03:00.0"]
    assert s.exists("bus/pci/drivers/nvidia/0000:03:00.0")
    assert len((s.read_str("bus/pci/devices/0000:03:00.0/resource") or "").splitlines()) == 13
    # links are relative, so the tree can be moved
    assert not os.readlink(host.sys_root / "bus/pci/devices/0000:03:00.0").startswith("/")


def test_iommu_off_has_no_groups(tmp_path) -> None:
    host = build_tree(tmp_path, "iommu-off")
    s = Sysfs(host.sys_root)
    assert s.listdir("kernel/iommu_groups") == []
    assert not s.exists("bus/pci/devices/0000:01:00.0/iommu_group")
    assert "intel_iommu=on" not in (host.proc_root / "cmdline").read_text()


def test_host_kernel_setting_alone_chooses_the_fake_kernel(tmp_path) -> None:
    """`host.kernel` is the only switch: a fake tree under the default `sysfs` gets the real kernel's plain Sysfs,
    whose writes move no driver; `fake` composes the fake kernel, whose writes do."""
    host = build_tree(tmp_path, "workstation")
    settings = settings_from_dict({"host": {"sysfs_root": str(host.sys_root)}})
    plain = open_kernel(settings)
    assert type(plain) is Sysfs
    fake = open_kernel(settings.replace(host={"kernel": "fake"}))
    assert isinstance(fake, FakeKernel) and fake.root == host.sys_root
    plain.write(f"bus/pci/devices/{GPU}/driver/unbind", GPU)
    assert drivers(fake, [GPU]) == {GPU: "nvidia"}
    fake.write(f"bus/pci/devices/{GPU}/driver/unbind", GPU)
    assert drivers(fake, [GPU]) == {GPU: None}


def test_cli_entry_prints_the_sysfs_root(tmp_path) -> None:
    out = subprocess.run([sys.executable, "-m", "hostagent.host.fakesysfs", "dgx8", str(tmp_path / "t")],
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(tmp_path / "t" / "sys")


# -- fake kernel ---------------------------------------------------------------------------------------------------

def test_unbind_from_wrong_driver_is_enodev(tmp_path) -> None:
    _, k, _ = fake_host(tmp_path, "workstation")
    with pytest.raises(HostError) as exc:
        k.write("bus/pci/drivers/snd_hda_intel/unbind", GPU)
    assert exc.value.details["errno"] == errno.ENODEV
    k.write(f"bus/pci/devices/{GPU}/driver/unbind", GPU)
    assert drivers(k, [GPU]) == {GPU: None}
    assert not k.exists(f"bus/pci/drivers/nvidia/{GPU}")


def test_override_probe_and_vfio_node(tmp_path) -> None:
    host, k, _ = fake_host(tmp_path, "workstation")
    k.write(f"bus/pci/devices/{GPU}/driver/unbind", GPU)
    k.write(f"bus/pci/devices/{GPU}/driver_override", "vfio-pci")
    assert k.read_str(f"bus/pci/devices/{GPU}/driver_override") == "vfio-pci"
    k.write("bus/pci/drivers_probe", GPU)
    assert drivers(k, [GPU]) == {GPU: None}  # vfio-pci not loaded yet: nothing takes it
    k.load_module("vfio-pci")
    k.write("bus/pci/drivers_probe", GPU)
    assert drivers(k, [GPU]) == {GPU: "vfio-pci"}
    group = k.read_link(f"bus/pci/devices/{GPU}/iommu_group")
    assert (host.dev_root / "vfio" / str(group)).exists()
    assert "vfio_pci" in (host.proc_root / "modules").read_text()
    k.write("bus/pci/drivers/vfio-pci/unbind", GPU)
    assert not (host.dev_root / "vfio" / str(group)).exists()
    k.write(f"bus/pci/devices/{GPU}/driver_override", "\n")
    assert k.read_str(f"bus/pci/devices/{GPU}/driver_override") == "(null)"
    k.write("bus/pci/drivers_probe", GPU)
    assert drivers(k, [GPU]) == {GPU: "nvidia"}


def test_bind_refuses_other_override_and_bound_device(tmp_path) -> None:
    _, k, _ = fake_host(tmp_path, "workstation")
    with pytest.raises(HostError) as exc:
        k.write("bus/pci/drivers/nvidia/bind", GPU)
    assert exc.value.details["errno"] == errno.EBUSY
    k.write(f"bus/pci/devices/{GPU}/driver/unbind", GPU)
    k.write(f"bus/pci/devices/{GPU}/driver_override", "vfio-pci")
    with pytest.raises(HostError) as exc:
        k.write("bus/pci/drivers/nvidia/bind", GPU)
    assert exc.value.details["errno"] == errno.ENODEV


def test_vfio_probe_fails_without_iommu_group(tmp_path) -> None:
    _, k, _ = fake_host(tmp_path, "iommu-off")
    addr = "0000:01:00.0"
    k.load_module("vfio_pci")
    k.write(f"bus/pci/devices/{addr}/driver/unbind", addr)
    k.write(f"bus/pci/devices/{addr}/driver_override", "vfio-pci")
    k.write("bus/pci/drivers_probe", addr)
    assert drivers(k, [addr]) == {addr: None}


def test_new_id_is_recorded_and_grabs_matching_devices(tmp_path) -> None:
    _, k, _ = fake_host(tmp_path, "dgx8")
    k.load_module("vfio_pci")
    k.write("bus/pci/devices/0000:03:00.0/driver/unbind", "0000:03:00.0")
    k.write("bus/pci/drivers/vfio-pci/new_id", "10de 20b0")
    assert k.new_id_writes() == ["vfio-pci: 10de 20b0"]
    assert drivers(k, ["0000:03:00.0"]) == {"0000:03:00.0": "vfio-pci"}


def test_writes_from_another_process_see_the_same_kernel(tmp_path) -> None:
    host, k, _ = fake_host(tmp_path, "workstation")
    code = ("from hostagent.host.fakekernel import FakeKernel; import sys; k = FakeKernel(sys.argv[1]); "
            f"k.write('bus/pci/devices/{GPU}/driver/unbind', '{GPU}')")
    subprocess.run([sys.executable, "-c", code, str(host.sys_root)], check=True)
    assert drivers(k, [GPU]) == {GPU: None}


def test_reset_follows_reset_method_and_can_fail(tmp_path) -> None:
    """`reset` uses the methods `reset_method` lists; an emptied list or a device that never comes back from its
    reset is ENOTTY; `reset_method` takes only what the device supports, and "default" restores them."""
    _, k, _ = fake_host(tmp_path, "workstation")
    dev = f"bus/pci/devices/{GPU}"
    assert k.read_str(f"{dev}/reset_method") == "flr bus"
    k.write(f"{dev}/reset", "1")
    with pytest.raises(HostError) as exc:
        k.write(f"{dev}/reset_method", "flr acpi")
    assert exc.value.details["errno"] == errno.EINVAL and k.read_str(f"{dev}/reset_method") == "flr bus"
    k.write(f"{dev}/reset_method", "bus")
    assert k.read_str(f"{dev}/reset_method") == "bus"
    k.write(f"{dev}/reset_method", "\n")
    with pytest.raises(HostError) as exc:
        k.write(f"{dev}/reset", "1")
    assert exc.value.details["errno"] == errno.ENOTTY
    k.write(f"{dev}/reset_method", "default")
    assert k.read_str(f"{dev}/reset_method") == "flr bus"
    k.set_fault("fail_reset", GPU)
    with pytest.raises(HostError) as exc:
        k.write(f"{dev}/reset", "1")
    assert exc.value.details["errno"] == errno.ENOTTY and "not ready" in exc.value.message
