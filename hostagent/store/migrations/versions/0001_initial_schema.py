"""initial schema

Revision ID: 0001
Revises: 
Create Date: 2026-11-23 04:12:35.929787
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import mysql

revision = '0001'
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Apply this revision."""
    op.create_table('hosts',
    sa.Column('id', sa.String(length=64), nullable=False),
    sa.Column('hostname', sa.String(length=255), nullable=False),
    sa.Column('agent_version', sa.String(length=32), nullable=True),
    sa.Column('first_seen', sa.Double(), nullable=False),
    sa.Column('last_seen', sa.Double(), nullable=False),
    sa.Column('info', sa.JSON(), nullable=True),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_hosts'))
    )
    op.create_table('lease_events',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('uid', sa.String(length=32), nullable=False),
    sa.Column('host_id', sa.String(length=64), nullable=False),
    sa.Column('lease_id', sa.String(length=64), nullable=True),
    sa.Column('gpu_id', sa.String(length=64), nullable=True),
    sa.Column('ts', sa.Double(), nullable=False),
    sa.Column('kind', sa.String(length=32), nullable=False),
    sa.Column('from_state', sa.String(length=32), nullable=True),
    sa.Column('to_state', sa.String(length=32), nullable=True),
    sa.Column('actor', sa.String(length=128), nullable=False),
    sa.Column('detail', sa.Text(), nullable=True),
    sa.Column('error', sa.Text(), nullable=True),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_lease_events')),
    sa.UniqueConstraint('uid', name=op.f('uq_lease_events_uid'))
    )
    with op.batch_alter_table('lease_events', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_lease_events_host_id_lease_id_ts'), ['host_id', 'lease_id', 'ts'], unique=False)
        batch_op.create_index(batch_op.f('ix_lease_events_host_id_ts'), ['host_id', 'ts'], unique=False)

    op.create_table('model_versions',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('version', sa.String(length=64), nullable=False),
    sa.Column('host_id', sa.String(length=64), nullable=True),
    sa.Column('kind', sa.String(length=32), nullable=False),
    sa.Column('created_at', sa.Double(), nullable=False),
    sa.Column('trained_on', sa.Integer(), nullable=True),
    sa.Column('metrics', sa.JSON(), nullable=True),
    sa.Column('params', sa.JSON(), nullable=True),
    sa.Column('artifact', sa.LargeBinary().with_variant(mysql.LONGBLOB(), 'mariadb').with_variant(mysql.LONGBLOB(), 'mysql'), nullable=True),
    sa.Column('artifact_path', sa.Text(), nullable=True),
    sa.Column('sha256', sa.String(length=64), nullable=True),
    sa.Column('active', sa.Boolean(), nullable=False),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_model_versions')),
    sa.UniqueConstraint('version', name=op.f('uq_model_versions_version'))
    )
    with op.batch_alter_table('model_versions', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_model_versions_kind_created_at'), ['kind', 'created_at'], unique=False)

    op.create_table('probe_results',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('uid', sa.String(length=32), nullable=False),
    sa.Column('host_id', sa.String(length=64), nullable=False),
    sa.Column('gpu_id', sa.String(length=64), nullable=False),
    sa.Column('ts', sa.Double(), nullable=False),
    sa.Column('score', sa.Double(), nullable=True),
    sa.Column('spread', sa.Double(), nullable=True),
    sa.Column('ok', sa.Boolean(), nullable=False),
    sa.Column('details', sa.JSON(), nullable=True),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_probe_results')),
    sa.UniqueConstraint('uid', name=op.f('uq_probe_results_uid'))
    )
    with op.batch_alter_table('probe_results', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_probe_results_host_id_gpu_id_ts'), ['host_id', 'gpu_id', 'ts'], unique=False)

    op.create_table('reclaim_events',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('uid', sa.String(length=32), nullable=False),
    sa.Column('host_id', sa.String(length=64), nullable=False),
    sa.Column('lease_id', sa.String(length=64), nullable=True),
    sa.Column('gpu_id', sa.String(length=64), nullable=True),
    sa.Column('ts', sa.Double(), nullable=False),
    sa.Column('action', sa.String(length=32), nullable=False),
    sa.Column('reason', sa.Text(), nullable=True),
    sa.Column('details', sa.JSON(), nullable=True),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_reclaim_events')),
    sa.UniqueConstraint('uid', name=op.f('uq_reclaim_events_uid'))
    )
    with op.batch_alter_table('reclaim_events', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_reclaim_events_host_id_lease_id'), ['host_id', 'lease_id'], unique=False)
        batch_op.create_index(batch_op.f('ix_reclaim_events_host_id_ts'), ['host_id', 'ts'], unique=False)

    op.create_table('tokens',
    sa.Column('sha256', sa.String(length=64), nullable=False),
    sa.Column('host_id', sa.String(length=64), nullable=True),
    sa.Column('role', sa.String(length=16), nullable=False),
    sa.Column('domain_uuid', sa.String(length=36), nullable=True),
    sa.Column('domain_name', sa.String(length=255), nullable=True),
    sa.Column('created_at', sa.Double(), nullable=False),
    sa.Column('expires_at', sa.Double(), nullable=True),
    sa.Column('revoked_at', sa.Double(), nullable=True),
    sa.Column('note', sa.String(length=255), nullable=True),
    sa.PrimaryKeyConstraint('sha256', name=op.f('pk_tokens'))
    )
    with op.batch_alter_table('tokens', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_tokens_domain_uuid'), ['domain_uuid'], unique=False)

    op.create_table('usage_rollups',
    sa.Column('host_id', sa.String(length=64), nullable=False),
    sa.Column('gpu_id', sa.String(length=64), nullable=False),
    sa.Column('resolution', sa.Integer(), nullable=False),
    sa.Column('bucket', sa.BigInteger(), nullable=False),
    sa.Column('lease_id', sa.String(length=64), nullable=False),
    sa.Column('n', sa.Integer(), nullable=False),
    sa.Column('util_n', sa.Integer(), nullable=False),
    sa.Column('util_sum', sa.Double(), nullable=False),
    sa.Column('util_min', sa.Double(), nullable=True),
    sa.Column('util_max', sa.Double(), nullable=True),
    sa.Column('idle_n', sa.Integer(), nullable=False),
    sa.Column('mem_n', sa.Integer(), nullable=False),
    sa.Column('mem_sum', sa.Double(), nullable=False),
    sa.Column('mem_max', sa.BigInteger(), nullable=True),
    sa.Column('work_n', sa.Integer(), nullable=False),
    sa.Column('work_sum', sa.Double(), nullable=False),
    sa.Column('irq_n', sa.Integer(), nullable=False),
    sa.Column('irq_sum', sa.Double(), nullable=False),
    sa.Column('first_ms', sa.BigInteger(), nullable=False),
    sa.Column('last_ms', sa.BigInteger(), nullable=False),
    sa.PrimaryKeyConstraint('host_id', 'gpu_id', 'resolution', 'bucket', 'lease_id', name=op.f('pk_usage_rollups'))
    )
    with op.batch_alter_table('usage_rollups', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_usage_rollups_host_id_lease_id_resolution_bucket'), ['host_id', 'lease_id', 'resolution', 'bucket'], unique=False)
        batch_op.create_index(batch_op.f('ix_usage_rollups_resolution_bucket'), ['resolution', 'bucket'], unique=False)

    op.create_table('usage_samples',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('host_id', sa.String(length=64), nullable=False),
    sa.Column('gpu_id', sa.String(length=64), nullable=False),
    sa.Column('ts_ms', sa.BigInteger(), nullable=False),
    sa.Column('lease_id', sa.String(length=64), nullable=False),
    sa.Column('source', sa.String(length=16), nullable=False),
    sa.Column('util_pct', sa.Double(), nullable=True),
    sa.Column('mem_used_bytes', sa.BigInteger(), nullable=True),
    sa.Column('work_rate', sa.Double(), nullable=True),
    sa.Column('vfio_irq_rate', sa.Double(), nullable=True),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_usage_samples')),
    sa.UniqueConstraint('host_id', 'gpu_id', 'ts_ms', 'lease_id', 'source', name=op.f('uq_usage_samples_host_id_gpu_id_ts_ms_lease_id_source'))
    )
    with op.batch_alter_table('usage_samples', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_usage_samples_host_id_lease_id_ts_ms'), ['host_id', 'lease_id', 'ts_ms'], unique=False)
        batch_op.create_index(batch_op.f('ix_usage_samples_ts_ms'), ['ts_ms'], unique=False)

    op.create_table('gpus',
    sa.Column('host_id', sa.String(length=64), nullable=False),
    sa.Column('gpu_id', sa.String(length=64), nullable=False),
    sa.Column('address', sa.String(length=16), nullable=False),
    sa.Column('vendor', sa.String(length=128), nullable=True),
    sa.Column('model', sa.String(length=255), nullable=True),
    sa.Column('vendor_id', sa.Integer(), nullable=True),
    sa.Column('device_id', sa.Integer(), nullable=True),
    sa.Column('memory_bytes', sa.BigInteger(), nullable=True),
    sa.Column('iommu_group', sa.Integer(), nullable=True),
    sa.Column('numa_node', sa.Integer(), nullable=True),
    sa.Column('switch_id', sa.String(length=32), nullable=True),
    sa.Column('root_port', sa.String(length=16), nullable=True),
    sa.Column('link_speed', sa.String(length=32), nullable=True),
    sa.Column('link_width', sa.Integer(), nullable=True),
    sa.Column('health_score', sa.Double(), nullable=True),
    sa.Column('probe_score', sa.Double(), nullable=True),
    sa.Column('state', sa.String(length=32), nullable=True),
    sa.Column('first_seen', sa.Double(), nullable=False),
    sa.Column('last_seen', sa.Double(), nullable=False),
    sa.ForeignKeyConstraint(['host_id'], ['hosts.id'], name=op.f('fk_gpus_host_id_hosts')),
    sa.PrimaryKeyConstraint('host_id', 'gpu_id', name=op.f('pk_gpus'))
    )
    op.create_table('leases',
    sa.Column('host_id', sa.String(length=64), nullable=False),
    sa.Column('id', sa.String(length=64), nullable=False),
    sa.Column('domain_uuid', sa.String(length=36), nullable=False),
    sa.Column('domain_name', sa.String(length=255), nullable=True),
    sa.Column('state', sa.String(length=32), nullable=False),
    sa.Column('gpus_requested', sa.Integer(), nullable=False),
    sa.Column('task_type', sa.String(length=64), nullable=True),
    sa.Column('data_scale', sa.Double(), nullable=True),
    sa.Column('precision', sa.String(length=16), nullable=True),
    sa.Column('min_memory_gib', sa.Double(), nullable=True),
    sa.Column('duration_s', sa.Integer(), nullable=True),
    sa.Column('priority', sa.Integer(), nullable=False),
    sa.Column('accept_partial', sa.Boolean(), nullable=False),
    sa.Column('accept_deferred', sa.Boolean(), nullable=False),
    sa.Column('not_after', sa.Double(), nullable=True),
    sa.Column('idempotency_key', sa.String(length=128), nullable=True),
    sa.Column('project', sa.String(length=64), nullable=True),
    sa.Column('request', sa.JSON(), nullable=True),
    sa.Column('granted_gpus', sa.Integer(), nullable=False),
    sa.Column('reasons', sa.JSON(), nullable=True),
    sa.Column('created_at', sa.Double(), nullable=False),
    sa.Column('queued_at', sa.Double(), nullable=True),
    sa.Column('granted_at', sa.Double(), nullable=True),
    sa.Column('expires_at', sa.Double(), nullable=True),
    sa.Column('ended_at', sa.Double(), nullable=True),
    sa.Column('end_reason', sa.Text(), nullable=True),
    sa.Column('outcome', sa.String(length=32), nullable=True),
    sa.Column('error', sa.Text(), nullable=True),
    sa.Column('updated_at', sa.Double(), nullable=False),
    sa.ForeignKeyConstraint(['host_id'], ['hosts.id'], name=op.f('fk_leases_host_id_hosts')),
    sa.PrimaryKeyConstraint('host_id', 'id', name=op.f('pk_leases'))
    )
    with op.batch_alter_table('leases', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_leases_domain_uuid_idempotency_key'), ['domain_uuid', 'idempotency_key'], unique=False)
        batch_op.create_index(batch_op.f('ix_leases_host_id_created_at'), ['host_id', 'created_at'], unique=False)
        batch_op.create_index(batch_op.f('ix_leases_state'), ['state'], unique=False)

    op.create_table('lease_devices',
    sa.Column('host_id', sa.String(length=64), nullable=False),
    sa.Column('lease_id', sa.String(length=64), nullable=False),
    sa.Column('gpu_id', sa.String(length=64), nullable=False),
    sa.Column('functions', sa.JSON(), nullable=True),
    sa.Column('iommu_group', sa.Integer(), nullable=True),
    sa.ForeignKeyConstraint(['host_id', 'lease_id'], ['leases.host_id', 'leases.id'], name=op.f('fk_lease_devices_host_id_leases')),
    sa.PrimaryKeyConstraint('host_id', 'lease_id', 'gpu_id', name=op.f('pk_lease_devices'))
    )
    with op.batch_alter_table('lease_devices', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_lease_devices_host_id_gpu_id'), ['host_id', 'gpu_id'], unique=False)



def downgrade() -> None:
    """Revert this revision."""
    with op.batch_alter_table('lease_devices', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_lease_devices_host_id_gpu_id'))

    op.drop_table('lease_devices')
    with op.batch_alter_table('leases', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_leases_state'))
        batch_op.drop_index(batch_op.f('ix_leases_host_id_created_at'))
        batch_op.drop_index(batch_op.f('ix_leases_domain_uuid_idempotency_key'))

    op.drop_table('leases')
    op.drop_table('gpus')
    with op.batch_alter_table('usage_samples', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_usage_samples_ts_ms'))
        batch_op.drop_index(batch_op.f('ix_usage_samples_host_id_lease_id_ts_ms'))

    op.drop_table('usage_samples')
    with op.batch_alter_table('usage_rollups', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_usage_rollups_resolution_bucket'))
        batch_op.drop_index(batch_op.f('ix_usage_rollups_host_id_lease_id_resolution_bucket'))

    op.drop_table('usage_rollups')
    with op.batch_alter_table('tokens', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_tokens_domain_uuid'))

    op.drop_table('tokens')
    with op.batch_alter_table('reclaim_events', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_reclaim_events_host_id_ts'))
        batch_op.drop_index(batch_op.f('ix_reclaim_events_host_id_lease_id'))

    op.drop_table('reclaim_events')
    with op.batch_alter_table('probe_results', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_probe_results_host_id_gpu_id_ts'))

    op.drop_table('probe_results')
    with op.batch_alter_table('model_versions', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_model_versions_kind_created_at'))

    op.drop_table('model_versions')
    with op.batch_alter_table('lease_events', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_lease_events_host_id_ts'))
        batch_op.drop_index(batch_op.f('ix_lease_events_host_id_lease_id_ts'))

    op.drop_table('lease_events')
    op.drop_table('hosts')
