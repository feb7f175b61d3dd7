"""index for the dispatcher's passes: active and queued jobs of every tenant without reading finished ones

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-30 13:30:00
"""
from alembic import op


revision = '0005'
down_revision = '0004'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.create_index('ix_jobs_state_order', ['state', 'priority', 'seq'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.drop_index('ix_jobs_state_order')
