"""index for queue order

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-30 05:00:22.722111
"""
from alembic import op


revision = '0003'
down_revision = '0002'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.create_index('ix_jobs_queue_order', ['tenant_id', 'state', 'priority', 'seq'], unique=False)



def downgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.drop_index('ix_jobs_queue_order')

