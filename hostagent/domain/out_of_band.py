"""Out-of-band changes: what a GPU function's driver change, removal or return that the agent did not make means.

The kernel announces every driver bind and unbind and every device removal and addition (uevents, see
host.uevents). The agent tells its own apart exactly (host.uevents.OwnChanges); `judge` decides what each of the
others means for an operator, from the event, the drivers read when the agent looks (its IOMMU group's lock held, so
none of its own steps is half done) and who held the GPU:

- a function gone from the bus (`remove`: by hand through sysfs, a surprise removal, a GPU "fallen off the bus") is
  a quarantine, whoever held the GPU, and the lease that held it is marked;
- a driver change of a function that a lease held, when the change came or when the agent looks (an unbind of a
  function a guest uses completes only once QEMU let go of it, and the DEVICE_REMOVED that follows may already have
  ended the lease): the GPU needs attention and the lease is marked (its guest lost, or may lose, the device);
- a free GPU's function now on vfio-pci (and not pinned there) was handed to vfio-pci by hand, perhaps for another
  tool's passthrough: attention, so placement never gives it to a second guest;
- a free GPU's function unbound from its host driver: attention (the host lost it, and a guest would be given a
  device someone is working on);
- a free GPU's function moved between host drivers, or given back from vfio-pci by hand, harms no lease: not a
  finding (the views show the drivers as they are).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

VFIO = "vfio-pci"
CHANGES = ("unbound", "rebound", "vfio-bound", "removed", "returned", "added")  # the metric's label values


@dataclass(frozen=True, slots=True)
class Touch:
    """What the kernel said of one function since the agent last looked, the agent's own changes left out: its
    last action, the driver it had before the first of them (None: none, or not known), and the lease that held the
    GPU when the first driver change came (None: none)."""

    action: str  # add | remove | bind | unbind
    was: str | None = None
    held_by: str | None = None
    driver: str | None = None  # the driver the last bind named


@dataclass(frozen=True, slots=True)
class Finding:
    """One out-of-band change and what it calls for."""

    change: str  # one of CHANGES
    gpu_id: str
    address: str
    mark: str  # "quarantine" | "attention" | "" (recorded only)
    reason: str
    lease_id: str | None = None

    def to_dict(self) -> dict[str, str | None]:
        """JSON form (API, journal detail)."""
        return {"change": self.change, "gpu_id": self.gpu_id, "address": self.address, "mark": self.mark,
                "reason": self.reason, "lease_id": self.lease_id}


def judge(gpu_id: str, touched: Mapping[str, Touch], drivers: Mapping[str, str | None], missing: frozenset[str],
          *, lease_id: str | None = None, pinned: frozenset[str] = frozenset()) -> list[Finding]:
    """The findings for the `touched` functions of one GPU, given its functions' `drivers` now, the addresses
    `missing` from the bus now, and the lease holding the GPU now (`lease_id`, None: free)."""
    out: list[Finding] = []
    for address in sorted(touched):
        touch = touched[address]
        lease = touch.held_by or lease_id
        held = f" while lease {lease} held it" if lease else ""
        now = drivers.get(address)
        if address in missing:
            out.append(Finding("removed", gpu_id, address, "quarantine",
                               f"{address} is gone from the PCI bus (removed through sysfs, or fallen off the bus)"
                               f"{held}; it comes back with a rescan or a reboot, then clear the quarantine", lease))
        elif touch.action == "add":
            out.append(Finding("returned", gpu_id, address, "",
                               f"{address} is back on the PCI bus (driver {now or 'none'})", lease))
        elif lease is not None:
            if touch.action == "unbind":
                change, what = "unbound", f"was unbound from {touch.was or 'its driver'}"
            elif touch.driver == VFIO:
                change, what = "unbound", "was unbound and bound to vfio-pci again"
            else:
                change, what = "rebound", f"was bound to {touch.driver or 'another driver'}"
            now_note = f" (now {'on ' + now if now else 'unbound'})" if now != (
                None if touch.action == "unbind" else touch.driver) else ""
            out.append(Finding(change, gpu_id, address, "attention",
                               f"{address} {what} outside the agent{held}{now_note}", lease))
        elif address in pinned:
            continue
        elif now == VFIO:
            out.append(Finding("vfio-bound", gpu_id, address, "attention",
                               f"{address} was bound to vfio-pci outside the agent (another tool may be passing it "
                               "through); kept out of placement until an operator clears it"))
        elif now is None and touch.was not in (None, VFIO):
            out.append(Finding("unbound", gpu_id, address, "attention",
                               f"{address} was unbound from {touch.was} outside the agent; kept out of placement "
                               "until an operator clears it"))
    return out


__all__ = ["CHANGES", "VFIO", "Finding", "Touch", "judge"]
