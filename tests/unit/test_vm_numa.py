"""Where a VM lives on the host's NUMA nodes, from its domain XML: memory binding first, then vCPU pinning."""

from __future__ import annotations

import pytest

from hostagent.domain.numa import parse_cpuset, vm_numa

CELLS = {0: frozenset(range(0, 16)), 1: frozenset(range(16, 32))}


def dom(body: str, vcpus: str = "<vcpu>2</vcpu>") -> str:
    return f"<domain type='kvm'><name>v</name>{vcpus}{body}</domain>"


@pytest.mark.parametrize("text,cpus", [("0-3,8", {0, 1, 2, 3, 8}), ("0-3,^2", {0, 1, 3}), (" 5 ", {5}), ("", set())])
def test_cpusets_read_as_the_kernel_and_libvirt_write_them(text: str, cpus: set[int]) -> None:
    assert parse_cpuset(text) == cpus


@pytest.mark.parametrize("text", ["x", "3-1", "-1", "1-99999999"])
def test_a_bad_cpuset_is_an_error(text: str) -> None:
    with pytest.raises(ValueError):
        parse_cpuset(text)


def test_memory_bound_to_one_node_decides() -> None:
    got = vm_numa(dom("<numatune><memory mode='strict' nodeset='1'/></numatune>",
                      "<vcpu cpuset='0-3'>2</vcpu>"), CELLS)  # vCPUs elsewhere: DMA goes to guest memory
    assert got.node == 1 and "numatune strict nodeset=1" in got.why
    assert got.reason.startswith("VM on NUMA node 1")
    # no mode: libvirt's default, strict, is what the reason names
    assert "numatune strict nodeset=1" in vm_numa(dom("<numatune><memory nodeset='1'/></numatune>"), CELLS).why


def test_vcpus_all_on_one_node_decide_when_memory_is_unbound() -> None:
    assert vm_numa(dom("", "<vcpu cpuset='16-19'>4</vcpu>"), CELLS).node == 1
    pins = "<cputune><vcpupin vcpu='0' cpuset='2'/><vcpupin vcpu='1' cpuset='3-4'/></cputune>"
    got = vm_numa(dom(pins), CELLS)
    assert got.node == 0 and "CPUs 2-4" in got.why


@pytest.mark.parametrize("body,vcpus,why", [
    ("", "<vcpu>2</vcpu>", "not pinned"),
    ("<cputune><vcpupin vcpu='0' cpuset='2'/></cputune>", "<vcpu>2</vcpu>", "not pinned"),  # vCPU 1 floats
    ("<cputune><vcpupin vcpu='0' cpuset='2'/><vcpupin vcpu='1' cpuset='20'/></cputune>", "<vcpu>2</vcpu>",
     "across nodes 0-1"),
    ("<numatune><memory mode='interleave' nodeset='0-1'/></numatune>", "<vcpu>2</vcpu>", "memory on nodes 0-1"),
    ("<numatune><memory nodeset='0-1'/></numatune>", "<vcpu cpuset='1'>1</vcpu>", "its vCPUs on node 0"),
    ("", "<vcpu cpuset='64'>1</vcpu>", "no node the host lists"),
    ("", "<vcpu cpuset='x'>1</vcpu>", "unreadable pinning"),
    ("<cputune><vcpupin vcpu='0'/></cputune>", "<vcpu>1</vcpu>", "not pinned"),  # a pin without its cpuset
])
def test_anything_else_is_unknown_and_says_why(body: str, vcpus: str, why: str) -> None:
    got = vm_numa(dom(body, vcpus), CELLS)
    assert got.node is None and why in got.why, got
    assert got.reason.startswith("VM's NUMA node unknown")


def test_unreadable_xml_is_unknown() -> None:
    assert vm_numa("<domain", CELLS).node is None
