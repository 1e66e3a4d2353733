"""placement.train_threads: the agent's scheduled retraining fits its trees on this many threads (scikit-learn's
OpenMP pool), not on a thread per CPU: a host's CPUs run its guests' vCPUs."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import sklearn.ensemble  # noqa: F401 - scikit-learn's OpenMP runtime loaded: threadpoolctl lists only what is
from threadpoolctl import threadpool_info

from hostagent.learn import lifecycle
from tests.support.agent import make_rig, start_rig


def openmp_threads() -> list[int]:
    """Each loaded OpenMP runtime's thread limit, as the calling thread sees it (an OpenMP limit is per thread)."""
    pools = [p["num_threads"] for p in threadpool_info() if p["user_api"] == "openmp"]
    assert pools, "scikit-learn's OpenMP runtime is not loaded"
    return pools


async def fit_threads(tmp: Path, aiohttp_client: Any, monkeypatch: pytest.MonkeyPatch,
                      **placement: Any) -> list[list[int]]:
    """An agent with these [placement] keys runs its scheduled retraining (Retrainer.scheduled, as its timer would); the
    OpenMP threads its training saw while it ran, once per call."""
    seen: list[list[int]] = []

    def train(store: Any, **kwargs: Any) -> lifecycle.TrainResult:
        seen.append(openmp_threads())
        return lifecycle.TrainResult("insufficient-records", None, {"records": 0})

    monkeypatch.setattr(lifecycle, "train", train)
    rig = await start_rig(make_rig(tmp, placement=placement), aiohttp_client)
    assert rig.runtime.settings.placement.train_threads == placement.get("train_threads", 1)
    await rig.runtime.retrainer.scheduled()
    return seen


async def test_the_scheduled_retraining_fits_on_placement_train_threads(
        tmp_path: Path, aiohttp_client: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Left out: one thread. 0: what any thread of the process gets (a thread per CPU, unless OMP_NUM_THREADS says
    otherwise). More than that default: that many (so the limit is told apart from the default on any machine)."""
    default = await asyncio.to_thread(openmp_threads)  # a worker thread's own, as Runtime.run's would be unlimited
    assert await fit_threads(tmp_path / "left-out", aiohttp_client, monkeypatch) == [[1] * len(default)]
    assert await fit_threads(tmp_path / "zero", aiohttp_client, monkeypatch, train_threads=0) == [default]
    more = max(default) + 1
    assert await fit_threads(tmp_path / "more", aiohttp_client, monkeypatch,
                             train_threads=more) == [[more] * len(default)]
