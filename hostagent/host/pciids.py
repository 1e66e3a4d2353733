"""Names for PCI ids from the pci.ids database (Debian package pci.ids), parsed once per path."""

from __future__ import annotations

import contextlib
import functools
import re


# A line at the left margin (a vendor, or a 'C' class) that is not a comment: where one vendor's section ends.
_TOP_LINE = re.compile(r"^[^\t#\n][^\n]*", re.M)


class PciIds:
    """Vendor, device, subsystem and class names. The text is indexed by vendor once (its left-margin lines only)
    and a vendor's devices and boards are parsed the first time one of them is asked for: a host asks for a
    handful of the database's 2,000-odd vendors, and parsing all of it cost every agent start about 0.3 s."""

    def __init__(self, text: str = "") -> None:
        self._text = text
        self._vendors: dict[int, tuple[str, int, int]] = {}  # vendor -> (name, start, end of its indented lines)
        self._parsed: dict[int, tuple[dict[int, str], dict[tuple[int, int, int], str]]] = {}
        self._classes: dict[int, str] = {}  # base class
        self._subclasses: dict[tuple[int, int], str] = {}
        tops = list(_TOP_LINE.finditer(text))
        for i, m in enumerate(tops):
            line, body_end = m.group(0), tops[i + 1].start() if i + 1 < len(tops) else len(text)
            if line.startswith("C "):
                code, _, name = line[2:].partition("  ")
                try:
                    base = int(code, 16)
                except ValueError:
                    continue
                self._classes[base] = name.strip()
                for sub in _body(text, m.end(), body_end, depth=1):
                    code, _, name = sub.partition("  ")
                    with contextlib.suppress(ValueError):
                        self._subclasses[(base, int(code, 16))] = name.strip()
                continue
            code, _, name = line.partition("  ")
            try:
                vendor = int(code, 16)
            except ValueError:
                continue  # a header we do not know
            self._vendors[vendor] = (name.strip(), m.end(), body_end)

    def _of(self, vendor: int) -> tuple[dict[int, str], dict[tuple[int, int, int], str]]:
        """One vendor's devices and subsystems, parsed on first use."""
        found = self._parsed.get(vendor)
        if found is not None:
            return found
        devices: dict[int, str] = {}
        subsystems: dict[tuple[int, int, int], str] = {}
        entry = self._vendors.get(vendor)
        device: int | None = None
        for line in (_lines(self._text, entry[1], entry[2]) if entry else ()):
            depth = _depth(line)
            body = line.strip()
            try:
                if depth == 1:
                    code, _, name = body.partition("  ")
                    device = int(code, 16)
                    devices[device] = name.strip()
                elif depth == 2 and device is not None:
                    pair, _, name = body.partition("  ")
                    sv, sd = pair.split()
                    subsystems[(device, int(sv, 16), int(sd, 16))] = name.strip()
            except ValueError:
                continue  # a malformed line costs a name, never the inventory
        self._parsed[vendor] = (devices, subsystems)
        return devices, subsystems

    def vendor(self, vendor: int) -> str | None:
        """Vendor name, e.g. 'NVIDIA Corporation'."""
        entry = self._vendors.get(vendor)
        return entry[0] if entry else None

    def device(self, vendor: int, device: int) -> str | None:
        """Device name, e.g. 'GA100 [A100 SXM4 40GB]'."""
        return self._of(vendor)[0].get(device)

    def subsystem(self, vendor: int, device: int, sub_vendor: int, sub_device: int) -> str | None:
        """Subsystem (board) name, e.g. 'Quadro RTX 6000'."""
        return self._of(vendor)[1].get((device, sub_vendor, sub_device))

    def class_name(self, class_code: int) -> str:
        """Subclass name ('Ethernet controller'), else base class name, else the hex code."""
        base, sub = (class_code >> 16) & 0xFF, (class_code >> 8) & 0xFF
        return self._subclasses.get((base, sub)) or self._classes.get(base) or f"class 0x{class_code:06x}"


def _lines(text: str, start: int, end: int) -> list[str]:
    """The non-empty, non-comment lines of text[start:end]."""
    return [ln for ln in text[start:end].split("\n") if ln and not ln.lstrip("\t").startswith("#")]


def _body(text: str, start: int, end: int, *, depth: int) -> list[str]:
    """The lines of text[start:end] indented exactly `depth` tabs, without their indent."""
    return [ln[depth:] for ln in _lines(text, start, end) if _depth(ln) == depth]


def _depth(line: str) -> int:
    """How many tabs indent a line (1: a device or subclass, 2: a board)."""
    return len(line) - len(line.lstrip("\t"))


def parse_pci_ids(text: str) -> PciIds:
    """Parse pci.ids text (tab-indented vendor/device/subsystem lines, then 'C' class sections)."""
    return PciIds(text)


@functools.lru_cache(maxsize=4)
def load_pci_ids(path: str = "/usr/share/misc/pci.ids") -> PciIds:
    """The parsed database at `path` (cached); empty when the file is missing, so names fall back to hex."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return parse_pci_ids(f.read())
    except OSError:
        return PciIds()
