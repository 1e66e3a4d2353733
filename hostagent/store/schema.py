"""The usage store's tables, as SQLAlchemy Core metadata: one schema for MySQL/MariaDB and SQLite.

Alembic migrations (``hostagent/store/migrations``) create exactly this; a test compares the two. Every row carries
the host it came from, because many agents may share one MySQL database. Times are unix seconds (DOUBLE), except
sample and rollup keys, which are integers (milliseconds, bucket seconds) so that uniqueness is exact on both
backends.
"""

from __future__ import annotations

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Column,
    Double,
    ForeignKey,
    ForeignKeyConstraint,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Table,
    Text,
    UniqueConstraint,
)
from sqlalchemy.dialects import mysql

from hostagent.store.limits import attach_sqlite_guards

# Constraint names are fixed so that migrations and the metadata agree on every backend.
NAMING = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

metadata = MetaData(naming_convention=NAMING)

# SQLite only auto-increments an INTEGER PRIMARY KEY; MySQL wants BIGINT for tables that grow without bound.
AutoId = BigInteger().with_variant(Integer(), "sqlite")
# MySQL's BLOB stops at 64 KiB; model artifacts are larger.
Artifact = LargeBinary().with_variant(mysql.LONGBLOB(), "mysql", "mariadb")

HOST = 64
ID = 64
LABEL = 128  # the API's limit on a request's labels (project, idempotency key)
ACTOR = 300  # "guest:" + a domain name of up to 255 characters, with room to spare

RES_MINUTE = 60
RES_HOUR = 3600

hosts = Table(
    "hosts", metadata,
    Column("id", String(HOST), primary_key=True),
    Column("hostname", String(255), nullable=False),
    Column("agent_version", String(32), nullable=True),
    Column("first_seen", Double, nullable=False),
    Column("last_seen", Double, nullable=False),
    Column("info", JSON, nullable=True),
)

gpus = Table(
    "gpus", metadata,
    Column("host_id", String(HOST), ForeignKey("hosts.id"), primary_key=True),
    Column("gpu_id", String(ID), primary_key=True),
    Column("address", String(16), nullable=False),
    Column("vendor", String(128), nullable=True),
    Column("model", String(255), nullable=True),
    Column("vendor_id", Integer, nullable=True),
    Column("device_id", Integer, nullable=True),
    Column("memory_bytes", BigInteger, nullable=True),
    Column("iommu_group", Integer, nullable=True),
    Column("numa_node", Integer, nullable=True),
    Column("switch_id", String(32), nullable=True),
    Column("root_port", String(16), nullable=True),
    Column("link_speed", String(32), nullable=True),
    Column("link_width", Integer, nullable=True),
    Column("health_score", Double, nullable=True),
    Column("probe_score", Double, nullable=True),
    Column("state", String(32), nullable=True),
    Column("first_seen", Double, nullable=False),
    Column("last_seen", Double, nullable=False),
)

leases = Table(
    "leases", metadata,
    # lease ids are unique per host; the host is part of the key so fleets never collide
    Column("host_id", String(HOST), ForeignKey("hosts.id"), primary_key=True),
    Column("id", String(ID), primary_key=True),
    Column("domain_uuid", String(36), nullable=False),
    Column("domain_name", String(255), nullable=True),
    Column("state", String(32), nullable=False),
    # the request
    Column("gpus_requested", Integer, nullable=False),
    Column("task_type", String(64), nullable=True),
    Column("data_scale", Double, nullable=True),
    Column("precision", String(16), nullable=True),
    Column("min_memory_gib", Double, nullable=True),
    Column("duration_s", Integer, nullable=True),
    Column("priority", Integer, nullable=False),
    Column("accept_partial", Boolean, nullable=False),
    Column("accept_deferred", Boolean, nullable=False),
    Column("not_after", Double, nullable=True),
    Column("idempotency_key", String(128), nullable=True),
    Column("project", String(LABEL), nullable=True),
    Column("request", JSON, nullable=True),  # the whole request as sent, for fields added later
    # what happened
    Column("granted_gpus", Integer, nullable=False),
    Column("reasons", JSON, nullable=True),  # placement reasons
    Column("created_at", Double, nullable=False),
    Column("queued_at", Double, nullable=True),
    Column("granted_at", Double, nullable=True),
    Column("expires_at", Double, nullable=True),
    Column("ended_at", Double, nullable=True),
    Column("end_reason", Text, nullable=True),
    Column("outcome", String(32), nullable=True),
    Column("error", Text, nullable=True),
    Column("updated_at", Double, nullable=False),
    Index(None, "host_id", "created_at"),
    Index(None, "domain_uuid", "idempotency_key"),
    Index(None, "state"),
)

lease_devices = Table(
    "lease_devices", metadata,
    Column("host_id", String(HOST), primary_key=True),
    Column("lease_id", String(ID), primary_key=True),
    Column("gpu_id", String(ID), primary_key=True),
    Column("functions", JSON, nullable=True),  # PCI addresses of the group moved with it
    Column("iommu_group", Integer, nullable=True),
    ForeignKeyConstraint(["host_id", "lease_id"], ["leases.host_id", "leases.id"]),
    Index(None, "host_id", "gpu_id"),
)

lease_events = Table(
    "lease_events", metadata,
    Column("id", AutoId, primary_key=True, autoincrement=True),
    Column("uid", String(32), nullable=False),  # client-made, so a replayed event is written once
    Column("host_id", String(HOST), nullable=False),
    Column("lease_id", String(ID), nullable=True),
    Column("ts", Double, nullable=False),
    Column("kind", String(32), nullable=False),
    Column("from_state", String(32), nullable=True),
    Column("to_state", String(32), nullable=True),
    Column("actor", String(ACTOR), nullable=False),
    Column("detail", Text, nullable=True),
    Column("error", Text, nullable=True),
    UniqueConstraint("uid"),
    Index(None, "host_id", "lease_id", "ts"),
    Index(None, "host_id", "ts"),
)

# The GPUs an event concerns, one row each (a lease's event names every GPU of the lease: up to 64 of them). Keyed
# by the event's uid, which lease_events and reclaim_events make unique across both tables.
event_gpus = Table(
    "event_gpus", metadata,
    Column("uid", String(32), primary_key=True),
    Column("gpu_id", String(ID), primary_key=True),
    Column("host_id", String(HOST), nullable=False),
    Index(None, "host_id", "gpu_id"),
)

usage_samples = Table(
    "usage_samples", metadata,
    Column("id", AutoId, primary_key=True, autoincrement=True),
    Column("host_id", String(HOST), nullable=False),
    Column("gpu_id", String(ID), nullable=False),
    Column("ts_ms", BigInteger, nullable=False),
    Column("lease_id", String(ID), nullable=False),  # '' for samples taken outside any lease
    Column("source", String(16), nullable=False),  # guest | host | probe ...
    Column("util_pct", Double, nullable=True),
    Column("mem_used_bytes", BigInteger, nullable=True),
    Column("work_rate", Double, nullable=True),
    Column("vfio_irq_rate", Double, nullable=True),
    # ts first after the GPU so one index serves both uniqueness and "this GPU between t0 and t1"
    UniqueConstraint("host_id", "gpu_id", "ts_ms", "lease_id", "source"),
    Index(None, "host_id", "lease_id", "ts_ms"),
    Index(None, "ts_ms"),
    # the rollup step reads "this host's rows past its watermark" (see usage_rollup_marks)
    Index(None, "host_id", "id"),
    # SQLite would reuse the ids of deleted (pruned) rows without AUTOINCREMENT, and a reused id at or below a
    # watermark would never reach the rollups; MySQL's AUTO_INCREMENT never goes back
    sqlite_autoincrement=True,
)

usage_rollups = Table(
    "usage_rollups", metadata,
    Column("host_id", String(HOST), primary_key=True),
    Column("gpu_id", String(ID), primary_key=True),
    Column("resolution", Integer, primary_key=True),  # 60 or 3600 seconds
    Column("bucket", BigInteger, primary_key=True),  # unix seconds, a multiple of resolution
    Column("lease_id", String(ID), primary_key=True),  # '' outside leases; a GPU has one lease per bucket mostly
    Column("n", Integer, nullable=False),
    Column("util_n", Integer, nullable=False),
    Column("util_sum", Double, nullable=False),
    Column("util_min", Double, nullable=True),
    Column("util_max", Double, nullable=True),
    Column("idle_n", Integer, nullable=False),  # samples under the idle threshold
    Column("mem_n", Integer, nullable=False),
    Column("mem_sum", Double, nullable=False),
    Column("mem_max", BigInteger, nullable=True),
    Column("work_n", Integer, nullable=False),
    Column("work_sum", Double, nullable=False),
    Column("irq_n", Integer, nullable=False),
    Column("irq_sum", Double, nullable=False),
    Column("first_ms", BigInteger, nullable=False),
    Column("last_ms", BigInteger, nullable=False),
    Index(None, "host_id", "lease_id", "resolution", "bucket"),
    Index(None, "resolution", "bucket"),
)

# How far each host's raw samples are folded into usage_rollups: every usage_samples row of the host with an id up
# to last_id is counted there, none above it. The rollup step moves it in the same transaction as its rollup
# upsert, so each sample is counted exactly once whatever crashes or replays happen in between.
usage_rollup_marks = Table(
    "usage_rollup_marks", metadata,
    Column("host_id", String(HOST), primary_key=True),
    Column("last_id", BigInteger, nullable=False),
    Column("updated_at", Double, nullable=False),
)

reclaim_events = Table(
    "reclaim_events", metadata,
    Column("id", AutoId, primary_key=True, autoincrement=True),
    Column("uid", String(32), nullable=False),
    Column("host_id", String(HOST), nullable=False),
    Column("lease_id", String(ID), nullable=True),
    Column("ts", Double, nullable=False),
    Column("action", String(32), nullable=False),  # strike1 | cleared | strike2 | notified | detached | rebound ...
    Column("reason", Text, nullable=True),
    Column("details", JSON, nullable=True),
    UniqueConstraint("uid"),
    Index(None, "host_id", "ts"),
    Index(None, "host_id", "lease_id"),
)

probe_results = Table(
    "probe_results", metadata,
    Column("id", AutoId, primary_key=True, autoincrement=True),
    Column("uid", String(32), nullable=False),
    Column("host_id", String(HOST), nullable=False),
    Column("gpu_id", String(ID), nullable=False),
    Column("ts", Double, nullable=False),
    Column("score", Double, nullable=True),
    Column("spread", Double, nullable=True),
    Column("ok", Boolean, nullable=False),
    Column("details", JSON, nullable=True),
    UniqueConstraint("uid"),
    Index(None, "host_id", "gpu_id", "ts"),
)

model_versions = Table(
    "model_versions", metadata,
    Column("id", AutoId, primary_key=True, autoincrement=True),
    Column("version", String(64), nullable=False),
    Column("host_id", String(HOST), nullable=True),  # None: trained for the fleet
    Column("kind", String(32), nullable=False),
    Column("created_at", Double, nullable=False),
    Column("trained_on", Integer, nullable=True),  # how many records
    Column("metrics", JSON, nullable=True),  # offline evaluation figures
    Column("params", JSON, nullable=True),
    Column("artifact", Artifact, nullable=True),
    Column("artifact_path", Text, nullable=True),
    Column("sha256", String(64), nullable=True),
    Column("active", Boolean, nullable=False),
    UniqueConstraint("version"),
    Index(None, "kind", "created_at"),
)

tokens = Table(
    "tokens", metadata,
    Column("sha256", String(64), primary_key=True),
    Column("host_id", String(HOST), nullable=True),
    Column("role", String(16), nullable=False),  # guest | operator | reader
    Column("domain_uuid", String(36), nullable=True),
    Column("domain_name", String(255), nullable=True),
    Column("created_at", Double, nullable=False),
    Column("expires_at", Double, nullable=True),
    Column("revoked_at", Double, nullable=True),
    Column("note", String(255), nullable=True),
    Index(None, "domain_uuid"),
)

attach_sqlite_guards(metadata)
