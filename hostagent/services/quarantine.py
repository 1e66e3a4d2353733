"""Quarantine: GPUs kept out of placement until an operator looks (a bind, rollback or give-back that could not be
undone, a failed probe). It journals and announces a quarantine (`quarantine_gpu`), marks a GPU for an operator's
attention (`mark_attention`) and clears either (`clear_quarantine`); a GPU that no lease holds is first given back from vfio-pci to its host drivers, and the clear
is refused, the quarantine kept, while a domain has one of its functions attached, while the domains cannot be
listed, or when the give-back fails (`give_back_unleased`, with `stranded_functions`, `attached_anywhere` and
`give_back_to_host`, which the reconciler shares through LeaseManager).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from hostagent.domain.errors import Conflict, HostAgentError, NotFound
from hostagent.domain.inventory import Gpu
from hostagent.services.lease_types import ANY_HOST_DRIVER, LOGGER, VFIO_DRIVER, LeaseCore
from hostagent.services.ports import HostOpResult

log = logging.getLogger(LOGGER)


async def quarantine_gpu(m: LeaseCore, gpu_id: str, reason: str, actor: str) -> None:
    """Keep a GPU out of placement: in memory, in the journal, and to the listeners (as a lease-less event)."""
    m.quarantined[gpu_id] = reason
    await m._run(m.journal.quarantine, gpu_id, reason, actor=actor)
    for listener in m.listeners:
        try:
            listener(None, f"quarantine {gpu_id}: {reason}")  # type: ignore[arg-type]
        except Exception:
            log.exception("listener failed")


async def mark_attention(m: LeaseCore, gpu_id: str, reason: str, actor: str, *, lease_id: str | None = None) -> None:
    """Keep a GPU out of placement until an operator looks (`clear_quarantine` takes the mark away): in memory, and
    an `attention` event in the journal."""
    m.attention[gpu_id] = reason
    await m._run(m.journal.event, "attention", actor=actor, lease_id=lease_id, gpu_id=gpu_id, detail=reason)


async def clear_quarantine(m: LeaseCore, gpu_id: str, *, actor: str) -> None:
    """Operator: put a quarantined GPU, or one marked for attention (a failed grant whose undo the guest never
    confirmed, a GPU found attached to a domain without a lease), back into placement.

    A GPU that no lease holds must not come back on vfio-pci (a hung or failed give-back leaves it there): the
    clear first gives its group back to the host drivers, and refuses, keeping the quarantine or the mark, while a
    domain has one of its functions attached, while the domains cannot be listed to tell, or when the give-back
    fails, and while one of its functions is off the PCI bus (services.out_of_band: back with a rescan first). A
    GPU a live lease holds keeps its functions where they are (the lease gives them back when it ends).
    """
    gpu = m.gpus.get(gpu_id)
    if gpu is None:
        raise NotFound(f"no GPU {gpu_id!r}", field="gpu_id")
    _still_to_clear(m, gpu_id)
    gone = [str(f.address) for f in gpu.functions if str(f.address) in m.missing]
    if gone:
        raise Conflict(f"GPU {gpu_id} is not on the PCI bus ({', '.join(gone)} removed); rescan "
                       "(echo 1 > /sys/bus/pci/rescan) or reboot before clearing it", field="gpu_id")
    if gpu_id not in m.claims:
        await give_back_unleased(m, gpu, actor)
        _still_to_clear(m, gpu_id)  # another clear may have finished while this one gave the GPU back
    if gpu_id in m.quarantined:
        if not await m._run(m.journal.clear_quarantine, gpu_id, actor=actor):
            raise Conflict(f"GPU {gpu_id} is not quarantined", field="gpu_id")
        m.quarantined.pop(gpu_id, None)
    why = m.attention.pop(gpu_id, None)
    if why is not None:
        await m._run(m.journal.event, "attention-cleared", actor=actor, gpu_id=gpu_id, detail=f"was: {why}")
    m._wake_queue.set()


def _still_to_clear(m: LeaseCore, gpu_id: str) -> None:
    if gpu_id not in m.quarantined and gpu_id not in m.attention:
        raise Conflict(f"GPU {gpu_id} is not quarantined, nor waiting for an operator's attention", field="gpu_id")


async def give_back_unleased(m: LeaseCore, gpu: Gpu, actor: str) -> None:
    """Return a GPU no lease holds from vfio-pci to its host drivers, or raise Conflict saying why not."""
    async with m._group_lock(gpu.iommu_group if gpu.iommu_group is not None else -1):
        drivers, on_vfio = await stranded_functions(m, gpu)
        if not on_vfio:
            return
        try:
            where = await attached_anywhere(m)
        except HostAgentError as exc:
            raise Conflict(f"GPU {gpu.id} is on vfio-pci and the domains cannot be listed to tell whether a guest "
                           f"holds it ({exc.message}); quarantine kept", field="id") from exc
        held = sorted({where[a] for a in drivers if a in where})
        if held:
            raise Conflict(f"GPU {gpu.id} is attached to {', '.join(held)} without a lease: detach it there "
                           "first (or stop that VM); the GPU stays out of placement", field="id")
        res = await give_back_to_host(m, gpu, drivers)
        await m._run(m.journal.event, "repair", actor=actor, gpu_id=gpu.id,
                     detail=f"clearing the quarantine: {', '.join(on_vfio)} on vfio-pci without a lease; "
                            + ("gave back to the host drivers" if res.ok else f"give-back failed: {res.error}"))
        if not res.ok:
            raise Conflict(f"GPU {gpu.id} would not return to its host drivers ({res.error}); quarantine kept",
                           field="id")


async def stranded_functions(m: LeaseCore, gpu: Gpu) -> tuple[dict[str, str | None], list[str]]:
    """A GPU's functions with their drivers, and those on vfio-pci that must go back to the host when no lease
    holds the GPU: none when one of its functions is pinned to vfio-pci (policy.pinned)."""
    drivers = await m._run(m.host.current_drivers, gpu)
    if any(a in m.policy.pinned for a in drivers):
        return drivers, []
    return drivers, sorted(a for a, d in drivers.items() if d == VFIO_DRIVER)


async def give_back_to_host(m: LeaseCore, gpu: Gpu, drivers: Mapping[str, str | None]) -> HostOpResult:
    """Give every function of a GPU no lease holds to whatever host driver the kernel probes for it."""
    return await m._run(m.host.give_back, gpu, {a: ANY_HOST_DRIVER for a in drivers}, None)


async def attached_anywhere(m: LeaseCore) -> dict[str, str]:
    """PCI address -> the domain it is attached to, over every domain the hypervisor knows (a domain that
    vanished while listed is skipped); raises the hypervisor's error when the domains cannot be listed."""
    where: dict[str, str] = {}
    for dom in await m.hv.list_domains():
        try:
            for h in await m.hv.attached_hostdevs(dom.uuid):
                where[str(h.source)] = dom.name
        except NotFound:
            continue
    return where
