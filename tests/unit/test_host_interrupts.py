"""parse_interrupts on real-format /proc/interrupts text."""

from __future__ import annotations

from hostagent.domain.pci import PciAddress
from hostagent.host.interrupts import parse_interrupts

SAMPLE = """\
            CPU0       CPU1       CPU2       CPU3
   0:         44          0          0          0   IO-APIC   2-edge      timer
   8:          0          0          1          0   IO-APIC   8-edge      rtc0
  24:          0          0       1873          0   PCI-MSI 1048576-edge      nvme0q0
 145:         10         20         30         40  IR-PCI-MSIX-0000:3b:00.0    0-edge      vfio-msix[0](0000:3b:00.0)
 146:          1          0          0       1000  IR-PCI-MSIX-0000:3b:00.0    1-edge      vfio-msix[1](0000:3b:00.0)
 147:          5          5          5          5  IR-PCI-MSI-0000:3b:00.1    0-edge      vfio-msi[0](0000:3b:00.1)
 148:          0          7          0          0  IR-IO-APIC   16-fasteoi   vfio-intx(0000:af:00.0)
 149:     999999          0          0          0  IR-PCI-MSIX-0000:5e:00.0    0-edge      mlx5_comp0@pci:0000:5e:00.0
 NMI:         12         12         12         12   Non-maskable interrupts
 LOC:    1234567    1234567    1234567    1234567   Local timer interrupts
 ERR:          0
 MIS:          0
"""


def test_sums_vfio_lines_per_device_across_cpus() -> None:
    counts = parse_interrupts(SAMPLE)
    assert counts == {
        PciAddress.parse("0000:3b:00.0"): 100 + 1001,
        PciAddress.parse("0000:3b:00.1"): 20,
        PciAddress.parse("0000:af:00.0"): 7,
    }


def test_other_devices_and_summary_lines_are_ignored() -> None:
    counts = parse_interrupts(SAMPLE)
    assert PciAddress.parse("0000:5e:00.0") not in counts
    assert parse_interrupts("") == {}
    assert parse_interrupts(SAMPLE.splitlines()[0] + "\n ERR:          0\n") == {}
