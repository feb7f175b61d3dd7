"""index for GPU-hours: the usage endpoint reads a tenant's admitted jobs from the index alone

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-30 06:30:00
"""
from alembic import op


revision = '0004'
down_revision = '0003'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.create_index('ix_jobs_gpu_time', ['tenant_id', 'admitted_at', 'finished_at', 'gpus'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.drop_index('ix_jobs_gpu_time')
