"""Test helpers for topology and probes: an agent rig with the topology routes, fake probe runners."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hostagent.domain.inventory import Gpu
from hostagent.host.fakeprobes import answer
from hostagent.host.probes import BANDWIDTH, MATMUL, RunnerResult
from hostagent.runtime import make_app
from hostagent.services.probes import ProbeSettings
from hostagent.web.topology import TOPOLOGY, TopologyParts
from tests.support.agent import AgentRig, make_rig

# dgx8's GPUs by switch, as the fake tree builds them (node 0: root bus 00, node 1: root bus 80)
SWITCH_A = ("gpu-0000-03-00-0", "gpu-0000-04-00-0")
SWITCH_B = ("gpu-0000-07-00-0", "gpu-0000-08-00-0")
SWITCH_C = ("gpu-0000-83-00-0", "gpu-0000-84-00-0")
SWITCH_D = ("gpu-0000-87-00-0", "gpu-0000-88-00-0")
NODE0 = SWITCH_A + SWITCH_B
NODE1 = SWITCH_C + SWITCH_D
ALL = NODE0 + NODE1


@dataclass
class FakeComputeRunner:
    """A compute runner whose measurements are set per GPU (TFLOP/s and GB/s), with optional run-to-run noise."""

    speeds: dict[str, float] = field(default_factory=dict)  # gpu_id -> factor on the nominal figures
    noise: list[float] = field(default_factory=lambda: [1.0])  # cycled per run
    problems: dict[str, tuple[str, ...]] = field(default_factory=dict)
    wrong: set[str] = field(default_factory=set)  # GPUs whose fp16 product is off in one entry (the known answer)
    calls: list[str] = field(default_factory=list)
    name: str = "fake-compute"
    kind: str = "compute"
    nominal: tuple[float, float] = (100.0, 1500.0)

    def unavailable(self) -> str | None:
        return None

    def run(self, gpu: Gpu, budget_s: float) -> RunnerResult:
        k = self.noise[len(self.calls) % len(self.noise)]
        self.calls.append(gpu.id)
        f = self.speeds.get(gpu.id, 1.0) * k
        wrong = answer("fp16", wrong=gpu.id in self.wrong)  # fast, and (when told) wrong
        return RunnerResult(self.name, metrics={MATMUL: self.nominal[0] * f, BANDWIDTH: self.nominal[1] * f},
                            problems=self.problems.get(gpu.id, ()) + ((wrong,) if wrong else ()))


@dataclass
class FakeHealthRunner:
    """A health runner reporting set problems per GPU."""

    problems: dict[str, tuple[str, ...]] = field(default_factory=dict)
    name: str = "fake-health"
    kind: str = "health"

    def unavailable(self) -> str | None:
        return None

    def run(self, gpu: Gpu, budget_s: float) -> RunnerResult:
        return RunnerResult(self.name, health={"temperature_c": 40}, problems=self.problems.get(gpu.id, ()))


def topology_rig(tmp: Path, *, runners: list[Any] | None = None, probe_settings: ProbeSettings | None = None,
                 **kw: Any) -> tuple[AgentRig, Any, TopologyParts]:
    """A rig over dgx8 (unless told) with the topology routes installed; returns (rig, app, parts)."""
    rig = make_rig(tmp, **kw)
    app = make_app(rig.runtime, probe_runners=runners if runners is not None else [FakeHealthRunner()],
                   probe_settings=probe_settings or ProbeSettings(enabled=False, period_s=0))
    parts = app[TOPOLOGY]
    assert rig.runtime.manager.place is rig.runtime.placer and rig.runtime.placer.topology_place is parts.placer
    return rig, app, parts
