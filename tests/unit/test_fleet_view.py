"""The fleet page's totals (`services.fleet.fleet_view`) from store rows, computed by hand."""

from __future__ import annotations

from typing import Any

from hostagent.services.fleet import STATES, fleet_view


def host(hid: str, states: list[str], *, util: tuple[float, int] | None = None, last_seen: float = 100.0,
         queue: int = 0, active: int = 0) -> dict[str, Any]:
    info: dict[str, Any] = {"publish_interval_s": 10.0, "queue": queue, "active_leases": active}
    if util is not None:
        info["util"] = {"mean_pct": util[0], "reporting": util[1]}
    return {"id": hid, "last_seen": last_seen, "info": info,
            "gpus": [{"gpu_id": f"g{i}", "state": s, "model": "H100"} for i, s in enumerate(states)]}


def test_the_fleet_utilisation_is_the_mean_over_every_reporting_gpu_of_every_host() -> None:
    """70 % over 2 GPUs and 40 % over 1: (140 + 40) / 3 = 60 %, weighted by GPUs, not a mean of hosts' means
    (55 %); a host whose GPUs report nothing does not pull it down."""
    view = fleet_view([host("a", ["leased", "leased", "free"], util=(70.0, 2)),
                       host("b", ["leased", "free"], util=(40.0, 1)),
                       host("c", ["free"], util=(0.0, 0))], 105.0, this_host="a", interval_s=10.0)
    assert view["totals"]["util_pct"] == 60.0
    assert view["totals"]["util_reporting"] == 3


def test_no_reporting_gpu_anywhere_gives_no_fleet_utilisation() -> None:
    view = fleet_view([host("a", ["free"]), host("b", ["free"], util=(50.0, 0))], 105.0, this_host="a",
                      interval_s=10.0)
    assert view["totals"]["util_pct"] is None and view["totals"]["util_reporting"] == 0


def test_the_totals_count_every_state_and_keep_the_known_ones_at_zero() -> None:
    """Every state the page knows stays as a column (0 where no GPU is in it); one it does not know (an agent
    newer than the reader) is shown only where a GPU has it."""
    view = fleet_view([host("a", ["leased", "free", "free"], queue=2, active=1),
                       host("b", ["quarantined", "rebooting"], queue=1, active=0, last_seen=0.0)],
                      105.0, this_host="a", interval_s=10.0)
    t = view["totals"]
    assert t["states"] == {**{s: 0 for s in STATES}, "free": 2, "leased": 1, "quarantined": 1, "rebooting": 1}
    assert list(t["states"])[:len(STATES)] == STATES
    assert view["states"] == [*STATES, "rebooting"]
    assert (t["hosts"], t["gpus"], t["queue"], t["active_leases"], t["stale"]) == (2, 5, 3, 1, 1)
    assert [h["id"] for h in view["hosts"]] == ["a", "b"]

