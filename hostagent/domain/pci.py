"""PCI addresses, parsed once at the boundary into ints."""

from __future__ import annotations

import re
from dataclasses import dataclass

from hostagent.domain.errors import InvalidInput

_ADDR = re.compile(
    r"^(?:(?P<domain>[0-9a-fA-F]{1,4}):)?(?P<bus>[0-9a-fA-F]{1,2}):(?P<slot>[0-9a-fA-F]{1,2})\.(?P<function>[0-7])$"
)


@dataclass(frozen=True, order=True, slots=True)
class PciAddress:
    """A PCI function address (domain:bus:slot.function) as ints."""

    domain: int
    bus: int
    slot: int
    function: int

    def __post_init__(self) -> None:
        if not (0 <= self.domain <= 0xFFFF and 0 <= self.bus <= 0xFF and 0 <= self.slot <= 0x1F and 0 <= self.function <= 7):
            raise InvalidInput(f"PCI address out of range: {self.domain:x}:{self.bus:x}:{self.slot:x}.{self.function:x}", field="address")

    @classmethod
    def parse(cls, text: str) -> PciAddress:
        """Parse `0000:3b:00.0` or `3b:00.0`; raise InvalidInput naming the expected form."""
        m = _ADDR.match(text.strip()) if isinstance(text, str) else None
        if m is None:
            raise InvalidInput(
                f"malformed PCI address {text!r}: expected DDDD:BB:SS.F, e.g. 0000:3b:00.0", field="address"
            )
        return cls(
            int(m["domain"] or "0", 16), int(m["bus"], 16), int(m["slot"], 16), int(m["function"], 10)
        )

    def __str__(self) -> str:
        return f"{self.domain:04x}:{self.bus:02x}:{self.slot:02x}.{self.function:x}"

    @property
    def device(self) -> tuple[int, int, int]:
        """The physical device (all functions share it)."""
        return (self.domain, self.bus, self.slot)

    def with_function(self, function: int) -> PciAddress:
        """The same device's other function."""
        return PciAddress(self.domain, self.bus, self.slot, function)
