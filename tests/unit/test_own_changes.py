"""host.uevents: the agent's own driver writes are told from anyone else's by count (issue #19)."""

from __future__ import annotations

from hostagent.host.uevents import OwnChanges, uevent_of


def test_which_writes_send_a_uevent() -> None:
    assert uevent_of("bus/pci/drivers/vfio-pci/unbind") == "unbind"
    assert uevent_of("bus/pci/drivers/nvidia/bind") == "bind"
    assert uevent_of("bus/pci/drivers_probe") == "bind"
    assert uevent_of("bus/pci/devices/0000:01:00.0/driver_override") is None
    assert uevent_of("bus/pci/drivers/vfio-pci/new_id") is None
    assert uevent_of("bus/pci/drivers/a/b/unbind") is None


def test_each_expected_uevent_is_claimed_once_and_a_cancelled_one_never() -> None:
    t = [0.0]
    own = OwnChanges(clock=lambda: t[0])
    own.expect("a", "bind")
    own.expect("a", "bind")
    own.expect("a", "unbind")
    own.cancel("a", "unbind")
    own.cancel("b", "unbind")  # nothing expected: no error
    assert own.claim("a", "unbind") is False
    assert own.claim("a", "bind") is True
    assert own.claim("b", "bind") is False
    assert own.claim("a", "bind") is True
    assert own.claim("a", "bind") is False  # two expected, two claimed: a third is someone else's


def test_an_expectation_nobody_claimed_lapses() -> None:
    t = [0.0]
    own = OwnChanges(clock=lambda: t[0])
    own.expect("a", "bind")
    t[0] = OwnChanges.TTL_S + 1
    own.expect("a", "bind")
    assert own.claim("a", "bind") is True  # the fresh one
    assert own.claim("a", "bind") is False
    own.expect("a", "unbind")
    t[0] += OwnChanges.TTL_S - 1
    assert own.claim("a", "unbind") is True  # not lapsed yet
