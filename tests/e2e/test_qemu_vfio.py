"""Real vfio-pci: the project's `hostagent vfio bind/release` against Debian's kernel in a QEMU TCG guest.

One boot serves every test here (a boot plus the Python imports cost ~25 s under TCG); tests/e2e/guest_vfio.py
does the work inside the guest and records facts, these tests judge them. The guest has, behind an emulated
Intel IOMMU: one e1000e alone in its group, a two-function e1000e behind a PCIe root port (one group, shaped
like a GPU with its HDMI audio), and an edu + e1000 behind a PCIe-to-PCI bridge (one group of two unrelated
devices: not viable).
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.support import qemu

pytestmark = [pytest.mark.qemu, pytest.mark.timeout(420)]

SCRIPT = """
set -e
"$PYTHON" "$REPO/tests/e2e/guest_vfio.py" {single} {pair} {shared}
"""


@pytest.fixture(scope="module")
def guest() -> dict[str, Any]:
    """Boot once, run every scenario, return the facts the guest recorded."""
    result = qemu.boot_guest(
        SCRIPT.format(single=qemu.NIC_ADDR, pair=qemu.PAIR_ADDRS[0], shared=qemu.SHARED_ADDRS[0]),
        devices=qemu.NIC_DEVICES + qemu.PAIR_DEVICES + qemu.SHARED_DEVICES,
        preload_modules=("e1000e", "e1000"),  # the host drivers (no udev in the guest to load them)
        memory_mib=1024, timeout_s=300,
    )
    result.check()
    facts: dict[str, Any] = result.json("vfio.json")
    print(f"qemu vfio guest: wall {result.wall_s:.1f} s, scenarios {facts['seconds']} s, kernel {facts['kernel']}")
    facts["_explain"] = result.explain()
    return facts


def _assert_cycle(rec: dict[str, Any], members: tuple[str, ...], why: str) -> None:
    """Bound, usable through /dev/vfio, given back to e1000e with the override cleared."""
    for m in members:
        assert rec["before"][m]["driver"] == "e1000e", f"{m} did not start on e1000e\n{why}"
    bind = rec["bind"]
    assert bind["rc"] == 0, f"bind failed: {bind['stderr']}{bind['stdout']}\n{why}"
    assert sorted(bind["json"]["drivers"]) == sorted(members), "bind must cover exactly the group's functions"
    group = bind["json"]["group"]
    assert {rec["before"][m]["group"] for m in members} == {group}
    for m in members:
        # sysfs read independently of the binder's own read-back
        assert rec["after_bind"][m]["driver"] == "vfio-pci", f"{m} not on vfio-pci after bind\n{why}"
        assert rec["after_bind"][m]["override"] == "vfio-pci"
    assert rec["node_after_bind"], f"/dev/vfio/{group} missing after bind"

    opened = rec["open"]
    assert "error" not in opened, f"using /dev/vfio/{group} failed: {opened.get('error')}\n{why}"
    assert opened["viable"] and opened["container_set"] and opened["type1_supported"]
    assert sorted(opened["devices"]) == sorted(members)
    for m in members:
        dev = opened["devices"][m]
        assert dev["pci"] and dev["regions"] >= 7, f"{m}: device fd info looks wrong: {dev}"

    release = rec["release"]
    assert release["rc"] == 0, f"release failed: {release['stderr']}{release['stdout']}\n{why}"
    for m in members:
        after = rec["after_release"][m]
        assert after["driver"] == "e1000e", f"{m} did not return to e1000e: {after}\n{why}"
        assert after["override"] is None, f"{m} kept driver_override={after['override']}"
        assert after["net"], f"{m}: e1000e is bound but registered no network interface"
    assert not rec["node_after_release"], f"/dev/vfio/{group} still exists after give-back"
    # Nothing outside the group moved.
    others = {a: s["driver"] for a, s in rec["before"].items() if a not in members}
    assert {a: rec["after_release"][a]["driver"] for a in others} == others


def test_single_function_group_binds_opens_and_returns_to_e1000e(guest: dict[str, Any]) -> None:
    """A one-function group: vfio-pci, a working device fd, then e1000e again."""
    assert guest["kernel"] == qemu.guest_image().release
    _assert_cycle(guest["single"], (qemu.NIC_ADDR,), guest["_explain"])


def test_two_function_group_moves_together(guest: dict[str, Any]) -> None:
    """Naming one function of the root-port pair binds and gives back both (the group is the unit)."""
    rec = guest["pair"]
    assert rec["address"] == qemu.PAIR_ADDRS[0]
    _assert_cycle(rec, qemu.PAIR_ADDRS, guest["_explain"])


def test_malformed_address_changes_nothing(guest: dict[str, Any]) -> None:
    """A malformed PCI address is refused with the field named, and no driver or override changes."""
    rec = guest["malformed"]
    assert rec["rc"] != 0
    assert "address" in rec["stderr"], rec["stderr"]
    assert rec["unchanged"]


def test_absent_device_changes_nothing(guest: dict[str, Any]) -> None:
    """A well-formed address with no device behind it is NotFound; nothing changes."""
    rec = guest["absent"]
    assert rec["rc"] != 0
    assert "no PCI device at 0000:00:1e.0" in rec["stderr"], rec["stderr"]
    assert rec["unchanged"]


def test_non_viable_group_is_refused_and_changes_nothing(guest: dict[str, Any]) -> None:
    """edu shares its group with an unrelated e1000: binding it would take the NIC from the host, so it is refused."""
    rec = guest["nonviable"]
    edu, nic = qemu.SHARED_ADDRS
    assert rec["before"][edu]["group"] == rec["before"][nic]["group"], "the emulated bridge should share one group"
    assert rec["before"][nic]["driver"] == "e1000"
    assert rec["rc"] != 0
    assert "not viable" in rec["stderr"], rec["stderr"]
    assert rec["unchanged"]
