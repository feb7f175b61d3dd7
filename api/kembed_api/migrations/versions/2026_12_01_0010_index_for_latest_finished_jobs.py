"""index for a tenant's latest finished jobs (the dashboard's team page)

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-01 15:55:00
"""
from alembic import op


revision = '0010'
down_revision = '0009'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.create_index('ix_jobs_tenant_finished', ['tenant_id', 'finished_at'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.drop_index('ix_jobs_tenant_finished')
