"""The usage store: SQLAlchemy Core tables, Alembic migrations, repositories, ingestion, rollups, outage spool.

Import the pieces from their modules (``hostagent.store.repo.UsageStore``, ``hostagent.store.aio.AsyncUsageStore``,
``hostagent.store.ingest.SampleIngestor``, ``hostagent.store.migrate.upgrade``); this package module stays light so
that importing ``hostagent.store.journal`` does not pull in SQLAlchemy.
"""
