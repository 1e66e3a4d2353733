"""libvirt `<hostdev>` XML for PCI passthrough, as frozen values rendered and parsed with lxml.

This module holds no policy beyond the XML's shape: which functions go to which guest slot is decided by
`hostdevs_for_gpu`, a pure function of its arguments. Values live in typed fields and are only turned into
text by lxml, so nothing is ever pasted into XML as a string.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lxml import etree

from hostagent.domain.errors import Conflict, InvalidInput
from hostagent.domain.pci import PciAddress

# libvirt keeps aliases that start with "ua-" (user aliases) instead of naming devices itself; ours also carry
# this prefix so the agent can tell its own hostdevs from ones an operator attached by hand.
ALIAS_PREFIX = "ua-hostagent-"

# Controllers whose bus is a single PCIe link: only slot 0 exists behind them.
_SINGLE_SLOT_MODELS = frozenset({"pcie-root-port", "pcie-switch-downstream-port"})

# A parser that never fetches anything and never expands entities: domain XML is data, not a document to trust.
_PARSER = etree.XMLParser(resolve_entities=False, no_network=True, remove_blank_text=True, huge_tree=False)


@dataclass(frozen=True, slots=True)
class GuestPciAddress:
    """Where a hostdev appears inside the guest (`<address type='pci' .../>` of the device)."""

    domain: int
    bus: int
    slot: int
    function: int
    multifunction: bool = False

    def __post_init__(self) -> None:
        # PciAddress carries the range checks; reuse them rather than repeat them.
        PciAddress(self.domain, self.bus, self.slot, self.function)

    @property
    def pci(self) -> PciAddress:
        """The same address as a plain PciAddress (without the multifunction flag)."""
        return PciAddress(self.domain, self.bus, self.slot, self.function)


@dataclass(frozen=True, slots=True)
class HostdevPci:
    """One `<hostdev mode='subsystem' type='pci'>`: one host PCI function given to a guest."""

    source: PciAddress
    guest: GuestPciAddress | None = None
    alias: str | None = None
    driver_vfio: bool = True
    rom_bar_off: bool = False
    managed: bool = False

    @property
    def ours(self) -> bool:
        """True when this hostdev carries the agent's alias prefix."""
        return self.alias is not None and self.alias.startswith(ALIAS_PREFIX)

    def to_element(self) -> etree._Element:
        """The hostdev as an lxml element."""
        root = etree.Element("hostdev", mode="subsystem", type="pci", managed="yes" if self.managed else "no")
        # Child order follows what libvirt itself writes, so a rendered device reads like libvirt's own XML.
        if self.driver_vfio:
            etree.SubElement(root, "driver", name="vfio")
        source = etree.SubElement(root, "source")
        etree.SubElement(source, "address", _address_attrs(self.source))
        if self.alias is not None:
            etree.SubElement(root, "alias", name=self.alias)
        if self.rom_bar_off:
            etree.SubElement(root, "rom", bar="off")
        if self.guest is not None:
            attrs = {"type": "pci", **_address_attrs(self.guest.pci)}
            if self.guest.multifunction:
                attrs["multifunction"] = "on"
            etree.SubElement(root, "address", attrs)
        return root

    def to_xml(self) -> str:
        """The hostdev as an XML string, ready for virDomainAttachDeviceFlags."""
        return str(etree.tostring(self.to_element(), encoding="unicode"))

    @classmethod
    def from_xml(cls, xml: str | bytes | etree._Element) -> HostdevPci:
        """Parse one PCI `<hostdev>` (string or element); raise InvalidInput if it is not one."""
        el = _parse(xml) if isinstance(xml, (str, bytes)) else xml
        if el.tag != "hostdev" or el.get("mode", "subsystem") != "subsystem" or el.get("type") != "pci":
            raise InvalidInput(f"not a PCI subsystem hostdev: <{el.tag} type={el.get('type')!r}>", field="hostdev")
        src = el.find("source/address")
        if src is None:
            raise InvalidInput("hostdev has no <source><address/></source>", field="hostdev")
        driver = el.find("driver")
        alias = el.find("alias")
        rom = el.find("rom")
        guest_el = el.find("address")
        guest = None
        if guest_el is not None and guest_el.get("type") == "pci":
            guest = GuestPciAddress(
                *_address_ints(guest_el), multifunction=guest_el.get("multifunction") == "on"
            )
        return cls(
            source=PciAddress(*_address_ints(src)),
            guest=guest,
            alias=alias.get("name") if alias is not None else None,
            driver_vfio=driver is not None and driver.get("name") == "vfio",
            rom_bar_off=rom is not None and rom.get("bar") == "off",
            managed=el.get("managed") == "yes",
        )


def alias_for(source: PciAddress) -> str:
    """The agent's user alias for a host function: `ua-hostagent-0000-3b-00-0` (libvirt-safe characters only)."""
    return f"{ALIAS_PREFIX}{source.domain:04x}-{source.bus:02x}-{source.slot:02x}-{source.function:x}"


def hostdevs_for_gpu(
    functions: Sequence[PciAddress],
    guest_bus: int,
    guest_slot: int,
    *,
    rom_bar_off: bool = False,
    driver_vfio: bool = True,
) -> tuple[HostdevPci, ...]:
    """Hostdevs for every function of one GPU, kept together on one guest slot.

    The guest sees one multifunction device: guest function numbers equal the host's when the functions are one
    host device that includes function 0 (drivers expect the GPU at .0 and its audio at .1); otherwise (a group
    spanning devices) they are numbered 0.. in the order given, primary first.
    """
    if not functions:
        raise InvalidInput("a GPU needs at least one PCI function", field="functions")
    if len(set(functions)) != len(functions):
        raise InvalidInput("duplicate PCI function in the list", field="functions")
    if len(functions) > 8:
        raise InvalidInput(f"{len(functions)} functions cannot share one guest slot (at most 8)", field="functions")
    one_device = len({f.device for f in functions}) == 1 and any(f.function == 0 for f in functions)
    ordered = sorted(functions) if one_device else list(functions)
    multi = len(ordered) > 1
    out = []
    for index, src in enumerate(ordered):
        fn = src.function if one_device else index
        guest = GuestPciAddress(0, guest_bus, guest_slot, fn, multifunction=multi and fn == 0)
        out.append(HostdevPci(source=src, guest=guest, alias=alias_for(src), driver_vfio=driver_vfio,
                              rom_bar_off=rom_bar_off))
    return tuple(out)


GUEST_LAYOUTS = ("auto", "multifunction", "per-function")


def guest_slots_needed(layout: str, functions: int) -> int:
    """How many free guest slots a GPU of `functions` functions needs in `layout` (auto: none, libvirt picks)."""
    return 0 if layout == "auto" else 1 if layout == "multifunction" else functions


def hostdevs_for_layout(functions: Sequence[PciAddress], layout: str, guest_bus: int, slots: Sequence[int], *,
                        rom_bar_off: bool = False, driver_vfio: bool = True) -> list[HostdevPci]:
    """Hostdevs for one GPU in a guest layout (host.guest_layout): `auto` leaves the guest addresses to libvirt
    (a hot-pluggable slot each, function 0, which is what libvirt can hot-plug and unplug); `multifunction` puts
    every function on slots[0] (libvirt hot-plugs only function 0 and cannot hot-unplug such a slot: for shut-off
    domains); `per-function` gives each function its own slot of `slots` on `guest_bus`."""
    if layout not in GUEST_LAYOUTS:
        raise InvalidInput(f"unknown guest layout {layout!r}; known: {', '.join(GUEST_LAYOUTS)}", field="guest_layout")
    if layout == "auto":
        return [HostdevPci(source=a, guest=None, alias=alias_for(a), driver_vfio=driver_vfio, rom_bar_off=rom_bar_off)
                for a in functions]
    if layout == "multifunction":
        return list(hostdevs_for_gpu(functions, guest_bus, slots[0], rom_bar_off=rom_bar_off, driver_vfio=driver_vfio))
    out: list[HostdevPci] = []
    for addr, slot in zip(functions, slots, strict=True):
        out.extend(hostdevs_for_gpu([addr], guest_bus, slot, rom_bar_off=rom_bar_off, driver_vfio=driver_vfio))
    return out


def parse_domain_hostdevs(domain_xml: str | bytes) -> tuple[HostdevPci, ...]:
    """Every PCI subsystem hostdev in a domain XML, in document order."""
    root = _parse(domain_xml)
    return tuple(HostdevPci.from_xml(el) for el in root.iterfind("devices/hostdev[@type='pci']"))


def free_guest_slots(domain_xml: str | bytes, bus: int, count: int) -> tuple[int, ...]:
    """The first `count` guest slots on `bus` that no `<address type='pci'>` of the domain uses.

    Behind a PCIe root or downstream port only slot 0 exists; on other buses slot 0 is the host bridge (bus 0)
    or reserved (PCI bridges), so slots 1-31 are offered. Raises Conflict when the bus has too few free slots.
    """
    if count < 0:
        raise InvalidInput("count must be >= 0", field="count")
    root = _parse(domain_xml)
    model = None
    for ctl in root.iterfind("devices/controller[@type='pci']"):
        if _int(ctl.get("index", "0")) == bus:
            model = ctl.get("model")
    if model is None and bus != 0:
        raise InvalidInput(f"the domain has no PCI controller for guest bus {bus}", field="guest_bus")
    candidates = [0] if model in _SINGLE_SLOT_MODELS else list(range(1, 32))
    used = set()
    # Only a device's own <address> (a direct child of the device) is a guest address; a hostdev's
    # <source><address> is a host address and must not count.
    for addr in root.iterfind("devices/*/address[@type='pci']"):
        if _int(addr.get("domain", "0")) == 0 and _int(addr.get("bus", "0")) == bus:
            used.add(_int(addr.get("slot", "0")))
    free = [s for s in candidates if s not in used]
    if len(free) < count:
        raise Conflict(
            f"guest bus {bus} has {len(free)} free slot(s), {count} needed", field="guest_bus", bus=bus,
            free=len(free), needed=count,
        )
    return tuple(free[:count])


def _parse(xml: str | bytes) -> Any:
    # lxml refuses str input that carries an encoding declaration; bytes work for both forms.
    data = xml.encode("utf-8") if isinstance(xml, str) else xml
    try:
        return etree.fromstring(data, _PARSER)
    except etree.XMLSyntaxError as exc:
        raise InvalidInput(f"malformed XML: {exc}", field="xml") from exc


def _int(text: str) -> int:
    """libvirt writes hex as 0x..; it also accepts decimal, so read both."""
    try:
        return int(text, 16) if text.lower().startswith("0x") else int(text, 10)
    except ValueError as exc:
        raise InvalidInput(f"not a number in an address: {text!r}", field="address") from exc


def _address_ints(el: Any) -> tuple[int, int, int, int]:
    return (_int(el.get("domain", "0")), _int(el.get("bus", "0")), _int(el.get("slot", "0")),
            _int(el.get("function", "0")))


def _address_attrs(a: PciAddress) -> dict[str, str]:
    return {"domain": f"0x{a.domain:04x}", "bus": f"0x{a.bus:02x}", "slot": f"0x{a.slot:02x}",
            "function": f"0x{a.function:x}"}
