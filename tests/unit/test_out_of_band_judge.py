"""domain.out_of_band.judge: what each change the agent did not make calls for (issue #19)."""

from __future__ import annotations

from hostagent.domain.out_of_band import Finding, Touch, judge

G = "gpu-0000-84-00-0"
A, B = "0000:84:00.0", "0000:84:00.1"


def one(touched: dict[str, Touch], drivers: dict[str, str | None], missing: frozenset[str] = frozenset(),
        **kw: object) -> Finding | None:
    found = judge(G, touched, drivers, missing, **kw)  # type: ignore[arg-type]
    assert len(found) <= 1, found
    return found[0] if found else None


def test_a_removed_function_is_a_quarantine_with_the_lease_that_held_it() -> None:
    f = one({A: Touch("remove", "vfio-pci")}, {A: None}, frozenset({A}), lease_id="l-1")
    assert f is not None and (f.change, f.mark, f.lease_id, f.address) == ("removed", "quarantine", "l-1", A)
    assert "gone from the PCI bus" in f.reason and "l-1" in f.reason and "rescan" in f.reason
    free = one({A: Touch("remove", "nvidia")}, {A: None}, frozenset({A}))
    assert free is not None and free.lease_id is None and free.mark == "quarantine" and "lease" not in free.reason


def test_a_function_back_on_the_bus_is_recorded_without_a_mark() -> None:
    f = one({A: Touch("add")}, {A: "nvidia"})
    assert f is not None and (f.change, f.mark) == ("returned", "") and "nvidia" in f.reason
    assert "none" in one({A: Touch("add")}, {A: None}).reason  # type: ignore[union-attr]
    # a remove then an add seen together, the function still gone: the removal wins
    assert one({A: Touch("add")}, {A: None}, frozenset({A})).change == "removed"  # type: ignore[union-attr]


def test_a_leased_function_changed_by_someone_else_marks_the_gpu_and_the_lease() -> None:
    unbound = one({A: Touch("unbind", "vfio-pci")}, {A: None}, lease_id="l-1")
    assert unbound is not None and (unbound.change, unbound.mark, unbound.lease_id) == ("unbound", "attention", "l-1")
    assert unbound.reason == f"{A} was unbound from vfio-pci outside the agent while lease l-1 held it"
    rebound = one({A: Touch("bind", "vfio-pci", driver="nvidia")}, {A: "nvidia"}, lease_id="l-1")
    assert rebound is not None and rebound.change == "rebound"
    assert rebound.reason == f"{A} was bound to nvidia outside the agent while lease l-1 held it"
    back = one({A: Touch("bind", "vfio-pci", driver="vfio-pci")}, {A: "vfio-pci"}, lease_id="l-1")
    assert back is not None and back.change == "unbound" and "unbound and bound to vfio-pci again" in back.reason
    assert "(now" not in back.reason
    # the lease that held it when the change came counts even when it has ended by the time the agent looks, and
    # what the agent then did to the function (gave it back to its host driver) is said apart
    late = one({A: Touch("unbind", "vfio-pci", held_by="l-2")}, {A: "nvidia"})
    assert late is not None and (late.change, late.lease_id, late.mark) == ("unbound", "l-2", "attention")
    assert late.reason == f"{A} was unbound from vfio-pci outside the agent while lease l-2 held it (now on nvidia)"
    gone = one({A: Touch("bind", None, held_by="l-2", driver="nouveau")}, {A: None})
    assert gone is not None and gone.reason.endswith("(now unbound)") and "bound to nouveau" in gone.reason
    # ... and it is that lease, not a newer one, that is named
    assert one({A: Touch("unbind", None, held_by="l-2")}, {A: None}, lease_id="l-3").lease_id == "l-2"  # type: ignore[union-attr]
    unknown = one({A: Touch("unbind", None)}, {A: None}, lease_id="l-1")
    assert unknown is not None and "unbound from its driver" in unknown.reason
    nameless = one({A: Touch("bind", None)}, {A: "x"}, lease_id="l-1")
    assert nameless is not None and "bound to another driver" in nameless.reason and nameless.change == "rebound"


def test_a_free_gpu_handed_to_vfio_by_hand_needs_attention_unless_pinned() -> None:
    f = one({A: Touch("bind", None)}, {A: "vfio-pci"})
    assert f is not None and (f.change, f.mark, f.lease_id) == ("vfio-bound", "attention", None)
    assert "outside the agent" in f.reason
    assert one({A: Touch("bind", None)}, {A: "vfio-pci"}, pinned=frozenset({A})) is None
    assert one({A: Touch("bind", None)}, {A: "vfio-pci"}, pinned=frozenset({B})) is not None


def test_a_free_gpu_unbound_from_its_host_driver_needs_attention_but_harmless_moves_do_not() -> None:
    f = one({A: Touch("unbind", "nvidia")}, {A: None})
    assert f is not None and (f.change, f.mark) == ("unbound", "attention") and "from nvidia" in f.reason
    assert one({A: Touch("unbind", "vfio-pci")}, {A: None}) is None  # given back from vfio-pci by hand
    assert one({A: Touch("unbind", None)}, {A: None}) is None  # it had no driver (or none known)
    assert one({A: Touch("bind", "nouveau")}, {A: "nvidia"}) is None  # host driver to host driver


def test_only_touched_functions_are_judged_in_address_order() -> None:
    found = judge(G, {B: Touch("bind", None), A: Touch("remove", "nvidia")}, {A: None, B: "vfio-pci"},
                  frozenset({A}))
    assert [(f.address, f.change) for f in found] == [(A, "removed"), (B, "vfio-bound")]
    assert judge(G, {}, {A: "vfio-pci"}, frozenset()) == []
    assert found[0].to_dict() == {"change": "removed", "gpu_id": G, "address": A, "mark": "quarantine",
                                  "reason": found[0].reason, "lease_id": None}
