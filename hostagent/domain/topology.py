"""Host topology as pure values: how far apart two GPUs are, which free blocks exist, which set to choose.

Distance levels follow what `nvidia-smi topo -m` prints, closest first:

====  ==============  ==========================================================================
 0    nvlink          the host's NVLink hints name both GPUs in one clique (sysfs cannot tell)
 1    pcie-switch     both GPUs sit below one root port (they share an upstream PCIe bridge: PIX/PXB)
 2    root-complex    different root ports of one root complex (through the host bridge: PHB)
 3    numa-node       different root complexes of one NUMA node (NODE)
 4    cross-socket    different NUMA nodes (SYS)
====  ==============  ==========================================================================

A set's distance is the largest pairwise distance inside it. Choosing a set is topology first (the policy, then
the distance), then quality (the placement scores, within a tolerance), then packing: the set whose removal
breaks up the host's free blocks least. Nothing here does I/O.
"""

from __future__ import annotations

import enum
import itertools
import re
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from hostagent.domain.errors import ConfigError, InvalidInput
from hostagent.domain.inventory import Gpu
from hostagent.domain.pci import PciAddress

NUMA_POLICIES = ("required", "preferred", "any")


class Level(enum.IntEnum):
    """Topology distance between two GPUs; lower is closer."""

    NVLINK = 0
    SWITCH = 1
    ROOT_COMPLEX = 2
    NUMA_NODE = 3
    SYSTEM = 4

    @property
    def label(self) -> str:
        """The name shown to operators."""
        return _LABELS[self]


_LABELS = {Level.NVLINK: "nvlink", Level.SWITCH: "pcie-switch", Level.ROOT_COMPLEX: "root-complex",
           Level.NUMA_NODE: "numa-node", Level.SYSTEM: "cross-socket"}

# Block kinds from the smallest to the host; packing compares the losses in this order.
BLOCK_KINDS = ("nvlink", "switch", "root-complex", "numa-node", "host")
OBJECTIVES = ("pack", "spread")  # [placement] objective: what decides among equally good sets


@dataclass(frozen=True, slots=True)
class DevicePlace:
    """Where one GPU sits: its NUMA node, root complex and root port (the PCIe switch block it belongs to)."""

    gpu_id: str
    address: PciAddress
    numa_node: int | None
    root_complex: str  # "pci0000:80": the root bus the GPU's root port hangs off
    root_port: str  # the bridge at the top of the GPU's chain (the GPU itself when it sits on the root bus)
    switch: str | None  # upstream port of the PCIe switch above the GPU, None when there is none

    @classmethod
    def from_gpu(cls, gpu: Gpu) -> DevicePlace:
        """Read the place from the primary function's upstream bridge chain (nearest first, root port last)."""
        chain = gpu.primary.parent_chain
        top = chain[-1] if chain else gpu.address
        return cls(
            gpu_id=gpu.id, address=gpu.address, numa_node=gpu.numa_node,
            root_complex=f"pci{top.domain:04x}:{top.bus:02x}", root_port=str(top),
            switch=str(chain[-2]) if len(chain) >= 3 else None,
        )

    @property
    def switch_block(self) -> str:
        """Id of the block of GPUs below the same root port (named after the switch when there is one)."""
        return self.switch or self.root_port


@dataclass(frozen=True, slots=True)
class Block:
    """A group of GPUs that are all within one distance level of each other."""

    kind: str  # nvlink | switch | root-complex | numa-node | host
    id: str
    gpu_ids: tuple[str, ...]
    children: tuple[Block, ...] = ()

    @property
    def level(self) -> Level:
        """The largest distance between two members."""
        return {"nvlink": Level.NVLINK, "switch": Level.SWITCH, "root-complex": Level.ROOT_COMPLEX,
                "numa-node": Level.NUMA_NODE, "host": Level.SYSTEM}[self.kind]


@dataclass(frozen=True)
class Topology:
    """Every GPU's place plus the NVLink cliques the operator declared."""

    devices: tuple[DevicePlace, ...]
    nvlink: tuple[frozenset[str], ...] = ()
    _by_id: dict[str, DevicePlace] = field(default_factory=dict, compare=False, repr=False)
    _cache: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        ordered = tuple(sorted(self.devices, key=lambda d: d.address))
        object.__setattr__(self, "devices", ordered)
        self._by_id.update({d.gpu_id: d for d in ordered})
        unknown = sorted({g for c in self.nvlink for g in c} - set(self._by_id))
        if unknown:
            raise InvalidInput(f"NVLink clique names unknown GPU(s): {', '.join(unknown)}", field="nvlink")

    @classmethod
    def from_gpus(cls, gpus: Iterable[Gpu], nvlink: Iterable[Collection[str]] = ()) -> Topology:
        """The topology of discovered GPUs (with cliques from `parse_nvlink_hints`)."""
        return cls(tuple(DevicePlace.from_gpu(g) for g in gpus), tuple(frozenset(c) for c in nvlink))

    @property
    def gpu_ids(self) -> tuple[str, ...]:
        """Every GPU id in address order."""
        return tuple(d.gpu_id for d in self.devices)

    def place(self, gpu_id: str) -> DevicePlace:
        """A GPU's place; NotFound-like InvalidInput for an unknown id."""
        try:
            return self._by_id[gpu_id]
        except KeyError:
            raise InvalidInput(f"unknown GPU {gpu_id!r}", field="gpu_id") from None

    @property
    def nvlinked(self) -> frozenset[str]:
        """GPUs in any NVLink clique (what a request's `requires: ["nvlink"]` admits)."""
        if "nvlinked" not in self._cache:
            self._cache["nvlinked"] = frozenset().union(*self.nvlink)
        return self._cache["nvlinked"]  # type: ignore[no-any-return]

    def nvlink_peers(self, gpu_id: str) -> tuple[str, ...]:
        """GPUs that share an NVLink clique with this one."""
        peers = {g for c in self.nvlink if gpu_id in c for g in c} - {gpu_id}
        return tuple(g for g in self.gpu_ids if g in peers)

    def distance(self, a: str, b: str) -> Level:
        """Topology distance between two GPUs."""
        if a == b:
            return Level.NVLINK
        if any(a in c and b in c for c in self.nvlink):
            return Level.NVLINK
        pa, pb = self.place(a), self.place(b)
        if pa.root_port == pb.root_port:
            return Level.SWITCH
        if pa.root_complex == pb.root_complex:
            return Level.ROOT_COMPLEX
        # a platform without NUMA information (every node None) is one node
        if pa.numa_node == pb.numa_node:
            return Level.NUMA_NODE
        return Level.SYSTEM

    def set_distance(self, gpu_ids: Sequence[str]) -> Level | None:
        """Largest pairwise distance in a set; None for fewer than two GPUs."""
        if len(gpu_ids) < 2:
            return None
        return max(self.distance(a, b) for a, b in itertools.combinations(gpu_ids, 2))

    def tree(self) -> Block:
        """The host as nested blocks: host > NUMA node > root complex > switch (root port) > GPU ids."""
        nodes: dict[int | None, dict[str, dict[str, list[str]]]] = {}
        for d in self.devices:
            nodes.setdefault(d.numa_node, {}).setdefault(d.root_complex, {}).setdefault(d.switch_block, []).append(
                d.gpu_id)
        node_blocks = []
        for node, complexes in sorted(nodes.items(), key=lambda kv: (kv[0] is None, kv[0] or 0)):
            rc_blocks = []
            for rc, switches in complexes.items():
                sw = tuple(Block("switch", s, tuple(ids)) for s, ids in switches.items())
                rc_blocks.append(Block("root-complex", rc, tuple(g for b in sw for g in b.gpu_ids), sw))
            node_id = "node-" if node is None else f"node{node}"
            node_blocks.append(Block("numa-node", node_id, tuple(g for b in rc_blocks for g in b.gpu_ids),
                                     tuple(rc_blocks)))
        return Block("host", "host", tuple(g for b in node_blocks for g in b.gpu_ids), tuple(node_blocks))

    def blocks(self) -> tuple[Block, ...]:
        """Every block (NVLink cliques, then the tree's blocks from switches up to the host)."""
        if "blocks" not in self._cache:
            self._cache["blocks"] = self._blocks()
        return self._cache["blocks"]  # type: ignore[no-any-return]

    def memberships(self) -> dict[str, tuple[int, ...]]:
        """For each GPU, the indexes (into `blocks()`) of the blocks holding it."""
        if "members" not in self._cache:
            out: dict[str, list[int]] = {g: [] for g in self.gpu_ids}
            for i, b in enumerate(self.blocks()):
                for g in b.gpu_ids:
                    out[g].append(i)
            self._cache["members"] = {g: tuple(ix) for g, ix in out.items()}
        return self._cache["members"]  # type: ignore[no-any-return]

    def _blocks(self) -> tuple[Block, ...]:
        out: list[Block] = [Block("nvlink", f"nvlink{i}", tuple(g for g in self.gpu_ids if g in c))
                            for i, c in enumerate(self.nvlink)]
        by_kind: dict[str, list[Block]] = {}

        def walk(b: Block) -> None:
            by_kind.setdefault(b.kind, []).append(b)
            for c in b.children:
                walk(c)

        walk(self.tree())
        for kind in BLOCK_KINDS[1:]:
            out.extend(by_kind.get(kind, ()))
        return tuple(out)


# -- NVLink hints ------------------------------------------------------------------------------------------------

_NVSMI_ADDR = re.compile(r"^(?P<domain>[0-9a-fA-F]{8}):(?P<rest>[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7])$")


def _resolve_token(token: str, gpus: Sequence[Gpu]) -> str | None:
    by_id = next((g.id for g in gpus if g.id == token), None)
    if by_id is not None:
        return by_id
    m = _NVSMI_ADDR.match(token)  # nvidia-smi prints 8-digit domains: 00000000:07:00.0
    text = f"{int(m['domain'], 16):04x}:{m['rest']}" if m else token
    try:
        addr = PciAddress.parse(text)
    except InvalidInput:
        return None
    return next((g.id for g in gpus if any(f.address == addr for f in g.functions)), None)


def parse_nvlink_hints(text: str, gpus: Sequence[Gpu], *, source: str = "host.nvlink_hints") -> tuple[frozenset[str], ...]:
    """Parse the NVLink hint format: one clique per line, GPU ids or PCI addresses split by spaces or commas.

    `#` starts a comment; blank lines are ignored; a line names at least two GPUs; a pair is the simplest clique
    (one link). Unknown names raise ConfigError with the line number.
    """
    cliques: list[frozenset[str]] = []
    for n, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        tokens = [t for t in re.split(r"[\s,]+", line) if t]
        ids: list[str] = []
        for tok in tokens:
            gid = _resolve_token(tok, gpus)
            if gid is None:
                raise ConfigError(f"{source} line {n}: {tok!r} is neither a GPU id nor the address of a GPU function",
                                  field="host.nvlink_hints")
            ids.append(gid)
        if len(set(ids)) < 2:
            raise ConfigError(f"{source} line {n}: a clique names at least two different GPUs",
                              field="host.nvlink_hints")
        cliques.append(frozenset(ids))
    return tuple(cliques)


# -- packing -----------------------------------------------------------------------------------------------------

class _Packer:
    """Free GPUs per block, counted once, so each candidate set's loss costs only its members' memberships."""

    def __init__(self, topology: Topology, free: Collection[str]) -> None:
        self.free = set(free)
        self.blocks = topology.blocks()
        self.members = topology.memberships()
        self.kind_index = [BLOCK_KINDS.index(b.kind) for b in self.blocks]
        self.f = [sum(1 for g in b.gpu_ids if g in self.free) for b in self.blocks]

        n = len(topology.gpu_ids)
        self.sizes = [2 ** p for p in range(max(1, n.bit_length()), 0, -1) if 2 ** p <= n]  # largest first

    def loss(self, taken: Iterable[str]) -> tuple[int, ...]:
        """(whole k-GPU sets lost per size, largest first) + (f^2 loss per block kind, smallest kind first)."""
        t: dict[int, int] = {}
        for g in set(taken):
            if g in self.free:
                for i in self.members[g]:
                    t[i] = t.get(i, 0) + 1
        slots = [0] * len(self.sizes)
        squares = [0] * len(BLOCK_KINDS)
        for i, used in t.items():
            f = self.f[i]
            squares[self.kind_index[i]] += f * f - (f - used) * (f - used)
            if self.kind_index[i] == 0:
                continue  # NVLink cliques already count at their tree blocks
            for j, k in enumerate(self.sizes):
                slots[j] += f // k - (f - used) // k
        return (*slots, *squares)

    def crowding(self, taken: Iterable[str]) -> tuple[int, ...]:
        """Busy GPUs (not free) in the blocks `taken` would share, per block kind from the smallest: what a
        spreading objective keeps low, so that running leases share switches, root complexes and nodes least."""
        busy = [0] * len(BLOCK_KINDS)
        for i in {i for g in set(taken) for i in self.members[g]}:
            busy[self.kind_index[i]] += len(self.blocks[i].gpu_ids) - self.f[i]
        return tuple(busy)

    def rank(self, objective: str, taken: Iterable[str]) -> tuple[int, ...]:
        """What the objective minimises among equally good sets: `pack` the free blocks lost, `spread` the
        crowding."""
        return self.loss(taken) if objective == "pack" else self.crowding(taken)

    def explain(self, loss: Sequence[int]) -> str:
        """The loss tuple in words."""
        slots = ", ".join(f"{k}-GPU: {n}" for k, n in zip(self.sizes, loss))
        return f"whole free sets lost {{{slots}}}"


def block_losses(topology: Topology, free: Collection[str], taken: Collection[str]) -> tuple[int, ...]:
    """How much taking `taken` out of `free` breaks up free blocks, compared as a tuple (smaller is better).

    First, for each request size k (powers of two, largest first), how many whole k-GPU sets the blocks lose
    (a block with f free GPUs holds f // k of them; every block from a switch up counts, so a set lost inside a
    switch weighs more than one lost only at the host). Then, per block kind from the smallest, the f^2 loss: a
    block with f free GPUs is worth f^2, so taking a GPU from a partly used switch costs less than from an intact
    one, and the cost grows with the block it breaks.
    """
    return _Packer(topology, free).loss(taken)


def capacity(topology: Topology, free: Collection[str]) -> float:
    """Share of the host's block capacity that is free: 1.0 with every GPU free, 0.0 with none."""
    free_set = set(free)
    total = have = 0
    for b in topology.blocks():
        total += len(b.gpu_ids) ** 2
        have += sum(1 for g in b.gpu_ids if g in free_set) ** 2
    return have / total if total else 0.0


def deployment_score(topology: Topology, free: Collection[str], chosen: Collection[str], requested: int) -> float:
    """How much of the request is satisfied minus how much of the host's free capacity the choice consumes.

    Satisfaction is the granted share discounted by the set's distance (a set across sockets satisfies a
    multi-GPU request less than one behind a switch); consumption is the drop in `capacity`.
    """
    if requested < 1:
        raise InvalidInput("requested must be at least 1", field="gpus")
    dist = topology.set_distance(list(chosen))
    closeness = 1.0 if dist is None else 1.0 - 0.5 * int(dist) / int(Level.SYSTEM)
    satisfied = min(1.0, len(chosen) / requested) * closeness
    consumed = capacity(topology, free) - capacity(topology, set(free) - set(chosen))
    return satisfied - consumed


# -- choosing a set ----------------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class SetChoice:
    """The chosen GPUs with the figures that decided."""

    gpu_ids: tuple[str, ...]
    distance: Level | None
    losses: tuple[int, ...]
    score: float
    reasons: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """JSON form."""
        return {"gpu_ids": list(self.gpu_ids), "distance": None if self.distance is None else int(self.distance),
                "distance_label": None if self.distance is None else self.distance.label,
                "losses": list(self.losses), "score": self.score, "reasons": list(self.reasons)}


def _nodes(topology: Topology, ids: Iterable[str]) -> set[int | None]:
    return {topology.place(g).numa_node for g in ids}


def _within_block(topology: Topology, pool: Sequence[str], count: int, scores: Mapping[str, float],
                  packer: _Packer, objective: str, tolerance: float) -> list[str]:
    """Greedy pick of `count` from a block's free GPUs: closest to those picked, then quality, then the objective
    (packing or spreading)."""
    chosen: list[str] = []
    rest = list(pool)
    while len(chosen) < count:
        best = max(scores.get(x, 0.0) for x in rest)

        def near(g: str) -> tuple[int, int]:
            far = max((topology.distance(g, c) for c in chosen), default=Level.NVLINK)
            return int(far), 0 if scores.get(g, 0.0) >= best - tolerance else 1

        def key(g: str) -> tuple[Any, ...]:
            return packer.rank(objective, [*chosen, g]), -scores.get(g, 0.0), topology.place(g).address
        # (closeness, quality) first; the objective's figure, the costly part, only among the closest and best
        first = {g: near(g) for g in rest}
        top = min(first.values())
        pick = min((g for g in rest if first[g] == top), key=key)
        chosen.append(pick)
        rest.remove(pick)
    return chosen


def choose(topology: Topology, eligible: Sequence[str], count: int, *, scores: Mapping[str, float] | None = None,
           policy: str = "preferred", vm_numa_node: int | None = None, max_distance: Level | None = None,
           host_free: Collection[str] | None = None, objective: str = "pack",
           tolerance: float = 1e-6) -> SetChoice | None:
    """Choose `count` GPUs among `eligible` (free, filtered), or None when no set meets the policy.

    Order of concerns: the NUMA policy (`required`: one node, the VM's when known; `preferred`: one node first,
    the VM's node first; `any`), then the smallest set distance (capped by `max_distance`), then quality (mean
    score within `tolerance` of the best), then the operator's objective over `host_free` (every free GPU of the
    host): `pack`, the smallest `block_losses` (whole free blocks kept for larger requests); `spread`, the fewest
    busy GPUs in the blocks the set shares, smallest block first (running leases share links least); then the
    higher score, then address order.
    """
    if policy not in NUMA_POLICIES:
        raise InvalidInput(f"numa_policy must be one of {', '.join(NUMA_POLICIES)}", field="numa_policy")
    if objective not in OBJECTIVES:
        raise InvalidInput(f"objective must be one of {', '.join(OBJECTIVES)}", field="objective")
    if count < 1:
        raise InvalidInput("count must be at least 1", field="gpus")
    scores = dict(scores or {})
    wanted = set(eligible)
    pool = [g for g in topology.gpu_ids if g in wanted]
    free = set(host_free) if host_free is not None else set(pool)
    free |= set(pool)
    if len(pool) < count:
        return None
    packer = _Packer(topology, free)
    candidates: list[list[str]] = []
    if count == 1:
        candidates = [[g] for g in pool]
    else:
        seen: set[frozenset[str]] = set()
        for block in topology.blocks():
            members = [g for g in block.gpu_ids if g in pool]
            if len(members) < count:
                continue
            pick = _within_block(topology, members, count, scores, packer, objective, tolerance)
            if frozenset(pick) not in seen:
                seen.add(frozenset(pick))
                candidates.append(pick)

    def policy_key(ids: Sequence[str]) -> tuple[int, ...]:
        nodes = _nodes(topology, ids)
        cross = int(len(nodes) > 1)
        off = int(vm_numa_node is not None and nodes != {vm_numa_node})
        if policy == "required":
            return (0,) if not cross and not off else (-1,)  # -1: not allowed
        if policy == "preferred":
            return (cross, off)
        return (0,)

    rows = []
    for ids in candidates:
        pk = policy_key(ids)
        if pk == (-1,):
            continue
        dist = topology.set_distance(ids)
        if max_distance is not None and dist is not None and dist > max_distance:
            continue
        mean = sum(scores.get(g, 0.0) for g in ids) / len(ids)
        rows.append((pk, -1 if dist is None else int(dist), mean, ids))
    if not rows:
        return None
    best_topo = min((pk, d) for pk, d, _, _ in rows)
    same = [r for r in rows if (r[0], r[1]) == best_topo]
    top = max(r[2] for r in same)
    good = [r for r in same if r[2] >= top - tolerance]

    def final_key(r: tuple[tuple[int, ...], int, float, list[str]]) -> tuple[Any, ...]:
        ids = r[3]
        return (packer.rank(objective, ids), -r[2], sorted(topology.place(g).address for g in ids))

    winner = min(good, key=final_key)
    ids = sorted(winner[3], key=lambda g: topology.place(g).address)
    dist = topology.set_distance(ids)
    losses = packer.loss(ids)
    reasons = [_describe(topology, ids, dist, policy, vm_numa_node)]
    if len(good) > 1 and objective == "pack":
        reasons.append(f"packing: of {len(good)} equally good choices took the one that breaks up free blocks least "
                       f"({packer.explain(losses)})")
    elif len(good) > 1:
        crowd = ", ".join(f"{kind}: {n}" for kind, n in zip(BLOCK_KINDS, packer.crowding(ids)) if kind != "host")
        reasons.append(f"spreading: of {len(good)} equally good choices took the one whose blocks hold the fewest "
                       f"busy GPUs ({{{crowd}}})")
    return SetChoice(tuple(ids), dist, losses, winner[2], tuple(reasons))


def _describe(topology: Topology, ids: Sequence[str], dist: Level | None, policy: str, vm_numa_node: int | None) -> str:
    nodes = sorted(_nodes(topology, ids), key=lambda n: -1 if n is None else n)
    where = ", ".join("unknown" if n is None else str(n) for n in nodes)
    vm = "" if vm_numa_node is None else f", VM on node {vm_numa_node}"
    if dist is None:
        return f"topology: {ids[0]} on NUMA node {where} (numa_policy={policy}{vm})"
    return (f"topology: {len(ids)} GPUs within {dist.label} (distance {int(dist)}), NUMA node(s) {where} "
            f"(numa_policy={policy}{vm})")


def free_blocks(topology: Topology, free: Collection[str], sizes: Sequence[int] = (1, 2, 4, 8)) -> dict[int, SetChoice | None]:
    """For each request size, the set the chooser would take now (any policy) or None: the free-block picture."""
    out: dict[int, SetChoice | None] = {}
    for n in sizes:
        out[n] = choose(topology, list(free), n, policy="any", host_free=free) if n <= len(topology.devices) else None
    return out


DistanceFn = Callable[[str, str], Level]
