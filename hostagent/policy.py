"""Settings -> the lease driver's policy (`LeasePolicy`): quotas per VM and project, queue limits, fairness, priority
rules, bookings and preemption, as the [leases], [libvirt], [host], [reclaim] and [placement] keys say."""

from __future__ import annotations

from hostagent.config import Settings
from hostagent.domain.assignment import Fairness
from hostagent.domain.lease import Quota
from hostagent.services.admission import priority_rules
from hostagent.services.leases import LeasePolicy


def lease_policy(settings: Settings) -> LeasePolicy:
    """LeasePolicy from settings."""
    lz = settings.leases
    projects = tuple(
        (name, Quota(int(p.get("max_gpus", 0)), float(p.get("max_gpu_hours_per_day", 0)),
                     int(p["max_priority"]) if p.get("max_priority") is not None else None),
         tuple(str(d) for d in p.get("domains", ())))
        for name, p in lz.projects.items()
    )
    return LeasePolicy(
        default_duration_s=lz.default_duration_s, max_duration_s=lz.max_duration_s, queue_max=lz.queue_max,
        keep_on_domain_stop=lz.keep_on_domain_stop, detach_timeout_s=settings.libvirt.detach_timeout_s,
        detach_retries=settings.libvirt.detach_retries, guest_bus=settings.libvirt.guest_bus,
        rom_bar_off=settings.host.rom_bar_off, driver_vfio=settings.host.driver_vfio, guest_layout=settings.host.guest_layout,
        vm_quota=Quota(lz.max_gpus_per_vm, lz.max_gpu_hours_per_day_per_vm, lz.guest_max_priority),
        project_quotas=projects, queue_max_per_vm=lz.queue_max_per_vm, queue_max_wait_s=lz.queue_max_wait_s,
        pinned=frozenset(settings.host.pinned), preempt_min_priority=lz.preempt_min_priority,
        preempt_notice_s=settings.reclaim.notice_window_s, booking_horizon_s=lz.booking_horizon_s,
        cap_at_scaling_limit=settings.placement.cap_at_scaling_limit, booking_lead_s=lz.booking_lead_s,
        fairness=Fairness(lz.fairness_max_passes, lz.fairness_max_delay_s, enabled=lz.queue_order == "advantage"),
        priority_rules=priority_rules(lz.priority_rules), consolidate=lz.consolidate,
    )


__all__ = ["lease_policy"]
