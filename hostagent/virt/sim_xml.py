"""The simulated hypervisor's domain XML: a freshly defined guest, and finding, removing and judging the hostdevs
in it (hostagent.virt.sim)."""

from __future__ import annotations

from typing import Any

from lxml import etree

from hostagent.domain.hostdev import HostdevPci


def domain_element(name: str, uuid: str) -> Any:
    """An i440fx-shaped domain: guest bus 0 with slots 1-3 taken, like a freshly defined libvirt guest."""
    root = etree.Element("domain", type="kvm")
    etree.SubElement(root, "name").text = name
    etree.SubElement(root, "uuid").text = uuid
    etree.SubElement(root, "memory", unit="KiB").text = "4194304"
    etree.SubElement(root, "vcpu").text = "4"
    os_el = etree.SubElement(root, "os")
    etree.SubElement(os_el, "type", arch="x86_64", machine="pc").text = "hvm"
    devices = etree.SubElement(root, "devices")
    etree.SubElement(devices, "controller", type="pci", index="0", model="pci-root")
    for tag, attrs, slot, fn in (("controller", {"type": "usb", "index": "0", "model": "piix3-uhci"}, 1, 2),
                                 ("video", {}, 2, 0), ("memballoon", {"model": "virtio"}, 3, 0)):
        el = etree.SubElement(devices, tag, attrs)
        etree.SubElement(el, "address", type="pci", domain="0x0000", bus="0x00", slot=f"0x{slot:02x}",
                         function=f"0x{fn:x}")
    return root


def find_source(el: Any, hd: HostdevPci) -> Any | None:
    for node in el.iterfind("devices/hostdev[@type='pci']"):
        if HostdevPci.from_xml(node).source == hd.source:
            return node
    return None


def remove_source(el: Any, hd: HostdevPci) -> None:
    node = find_source(el, hd)
    if node is not None:
        node.getparent().remove(node)


def contains(el: Any, hd: HostdevPci) -> bool:
    node = find_source(el, hd)
    return node is not None and (hd.guest is None or HostdevPci.from_xml(node).guest == hd.guest)


def multifunction(domain_el: Any, node: Any) -> bool:
    """True when the device's guest slot is multifunction or shared with another function (libvirt's test)."""
    addr = node.find("address[@type='pci']")
    if addr is None:
        return False
    if addr.get("multifunction") == "on":
        return True
    key = (addr.get("domain"), addr.get("bus"), addr.get("slot"))
    return any(other is not addr and (other.get("domain"), other.get("bus"), other.get("slot")) == key
               for other in domain_el.iterfind("devices/*/address[@type='pci']"))


def alias_of(node: Any) -> str:
    a = node.find("alias")
    return a.get("name") if a is not None else ""
