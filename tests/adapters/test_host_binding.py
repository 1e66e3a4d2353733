"""VfioBinder against the fake kernel: round trips, rollback at every step, hangs, and group invariants."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hostagent.domain.errors import HostError
from hostagent.host.adapter import SysfsHost
from hostagent.host.binding import VFIO_PCI, VfioBinder
from hostagent.host.fakesysfs import record_interrupts, record_interrupts_of
from tests.support.host import drivers, fake_host

TURING = ["0000:02:00.0", "0000:02:00.1", "0000:02:00.2", "0000:02:00.3"]
NATIVE = {"0000:02:00.0": "nvidia", "0000:02:00.1": "snd_hda_intel", "0000:02:00.2": "xhci_hcd",
          "0000:02:00.3": "nvidia-gpu"}


def _turing(inv):
    return next(g for g in inv.gpus if str(g.address) == TURING[0])


def test_bind_and_release_round_trip(tmp_path) -> None:
    host, k, inv = fake_host(tmp_path, "workstation")
    gpu = _turing(inv)
    binder = VfioBinder(k, host.dev_root, step_timeout_s=5)
    seen: list[tuple[str, str]] = []
    res = binder.bind_group(gpu.group, on_step=lambda s, a: seen.append((s, a)))
    assert res.ok, res.error
    assert drivers(k, TURING) == {a: VFIO_PCI for a in TURING}
    assert res.original_drivers == NATIVE
    assert (host.dev_root / "vfio" / str(gpu.iommu_group)).exists()
    assert ("unbind", TURING[0]) in seen and ("read-back", TURING[3]) in seen
    assert seen.index(("unbind", TURING[0])) < seen.index(("override", TURING[0])) < seen.index(("probe", TURING[0]))
    back = binder.release_group(gpu.group, res.original_drivers)
    assert back.ok, back.error
    assert drivers(k, TURING) == NATIVE
    assert not (host.dev_root / "vfio" / str(gpu.iommu_group)).exists()
    assert all(k.read_str(f"bus/pci/devices/{a}/driver_override") == "(null)" for a in TURING)
    assert k.new_id_writes() == []


def test_plan_touches_nothing(tmp_path) -> None:
    from tests.support.host import tree_digest

    host, k, inv = fake_host(tmp_path, "workstation")
    before = tree_digest(tmp_path)
    binder = VfioBinder(k, host.dev_root)
    plan = binder.plan_bind(_turing(inv).group)
    assert plan[0] == "load modules vfio_pci, vfio_iommu_type1"
    assert f"{TURING[1]}: unbind from snd_hda_intel (echo {TURING[1]} > bus/pci/drivers/snd_hda_intel/unbind)" in plan
    assert binder.plan_release(_turing(inv).group, NATIVE)
    assert tree_digest(tmp_path) == before


def test_failed_probe_rolls_back_the_whole_group(tmp_path) -> None:
    host, k, inv = fake_host(tmp_path, "workstation")
    k.set_fault("fail_bind", TURING[2])
    res = VfioBinder(k, host.dev_root).bind_group(_turing(inv).group)
    assert not res.ok and not res.needs_attention
    assert res.stopped_at == f"read-back {TURING[2]}"
    assert drivers(k, TURING) == NATIVE
    undos = [(s.name, s.address) for s in res.steps if s.name.startswith("undo-")]
    assert undos[:3] == [("undo-probe", TURING[2]), ("undo-override", TURING[2]), ("undo-unbind", TURING[2])]
    assert undos[-1] == ("undo-unbind", TURING[0])
    assert not (host.dev_root / "vfio" / str(_turing(inv).iommu_group)).exists()


def test_failed_undo_needs_attention(tmp_path) -> None:
    host, k, inv = fake_host(tmp_path, "workstation")
    k.set_fault("fail_bind", TURING[1])
    k.set_fault("no_rebind", TURING[0])
    res = VfioBinder(k, host.dev_root).bind_group(_turing(inv).group)
    assert not res.ok and res.needs_attention
    assert drivers(k, TURING)[TURING[0]] is None
    assert VFIO_PCI not in drivers(k, TURING).values()


def test_hung_unbind_times_out_and_marks_the_device(tmp_path) -> None:
    host, k, inv = fake_host(tmp_path, "workstation")
    k.set_fault("hang_unbind", TURING[1], "0.6")
    binder = VfioBinder(k, host.dev_root, step_timeout_s=0.1)
    res = binder.bind_group(_turing(inv).group)
    assert not res.ok and res.needs_attention
    assert res.stopped_at == f"unbind {TURING[1]}"
    assert "did not return within 0.1 s" in (res.error or "")
    assert binder.stuck == {TURING[1]: "unbind"}
    assert drivers(k, [TURING[0]]) == {TURING[0]: "nvidia"}  # the step before it was undone
    again = binder.bind_group(_turing(inv).group)  # refuses while the device is stuck
    assert not again.ok and again.needs_attention and again.steps == ()
    time.sleep(0.8)  # let the hung write finish so the tree is quiet when tmp_path goes


def test_release_refused_unbind_keeps_group_whole_on_vfio(tmp_path) -> None:
    host, k, inv = fake_host(tmp_path, "workstation")
    binder = VfioBinder(k, host.dev_root)
    assert binder.bind_group(_turing(inv).group).ok
    k.set_fault("fail_unbind", TURING[2])
    res = binder.release_group(_turing(inv).group, NATIVE)
    assert not res.ok
    assert drivers(k, TURING) == {a: VFIO_PCI for a in TURING}


def test_release_with_no_rebind_reports_attention(tmp_path) -> None:
    host, k, inv = fake_host(tmp_path, "workstation")
    binder = VfioBinder(k, host.dev_root)
    assert binder.bind_group(_turing(inv).group).ok
    k.set_fault("no_rebind", TURING[3])
    res = binder.release_group(_turing(inv).group, NATIVE)
    assert not res.ok and res.needs_attention
    assert res.drivers == {**NATIVE, TURING[3]: None}


def test_release_to_any_host_driver_and_to_none(tmp_path) -> None:
    host, k, inv = fake_host(tmp_path, "workstation")
    binder = VfioBinder(k, host.dev_root)
    assert binder.bind_group(_turing(inv).group).ok
    res = binder.release_group(_turing(inv).group, {TURING[0]: "*", TURING[1]: None, TURING[2]: "*", TURING[3]: "*"})
    assert res.ok, res.error
    assert drivers(k, TURING) == {**NATIVE, TURING[1]: None}


def test_iommu_off_bind_fails_cleanly(tmp_path) -> None:
    from hostagent.domain.inventory import IommuGroup

    host, k, inv = fake_host(tmp_path, "iommu-off")
    group = IommuGroup(number=99, functions=(inv.gpus[0].primary,))
    res = VfioBinder(k, host.dev_root).bind_group(group)
    assert not res.ok and not res.needs_attention
    assert drivers(k, ["0000:01:00.0"]) == {"0000:01:00.0": "nvidia"}


def test_sysfs_host_port(tmp_path) -> None:
    host, k, inv = fake_host(tmp_path, "shared-rootport")
    port = SysfsHost(k, dev_root=host.dev_root, proc_root=host.proc_root, step_timeout_s=5, inventory=inv)
    bad, good = inv.gpus
    refused = port.bind(bad)
    assert not refused.ok and "mlx5_core" in (refused.error or "")
    assert port.current_drivers(bad) == {"0000:03:00.0": "nvidia", "0000:04:00.0": "mlx5_core"}
    res = port.bind(good)
    assert res.ok and port.current_drivers(good) == {"0000:05:00.0": VFIO_PCI}
    assert port.plan_give_back(good, {"0000:05:00.0": "nvidia"})
    record_interrupts(host.proc_root, "0000:05:00.0", 4242)
    assert port.vfio_interrupts() == {"0000:05:00.0": 4242}
    # several devices in one rewrite (the demo's guests, once per round): the others' lines are kept
    record_interrupts_of(host.proc_root, {"0000:03:00.0": 7, "0000:04:00.0": 1001})
    assert port.vfio_interrupts() == {"0000:05:00.0": 4242, "0000:03:00.0": 7, "0000:04:00.0": 1001}
    record_interrupts_of(host.proc_root, {"0000:05:00.0": 5000})
    record_interrupts_of(host.proc_root, {})  # nothing moved: the file stays as it is
    assert port.vfio_interrupts() == {"0000:05:00.0": 5000, "0000:03:00.0": 7, "0000:04:00.0": 1001}
    assert port.give_back(good, {"0000:05:00.0": "nvidia"}).ok
    assert port.current_drivers(good) == {"0000:05:00.0": "nvidia"}


FAULTS = ("fail_unbind", "fail_override", "fail_bind", "no_rebind")


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(faults=st.lists(st.tuples(st.sampled_from(FAULTS), st.sampled_from(TURING)), max_size=3),
       release_faults=st.lists(st.tuples(st.sampled_from(FAULTS), st.sampled_from(TURING)), max_size=2))
def test_random_faults_never_split_a_group(faults, release_faults) -> None:
    with tempfile.TemporaryDirectory() as d:
        host, k, inv = fake_host(Path(d), "workstation")
        gpu = _turing(inv)
        binder = VfioBinder(k, host.dev_root, step_timeout_s=5)
        for kind, addr in faults:
            k.set_fault(kind, addr)
        res = binder.bind_group(gpu.group)
        now = drivers(k, TURING)
        on_vfio = [a for a, drv in now.items() if drv == VFIO_PCI]
        if res.ok:
            assert on_vfio == TURING
            assert (host.dev_root / "vfio" / str(gpu.iommu_group)).exists()
        else:
            assert on_vfio == []  # nothing left on vfio-pci after a failed bind
            if not res.needs_attention:
                assert now == NATIVE
        assert res.drivers == now
        k.clear_faults()
        if res.ok:
            for kind, addr in release_faults:
                k.set_fault(kind, addr)
            back = binder.release_group(gpu.group, res.original_drivers)
            now = drivers(k, TURING)
            on_vfio = [a for a, drv in now.items() if drv == VFIO_PCI]
            assert on_vfio in ([], TURING)  # never half on vfio-pci
            if back.ok:
                assert now == NATIVE
        assert k.new_id_writes() == []


def test_write_errors_surface_as_host_errors(tmp_path) -> None:
    host, k, _ = fake_host(tmp_path, "workstation")
    with pytest.raises(HostError):
        k.write("bus/pci/drivers_probe", "0000:77:00.0")


def test_clear_faults_disarms_every_armed_fault(tmp_path: Path) -> None:
    _host, k, _inv = fake_host(tmp_path, "workstation")
    k.set_fault("fail_unbind", TURING[0])
    k.set_fault("fail_bind", TURING[1], "EBUSY")
    k.clear_faults()
    assert k._fault("fail_unbind", TURING[0]) is None and k._fault("fail_bind", TURING[1]) is None  # noqa: SLF001


@pytest.mark.parametrize("winner", ["nouveau", VFIO_PCI])
def test_give_back_recovers_when_another_driver_wins_the_probe(tmp_path, winner: str) -> None:
    """On real hosts nouveau can win the rebind over nvidia, or vfio-pci's ids= option grabs the device again: the
    give-back takes the function from that driver and binds the one it had, and says so in its steps."""
    from hostagent.host.fakesysfs import make_driver_dir

    host, k, inv = fake_host(tmp_path, "workstation")
    gpu = _turing(inv)
    binder = VfioBinder(k, host.dev_root, step_timeout_s=5)
    res = binder.bind_group(gpu.group)
    assert res.ok, res.error
    make_driver_dir(host.sys_root, winner)
    k.set_fault("probe_winner", TURING[0], winner)
    seen: list[tuple[str, str]] = []
    back = binder.release_group(gpu.group, res.original_drivers, on_step=lambda s, a: seen.append((s, a)))
    assert back.ok, back.error
    assert drivers(k, TURING) == NATIVE
    assert ("unbind-other", TURING[0]) in seen and ("unbind-other", TURING[1]) not in seen


def test_give_back_to_any_host_driver_names_vfio_taking_it_back(tmp_path) -> None:
    """With no original driver to ask by name ('*'), vfio-pci winning the probe is reported with its likely cause."""
    host, k, inv = fake_host(tmp_path, "workstation")
    gpu = _turing(inv)
    binder = VfioBinder(k, host.dev_root, step_timeout_s=5)
    assert binder.bind_group(gpu.group).ok
    k.set_fault("probe_winner", TURING[0], VFIO_PCI)
    back = binder.release_group(gpu.group, {a: "*" for a in TURING})
    assert not back.ok and back.needs_attention
    assert "vfio-pci took it back on probe" in back.error
