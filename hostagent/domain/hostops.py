"""Results of host operations (bind a group to vfio-pci, give it back), as plain values shared by the sysfs
adapter that produces them and the services that read them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class Step:
    """One named host step (unbind, override, probe, read-back, an undo...) and how it went."""

    name: str
    address: str
    ok: bool
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON form."""
        return {"name": self.name, "address": self.address, "ok": self.ok, "error": self.error}


@dataclass(frozen=True, slots=True)
class HostOpResult:
    """Outcome of binding or giving back a whole IOMMU group."""

    ok: bool
    steps: tuple[Step, ...] = ()
    error: str | None = None
    needs_attention: bool = False  # an undo failed or a step hung: the caller quarantines the device
    drivers: dict[str, str | None] = field(default_factory=dict)  # address -> driver after the operation
    original_drivers: dict[str, str | None] = field(default_factory=dict)  # address -> driver before
    stopped_at: str | None = None  # 'step address' where a failure or hang stopped the operation
    refused: bool = False  # refused before any write (host.preflight): the host uses the device; nothing changed
    warnings: tuple[str, ...] = ()  # what the preflight allowed but the operator should know (no reset method)
