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


def test_each_expected_uevent_is_claimed_once_and_a_failed_write_claims_none() -> None:
    t = [0.0]
    own = OwnChanges(clock=lambda: t[0])
    b1, b2 = own.expect("a", "bind"), own.expect("a", "bind")
    u = own.expect("a", "unbind")
    own.done(u, sent=False)
    assert own.claim("a", "unbind") is False
    assert own.claim("a", "bind", driver="vfio-pci") is True
    assert own.claim("b", "bind") is False
    own.done(b1, sent=True)
    own.done(b2, sent=True)
    assert own.claim("a", "bind") is True
    assert own.claim("a", "bind") is False  # two expected, two claimed: a third is someone else's
    assert own._pending == {}  # nothing left behind


def test_a_uevent_claimed_for_a_write_that_then_failed_goes_back_as_someone_elses() -> None:
    """Another writer's unbind completes while the agent's own unbind waits on the device; the agent's then finds
    nothing to unbind (ENODEV): the uevent claimed for it was the other writer's."""
    t = [0.0]
    own = OwnChanges(clock=lambda: t[0])
    back: list[tuple[object, ...]] = []
    own.on_misclaimed = lambda *args: back.append(args)
    e = own.expect("a", "unbind")
    t[0] = 1.0
    assert own.claim("a", "unbind", at=1.0) is True
    own.done(e, sent=False)
    assert back == [("a", "unbind", None, 1.0)]
    ok = own.expect("a", "bind")
    assert own.claim("a", "bind", at=2.0, driver="nvidia") is True
    own.done(ok, sent=True)
    assert len(back) == 1 and own._pending == {}


def test_a_uevent_sent_before_the_expectation_is_not_the_agents() -> None:
    t = [5.0]
    own = OwnChanges(clock=lambda: t[0])
    own.expect("a", "unbind")
    assert own.claim("a", "unbind", at=4.9) is False
    assert own.claim("a", "unbind", at=5.0) is True


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
