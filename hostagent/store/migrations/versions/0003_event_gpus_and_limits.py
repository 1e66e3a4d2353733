"""an event's GPUs one row each (event_gpus), labels as long as the API allows, SQLite as strict as MariaDB

A multi-GPU lease's events named their GPUs in one comma-joined ``gpu_id`` VARCHAR(64): four GPU ids are longer,
and MariaDB (strict) refused the row, which stopped the agent's mirror for good. Each event's GPUs now live in
``event_gpus`` (one row per GPU); existing rows are carried over, split at the commas. ``leases.project`` takes the
128 characters the API accepts, ``lease_events.actor`` a whole "guest:<domain name>". SQLite stores get triggers
that refuse a string longer than its column, as MariaDB does.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-25 09:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0003'
down_revision = '0002'
branch_labels = None
depends_on = None

_CHUNK = 1000


def _carry(table: str) -> None:
    """Copy the comma-joined gpu_id of every row of ``table`` into event_gpus, one row per GPU."""
    bind = op.get_bind()
    src = sa.table(table, sa.column('id'), sa.column('uid'), sa.column('host_id'), sa.column('gpu_id'))
    dst = sa.table('event_gpus', sa.column('uid'), sa.column('gpu_id'), sa.column('host_id'))
    last = 0
    while True:
        rows = bind.execute(sa.select(src.c.id, src.c.uid, src.c.host_id, src.c.gpu_id)
                            .where(src.c.id > last, src.c.gpu_id.is_not(None)).order_by(src.c.id)
                            .limit(_CHUNK)).all()
        if not rows:
            return
        out = {}
        for r in rows:
            for gpu in (g.strip() for g in r.gpu_id.split(',')):
                if gpu:
                    out[(r.uid, gpu)] = {'uid': r.uid, 'gpu_id': gpu[:64], 'host_id': r.host_id}
        if out:
            bind.execute(sa.insert(dst), list(out.values()))
        last = rows[-1].id


def upgrade() -> None:
    """Apply this revision."""
    op.create_table('event_gpus',
    sa.Column('uid', sa.String(length=32), nullable=False),
    sa.Column('gpu_id', sa.String(length=64), nullable=False),
    sa.Column('host_id', sa.String(length=64), nullable=False),
    sa.PrimaryKeyConstraint('uid', 'gpu_id', name=op.f('pk_event_gpus'))
    )
    with op.batch_alter_table('event_gpus', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_event_gpus_host_id_gpu_id'), ['host_id', 'gpu_id'], unique=False)
    _carry('lease_events')
    _carry('reclaim_events')
    with op.batch_alter_table('lease_events', schema=None) as batch_op:
        batch_op.drop_column('gpu_id')
        batch_op.alter_column('actor', existing_type=sa.String(length=128), type_=sa.String(length=300),
                              existing_nullable=False)
    with op.batch_alter_table('reclaim_events', schema=None) as batch_op:
        batch_op.drop_column('gpu_id')
    with op.batch_alter_table('leases', schema=None) as batch_op:
        batch_op.alter_column('project', existing_type=sa.String(length=64), type_=sa.String(length=128),
                              existing_nullable=True)
    if op.get_bind().dialect.name == 'sqlite':
        from hostagent.store.limits import install_sqlite_guards
        from hostagent.store.schema import metadata

        # The guards follow the schema at head; a later revision that changes a length calls this again.
        install_sqlite_guards(op.get_bind(), metadata)


def downgrade() -> None:
    """Revert this revision (an event's GPUs are joined with commas again, cut to 64 characters)."""
    bind = op.get_bind()
    if bind.dialect.name == 'sqlite':
        for name in [r[0] for r in bind.execute(sa.text(
                "SELECT name FROM sqlite_master WHERE type='trigger' AND name LIKE 'guard\\_%' ESCAPE '\\'"))]:
            op.execute(sa.text(f'DROP TRIGGER {name}'))
    with op.batch_alter_table('leases', schema=None) as batch_op:
        batch_op.alter_column('project', existing_type=sa.String(length=128), type_=sa.String(length=64),
                              existing_nullable=True)
    with op.batch_alter_table('reclaim_events', schema=None) as batch_op:
        batch_op.add_column(sa.Column('gpu_id', sa.String(length=64), nullable=True))
    with op.batch_alter_table('lease_events', schema=None) as batch_op:
        batch_op.add_column(sa.Column('gpu_id', sa.String(length=64), nullable=True))
        batch_op.alter_column('actor', existing_type=sa.String(length=300), type_=sa.String(length=128),
                              existing_nullable=False)
    eg = sa.table('event_gpus', sa.column('uid'), sa.column('gpu_id'))
    joined: dict[str, list[str]] = {}
    for uid, gpu in bind.execute(sa.select(eg.c.uid, eg.c.gpu_id).order_by(eg.c.uid, eg.c.gpu_id)):
        joined.setdefault(uid, []).append(gpu)
    for table in ('lease_events', 'reclaim_events'):
        t = sa.table(table, sa.column('uid'), sa.column('gpu_id'))
        for uid, gpus in joined.items():
            bind.execute(sa.update(t).where(t.c.uid == uid).values(gpu_id=','.join(gpus)[:64]))
    with op.batch_alter_table('event_gpus', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_event_gpus_host_id_gpu_id'))
    op.drop_table('event_gpus')
