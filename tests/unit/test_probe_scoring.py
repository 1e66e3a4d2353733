"""Pure probe maths: median of K runs, scores relative to peers, spread, quarantine verdicts, nvidia-smi rows."""

from __future__ import annotations

import subprocess

import pytest

from hostagent.host import probes
from hostagent.host.probes import COMPUTE, HEALTH, RunnerResult, _aer_counts, parse_smi_row, select_runners
from hostagent.services.probes import (
    ProbeSettings,
    combine_runs,
    judge,
    peer_reference,
    relative_score,
    score_spread,
)

def test_combine_runs_takes_each_metrics_median() -> None:
    runs = [{"a": 10.0, "b": 1.0}, {"a": 30.0, "b": 3.0}, {"a": 20.0}]
    assert combine_runs(runs) == {"a": 20.0, "b": 2.0}
    assert combine_runs([]) == {}

def test_relative_score_is_the_geometric_mean_of_ratios() -> None:
    assert relative_score({"a": 50.0, "b": 200.0}, {"a": 100.0, "b": 100.0}) == pytest.approx(1.0)
    assert relative_score({"a": 50.0}, {"a": 100.0, "b": 7.0}) == pytest.approx(0.5)
    assert relative_score({"a": 1.0}, {"b": 1.0}) is None
    assert relative_score({"a": 1.0}, {"a": 0.0}) is None

def test_peer_reference_excludes_the_gpu_itself() -> None:
    latest = {"g0": {"a": 100.0}, "g1": {"a": 90.0}, "g2": {"a": 110.0}, "g3": {}}
    ref, n = peer_reference(latest, "g0")
    assert ref == {"a": 100.0} and n == 2
    assert peer_reference({"g0": {"a": 1.0}}, "g0") == ({}, 0)

def test_spread_is_half_the_range_of_per_run_scores() -> None:
    assert score_spread([{"a": 90.0}, {"a": 110.0}, {"a": 100.0}], {"a": 100.0}) == pytest.approx(0.1)
    assert score_spread([{"a": 90.0}], {"a": 100.0}) == 0.0
    assert score_spread([], {"a": 1.0}) is None

def test_judge() -> None:
    s = ProbeSettings(quarantine_below=0.7, min_peers=2)
    assert judge(0.5, 3, [], s).quarantine and "0.50" in (judge(0.5, 3, [], s).reason or "")
    assert not judge(0.5, 1, [], s).quarantine  # too few peers to call it far below them
    assert not judge(0.9, 3, [], s).quarantine
    v = judge(1.0, 0, ["2 uncorrectable ECC error(s)"], s)
    assert v.quarantine and "ECC" in (v.reason or "")
    assert not judge(None, 5, ["x"], ProbeSettings(quarantine_on_errors=False)).quarantine

def test_parse_smi_row_and_aer() -> None:
    row = parse_smi_row("00000000:3B:00.0, 41, 0, No, Not Active, 4, 4, 8, 16")
    assert row["pci.bus_id"] == "00000000:3b:00.0" and row["temperature.gpu"] == 41
    assert row["pcie.link.width.current"] == 8 and row["retired_pages.pending"] == "No"
    assert "ecc.errors.uncorrected.volatile.total" in row
    assert "temperature.gpu" not in parse_smi_row("00000000:3B:00.0, [N/A]")
    assert _aer_counts("RxErr 2\nBadTLP 0\nTOTAL_ERR_COR 2\n") == {"RxErr": 2, "BadTLP": 0, "TOTAL_ERR_COR": 2}

class R:
    def __init__(self, name: str, kind: str, why: str | None) -> None:
        self.name, self.kind, self.why, self.asked = name, kind, why, 0

    def unavailable(self) -> str | None:
        self.asked += 1
        return self.why

    def run(self, gpu: object, budget_s: float) -> RunnerResult:
        return RunnerResult(self.name)

def test_select_runners_prefers_nvml_and_one_compute_runner() -> None:
    chosen, status = select_runners([R("sysfs", HEALTH, None), R("nvml", HEALTH, None), R("nvidia-smi", HEALTH, None),
                                     R("torch", COMPUTE, "PyTorch is not installed"), R("cupy", COMPUTE, None),
                                     R("other", COMPUTE, None)])
    assert [r.name for r in chosen] == ["sysfs", "nvml", "cupy"]
    why = {s.name: s.reason for s in status}
    assert why["torch"] == "PyTorch is not installed" and "NVML is available" in (why["nvidia-smi"] or "")
    assert "another compute runner" in (why["other"] or "")


def test_a_compute_runner_after_the_chosen_one_is_not_asked() -> None:
    """Asking PyTorch or CuPy costs a child process that imports the library: not done for a runner that would not
    be used (the simulated runner comes first on a fake host, so the demo and the tests start without it)."""
    first, torch, cupy = R("sim", COMPUTE, None), R("torch", COMPUTE, None), R("cupy", COMPUTE, None)
    chosen, status = select_runners([first, R("sysfs", HEALTH, None), torch, cupy])
    assert [r.name for r in chosen] == ["sim", "sysfs"] and (first.asked, torch.asked, cupy.asked) == (1, 0, 0)
    assert [s.available for s in status] == [True, True, False, False]


@pytest.mark.parametrize(("rc", "out", "err", "why"), [
    (0, '{"unavailable": null}\n', "", None),
    (0, 'a warning\n{"unavailable": "PyTorch sees no CUDA device"}\n', "", "PyTorch sees no CUDA device"),
    (0, "not json\n", "", "the torch check printed no answer: not json"),
    (0, "", "", "the torch check exited 0: "),
    (1, "", "ImportError: libcuda.so.1", "the torch check exited 1: ImportError: libcuda.so.1"),
])
def test_the_child_cuda_check_reads_its_last_line_or_says_what_went_wrong(
        monkeypatch: pytest.MonkeyPatch, rc: int, out: str, err: str, why: str | None) -> None:
    seen: list[list[str]] = []

    def run(cmd: list[str], **kw: object) -> subprocess.CompletedProcess[str]:
        seen.append(cmd)
        return subprocess.CompletedProcess(cmd, rc, out, err)

    monkeypatch.setattr(probes.subprocess, "run", run)
    assert probes.cuda_check_in_child("torch") == why
    assert seen[0][1:] == ["-m", "hostagent.host.probes", "--check", "torch"]
