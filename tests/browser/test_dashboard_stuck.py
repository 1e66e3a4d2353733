"""The GPU's truth on its page, in Chromium: a leased GPU's functions show vfio-pci (and their host driver again once
given back), and a detach that never completes (one VM's guest ignores every unplug request) shows one banner (how
long it has been stuck, what the operator can do) while the lease and its GPU hold still at detach-pending through
the agent's retries instead of flapping, the retries read as one event line with a count."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from playwright.sync_api import Browser, expect

from hostagent.demo import prepare_demo
from hostagent.virt.sim import SimulatedHypervisor
from tests.support.dashboard import Demo, login, screenshot, start_demo

pytestmark = [pytest.mark.browser, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Demo]:
    base = tmp_path_factory.mktemp("stuck")
    state = base / "state"
    prepare_demo(state)  # the demo's host and VMs, then one of its guests made deaf to unplug requests
    hv = SimulatedHypervisor.load(state / "hypervisor.json")
    hv.set_refuse_detach("vm-foxtrot")
    hv.save()
    config = base / "hostagent.toml"
    config.write_text("[dashboard]\nrefresh_s = 1.0\n")
    d = start_demo(state, "--config", str(config))
    try:
        held = d.lease("vm-foxtrot", gpus=1, task_type="training")
        status, body = d.api("DELETE", f"/v1/leases/{held['id']}", d.vm_token("vm-foxtrot"))
        assert status == 202 and body["state"] == "DETACH_PENDING", body
        d.extra = {"held": held, "since": time.time()}  # type: ignore[attr-defined]
        yield d
    finally:
        d.stop()


def test_a_stuck_detach_shows_one_banner_and_holds_still(browser: Browser, demo: Demo) -> None:
    held = demo.extra["held"]  # type: ignore[attr-defined]
    gid = held["devices"][0]["gpu_id"]
    page = login(browser, demo, path=f"/ui/leases/{held['id']}")
    banner = page.locator(".stuck-banner")
    expect(banner).to_have_count(1)
    expect(banner).to_contain_text("Detach stuck for")
    expect(banner).to_contain_text("shut the VM")
    states: list[str] = []
    retried = page.locator("table.events td", has_text="detach retried")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and retried.count() == 0:  # two of the agent's retries (each waits 5 s)
        for _ in range(6):  # the head refreshes itself every second: its state, read twice a second
            states.append(page.locator("#lease-head h1 .badge").inner_text())
            expect(banner).to_have_count(1)
            page.wait_for_timeout(500)
        page.reload()  # the events table is drawn with the page
    assert retried.count() == 1, "two retries, one line"
    expect(retried).to_contain_text("detach retried 2 times over")
    assert states and set(states) == {"detach-pending"}, f"the lease's state flapped: {sorted(set(states))}"
    assert len(states) > 10
    screenshot(page, "lease-stuck-detach")
    gpu = login(browser, demo, path=f"/ui/gpus/{gid}")
    expect(gpu.locator(".stuck-banner")).to_have_count(1)
    expect(gpu.locator("h1 .badge")).to_have_text("detach-pending")


def test_a_leased_gpus_page_shows_its_functions_on_vfio_pci(browser: Browser, demo: Demo) -> None:
    lease = demo.lease("vm-alpha", gpus=1, task_type="inference")
    gid = lease["devices"][0]["gpu_id"]
    page = login(browser, demo, path=f"/ui/gpus/{gid}")
    drivers = page.locator("#gpu-head table.functions td:nth-child(3)")  # address, class, driver, name
    expect(drivers.first).to_have_text("vfio-pci")
    assert set(drivers.all_inner_texts()) == {"vfio-pci"}
    status, body = demo.api("DELETE", f"/v1/leases/{lease['id']}", demo.vm_token("vm-alpha"))
    assert status == 200 and body["state"] == "RELEASED", body
    page.reload()
    expect(drivers.first).not_to_have_text("vfio-pci")
    assert "vfio-pci" not in drivers.all_inner_texts()
