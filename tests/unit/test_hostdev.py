"""Hostdev XML model: one pinned XML string per shape, round trips, XML safety (also of the simulator's domain XML),
guest slot choice."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from lxml import etree

from hostagent.domain.errors import Conflict, HypervisorError, InvalidInput
from hostagent.domain.hostdev import (
    GuestPciAddress,
    HostdevPci,
    alias_for,
    free_guest_slots,
    hostdevs_for_gpu,
    parse_domain_hostdevs,
)
from hostagent.domain.pci import PciAddress
from hostagent.virt.sim import SimulatedHypervisor

A = PciAddress.parse


def _xml(*parts: str) -> str:
    return "".join(parts)


def _hd(src: str, fn: int, mf: bool = False, *, drv: bool = True, rom: bool = False, bus: int = 0, slot: int = 5) -> str:
    s = A(src)
    return _xml(
        '<hostdev mode="subsystem" type="pci" managed="no">',
        '<driver name="vfio"/>' if drv else "",
        f'<source><address domain="0x{s.domain:04x}" bus="0x{s.bus:02x}" slot="0x{s.slot:02x}" function="0x{s.function:x}"/></source>',
        f'<alias name="ua-hostagent-{s.domain:04x}-{s.bus:02x}-{s.slot:02x}-{s.function:x}"/>',
        '<rom bar="off"/>' if rom else "",
        f'<address type="pci" domain="0x0000" bus="0x{bus:02x}" slot="0x{slot:02x}" function="0x{fn:x}"',
        ' multifunction="on"/>' if mf else "/>",
        "</hostdev>",
    )


SINGLE = (
    '<hostdev mode="subsystem" type="pci" managed="no"><driver name="vfio"/>'
    '<source><address domain="0x0000" bus="0x3b" slot="0x00" function="0x0"/></source>'
    '<alias name="ua-hostagent-0000-3b-00-0"/>'
    '<address type="pci" domain="0x0000" bus="0x00" slot="0x05" function="0x0"/></hostdev>'
)


def test_single_function_renders_exactly() -> None:
    (hd,) = hostdevs_for_gpu([A("0000:3b:00.0")], 0, 5)
    assert hd.to_xml() == SINGLE
    assert HostdevPci.from_xml(SINGLE) == hd


def test_gpu_and_audio_share_one_multifunction_slot() -> None:
    hds = hostdevs_for_gpu([A("0000:3b:00.1"), A("0000:3b:00.0")], 0, 7)
    assert [h.to_xml() for h in hds] == [
        _hd("0000:3b:00.0", 0, True, slot=7),
        _hd("0000:3b:00.1", 1, slot=7),
    ]
    assert [HostdevPci.from_xml(h.to_xml()) for h in hds] == list(hds)


def test_four_functions_gpu_audio_usb_ucsi() -> None:
    funcs = [A(f"0000:af:00.{i}") for i in range(4)]
    hds = hostdevs_for_gpu(funcs, 1, 0, rom_bar_off=True)
    assert [h.to_xml() for h in hds] == [
        _hd("0000:af:00.0", 0, True, rom=True, bus=1, slot=0),
        _hd("0000:af:00.1", 1, rom=True, bus=1, slot=0),
        _hd("0000:af:00.2", 2, rom=True, bus=1, slot=0),
        _hd("0000:af:00.3", 3, rom=True, bus=1, slot=0),
    ]
    assert tuple(HostdevPci.from_xml(h.to_xml()) for h in hds) == hds


@pytest.mark.parametrize("drv,rom", [(True, True), (False, False), (False, True), (True, False)])
def test_driver_and_rom_flags(drv: bool, rom: bool) -> None:
    (hd,) = hostdevs_for_gpu([A("0000:3b:00.0")], 0, 5, rom_bar_off=rom, driver_vfio=drv)
    assert hd.to_xml() == _hd("0000:3b:00.0", 0, drv=drv, rom=rom)
    back = HostdevPci.from_xml(hd.to_xml())
    assert back == hd and back.driver_vfio is drv and back.rom_bar_off is rom


def test_group_spanning_devices_is_numbered_in_order() -> None:
    hds = hostdevs_for_gpu([A("0000:3b:00.0"), A("0000:3c:00.0")], 0, 9)
    assert [(h.source, h.guest) for h in hds] == [
        (A("0000:3b:00.0"), GuestPciAddress(0, 0, 9, 0, True)),
        (A("0000:3c:00.0"), GuestPciAddress(0, 0, 9, 1, False)),
    ]


def test_bad_function_lists_are_refused() -> None:
    with pytest.raises(InvalidInput):
        hostdevs_for_gpu([], 0, 1)
    with pytest.raises(InvalidInput) as err:
        hostdevs_for_gpu([A("0000:3b:00.0"), A("0000:3b:00.0")], 0, 1)
    assert (err.value.field, err.value.message) == ("functions", "duplicate PCI function in the list")
    with pytest.raises(InvalidInput):
        hostdevs_for_gpu([A(f"0000:{b:02x}:00.0") for b in range(9)], 0, 1)
    with pytest.raises(InvalidInput):
        hostdevs_for_gpu([A("0000:3b:00.0")], 0, 32)


@pytest.mark.parametrize("alias", ['q"uote\'s', "<tag>&amp;", "ünïcødé ✓ 漢字", "ua-]]>", "tab\tand  spaces",
                                   "&#x41;&amp;", "&#65;&lt;&quot;"])
def test_string_fields_round_trip_exactly(alias: str) -> None:
    hd = HostdevPci(source=A("0000:3b:00.0"), alias=alias)
    xml = hd.to_xml()
    assert HostdevPci.from_xml(xml).alias == alias
    assert HostdevPci.from_xml(xml.encode()).alias == alias
    dom = f"<domain><devices>{xml}</devices></domain>"
    assert parse_domain_hostdevs(dom) == (hd,)


def test_character_reference_text_stays_literal() -> None:
    # Text that looks like a character reference is text: written escaped, read back as written, never as "A&".
    hd = HostdevPci(source=A("0000:3b:00.0"), alias="&#x41;&amp;")
    xml = hd.to_xml()
    assert 'name="&amp;#x41;&amp;amp;"' in xml
    assert HostdevPci.from_xml(xml).alias == "&#x41;&amp;"
    assert parse_domain_hostdevs(f"<domain><devices>{xml}</devices></domain>")[0].alias == "&#x41;&amp;"
    # Written by someone else as a real reference, it is a character: decoded once, exactly once.
    raw = xml.replace("&amp;#x41;&amp;amp;", "&#x41;&amp;amp;")
    assert HostdevPci.from_xml(raw).alias == "A&amp;"


@given(st.text(alphabet=st.characters(blacklist_categories=("Cs", "Cc")), max_size=40))
def test_any_printable_alias_round_trips(alias: str) -> None:
    hd = HostdevPci(source=A("0000:01:02.3"), alias=alias)
    assert HostdevPci.from_xml(hd.to_xml()) == hd


def test_alias_for_uses_only_libvirt_safe_characters() -> None:
    alias = alias_for(A("0001:af:1f.7"))
    assert alias == "ua-hostagent-0001-af-1f-7"
    assert set(alias) <= set("abcdefghijklmnopqrstuvwxyz0123456789-")


DOMAIN = """<?xml version='1.0' encoding='UTF-8'?>
<domain type='kvm'>
  <name>vm1</name>
  <devices>
    <controller type='pci' index='0' model='pcie-root'/>
    <controller type='pci' index='1' model='pcie-root-port'>
      <address type='pci' domain='0x0000' bus='0x00' slot='0x01' function='0x0' multifunction='on'/>
    </controller>
    <controller type='pci' index='2' model='pcie-root-port'>
      <address type='pci' domain='0x0000' bus='0x00' slot='0x01' function='0x1'/>
    </controller>
    <controller type='sata' index='0'>
      <address type='pci' domain='0x0000' bus='0x00' slot='0x1f' function='0x2'/>
    </controller>
    <interface type='network'>
      <address type='pci' domain='0x0000' bus='0x00' slot='0x02' function='0x0'/>
    </interface>
    <hostdev mode='subsystem' type='pci' managed='no'>
      <source><address domain='0x0000' bus='0x00' slot='0x03' function='0x0'/></source>
      <alias name='hostdev0'/>
      <address type='pci' domain='0x0000' bus='0x01' slot='0x00' function='0x0'/>
    </hostdev>
    <hostdev mode='subsystem' type='usb'>
      <source><vendor id='0x1234'/><product id='0xbeef'/></source>
    </hostdev>
    <hostdev mode='subsystem' type='pci' managed='yes'>
      <driver name='vfio'/>
      <source><address domain='0x0000' bus='0x3b' slot='0x00' function='0x1'/></source>
      <alias name='ua-hostagent-0000-3b-00-1'/>
      <rom bar='off'/>
      <address type='pci' domain='0x0000' bus='0x00' slot='0x04' function='0x1'/>
    </hostdev>
  </devices>
</domain>
"""


def test_parse_domain_hostdevs_finds_only_pci_hostdevs() -> None:
    hds = parse_domain_hostdevs(DOMAIN)
    assert hds == (
        HostdevPci(A("0000:00:03.0"), GuestPciAddress(0, 1, 0, 0), alias="hostdev0", driver_vfio=False),
        HostdevPci(A("0000:3b:00.1"), GuestPciAddress(0, 0, 4, 1), alias="ua-hostagent-0000-3b-00-1",
                   rom_bar_off=True, managed=True),
    )
    assert [h.ours for h in hds] == [False, True]


def test_free_guest_slots_skips_used_and_ignores_host_source_addresses() -> None:
    # Bus 0 uses slots 1, 2, 4 and 0x1f; the first hostdev's *source* 00:03.0 is a host address and must not count.
    assert free_guest_slots(DOMAIN, 0, 3) == (3, 5, 6)
    # A root port bus has one slot; bus 1's is taken by a hostdev, bus 2's is free.
    assert free_guest_slots(DOMAIN, 2, 1) == (0,)
    with pytest.raises(Conflict):
        free_guest_slots(DOMAIN, 1, 1)
    with pytest.raises(Conflict):
        free_guest_slots(DOMAIN, 0, 28)
    with pytest.raises(InvalidInput):
        free_guest_slots(DOMAIN, 9, 1)


def test_from_xml_refuses_what_is_not_a_pci_hostdev() -> None:
    with pytest.raises(InvalidInput):
        HostdevPci.from_xml("<hostdev mode='subsystem' type='usb'/>")
    with pytest.raises(InvalidInput):
        HostdevPci.from_xml("<hostdev mode='subsystem' type='pci'/>")
    with pytest.raises(InvalidInput):
        HostdevPci.from_xml("<hostdev")
    with pytest.raises(InvalidInput):
        HostdevPci.from_xml("<hostdev type='pci'><source><address bus='zz'/></source></hostdev>")


def test_external_entities_are_refused_not_expanded() -> None:
    evil = (
        '<!DOCTYPE d [<!ENTITY x SYSTEM "file:///etc/passwd">]>'
        '<domain><devices><hostdev mode="subsystem" type="pci"><source><address bus="0x3b"/></source>'
        '<alias name="&x;"/></hostdev></devices></domain>'
    )
    with pytest.raises(InvalidInput, match="external entity"):
        parse_domain_hostdevs(evil)


# A domain whose free-text parts hold everything XML must escape: quotes, angle brackets, predefined entities,
# character references (real ones, which decode, and escaped ones, which stay text) and non-ASCII. The description
# even holds, as text, something shaped like a guest address on slot 5: only elements may count.
ODD_DOMAIN = """<?xml version='1.0' encoding='UTF-8'?>
<domain type='kvm' xmlns:app='http://example.org/app'>
  <name>vm &quot;q&quot; &apos;a&apos; &lt;b&gt; &amp; &#233;t&#xE9; ✓ 漢字</name>
  <uuid>0b5c5c1e-7d4b-4a1f-9d3e-2f6a8c1b0e11</uuid>
  <description>He said "hi" &amp; it's &lt;not&gt; a tag: &lt;address type='pci' bus='0x00' slot='0x05'/&gt;; \
&amp;#x41; stays, &#x263A; decodes; ünïcødé<![CDATA[ <raw> & "cdata" ]]></description>
  <metadata>
    <app:info note="a &quot;b&quot; 'c' &lt;d&gt; &amp;e &#x41;">ünï &lt;x&gt; &amp;amp;</app:info>
  </metadata>
  <devices>
    <controller type='pci' index='0' model='pci-root'/>
    <hostdev mode='subsystem' type='pci' managed='no'>
      <driver name='vfio'/>
      <source><address domain='0x0000' bus='0x3b' slot='0x00' function='0x0'/></source>
      <alias name='ua-&quot;&apos;&lt;&gt;&amp;#x41;-é'/>
      <address type='pci' domain='0x0000' bus='0x00' slot='0x04' function='0x0'/>
    </hostdev>
  </devices>
</domain>
"""
ODD_NAME = "vm \"q\" 'a' <b> & été ✓ 漢字"
ODD_DESCRIPTION = ("He said \"hi\" & it's <not> a tag: <address type='pci' bus='0x00' slot='0x05'/>; "
                   "&#x41; stays, \u263a decodes; ünïcødé <raw> & \"cdata\" ")
ODD_NOTE = "a \"b\" 'c' <d> &e A"
ODD_INFO = "ünï <x> &amp;"
ODD_ALIAS = "ua-\"'<>&#x41;-é"
ODD_HOSTDEV = HostdevPci(A("0000:3b:00.0"), GuestPciAddress(0, 0, 4, 0), alias=ODD_ALIAS)


def _odd_fields(xml: str | bytes) -> tuple[str, str, str, str]:
    """name, description, metadata note and text, as an XML reader sees them."""
    root = etree.fromstring(xml.encode() if isinstance(xml, str) else xml,
                            etree.XMLParser(resolve_entities=False, no_network=True))
    info = root.find("metadata/{http://example.org/app}info")
    return root.findtext("name"), root.findtext("description"), info.get("note"), info.text


def test_domain_free_text_parses_to_exactly_the_intended_values() -> None:
    assert _odd_fields(ODD_DOMAIN) == (ODD_NAME, ODD_DESCRIPTION, ODD_NOTE, ODD_INFO)
    for xml in (ODD_DOMAIN, ODD_DOMAIN.encode()):
        assert parse_domain_hostdevs(xml) == (ODD_HOSTDEV,)
    # Slot 4 is a hostdev's; slot 5 appears only inside the description's text, so it is free.
    assert free_guest_slots(ODD_DOMAIN, 0, 2) == (1, 2)
    assert 5 in free_guest_slots(ODD_DOMAIN, 0, 5)


async def test_simulator_keeps_odd_domain_text_and_aliases_exact(tmp_path: Path) -> None:
    uuid = "0b5c5c1e-7d4b-4a1f-9d3e-2f6a8c1b0e11"
    state = tmp_path / "hv.json"
    state.write_text(json.dumps({"version": 1, "attach_count": 0, "settings": {
        "attach_latency_s": 0, "detach_ack_delay_s": 0, "refuse_detach": [], "fail_attach_after": None},
        "domains": [{"uuid": uuid, "name": ODD_NAME, "state": "running", "config": ODD_DOMAIN, "live": ODD_DOMAIN,
                     "pending": {}}]}))
    hv = SimulatedHypervisor.load(state)
    assert (await hv.get_domain(ODD_NAME)).uuid == uuid
    assert _odd_fields(await hv.domain_xml(uuid)) == (ODD_NAME, ODD_DESCRIPTION, ODD_NOTE, ODD_INFO)
    assert await hv.attached_hostdevs(uuid) == (ODD_HOSTDEV,)
    # An alias holding both quote characters and reference-shaped text: attached as is, and a second device with
    # the same alias is refused as libvirt refuses it (the check once built an XPath literal, which cannot hold both).
    both = "it's \"both\" &#x41;&amp;"
    await hv.attach_hostdevs(uuid, [HostdevPci(A("0000:3c:00.0"), alias=both)])
    with pytest.raises(HypervisorError, match="non unique alias"):
        await hv.attach_hostdevs(uuid, [HostdevPci(A("0000:3d:00.0"), alias=both)])
    with pytest.raises(HypervisorError, match="non unique alias"):
        await hv.attach_hostdevs(uuid, [HostdevPci(A("0000:3d:00.0"), alias=ODD_ALIAS)])
    # Through the state file and back (a restarted agent's view): still exact.
    await hv.close()
    again = SimulatedHypervisor.load(state)
    for live in (True, False):
        assert _odd_fields(await again.domain_xml(uuid, live=live)) == (ODD_NAME, ODD_DESCRIPTION, ODD_NOTE,
                                                                         ODD_INFO)
    assert [(h.source, h.alias) for h in await again.attached_hostdevs(uuid)] == [
        (A("0000:3b:00.0"), ODD_ALIAS), (A("0000:3c:00.0"), both)]
