"""The crash points' counting (services.faults): `name@N` kills at the Nth time the point is reached, and only
then; the kill -9 tests (tests/adapters/test_crash_matrix.py) rely on it to land between two functions of a group."""

from __future__ import annotations

import signal

import pytest

from hostagent.services import faults


@pytest.fixture
def kills(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    seen: list[int] = []
    monkeypatch.setattr(faults.os, "kill", lambda pid, sig: seen.append(sig))
    monkeypatch.setattr(faults, "_reached", faults.Counter())
    return seen


def test_the_nth_time_and_no_other(monkeypatch: pytest.MonkeyPatch, kills: list[int]) -> None:
    monkeypatch.setenv(faults.CRASH_ENV, "bind:probe@2")
    faults.crash_point("bind:probe")
    assert kills == []
    faults.crash_point("bind:unbind")  # another point does not count
    assert kills == []
    faults.crash_point("bind:probe")
    assert kills == [signal.SIGKILL]
    faults.crash_point("bind:probe")  # the third time: past it
    assert kills == [signal.SIGKILL]


def test_without_a_count_the_first_time_and_without_the_variable_never(monkeypatch: pytest.MonkeyPatch,
                                                                        kills: list[int]) -> None:
    faults.crash_point("detach:sent")
    assert kills == []
    monkeypatch.setenv(faults.CRASH_ENV, "detach:sent")
    faults.crash_point("after-attach")
    assert kills == []
    faults.crash_point("detach:sent")
    assert kills == [signal.SIGKILL]
