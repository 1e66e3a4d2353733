"""Pure topology: distances, NVLink hints, set choice under each NUMA policy, packing, and invariants."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hostagent.domain.errors import ConfigError, InvalidInput
from hostagent.domain.inventory import Gpu, PciFunction
from hostagent.domain.pci import PciAddress
from hostagent.domain.topology import (
    OBJECTIVES,
    Level,
    Topology,
    block_losses,
    capacity,
    choose,
    deployment_score,
    free_blocks,
    parse_nvlink_hints,
)

P = PciAddress.parse


def gpu(addr: str, chain: tuple[str, ...], numa: int | None) -> Gpu:
    fn = PciFunction(address=P(addr), vendor_id=0x10DE, device_id=0x20B0, class_code=0x030200, numa_node=numa,
                     parent_chain=tuple(P(c) for c in chain), device_name="GA100 [A100 SXM4 40GB]")
    return Gpu(id=f"gpu-{addr.replace(':', '-').replace('.', '-')}", primary=fn, functions=(fn,), group=None)


def dgx8() -> list[Gpu]:
    """The fake dgx8 host's chains: root port -> switch upstream -> downstream port -> GPU."""
    out = []
    for numa, root in ((0, 0x00), (1, 0x80)):
        bus = root + 1
        for sw in range(2):
            rp = f"0000:{root:02x}:{1 + sw:02x}.0"
            up = f"0000:{bus:02x}:00.0"
            for i in range(2):
                down = f"0000:{bus + 1:02x}:{i:02x}.0"
                out.append(gpu(f"0000:{bus + 2 + i:02x}:00.0", (down, up, rp), numa))
            bus += 4
    return out


GPUS = dgx8()
IDS = [g.id for g in GPUS]
A, B, C, D = IDS[0:2], IDS[2:4], IDS[4:6], IDS[6:8]
TOPO = Topology.from_gpus(GPUS)


def test_dgx8_places_and_distances() -> None:
    assert IDS == ["gpu-0000-03-00-0", "gpu-0000-04-00-0", "gpu-0000-07-00-0", "gpu-0000-08-00-0",
                   "gpu-0000-83-00-0", "gpu-0000-84-00-0", "gpu-0000-87-00-0", "gpu-0000-88-00-0"]
    p = TOPO.place(A[0])
    assert (p.root_complex, p.root_port, p.switch, p.numa_node) == ("pci0000:00", "0000:00:01.0", "0000:01:00.0", 0)
    assert TOPO.distance(*A) is Level.SWITCH
    assert TOPO.distance(A[0], B[0]) is Level.ROOT_COMPLEX
    assert TOPO.distance(A[0], C[0]) is Level.SYSTEM
    assert TOPO.set_distance(A + B) is Level.ROOT_COMPLEX and TOPO.set_distance(A[:1]) is None


def test_numa_node_level_between_root_complexes_of_one_node() -> None:
    gpus = [gpu("0000:03:00.0", ("0000:00:01.0",), 0), gpu("0000:43:00.0", ("0000:40:01.0",), 0),
            gpu("0000:83:00.0", ("0000:80:01.0",), 1), gpu("0000:c3:00.0", ("0000:c0:01.0",), None)]
    t = Topology.from_gpus(gpus)
    ids = [g.id for g in gpus]
    assert t.distance(ids[0], ids[1]) is Level.NUMA_NODE
    assert t.distance(ids[0], ids[2]) is Level.SYSTEM
    assert t.distance(ids[0], ids[3]) is Level.SYSTEM  # a known node and an unknown one: assume the worst
    assert t.place(ids[0]).switch is None and t.place(ids[0]).switch_block == "0000:00:01.0"


def test_tree_and_blocks() -> None:
    tree = TOPO.tree()
    assert tree.kind == "host" and [n.id for n in tree.children] == ["node0", "node1"]
    assert [s.gpu_ids for s in tree.children[0].children[0].children] == [tuple(A), tuple(B)]
    kinds = [b.kind for b in TOPO.blocks()]
    assert kinds == ["switch"] * 4 + ["root-complex"] * 2 + ["numa-node"] * 2 + ["host"]


def test_nvlink_hints_format() -> None:
    text = """
    # NVLink cliques, one per line
    gpu-0000-03-00-0 gpu-0000-07-00-0      # ids
    0000:83:00.0, 00000000:87:00.0          # addresses, nvidia-smi's 8-digit domain too
    """
    cliques = parse_nvlink_hints(text, GPUS)
    assert cliques == (frozenset({A[0], B[0]}), frozenset({C[0], D[0]}))
    t = Topology.from_gpus(GPUS, cliques)
    assert t.distance(A[0], B[0]) is Level.NVLINK and t.nvlink_peers(A[0]) == (B[0],)
    assert t.distance(A[0], A[1]) is Level.SWITCH
    # the clique is the closest pair now
    assert choose(t, IDS, 2).gpu_ids == (A[0], B[0])
    assert choose(t, IDS, 2).distance is Level.NVLINK


@pytest.mark.parametrize("text, message", [
    ("gpu-0000-03-00-0 gpu-nope", "line 1: 'gpu-nope'"),
    ("\n0000:03:00.0", "line 2: a clique names at least two"),
    ("0000:03:00.0 0000:03:00.0", "at least two different"),
    ("0000:99:00.0 0000:03:00.0", "'0000:99:00.0' is neither"),
])
def test_nvlink_hint_errors_name_the_line(text: str, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_nvlink_hints(text, GPUS)
    assert message in err.value.message and err.value.field == "host.nvlink_hints"


def test_hand_computed_choices_with_everything_free() -> None:
    assert choose(TOPO, IDS, 1).gpu_ids == (A[0],)
    assert choose(TOPO, IDS, 2).gpu_ids == tuple(A)
    four = choose(TOPO, IDS, 4)
    assert four.gpu_ids == tuple(A + B) and four.distance is Level.ROOT_COMPLEX
    eight = choose(TOPO, IDS, 8)
    assert eight.gpu_ids == tuple(IDS) and eight.distance is Level.SYSTEM
    assert choose(TOPO, IDS, 9) is None


def test_single_gpu_packs_into_a_partly_used_switch() -> None:
    free = [A[1], *B, *C, *D]  # A[0] leased
    assert choose(TOPO, free, 1).gpu_ids == (A[1],)
    free = [*A, *B, C[1], *D]  # C[0] leased: the partly used switch is on node 1, at higher addresses
    picked = choose(TOPO, free, 1)
    assert picked.gpu_ids == (C[1],) and "packing" in " ".join(picked.reasons)


def test_spread_takes_the_gpu_whose_switch_and_node_are_least_busy() -> None:
    free = [A[1], *B, *C, *D]  # A[0] leased: A[1] shares its switch, B its root complex and node
    spread = choose(TOPO, free, 1, objective="spread")
    assert spread is not None and spread.gpu_ids == (C[0],)
    assert "spreading" in " ".join(spread.reasons) and "switch: 0" in " ".join(spread.reasons)
    free = [*A, *B, C[1], *D]  # C[0] leased: node 0 is untouched
    assert choose(TOPO, free, 1, objective="spread").gpu_ids == (A[0],)
    free = [A[1], *B, *C, *D]
    assert choose(TOPO, free, 2).gpu_ids == tuple(B)  # pack: the node already broken
    assert choose(TOPO, free, 2, objective="spread").gpu_ids == tuple(C)  # spread: the idle node
    with pytest.raises(InvalidInput) as err:
        choose(TOPO, free, 1, objective="balance")
    assert err.value.field == "objective"


def test_pairs_take_the_node_that_is_already_broken() -> None:
    free = [A[1], *B, *C, *D]  # node 0 has a used GPU: keep node 1 whole for a 4-GPU request
    assert choose(TOPO, free, 2).gpu_ids == tuple(B)
    assert choose(TOPO, free, 4).gpu_ids == tuple(C + D)
    assert choose(TOPO, free, 3).gpu_ids == (A[1], *B)  # the three on node 0, not three of node 1's four


def test_numa_policies() -> None:
    free = [A[1], B[1], C[0], *D]  # node 0: 2 free (different switches), node 1: 3 free
    assert choose(TOPO, free, 2, policy="any").gpu_ids == tuple(D)
    assert choose(TOPO, free, 2, policy="required", vm_numa_node=0).gpu_ids == (A[1], B[1])
    assert choose(TOPO, free, 2, policy="preferred", vm_numa_node=0).gpu_ids == (A[1], B[1])
    assert choose(TOPO, free, 4, policy="required") is None
    spread = choose(TOPO, free, 4, policy="preferred")
    assert spread is not None and spread.distance is Level.SYSTEM
    assert choose(TOPO, free, 3, policy="required", vm_numa_node=0) is None
    assert choose(TOPO, free, 3, policy="required").gpu_ids == (C[0], *D)
    assert choose(TOPO, free, 2, max_distance=Level.SWITCH, policy="any").gpu_ids == tuple(D)
    assert choose(TOPO, [A[1], B[1]], 2, max_distance=Level.SWITCH) is None
    assert choose(TOPO, free, 1, policy="preferred", vm_numa_node=1).gpu_ids == (C[0],)
    with pytest.raises(InvalidInput):
        choose(TOPO, free, 1, policy="nearby")


def test_quality_before_packing_within_tolerance() -> None:
    free = [A[1], *B, *C, *D]
    scores = dict.fromkeys(free, 1.0) | {A[1]: 0.5}
    assert choose(TOPO, free, 1, scores=scores).gpu_ids == (B[0],)  # the packing choice is clearly worse
    scores[A[1]] = 0.999
    assert choose(TOPO, free, 1, scores=scores, tolerance=0.01).gpu_ids == (A[1],)  # as good: pack


def test_losses_capacity_and_deployment_score() -> None:
    assert capacity(TOPO, IDS) == 1.0 and capacity(TOPO, []) == 0.0
    intact = block_losses(TOPO, IDS, [A[0]])
    partial = block_losses(TOPO, [A[1], *B, *C, *D], [A[1]])
    assert partial < intact
    free = [A[1], *B, *C, *D]
    good = deployment_score(TOPO, free, B, 2)
    spread = deployment_score(TOPO, free, [A[1], C[0]], 2)
    assert good > spread
    assert deployment_score(TOPO, free, B[:1], 2) < good  # half a request satisfies less
    pic = free_blocks(TOPO, free)
    assert pic[2].gpu_ids == tuple(B) and pic[8] is None


def _best_distance(topo: Topology, free: list[str], k: int) -> Level | None:
    return min((topo.set_distance(list(c)) for c in itertools.combinations(free, k)), default=None,
               key=lambda d: -1 if d is None else int(d))


@settings(max_examples=150, deadline=None)
@given(free=st.sets(st.sampled_from(IDS), min_size=1), k=st.integers(1, 8), objective=st.sampled_from(OBJECTIVES))
def test_choice_is_valid_and_as_close_as_possible(free: set[str], k: int, objective: str) -> None:
    ordered = sorted(free)
    c = choose(TOPO, ordered, k, policy="any", objective=objective)
    if k > len(free):
        assert c is None
        return
    assert c is not None and len(set(c.gpu_ids)) == k and set(c.gpu_ids) <= free
    assert c.distance == TOPO.set_distance(list(c.gpu_ids))
    best = _best_distance(TOPO, ordered, k)
    assert (c.distance is None and best is None) or c.distance == best


@settings(max_examples=100, deadline=None)
@given(free=st.sets(st.sampled_from(IDS), min_size=2), k=st.integers(2, 4))
def test_required_never_spans_nodes(free: set[str], k: int) -> None:
    c = choose(TOPO, sorted(free), k, policy="required")
    per_node = [sum(1 for g in free if TOPO.place(g).numa_node == n) for n in (0, 1)]
    if max(per_node) < k:
        assert c is None
    else:
        assert c is not None and len({TOPO.place(g).numa_node for g in c.gpu_ids}) == 1
