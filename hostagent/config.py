"""Configuration: one TOML file plus HOSTAGENT_<SECTION>__<KEY> environment overrides, validated into frozen settings."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shlex
import socket
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hostagent.domain.assignment import Fairness
from hostagent.domain.errors import ConfigError
from hostagent.domain.lease import DEFAULT_DURATION_S

DEFAULT_CONFIG_PATH = Path("/etc/hostagent/hostagent.toml")
ENV_PREFIX = "HOSTAGENT_"


@dataclass(frozen=True)
class AgentSettings:
    """[agent]: identity, state and the HTTP listener."""

    host_id: str = field(default_factory=socket.gethostname)
    state_dir: str = "/var/lib/hostagent"
    listen: str = "127.0.0.1"
    port: int = 8470
    tls_cert: str = ""
    tls_key: str = ""
    allow_plain_http: bool = False  # plain HTTP off loopback needs this
    log_format: str = "auto"  # auto | json | text
    log_level: str = "INFO"
    max_body_bytes: int = 1_048_576
    body_timeout_s: float = 10.0  # a client that does not finish sending its body in this time gets 408
    header_timeout_s: float = 10.0  # request line + headers not all in this long after connect / their first byte: 408
    idle_timeout_s: float = 75.0  # a keep-alive connection idle this long between requests is closed
    max_connections: int = 256  # open HTTP connections at most; one more gets 503 and is closed
    max_connections_per_source: int = 32  # open connections from one client address at most; one more gets 429
    max_inflight_per_token: int = 8  # a guest token's requests being handled at once at most; one more gets 429
    guest_requests_per_s: float = 50.0  # a guest's sustained request rate (bursts of 10 s of it; long lists cost more)
    metrics_listen: str = ""  # "": /metrics on the API port, operator token required; "host:port": its own listener
    gc_freeze: bool = True  # after start (and each model swap), freeze the heap out of the collector's reach
    public_url: str = ""  # this agent's dashboard as other hosts (the fleet page) link to it; "": the bound address


@dataclass(frozen=True)
class HostSettings:
    """[host]: where the kernel's interfaces are and what counts as a GPU."""

    sysfs_root: str = "/sys"
    kernel: str = "sysfs"  # sysfs: the running kernel | fake: the fake kernel over a fake tree (the demo, test rigs)
    dev_root: str = ""  # default: /dev, or <sysfs_root>/../dev for a fake tree
    proc_root: str = ""  # default: /proc, or <sysfs_root>/../proc for a fake tree
    pci_ids_path: str = "/usr/share/misc/pci.ids"
    gpu_vendors: tuple[str, ...] = ("10de", "1002")
    group_allow_list: tuple[str, ...] = ()  # "vendor:device" hex pairs allowed to share a GPU's group
    step_timeout_s: float = 10.0
    rom_bar_off: bool = False
    driver_vfio: bool = True
    guest_layout: str = "auto"  # auto (libvirt picks hot-pluggable addresses) | multifunction | per-function
    pinned: tuple[str, ...] = ()  # PCI addresses an operator keeps on vfio-pci outside any lease
    nvlink_hints: str = ""  # path of a file naming NVLink peers
    allow_boot_vga: bool = False  # lease the firmware's boot display device too
    no_reset: str = "warn"  # a GPU with no reset method: warn | refuse


@dataclass(frozen=True)
class LibvirtSettings:
    """[libvirt]: the hypervisor connection."""

    uri: str = "qemu:///system"
    detach_timeout_s: float = 30.0
    detach_retries: int = 3
    guest_bus: int = 0  # guest PCI bus where hostdevs go (0 on i440fx; a root port bus on q35)


@dataclass(frozen=True)
class StoreSettings:
    """[store]: the usage store."""

    url: str = ""  # default: sqlite:///<state_dir>/usage.sqlite3
    auto_upgrade: bool = True
    spool_path: str = ""  # default: <state_dir>/spool.sqlite3
    queue_max: int = 20_000
    samples_per_lease_per_s: float = 20.0  # a lease's sustained heartbeat sample rate (bursts of 60 s of it); over: 429
    ingest_share: float = 0.25  # the part of queue_max one VM's samples may fill; over: 429 for that VM only
    flush_interval_s: float = 1.0
    flush_batch: int = 1000
    raw_retention_days: int = 30
    minute_retention_days: int = 90
    max_lag_s: float = 60.0  # readiness turns degraded when the mirror or the sample queue is further behind
    fleet_publish_interval_s: float = 15.0  # this agent's live state (GPU states, queue, model...) to the store


@dataclass(frozen=True)
class LeaseSettings:
    """[leases]: lifetimes, queueing, quotas."""

    default_duration_s: int = DEFAULT_DURATION_S
    max_duration_s: int = 7 * 24 * 3600
    queue_max: int = 1000
    queue_max_per_vm: int = 32  # a VM's share of the queue; 0: the whole queue
    queue_max_wait_s: float = 86400.0  # a queued request without not_after gives up after this long; 0: never
    guest_max_priority: int = 0  # the highest priority a guest may ask for itself (projects may raise it)
    keep_on_domain_stop: bool = False  # keep leases (and vfio binding) when the VM shuts down; a guest reboot never ends them
    preempt_min_priority: int = 0  # 0: never preempt; else priorities >= this may preempt lower ones
    max_gpus_per_vm: int = 0  # 0: no quota
    max_gpu_hours_per_day_per_vm: float = 0.0  # 0: no quota
    projects: dict[str, dict[str, Any]] = field(default_factory=dict)  # project -> {domains, max_gpus, ...}
    # rule -> {priority, and any of task_type, project, domains, max_duration_s}: the priority of a request that
    # states none, from the first rule (in file order) it matches
    priority_rules: dict[str, dict[str, Any]] = field(default_factory=dict)
    numa_policy: str = "preferred"  # required | preferred | any, for multi-GPU requests
    queue_order: str = "advantage"  # advantage (comparative advantage, bounded) | strict (serve order only)
    fairness_max_passes: int = Fairness().max_passes  # a queued request passed over this often is served in turn
    fairness_max_delay_s: float = Fairness().max_delay_s  # ... or once first passed over this long ago
    booking_horizon_s: float = 30 * 86400.0  # how far ahead a booking (start_at) may start
    booking_lead_s: float = 30.0  # a booking binds at least this long before its start (longer if grants are slower)
    consolidate: bool = False  # perform (not only propose) the moves that free a block for a request on scattered GPUs
    journal_retention_days: int = 90  # ended leases (and their events) kept in the journal; 0: forever


@dataclass(frozen=True)
class ReclaimSettings:
    """[reclaim]: the two-strike idle detector."""

    enabled: bool = True
    check_interval_s: float = 3600.0
    grace_s: float = 1200.0
    idle_util_pct: float = 5.0
    memory_counts_busy: bool = True
    min_lease_age_s: float = 600.0
    no_heartbeat: str = "host-signal"  # host-signal | never-idle
    guest_busy_host_idle: str = "flag"  # guest busy, host flat: flag (guest wins) | reclaim (host wins)
    host_signal: str = "auto"  # auto (detect IRQ bypass) | trusted | untrusted
    notice_window_s: float = 60.0
    per_priority: dict[str, dict[str, float]] = field(default_factory=dict)  # "10" -> {check_interval_s=..}


@dataclass(frozen=True)
class PlacementSettings:
    """[placement]: the learned scorer."""

    outcome: str = "work_rate"  # work_rate | utilization | completion
    min_records: int = 30
    explore_epsilon: float = 0.05
    # before the first model (the cold-start rule, which predicts nothing): a random GPU this often, so the first
    # model learns more than the pairs the rule favours (the simulator's `model` evaluates the same, learn.simulate)
    cold_explore_epsilon: float = 0.3
    explore_max_priority: int = 5  # no exploration for requests above this priority
    retrain_interval_s: float = 6 * 3600.0
    # and as the records grow: the first model once min_records leases have finished, then each time the finished
    # leases reach this multiple of those the model in use was trained at (0: the interval alone; services.retraining)
    retrain_growth: float = 2.0
    model_check_interval_s: float = 30.0  # the running agent follows the store's active model version this often
    objective: str = "pack"  # among equally good sets: pack (keep whole free blocks) | spread (share links least)
    objective_per_task: dict[str, str] = field(default_factory=dict)  # task_type -> pack | spread
    cap_at_scaling_limit: bool = False  # cut a request to where its task type's records stop gaining
    train_threads: int = 1  # the scheduled retraining's fit threads (0: a thread per CPU); the CPUs are the guests'


@dataclass(frozen=True)
class ProbesSettings:
    """[probes]: what the operator adds to the built-in probes."""

    # task type -> command (an absolute path, then its arguments): the task's own probe (services.task_probes)
    task_probes: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class DashboardSettings:
    """[dashboard]: how the operators' web pages stay current."""

    refresh_s: float = 5.0  # open pages fetch fresh data this often (the leases table and GPU pages every 2x that)
    stale_after_s: float = 60.0  # a guest heartbeat older than this is stale (2x the guest agent's 30 s interval)


@dataclass(frozen=True)
class AuthSettings:
    """[auth]: the operator credential (its SHA-256; tokens for VMs live in the store)."""

    operator_token_sha256: str = ""


@dataclass(frozen=True)
class Settings:
    """Every setting, validated and frozen at start."""

    agent: AgentSettings = field(default_factory=AgentSettings)
    host: HostSettings = field(default_factory=HostSettings)
    libvirt: LibvirtSettings = field(default_factory=LibvirtSettings)
    store: StoreSettings = field(default_factory=StoreSettings)
    leases: LeaseSettings = field(default_factory=LeaseSettings)
    reclaim: ReclaimSettings = field(default_factory=ReclaimSettings)
    placement: PlacementSettings = field(default_factory=PlacementSettings)
    probes: ProbesSettings = field(default_factory=ProbesSettings)
    auth: AuthSettings = field(default_factory=AuthSettings)
    dashboard: DashboardSettings = field(default_factory=DashboardSettings)

    # Derived paths: one place decides the defaults that depend on other keys.
    @property
    def state_dir(self) -> Path:
        """The agent's state directory."""
        return Path(self.agent.state_dir)

    @property
    def dev_root(self) -> Path:
        """/dev, or the fake tree's dev beside its sysfs root."""
        if self.host.dev_root:
            return Path(self.host.dev_root)
        return Path("/dev") if self.host.sysfs_root == "/sys" else Path(self.host.sysfs_root).parent / "dev"

    @property
    def proc_root(self) -> Path:
        """/proc, or the fake tree's proc beside its sysfs root."""
        if self.host.proc_root:
            return Path(self.host.proc_root)
        return Path("/proc") if self.host.sysfs_root == "/sys" else Path(self.host.sysfs_root).parent / "proc"

    @property
    def store_url(self) -> str:
        """SQLAlchemy URL of the usage store."""
        return self.store.url or f"sqlite:///{self.state_dir / 'usage.sqlite3'}"

    @property
    def spool_path(self) -> Path:
        """Local spool used while MySQL is unreachable."""
        return Path(self.store.spool_path) if self.store.spool_path else self.state_dir / "spool.sqlite3"

    def replace(self, **sections: dict[str, Any]) -> Settings:
        """A copy with some keys changed, validated like a file: `replace(agent={"port": 0})`."""
        raw = settings_to_dict(self)
        for name, values in sections.items():
            raw.setdefault(name, {}).update(values)
        return settings_from_dict(raw)


_CHOICES: dict[str, tuple[str, ...]] = {
    "agent.log_format": ("auto", "json", "text"),
    "agent.log_level": ("DEBUG", "INFO", "WARNING", "ERROR"),
    "leases.numa_policy": ("required", "preferred", "any"),
    "leases.queue_order": ("advantage", "strict"),
    "host.guest_layout": ("auto", "multifunction", "per-function"),
    "host.kernel": ("sysfs", "fake"),
    "host.no_reset": ("warn", "refuse"),
    "reclaim.no_heartbeat": ("host-signal", "never-idle"),
    "reclaim.guest_busy_host_idle": ("flag", "reclaim"),
    "reclaim.host_signal": ("auto", "trusted", "untrusted"),
    "placement.outcome": ("work_rate", "utilization", "completion"),
    "placement.objective": ("pack", "spread"),
}
REMOVED = {  # keys older versions documented, and why a file that sets one must change
    "placement.model_dir": "placement models are kept in the usage store with their figures "
                           "(`hostagent model show`, `hostagent model rollback`); remove the key",
}
_POSITIVE = {
    "agent.max_body_bytes", "agent.body_timeout_s", "agent.header_timeout_s", "agent.idle_timeout_s",
    "agent.max_connections", "agent.max_connections_per_source", "agent.max_inflight_per_token", "agent.guest_requests_per_s",
    "store.samples_per_lease_per_s", "store.ingest_share", "host.step_timeout_s", "libvirt.detach_timeout_s", "store.queue_max",
    "store.flush_interval_s", "store.flush_batch", "store.max_lag_s", "leases.default_duration_s", "leases.max_duration_s",
    "store.fleet_publish_interval_s",
    "reclaim.check_interval_s", "reclaim.grace_s", "placement.retrain_interval_s",
    "leases.fairness_max_passes", "leases.fairness_max_delay_s", "leases.booking_horizon_s", "leases.booking_lead_s",
    "placement.model_check_interval_s",
    "dashboard.refresh_s", "dashboard.stale_after_s",
}


def _coerce(key: str, value: Any, hint: Any) -> Any:
    """Check one value against its type hint; raise ConfigError naming the key."""
    origin = typing.get_origin(hint)
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected true or false, got {value!r}", field=key)
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected an integer, got {value!r}", field=key)
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise ConfigError(f"{key}: expected a number, got {value!r}", field=key)
    if hint is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{key}: expected a string, got {value!r}", field=key)
    if origin is tuple:
        if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
            return tuple(value)
        raise ConfigError(f"{key}: expected a list of strings, got {value!r}", field=key)
    if origin is dict:
        if isinstance(value, dict):
            return dict(value)
        raise ConfigError(f"{key}: expected a table, got {value!r}", field=key)
    raise ConfigError(f"{key}: unsupported setting type", field=key)  # pragma: no cover


def settings_from_dict(raw: dict[str, Any]) -> Settings:
    """Validate a parsed TOML document into Settings; unknown sections or keys are errors."""
    if not isinstance(raw, dict):
        raise ConfigError("configuration must be a TOML table")
    sections: dict[str, Any] = {}
    section_types = {f.name: f.type for f in dataclasses.fields(Settings)}
    hints_by_section = typing.get_type_hints(Settings)
    for name, values in raw.items():
        if name not in section_types:
            raise ConfigError(
                f"unknown section [{name}]; known sections: {', '.join(sorted(section_types))}", field=name
            )
        if not isinstance(values, dict):
            raise ConfigError(f"[{name}] must be a table", field=name)
        cls = hints_by_section[name]
        hints = typing.get_type_hints(cls)
        kwargs: dict[str, Any] = {}
        for key, value in values.items():
            full = f"{name}.{key}"
            if full in REMOVED:
                raise ConfigError(f"{full} is no longer a setting: {REMOVED[full]}", field=full)
            if key not in hints:
                raise ConfigError(
                    f"unknown key {full}; keys of [{name}]: {', '.join(sorted(hints))}", field=full
                )
            v = _coerce(full, value, hints[key])
            if full in _CHOICES and v not in _CHOICES[full]:
                raise ConfigError(f"{full}: must be one of {', '.join(_CHOICES[full])}, got {v!r}", field=full)
            if full in _POSITIVE and v <= 0:
                raise ConfigError(f"{full}: must be greater than 0, got {v!r}", field=full)
            kwargs[key] = v
        sections[name] = cls(**kwargs)
    settings = Settings(**sections)
    _check_cross(settings)
    return settings


def metrics_address(value: str) -> tuple[str, int]:
    """agent.metrics_listen as (host, port): "127.0.0.1:9470", "[::1]:9470" or ":9470" (loopback)."""
    host, sep, port = value.rpartition(":")
    host = host.strip("[]") or "127.0.0.1"
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(f"agent.metrics_listen: expected host:port, got {value!r}", field="agent.metrics_listen")
    return host, int(port)


def _check_cross(s: Settings) -> None:
    """Rules that involve more than one key."""
    for task, command in s.probes.task_probes.items():
        where = f"probes.task_probes.{task}"
        if not re.fullmatch(r"[A-Za-z0-9_.:-]{1,64}", task):
            raise ConfigError(f"{where}: a task type is 1-64 letters, digits, '_', '.', ':' or '-'", field=where)
        try:
            argv = shlex.split(command) if isinstance(command, str) else []
        except ValueError as exc:
            raise ConfigError(f"{where}: not a command line: {exc}", field=where) from None
        if not argv or not argv[0].startswith("/"):
            raise ConfigError(f"{where}: a command line that starts with an absolute path, got {command!r}",
                              field=where)
    for task, objective in s.placement.objective_per_task.items():
        if objective not in _CHOICES["placement.objective"]:
            raise ConfigError(f"placement.objective_per_task.{task}: must be one of "
                              f"{', '.join(_CHOICES['placement.objective'])}, got {objective!r}",
                              field=f"placement.objective_per_task.{task}")
    if not (0 <= s.agent.port <= 65535):
        raise ConfigError(f"agent.port: must be 0..65535, got {s.agent.port}", field="agent.port")
    if s.agent.header_timeout_s > s.agent.idle_timeout_s:
        raise ConfigError("agent.header_timeout_s must not exceed agent.idle_timeout_s (the idle timer would close a "
                          "silent new connection first, without the 408)", field="agent.header_timeout_s")
    if s.store.ingest_share > 1:
        raise ConfigError("store.ingest_share: a part of store.queue_max, 0 < share <= 1", field="store.ingest_share")
    if s.agent.metrics_listen:
        metrics_address(s.agent.metrics_listen)
    if s.agent.public_url and not re.fullmatch(r"https?://[^\s/?#]+(/[^\s?#]*)?", s.agent.public_url):
        raise ConfigError(f"agent.public_url: expected an http:// or https:// URL with no query, got "
                          f"{s.agent.public_url!r}", field="agent.public_url")
    if bool(s.agent.tls_cert) != bool(s.agent.tls_key):
        raise ConfigError("agent.tls_cert and agent.tls_key must be set together", field="agent.tls_cert")
    for v in s.host.gpu_vendors:
        if len(v) != 4 or any(c not in "0123456789abcdefABCDEF" for c in v):
            raise ConfigError(f"host.gpu_vendors: {v!r} is not a 4-digit hex PCI vendor id", field="host.gpu_vendors")
    for pair in s.host.group_allow_list:
        parts = pair.split(":")
        if len(parts) != 2 or not all(len(p) == 4 for p in parts):
            raise ConfigError(
                f"host.group_allow_list: {pair!r} is not vendor:device hex (e.g. 10de:22ba)", field="host.group_allow_list"
            )
    if not 0 <= s.reclaim.idle_util_pct <= 100:
        raise ConfigError("reclaim.idle_util_pct: must be 0..100", field="reclaim.idle_util_pct")
    if not 0 <= s.placement.explore_epsilon <= 0.5:
        raise ConfigError("placement.explore_epsilon: must be 0..0.5", field="placement.explore_epsilon")
    if not 0 <= s.placement.cold_explore_epsilon <= 1:
        raise ConfigError("placement.cold_explore_epsilon: must be 0..1", field="placement.cold_explore_epsilon")
    if s.placement.retrain_growth != 0 and not s.placement.retrain_growth > 1:
        raise ConfigError("placement.retrain_growth: must be 0 (off) or above 1", field="placement.retrain_growth")
    if not 0 <= s.placement.train_threads <= 1024:
        raise ConfigError(f"placement.train_threads: must be 0 (a thread per CPU) or 1..1024, got "
                          f"{s.placement.train_threads}", field="placement.train_threads")
    if s.leases.journal_retention_days < 0:
        raise ConfigError("leases.journal_retention_days: must be 0 (keep forever) or more",
                          field="leases.journal_retention_days")
    if s.leases.default_duration_s > s.leases.max_duration_s:
        raise ConfigError(
            "leases.default_duration_s must not exceed leases.max_duration_s", field="leases.default_duration_s"
        )
    for key in ("queue_max_per_vm", "queue_max_wait_s", "max_gpus_per_vm", "max_gpu_hours_per_day_per_vm"):
        if getattr(s.leases, key) < 0:
            raise ConfigError(f"leases.{key}: must be 0 (no limit) or more", field=f"leases.{key}")
    if s.libvirt.detach_retries < 0:
        raise ConfigError("libvirt.detach_retries: must be 0 (alert after the first detach) or more",
                          field="libvirt.detach_retries")
    if not -1000 <= s.leases.guest_max_priority <= 1000:
        raise ConfigError("leases.guest_max_priority: must be -1000..1000", field="leases.guest_max_priority")
    _check_projects(s.leases.projects)
    _check_priority_rules(s.leases.priority_rules, s.leases.projects)


RULE_KEYS = {"priority": int, "task_type": str, "project": str, "domains": list, "max_duration_s": int}


def _check_priority_rules(rules: dict[str, Any], projects: dict[str, Any]) -> None:
    """Each [leases.priority_rules.NAME] table: a priority and known match keys of the right types."""
    for name, r in rules.items():
        where = f"leases.priority_rules.{name}"
        if not isinstance(r, dict):
            raise ConfigError(f"{where}: must be a table", field=where)
        for key, value in r.items():
            want = RULE_KEYS.get(key)
            if want is None:
                raise ConfigError(f"{where}.{key}: unknown key (known: {', '.join(sorted(RULE_KEYS))})",
                                  field=f"{where}.{key}")
            if isinstance(value, bool) or not isinstance(value, want):
                raise ConfigError(f"{where}.{key}: wrong type", field=f"{where}.{key}")
        if "priority" not in r or not -1000 <= r["priority"] <= 1000:
            raise ConfigError(f"{where}.priority: required, -1000..1000", field=f"{where}.priority")
        if r.get("max_duration_s") is not None and r["max_duration_s"] < 1:
            raise ConfigError(f"{where}.max_duration_s: must be 1 or more", field=f"{where}.max_duration_s")
        if r.get("project") is not None and r["project"] not in projects:
            raise ConfigError(f"{where}.project: no [leases.projects.{r['project']}]", field=f"{where}.project")


PROJECT_KEYS = {"domains": list, "max_gpus": int, "max_gpu_hours_per_day": (int, float), "max_priority": int}


def _check_projects(projects: dict[str, Any]) -> None:
    """Each [leases.projects.NAME] table: known keys of the right types (a typo must not silently drop a quota)."""
    for name, p in projects.items():
        where = f"leases.projects.{name}"
        if not isinstance(p, dict):
            raise ConfigError(f"{where}: must be a table", field=where)
        for key, value in p.items():
            want = PROJECT_KEYS.get(key)
            if want is None:
                raise ConfigError(f"{where}.{key}: unknown key (known: {', '.join(sorted(PROJECT_KEYS))})",
                                  field=f"{where}.{key}")
            if isinstance(value, bool) or not isinstance(value, want):
                raise ConfigError(f"{where}.{key}: wrong type", field=f"{where}.{key}")
            if key != "domains" and key != "max_priority" and value < 0:
                raise ConfigError(f"{where}.{key}: must be 0 (no limit) or more", field=f"{where}.{key}")
        if p.get("max_priority") is not None and not -1000 <= p["max_priority"] <= 1000:
            raise ConfigError(f"{where}.max_priority: must be -1000..1000", field=f"{where}.max_priority")


def settings_to_dict(s: Settings) -> dict[str, Any]:
    """Settings as a TOML-shaped dict (for `hostagent config show`)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(s):
        sec = getattr(s, f.name)
        out[f.name] = {k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(sec).items()}
    return out


def _env_overrides(environ: typing.Mapping[str, str]) -> dict[str, dict[str, Any]]:
    """HOSTAGENT_AGENT__PORT=9000 -> {"agent": {"port": 9000}}; values parse as TOML, else as strings."""
    out: dict[str, dict[str, Any]] = {}
    for name, text in environ.items():
        if not name.startswith(ENV_PREFIX) or "__" not in name:
            continue
        section, _, key = name[len(ENV_PREFIX):].lower().partition("__")
        try:
            value = tomllib.loads(f"v = {text}")["v"]
        except tomllib.TOMLDecodeError:
            value = text
        out.setdefault(section, {})[key] = value
    return out


def settings_without_file(overrides: dict[str, dict[str, Any]], *,
                          environ: typing.Mapping[str, str] | None = None) -> Settings:
    """Defaults, then the HOSTAGENT_* environment, then `overrides`: settings that no file adds to (the demo)."""
    raw: dict[str, dict[str, Any]] = {}
    for layer in (_env_overrides(os.environ if environ is None else environ), overrides):
        for section, values in layer.items():
            raw.setdefault(section, {}).update(values)
    return settings_from_dict(raw)


def load_settings(path: str | os.PathLike[str] | None = None, *, environ: typing.Mapping[str, str] | None = None,
                  overrides: dict[str, dict[str, Any]] | None = None) -> Settings:
    """Read the TOML file (a missing default file means defaults), apply env and explicit overrides, validate."""
    environ = os.environ if environ is None else environ
    explicit = path is not None or "HOSTAGENT_CONFIG" in environ
    p = Path(path) if path is not None else Path(environ.get("HOSTAGENT_CONFIG", DEFAULT_CONFIG_PATH))
    raw: dict[str, Any] = {}
    if p.exists():
        try:
            raw = tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{p}: not valid TOML: {exc}") from exc
        except OSError as exc:
            raise ConfigError(f"{p}: cannot read: {exc.strerror}") from exc
    elif explicit:
        raise ConfigError(f"{p}: configuration file not found (pass --config FILE, or create it)", field="config")
    for layer in (_env_overrides(environ), overrides or {}):
        for section, values in layer.items():
            if not isinstance(raw.get(section, {}), dict):
                continue
            raw.setdefault(section, {}).update(values)
    try:
        return settings_from_dict(raw)
    except ConfigError as exc:
        where = str(p) if p.exists() else "configuration"
        raise ConfigError(f"{where}: {exc.message}", field=exc.field) from exc


def dumps_json(s: Settings) -> str:
    """Settings as JSON."""
    return json.dumps(settings_to_dict(s), indent=2, sort_keys=True)
