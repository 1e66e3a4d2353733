"""A lease whose device left its running domain while nobody watched: attached again, or the lease ends.

The crash matrix holds the agent to "an ACTIVE lease's functions are attached to its domain". A device can leave a
running domain without the agent seeing it: the guest ejects it (its DEVICE_REMOVED lost while the agent was down,
or while libvirt's connection was), or someone detaches it by hand. Found at start (reconcile) or after a reconnect
(the re-read), the agent puts back what is missing; where libvirt refuses, the lease ends and the GPU goes back to
its host driver. Only an unreachable libvirt leaves the lease as it is, to be looked at again.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from lxml import etree

from hostagent.domain.hostdev import parse_domain_hostdevs
from hostagent.domain.errors import HypervisorError
from hostagent.domain.lease import LeaseRequest, LeaseState
from hostagent.services.lease_types import guest_addr
from hostagent.runtime import build_runtime
from hostagent.virt.port import DomainEvent, EventKind
from tests.support.agent import AgentRig, make_rig
from tests.support.waits import until

S = LeaseState


def live_sources(rig: AgentRig, vm: str, *, config: bool = False) -> set[str]:
    """PCI sources in the domain's live XML (or its persistent definition), as the simulator holds it."""
    dom = rig.hv._find(vm)
    el = dom.config if config else dom.live
    assert el is not None
    return {str(h.source) for h in parse_domain_hostdevs(etree.tostring(el, encoding="unicode"))}


async def _lease_then_eject_while_down(tmp_path: Path, *, refuse: bool,
                                       layout: str = "auto") -> tuple[AgentRig, str, list[str]]:
    """A two-function lease (the workstation's 4090 + its audio); the agent stops; the guest ejects one function;
    the agent starts again over the same host and hypervisor (refusing attaches from then on when `refuse`)."""
    rig = make_rig(tmp_path, scenario="workstation-vfio", host={"guest_layout": layout})
    rig.runtime.use_store = False
    await rig.runtime.start()
    lease = await rig.runtime.manager.request(rig.uuids["vm-a"], LeaseRequest(gpus=1, min_memory_gib=20),
                                              actor="test")
    assert lease.state is S.ACTIVE
    functions = list(lease.devices[0].functions)
    assert len(functions) == 2 and live_sources(rig, "vm-a") == set(functions)
    await rig.runtime.stop()
    rig.hv.eject("vm-a", functions[1])  # nobody listens: the DEVICE_REMOVED is lost
    assert live_sources(rig, "vm-a") == {functions[0]}
    if refuse:
        rig.hv.fail_attach_after = rig.hv.attach_count
    rig.runtime = build_runtime(rig.settings, hypervisor=rig.hv)
    rig.runtime.use_store = False
    await rig.runtime.start()
    return rig, lease.id, functions


def guest_addresses(rig: AgentRig, vm: str) -> dict[str, str]:
    """Each hostdev's host source -> its guest PCI address, in the running domain."""
    dom = rig.hv._find(vm)
    assert dom.live is not None
    return {str(h.source): guest_addr(h) for h in parse_domain_hostdevs(etree.tostring(dom.live, encoding="unicode"))}


@pytest.mark.parametrize("layout", ["auto", "per-function"])
async def test_start_reattaches_what_the_running_domain_lost(tmp_path: Path, layout: str) -> None:
    rig, lease_id, functions = await _lease_then_eject_while_down(tmp_path, refuse=False, layout=layout)
    try:
        rt = rig.runtime
        if layout == "per-function":  # the function goes back to the guest slot it had
            had = dict(zip(functions, rt.manager.leases[lease_id].devices[0].guest_addresses))
            assert guest_addresses(rig, "vm-a") == had and len(set(had.values())) == 2, had
        assert rt.manager.leases[lease_id].state is S.ACTIVE
        assert live_sources(rig, "vm-a") == set(functions)  # only the missing function went back in
        assert live_sources(rig, "vm-a", config=True) == set(functions)  # and the definition has each once
        (note,) = [r for r in rt.repairs if r.subject == lease_id]
        assert note.action == "re-attached"
        assert all(rig.sysfs_driver(f) == "vfio-pci" for f in functions)
    finally:
        await rig.runtime.stop()


async def test_start_ends_a_lease_whose_device_cannot_go_back(tmp_path: Path) -> None:
    rig, lease_id, functions = await _lease_then_eject_while_down(tmp_path, refuse=True)
    try:
        rt = rig.runtime
        assert lease_id not in rt.manager.leases
        done = rt.journal.get(lease_id)
        assert done is not None and done.state is S.RELEASED, done
        assert done.end_reason is not None and done.end_reason.startswith(
            "device missing from the domain; re-attach refused"), done.end_reason
        (note,) = [r for r in rt.repairs if r.subject == lease_id]
        assert note.action.startswith("re-attach refused") and note.action.endswith("lease ended")
        # The function still in the guest was detached (acknowledged) before anything went back to the host, and
        # neither is left in the definition, where the next boot would take a GPU the host has back.
        assert live_sources(rig, "vm-a") == set()
        assert live_sources(rig, "vm-a", config=True) == set()
        assert [rig.sysfs_driver(f) for f in functions] == ["nvidia", "snd_hda_intel"]
    finally:
        await rig.runtime.stop()


async def test_reconnect_finds_a_device_the_guest_gave_up_while_away(tmp_path: Path) -> None:
    """libvirt's connection drops; meanwhile the guest ejects one of two leased GPUs (the event is lost). The
    re-read after the reconnect sees it: with attaches refused, that lease ends (its GPU back on nvidia), the other
    lease of the same domain stays ACTIVE with its device."""
    rig = make_rig(tmp_path)
    rt, hv = rig.runtime, rig.hv
    rt.use_store = False
    rt.reread_retry_s = 0.05
    await rt.start()
    try:
        a = await rt.manager.request(rig.uuids["vm-a"], LeaseRequest(gpus=1), actor="test")
        b = await rt.manager.request(rig.uuids["vm-a"], LeaseRequest(gpus=1), actor="test")
        fa, fb = a.devices[0].functions[0], b.devices[0].functions[0]
        listeners = list(hv._subscribers)
        hv._emit(DomainEvent("", "", EventKind.DISCONNECTED))
        hv._subscribers.clear()
        hv.eject("vm-a", fa)
        hv.fail_attach_after = hv.attach_count
        assert rt.manager.leases[a.id].state is S.ACTIVE  # nothing told the agent
        hv._subscribers.extend(listeners)
        hv._emit(DomainEvent("", "", EventKind.RECONNECTED))
        await until(lambda: a.id not in rt.manager.leases, 10.0, "the lease without its device ended")
        done = rt.journal.get(a.id)
        assert done is not None and done.state is S.RELEASED
        assert "re-attach refused" in (done.end_reason or "")
        assert rig.sysfs_driver(fa) == "nvidia"
        assert rt.manager.leases[b.id].state is S.ACTIVE and rig.sysfs_driver(fb) == "vfio-pci"
        assert live_sources(rig, "vm-a") == {fb}
        assert live_sources(rig, "vm-a", config=True) == {fb}
        assert [r.action for r in rt.repairs if r.subject == a.id][0].startswith("re-attach refused")
    finally:
        await rt.stop()


async def test_a_release_whose_definition_cleanup_fails_still_ends_and_says_so(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The guest gave the device up by itself; removing it from the persistent definition then fails: the release
    is not held up by the definition (the device is out of the guest), and the log says what is left to clean."""
    rig = make_rig(tmp_path)
    rt = rig.runtime
    rt.use_store = False
    await rt.start()
    try:
        lease = await rt.manager.request(rig.uuids["vm-a"], LeaseRequest(gpus=1), actor="test")
        fn = lease.devices[0].functions[0]
        rig.hv.eject("vm-a", fn)

        async def refuse(*_: object, **__: object) -> None:
            raise HypervisorError("libvirt: cannot write the definition")

        rig.hv.detach_hostdevs = refuse  # type: ignore[method-assign]
        done = await rt.manager.release(lease.id, actor="test")
        assert done.state is S.RELEASED and rig.sysfs_driver(fn) == "nvidia"
        (line,) = [r for r in caplog.records if "removing its devices from the definition" in r.getMessage()]
        assert line.levelname == "WARNING" and getattr(line, "lease_id", None) == lease.id
        assert line.getMessage() == (f"lease {lease.id}: removing its devices from the definition of vm-a failed: "
                                     "libvirt: cannot write the definition")
    finally:
        await rt.stop()
