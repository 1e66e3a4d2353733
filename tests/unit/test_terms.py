"""The tenant's terms turned into a request the agent can place (hostagent.domain.terms), as pure functions."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from hostagent.domain.capabilities import Capabilities
from hostagent.domain.errors import Conflict
from hostagent.domain.lease import MAX_GPUS_PER_REQUEST, LeaseRequest
from hostagent.domain.terms import Scaling, check_requires, resolve_throughput


def test_a_scaling_limit_past_the_request_maximum_still_stops_at_the_maximum() -> None:
    """Records that say a task type gains up to 100 GPUs do not let one request have more than a request may."""
    rates = [1.0] * (MAX_GPUS_PER_REQUEST + 40)
    scaling = Scaling("resnet", {100: 100.0, 128: 101.0})  # past 100 GPUs it gains 1 %
    assert scaling.limit == 100
    request = LeaseRequest(task_type="resnet", target_work_rate=MAX_GPUS_PER_REQUEST + 2.0)
    with pytest.raises(Conflict) as err:
        resolve_throughput(request, rates, "v1", scaling)
    assert err.value.field == "target_work_rate"
    assert f"with {MAX_GPUS_PER_REQUEST} GPU(s)" in err.value.message, err.value.message


def test_a_requires_refusal_says_what_each_model_has_unknown_and_none_included() -> None:
    gpus: list[Any] = [SimpleNamespace(model="Mystery"), SimpleNamespace(model="Old"),
                       SimpleNamespace(model="T4")]
    caps = {"Mystery": Capabilities(None, "not in pci.ids"), "Old": Capabilities(frozenset(), "Maxwell"),
            "T4": Capabilities(frozenset({"int8", "fp16"}), "TU104")}
    with pytest.raises(Conflict) as err:
        check_requires(LeaseRequest(requires=("bf16",)), gpus, lambda g: caps[g.model])
    assert err.value.field == "requires"
    assert err.value.message == ("no GPU on this host has bf16 (its GPUs have: Mystery: unknown; Old: none; "
                                 "T4: fp16, int8)")
    check_requires(LeaseRequest(requires=("fp16",)), gpus, lambda g: caps[g.model])  # T4 has it: no refusal
