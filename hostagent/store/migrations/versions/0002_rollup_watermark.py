"""rollups out of the sample insert: per-host watermark, (host_id, id) index, never-reused sample ids on SQLite

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-23 05:10:00
"""

from __future__ import annotations

import time

import sqlalchemy as sa
from alembic import op

revision = '0002'
down_revision = '0001'
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Apply this revision."""
    op.create_table('usage_rollup_marks',
    sa.Column('host_id', sa.String(length=64), nullable=False),
    sa.Column('last_id', sa.BigInteger(), nullable=False),
    sa.Column('updated_at', sa.Double(), nullable=False),
    sa.PrimaryKeyConstraint('host_id', name=op.f('pk_usage_rollup_marks'))
    )
    if op.get_bind().dialect.name == 'sqlite':
        # Rebuild with AUTOINCREMENT: without it SQLite hands out max(id) + 1, which can fall below a watermark
        # once pruning has deleted the newest rows.
        with op.batch_alter_table('usage_samples', recreate='always',
                                  table_kwargs={'sqlite_autoincrement': True}) as batch_op:
            batch_op.create_index(batch_op.f('ix_usage_samples_host_id_id'), ['host_id', 'id'], unique=False)
    else:
        op.create_index(op.f('ix_usage_samples_host_id_id'), 'usage_samples', ['host_id', 'id'], unique=False)
    # Samples stored before this revision were rolled up as they were inserted: start every host's watermark
    # past them, or the first rollup step would count them a second time.
    op.execute(sa.text('INSERT INTO usage_rollup_marks (host_id, last_id, updated_at) '
                       'SELECT host_id, MAX(id), :now FROM usage_samples GROUP BY host_id')
               .bindparams(now=time.time()))


def downgrade() -> None:
    """Revert this revision (samples not yet folded into the rollups stay raw only)."""
    if op.get_bind().dialect.name == 'sqlite':
        with op.batch_alter_table('usage_samples', recreate='always',
                                  table_kwargs={'sqlite_autoincrement': False}) as batch_op:
            batch_op.drop_index(batch_op.f('ix_usage_samples_host_id_id'))
    else:
        op.drop_index(op.f('ix_usage_samples_host_id_id'), table_name='usage_samples')
    op.drop_table('usage_rollup_marks')
