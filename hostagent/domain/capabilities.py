"""What a GPU can do, for requests in the tenant's terms (`requires`): fast precisions and features, worked out from
the PCI id (the chip code in the pci.ids name: GA100, TU104GL, AD102, ...) and the host's NVLink cliques.

A feature is listed only where the chip runs it at full rate in hardware: `fp64` on the x100 data-centre chips
(GP100, GV100, GA100, GH100, GB100: 1/2 of the FP32 rate; every other NVIDIA chip runs FP64 at 1/32 or 1/64),
`fp16` with double-rate or tensor-core FP16 (compute capability 6.0, and 7.0 onwards), `bf16` and `tf32` from
Ampere (8.0), `int8` tensor cores from Turing (7.5; DP4A on the 6.1 Pascal chips), `fp8` from Ada and Hopper (8.9).
A GPU whose chip is not known here has unknown capabilities: a request that requires anything is never placed on
it (the placement's dropped list says why), rather than on a guess.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

FEATURES = ("fp16", "bf16", "tf32", "fp64", "int8", "fp8", "nvlink")  # what a request may require
WRONG_ANSWER = "wrong answer"  # how a probe's problem begins when a known-answer check failed (host.known_answer)
NVIDIA = 0x10DE
AMD = 0x1002
_NV_CHIP = re.compile(r"\b(GK|GM|GP|GV|TU|GA|AD|GH|GB)(\d)(\d\d)")
_AMD_INSTINCT = re.compile(r"\bMI(\d)\d\d")


@dataclass(frozen=True, slots=True)
class Capabilities:
    """A GPU's features (None when unknown) and where they were read from, in words."""

    features: frozenset[str] | None
    source: str
    chip: str | None = None  # the chip code read from the name (GA100, TU104, ...), None when unknown

    def lacks(self, required: tuple[str, ...]) -> tuple[str, ...]:
        """The required features this GPU does not have (all of them when its features are unknown)."""
        if self.features is None:
            return required
        return tuple(f for f in required if f not in self.features)

    def to_dict(self) -> dict[str, object]:
        """JSON form."""
        return {"features": None if self.features is None else sorted(self.features), "source": self.source}


def _nvidia(chip: str, big: str, rest: str) -> tuple[str, frozenset[str]] | None:
    x100 = big == "1" and rest == "00"  # GP100, GV100, GA100, GH100, GB100
    code = f"{chip}{big}{rest}"
    if chip == "GK":
        return f"{code} (Kepler)", frozenset({"fp64"} if code in ("GK110", "GK210") else ())
    if chip == "GM":
        return f"{code} (Maxwell, compute capability 5.x)", frozenset()
    if chip == "GP":
        return ((f"{code} (Pascal, compute capability 6.0)", frozenset({"fp64", "fp16"})) if x100
                else (f"{code} (Pascal, compute capability 6.1)", frozenset({"int8"})))
    if chip == "GV":
        return f"{code} (Volta, compute capability 7.0)", frozenset({"fp64", "fp16"} if x100 else {"fp16"})
    if chip == "TU":
        return f"{code} (Turing, compute capability 7.5)", frozenset({"fp16", "int8"})
    ampere = {"fp16", "bf16", "tf32", "int8"}
    if chip == "GA":
        return ((f"{code} (Ampere, compute capability 8.0)", frozenset(ampere | {"fp64"})) if x100
                else (f"{code} (Ampere, compute capability 8.6)", frozenset(ampere)))
    if chip == "AD":
        return f"{code} (Ada, compute capability 8.9)", frozenset(ampere | {"fp8"})
    if chip == "GH":
        return f"{code} (Hopper, compute capability 9.0)", frozenset(ampere | {"fp8", "fp64"})
    if chip == "GB":
        return ((f"{code} (Blackwell, compute capability 10.0)", frozenset(ampere | {"fp8", "fp64"})) if big == "1"
                else (f"{code} (Blackwell, compute capability 12.0)", frozenset(ampere | {"fp8"})))
    return None  # pragma: no cover - the pattern admits only the families above


def capabilities(vendor_id: int, device_name: str | None, *, nvlink: bool = False) -> Capabilities:
    """The features of a GPU from its PCI vendor id and pci.ids device name; `nvlink`: the host's NVLink hints put
    it in a clique."""
    name = device_name or ""
    found: tuple[str, frozenset[str]] | None = None
    chip = None
    if vendor_id == NVIDIA and (m := _NV_CHIP.search(name)):
        chip = m.group(0)
        found = _nvidia(m.group(1), m.group(2), m.group(3))
    elif vendor_id == AMD and (m := _AMD_INSTINCT.search(name)):
        gen, chip = int(m.group(1)), m.group(0)  # MI100 (CDNA), MI200 (CDNA 2), MI300 (CDNA 3)
        feats = {"fp64", "fp16", "bf16"} | ({"int8"} if gen >= 2 else set()) | ({"tf32", "fp8"} if gen >= 3 else set())
        found = (f"Instinct MI{gen}xx (CDNA{'' if gen == 1 else f' {gen}'})", frozenset(feats))
    if found is None:
        return Capabilities(None, f"unknown chip ({name or f'{vendor_id:04x}'!r})")
    source, feats = found
    if nvlink:
        return Capabilities(feats | {"nvlink"}, f"{source}; NVLink per host.nvlink_hints", chip)
    return Capabilities(feats, source, chip)
