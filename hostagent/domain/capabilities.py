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
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

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


# What the driver's compute capability says where the PCI name does not (pci.ids older than the card): the chip
# family whose features _nvidia lists, as (family, first digit, last two digits) of a representative chip code.
_CC_FAMILY: dict[tuple[int, int], tuple[str, str, str]] = {
    (6, 0): ("GP", "1", "00"), (6, 1): ("GP", "1", "02"), (7, 0): ("GV", "1", "00"), (7, 5): ("TU", "1", "02"),
    (8, 0): ("GA", "1", "00"), (8, 6): ("GA", "1", "02"), (8, 7): ("GA", "1", "0B"), (8, 9): ("AD", "1", "02"),
    (9, 0): ("GH", "1", "00"), (10, 0): ("GB", "1", "00"), (12, 0): ("GB", "2", "02"),
}
# A precision is fast where its measured matmul rate is at least this multiple of the measured FP32 rate: tensor
# cores or double-rate FP16 run 2x to 16x FP32; the x100 chips run FP64 at 1/2 of FP32 (Hopper's FP64 tensor cores
# above it), every other chip at 1/32 or 1/64.
FAST_RATIO = {"fp16": 1.5, "bf16": 1.5, "fp64": 0.25}


@dataclass(frozen=True, slots=True)
class Measured:
    """What a GPU's latest probe established: the driver's own facts (compute capability, name, memory size), the
    capability vector (`tflops_<precision>`, ...) and the precisions whose known-answer check failed."""

    compute_capability: str | None = None  # "9.0"
    name: str | None = None  # the driver's name for the board ("NVIDIA H200")
    memory_bytes: int | None = None
    figures: Mapping[str, float] = field(default_factory=dict)
    wrong: frozenset[str] = frozenset()

    @classmethod
    def from_probe(cls, health: Mapping[str, Mapping[str, Any]], figures: Mapping[str, float]) -> Measured:
        """From a probe report's health signals by runner (the first runner that reports a fact wins) and its
        metric medians."""
        def first(*keys: str) -> Any:
            return next((h[k] for h in health.values() for k in keys if isinstance(h, Mapping) and h.get(k)), None)

        wrong = {p for h in health.values() if isinstance(h, Mapping)
                 for p, v in (h.get("known_answer") or {}).items() if v == "wrong"}
        memory = first("memory_total_bytes")
        return cls(compute_capability=first("compute_capability"), name=first("name", "device_name"),
                   memory_bytes=int(memory) if memory else None, figures=dict(figures), wrong=frozenset(wrong))

    def fast(self, precision: str) -> bool | None:
        """Whether the precision measured fast (FAST_RATIO x the FP32 rate); None when either was not measured."""
        got, fp32 = self.figures.get(f"tflops_{precision}"), self.figures.get("tflops_fp32")
        if not got or not fp32:
            return None
        return got >= FAST_RATIO[precision] * fp32


def _from_compute_capability(cc: str | None) -> tuple[str, frozenset[str]] | None:
    m = re.fullmatch(r"(\d+)\.(\d+)", cc or "")
    family = _CC_FAMILY.get((int(m.group(1)), int(m.group(2)))) if m else None
    if family is None:
        return None
    desc, feats = _nvidia(*family)
    return f"compute capability {cc} as the driver reports it ({desc.split('(')[1].split(',')[0]})", feats


def _adjust(feats: frozenset[str], measured: Measured) -> tuple[frozenset[str], list[str]]:
    """The features as the probe measured them: a precision whose rate is (not) fast is added (removed), one whose
    known-answer check failed is removed; with what changed, in words."""
    out, said = set(feats), []
    for p in FAST_RATIO:
        fast = measured.fast(p)
        ratio = f"{measured.figures.get(f'tflops_{p}', 0) / measured.figures.get('tflops_fp32', 1):.2g}x FP32"
        if fast and p not in out:
            out.add(p)
            said.append(f"probe adds {p} (measured {ratio})")
        elif fast is False and p in out:
            out.discard(p)
            said.append(f"probe removes {p} (measured {ratio})")
    for p in sorted(measured.wrong & out):
        out.discard(p)
        said.append(f"probe removes {p} (wrong answer)")
    return frozenset(out), said


def capabilities(vendor_id: int, device_name: str | None, *, nvlink: bool = False,
                 measured: Measured | None = None) -> Capabilities:
    """The features of a GPU from its PCI vendor id and pci.ids device name, else the compute capability its probe
    read from the driver; adjusted by what the probe measured (`_adjust`); `nvlink`: the host's NVLink hints put it
    in a clique."""
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
    elif vendor_id == NVIDIA and measured is not None:
        found = _from_compute_capability(measured.compute_capability)
    if found is None:
        return Capabilities(None, f"unknown chip ({name!r})" if name else
                            "unknown chip (pci.ids has no name for it and no probe has read its compute capability)")
    source, feats = found
    if measured is not None:
        feats, said = _adjust(feats, measured)
        source = "; ".join([source, *said])
    if nvlink:
        return Capabilities(feats | {"nvlink"}, f"{source}; NVLink per host.nvlink_hints", chip)
    return Capabilities(feats, source, chip)
