"""Random sequences of grant / release with faults at every layer, over the fake kernel + simulated hypervisor.

Hypothesis draws a sequence of operations: leases of 1-2 GPUs for several VMs, releases, kernel faults armed on a
function (unbind, driver_override, probe, rebind refused), an attach that fails part-way through a group, guests
that refuse a detach (and later acknowledge it). After every operation the invariants of the passthrough path hold:

- no IOMMU group is split across drivers (all of a GPU's functions on vfio-pci, or none);
- a GPU on vfio-pci is held by a live lease or recorded for an operator (quarantine or attention), never stranded;
- a function attached to a domain is on vfio-pci (nothing is given back before DEVICE_REMOVED);
- an ACTIVE lease's functions are on vfio-pci and attached to its own domain; no GPU is claimed twice.
"""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lxml import etree

from hostagent.domain.errors import HostAgentError
from hostagent.domain.hostdev import parse_domain_hostdevs
from hostagent.domain.lease import LeaseState, parse_lease_request
from hostagent.host.fakekernel import FAULT_KINDS, FakeKernel
from tests.support.agent import AgentRig, make_rig

VFIO = "vfio-pci"
S = LeaseState
VM_NAMES = ("vm-a", "vm-b", "vm-c")
# A hang costs a step timeout (tested alone); the agent never resets a function itself (vfio-pci does, on open).
KERNEL_FAULTS = tuple(k for k in FAULT_KINDS if k not in ("hang_unbind", "fail_reset"))

vm = st.integers(0, len(VM_NAMES) - 1)
gpu = st.integers(0, 7)
OPS = st.one_of(
    st.tuples(st.just("grant"), vm, st.integers(1, 2), st.booleans()),
    st.tuples(st.just("release"), st.integers(0, 7), st.booleans()),  # True: its guest refuses the detach
    st.tuples(st.just("fault"), st.sampled_from(KERNEL_FAULTS), gpu, st.integers(0, 3)),
    st.tuples(st.just("clear-faults")),
    st.tuples(st.just("fail-next-attach"), st.integers(1, 2)),
    st.tuples(st.just("acknowledge"), vm),
)


def check_invariants(rig: AgentRig, where: str) -> None:
    m = rig.runtime.manager
    attached: dict[str, str] = {}  # function -> domain uuid
    for dom in rig.hv.domains_sync():
        xml = etree.tostring(rig.hv._find(dom.uuid).current())  # noqa: SLF001 - the simulator's own view, now
        for hd in parse_domain_hostdevs(xml):
            attached[str(hd.source)] = dom.uuid
    for g in m.gpus.values():
        fns = [str(f.address) for f in g.functions]
        drivers = {a: rig.sysfs_driver(a) for a in fns}
        on_vfio = [a for a in fns if drivers[a] == VFIO]
        assert on_vfio in ([], fns), f"{where}: group of {g.id} split across drivers: {drivers}"
        if on_vfio:
            held = m.lease_of(g.id) is not None
            assert held or g.id in m.quarantined or g.id in m.attention, \
                f"{where}: {g.id} on vfio-pci without a lease, a quarantine or an attention record"
        for a in fns:
            if a in attached:
                assert drivers[a] == VFIO, f"{where}: {a} is attached to a domain but on {drivers[a]}"
    claimed: dict[str, str] = {}
    for lease in m.leases.values():
        for gid in lease.gpu_ids if lease.state.holds_devices else ():
            assert gid not in claimed, f"{where}: {gid} claimed by {claimed[gid]} and {lease.id}"
            claimed[gid] = lease.id
        if lease.state is S.ACTIVE:
            for dev in lease.devices:
                for a in dev.functions:
                    assert rig.sysfs_driver(a) == VFIO, f"{where}: ACTIVE {lease.id} holds {a} off vfio-pci"
                    assert attached.get(a) == lease.domain_uuid, f"{where}: ACTIVE {lease.id}: {a} not attached"


async def play(rig: AgentRig, ops: list[tuple[Any, ...]]) -> None:
    m = rig.runtime.manager
    kernel = FakeKernel(rig.tree.sys_root)  # faults live in files under the tree: the agent's kernel sees them
    await rig.runtime.start()
    try:
        check_invariants(rig, "start")
        for i, op in enumerate(ops):
            where = f"after op {i} {op}"
            kind = op[0]
            if kind == "grant":
                request = parse_lease_request({"gpus": op[2], "accept_partial": op[3], "task_type": "training"},
                                              now=rig.runtime.clock(), max_duration_s=86400)
                try:
                    await m.request(rig.uuids[VM_NAMES[op[1]]], request, actor="test")
                except HostAgentError:
                    pass  # refused, or failed and rolled back: the invariants say whether cleanly
            elif kind == "release":
                live = sorted(m.leases)
                if live:
                    lease_id = live[op[1] % len(live)]
                    if op[2]:
                        rig.hv.set_refuse_detach(m.leases[lease_id].domain_uuid)
                    try:
                        await m.release(lease_id, actor="test")
                    except HostAgentError:
                        pass
            elif kind == "fault":
                g = sorted(m.gpus.values(), key=lambda x: x.id)[op[2]]
                fn = g.functions[op[3] % len(g.functions)]
                kernel.set_fault(op[1], str(fn.address))
            elif kind == "clear-faults":
                kernel.clear_faults()
            elif kind == "fail-next-attach":
                rig.hv.fail_attach_after = rig.hv.attach_count + op[1]
            elif kind == "acknowledge":
                rig.hv.acknowledge_detaches(VM_NAMES[op[1]])
                await asyncio.sleep(0.05)  # DEVICE_REMOVED reaches the agent, which finishes the release
            check_invariants(rig, where)
        # Wind down: guests let go, faults clear, everything is released; every GPU ends in a known state.
        rig.hv.fail_attach_after = None
        kernel.clear_faults()
        for name in VM_NAMES:
            rig.hv.acknowledge_detaches(name)
        await asyncio.sleep(0.05)
        for lease_id in sorted(m.leases):
            try:
                await m.release(lease_id, actor="test")
            except HostAgentError:
                pass
        check_invariants(rig, "end")
        assert not [x for x in m.leases.values() if x.state.holds_devices and x.state is not S.DETACH_PENDING]
    finally:
        await rig.runtime.stop()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(OPS, min_size=4, max_size=14))
def test_random_fault_sequences_keep_every_gpu_in_a_known_state(ops: list[tuple[Any, ...]]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        rig = make_rig(Path(tmp), vms=VM_NAMES, libvirt={"detach_timeout_s": 0.2})
        asyncio.run(play(rig, ops))
