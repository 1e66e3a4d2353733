"""The usage store: SQLAlchemy Core tables, Alembic migrations, repositories, ingestion, rollups, outage spool.

Import the pieces from their modules (``hostagent.store.repo.UsageStore``, ``hostagent.store.aio.AsyncUsageStore``,
``hostagent.store.ingest.SampleIngestor``, ``hostagent.store.migrate.upgrade``); this package module stays light so
that importing ``hostagent.store.journal`` does not pull in SQLAlchemy.
"""

# What `hostagent db export` can write (store/export.py): here, so that the CLI's parser names them without importing
# SQLAlchemy and Alembic (0.8 s of every command's start).
EXPORT_KINDS = ("leases", "lease_events", "samples", "rollups_minute", "rollups_hour", "reclaim_events",
                "probe_results")
