"""Where a VM lives on the host's NUMA nodes, read from its domain XML: the fact placement weighs a GPU's node
against (a GPU across the socket from the guest's memory pays for every DMA in interconnect bandwidth).

Sources, in the order they decide (libvirt's formatdomain, "NUMA Node Tuning" and "CPU Tuning"):
- `<numatune><memory nodeset=.../>`: the nodes the guest's memory is allocated from (mode strict, restrictive,
  preferred or interleave; with `placement='auto'` libvirt asks numad and the live XML carries the nodeset chosen).
  A passed-through GPU's DMA targets guest memory, so this decides when it names one node.
- The vCPUs' pinning: `<cputune><vcpupin cpuset=.../>` per vCPU, else `<vcpu cpuset=...>` for all of them (the
  live XML shows pinning changed at run time), mapped to nodes through the host's cells (each node's CPU list).
Memory on one node decides; else vCPUs all on one node decide; anything else (unpinned, spread over nodes,
disagreeing, or a CPU the host has no node for) is unknown, and the reason says which.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from lxml import etree

_PARSER = etree.XMLParser(resolve_entities=False, no_network=True)
MAX_CPUSET = 1 << 16  # the highest CPU or node number a set may name (libvirt's own bound is far below)


@dataclass(frozen=True, slots=True)
class VmNuma:
    """The VM's NUMA node (None: unknown) and how it was found, said in the lease's reasons."""

    node: int | None
    why: str

    @property
    def reason(self) -> str:
        """One line for the lease's reasons."""
        return f"VM on NUMA node {self.node} ({self.why})" if self.node is not None else \
            f"VM's NUMA node unknown ({self.why})"


def parse_cpuset(text: str) -> frozenset[int]:
    """libvirt's and the kernel's list syntax: "0-3,8,^2" (ranges, single numbers, ^ exclusions). ValueError on
    anything else, or on a number past MAX_CPUSET."""
    include: set[int] = set()
    exclude: set[int] = set()
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        target = exclude if part.startswith("^") else include
        part = part.lstrip("^")
        lo_text, _, hi_text = part.partition("-")
        lo, hi = int(lo_text), int(hi_text) if hi_text else int(lo_text)
        if not 0 <= lo <= hi <= MAX_CPUSET:
            raise ValueError(f"bad range {part!r} in {text!r}")
        target.update(range(lo, hi + 1))
    return frozenset(include - exclude)


def vm_numa(domain_xml: str, cells: Mapping[int, frozenset[int]]) -> VmNuma:
    """The VM's node from its domain XML (live, when it runs) and the host's cells (node -> its CPUs)."""
    try:
        root = etree.fromstring(domain_xml.encode(), _PARSER)
    except etree.XMLSyntaxError as exc:
        return VmNuma(None, f"domain XML unreadable: {exc}")
    try:
        memory = root.find("numatune/memory")
        if memory is not None and memory.get("nodeset"):
            nodes = parse_cpuset(memory.get("nodeset", ""))
            mode = memory.get("mode", "strict")
            if len(nodes) == 1:
                (node,) = nodes
                return VmNuma(node, f"its memory on node {node}: numatune {mode} nodeset={memory.get('nodeset')}")
            spread = f"its memory on nodes {_list(nodes)} (numatune {mode})"
        else:
            spread = ""
        cpus = _pinned_cpus(root)
    except ValueError as exc:
        return VmNuma(None, f"unreadable pinning: {exc}")
    if cpus is None:
        return VmNuma(None, spread or "not pinned: no numatune nodeset, no vCPU pinning")
    node_of = {cpu: node for node, members in cells.items() for cpu in members}
    nodes = {node_of.get(c) for c in cpus}
    if None in nodes:
        return VmNuma(None, (spread + "; " if spread else "") +
                      f"its vCPUs pinned to CPUs {_list(cpus)}, some on no node the host lists")
    if len(nodes) == 1 and not spread:
        (node,) = nodes
        return VmNuma(node, f"its vCPUs pinned to CPUs {_list(cpus)}, all on node {node}")
    if len(nodes) == 1:
        return VmNuma(None, f"{spread}; its vCPUs on node {next(iter(nodes))}")
    return VmNuma(None, (spread + "; " if spread else "") + f"its vCPUs pinned across nodes {_list(nodes)}")


def _pinned_cpus(root: etree._Element) -> frozenset[int] | None:
    """Every host CPU a vCPU may run on (None: not pinned). Per-vCPU pins take the place of `<vcpu cpuset>` for
    their vCPU; vCPUs without one run on `<vcpu cpuset>`, or anywhere when it is absent."""
    vcpu = root.find("vcpu")
    count = min(int((vcpu.text or "1").strip()), 4096) if vcpu is not None else 1  # libvirt allows ~4096
    default = parse_cpuset(vcpu.get("cpuset", "")) if vcpu is not None and vcpu.get("cpuset") else None
    pins = {int(p.get("vcpu", "-1")): parse_cpuset(p.get("cpuset", "")) for p in root.iterfind("cputune/vcpupin")}
    cpus: set[int] = set()
    for i in range(max(count, 1)):
        pinned = pins.get(i, default)
        if pinned is None:
            return None
        cpus |= pinned
    return frozenset(cpus) if cpus else None


def _list(values: frozenset[int] | set[int]) -> str:
    """A short form of a set of numbers: "0-3,8"."""
    runs: list[list[int]] = []
    for v in sorted(values):
        if runs and runs[-1][1] == v - 1:
            runs[-1][1] = v
        else:
            runs.append([v, v])
    return ",".join(f"{a}-{b}" if b > a else str(a) for a, b in runs)
