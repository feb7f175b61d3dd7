"""queue order indexes descending by priority: the queue is read in admission order without a sort

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-30 17:20:00
"""
import sqlalchemy as sa
from alembic import op


revision = '0007'
down_revision = '0006'
branch_labels = None
depends_on = None


def _recreate(name: str, columns: list) -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.drop_index(name)
        batch_op.create_index(name, columns, unique=False)


def upgrade() -> None:
    _recreate('ix_jobs_queue_order', ['tenant_id', 'state', sa.text('priority DESC'), 'seq'])
    _recreate('ix_jobs_state_order', ['state', sa.text('priority DESC'), 'seq'])


def downgrade() -> None:
    _recreate('ix_jobs_queue_order', ['tenant_id', 'state', 'priority', 'seq'])
    _recreate('ix_jobs_state_order', ['state', 'priority', 'seq'])
