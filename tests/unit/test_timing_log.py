"""The lease driver's bounded step-timing log: positions stay valid as old entries drop out."""

from __future__ import annotations

from hostagent.services.leases import TimingLog


def test_bounded_and_read_by_position() -> None:
    log = TimingLog(maxlen=3)
    for i in range(5):
        log.append((f"step{i}", float(i)))
    assert len(log) == 3 and log.total == 5
    assert [k for k, _ in log.since(0)] == ["step2", "step3", "step4"]  # what dropped out is skipped
    assert [k for k, _ in log.since(4)] == ["step4"]
    assert [k for k, _ in log.since(2, 4)] == ["step2", "step3"]
    assert log.since(5) == [] and log.since(1, 2) == []


def test_a_reader_never_sees_an_entry_twice() -> None:
    log = TimingLog(maxlen=4)
    seen: list[str] = []
    mark = 0
    for i in range(30):
        log.append((f"s{i}", 0.0))
        if i % 7 == 6:  # the metrics listener reads now and then; the log wraps in between
            seen += [k for k, _ in log.since(mark)]
            mark = log.total
    assert len(seen) == len(set(seen)) and seen[-1] == "s27"
