"""pci.ids parsing: vendors, devices scoped to their vendor, subsystems, classes."""

from __future__ import annotations

from hostagent.host.pciids import load_pci_ids, parse_pci_ids

SAMPLE = """\
# comment
10de  NVIDIA Corporation
\t20b0  GA100 [A100 SXM4 40GB]
\t1e30  TU102GL [Quadro RTX 6000/8000]
\t\t10de 12ba  Quadro RTX 6000
8086  Intel Corporation
\t1e04  7 Series/C210 Series Chipset Family SATA Controller [RAID mode]
C 02  Network controller
\t00  Ethernet controller
C 03  Display controller
\t02  3D controller
"""


def test_parse_scopes_devices_to_their_vendor() -> None:
    ids = parse_pci_ids(SAMPLE)
    assert ids.vendor(0x10DE) == "NVIDIA Corporation"
    assert ids.device(0x10DE, 0x20B0) == "GA100 [A100 SXM4 40GB]"
    assert ids.device(0x10DE, 0x1E04) is None
    assert ids.device(0x8086, 0x1E04).startswith("7 Series")
    assert ids.subsystem(0x10DE, 0x1E30, 0x10DE, 0x12BA) == "Quadro RTX 6000"


def test_class_names_fall_back_to_base_then_hex() -> None:
    ids = parse_pci_ids(SAMPLE)
    assert ids.class_name(0x020000) == "Ethernet controller"
    assert ids.class_name(0x028000) == "Network controller"
    assert ids.class_name(0x0B4000) == "class 0x0b4000"


def test_missing_database_gives_empty_names(tmp_path) -> None:
    ids = load_pci_ids(str(tmp_path / "nope.ids"))
    assert ids.vendor(0x10DE) is None


def test_a_comment_inside_a_vendor_keeps_its_later_devices_and_a_bad_line_costs_only_its_name() -> None:
    ids = parse_pci_ids("10de  NVIDIA Corporation\n\t20b0  GA100\n# a comment at the margin\n\tzzzz  not hex\n"
                        "\t2330  GH100 [H100 SXM5 80GB]\n\t\t10de 16c1  H100 SXM5 80GB\n"
                        "1002  Advanced Micro Devices, Inc. [AMD/ATI]\n\t740f  Aldebaran/MI200 [Instinct MI210]\n")
    assert ids.device(0x10DE, 0x2330) == "GH100 [H100 SXM5 80GB]"
    assert ids.subsystem(0x10DE, 0x2330, 0x10DE, 0x16C1) == "H100 SXM5 80GB"
    assert ids.device(0x10DE, 0x740F) is None and ids.device(0x1002, 0x740F) == "Aldebaran/MI200 [Instinct MI210]"
    assert ids.vendor(0x1002) == "Advanced Micro Devices, Inc. [AMD/ATI]" and ids.vendor(0x8086) is None
    assert ids.device(0x8086, 0x1E04) is None and ids.class_name(0x030200) == "class 0x030200"


def test_the_system_database_names_a_gpu_and_its_class() -> None:
    ids = load_pci_ids()  # Debian's pci.ids (the pci.ids package; the suite installs it)
    assert ids.vendor(0x10DE) == "NVIDIA Corporation"
    assert ids.device(0x10DE, 0x20B0) == "GA100 [A100 SXM4 40GB]"
    assert ids.class_name(0x030200) == "3D controller"
