"""storage quota and run time: a tenant's storage quota, its jobs' time limit, the bytes it keeps (its jobs'
checkpoints and logs, summed), and each job's time spent running

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-03 08:30:00
"""
import sqlalchemy as sa
from alembic import op

import kembed_api.platform.db

revision = '0016'
down_revision = '0015'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('tenants', schema=None) as batch_op:
        batch_op.add_column(sa.Column('quota_storage_bytes', sa.BigInteger(), nullable=True))
        batch_op.add_column(sa.Column('quota_max_run_seconds', sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column('stored_bytes', sa.BigInteger(), server_default='0', nullable=False))
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('checkpoint_bytes', sa.BigInteger(), server_default='0', nullable=False))
        batch_op.add_column(sa.Column('log_bytes', sa.BigInteger(), server_default='0', nullable=False))
        batch_op.add_column(sa.Column('run_seconds', sa.Float(), server_default='0', nullable=False))
        batch_op.add_column(sa.Column('running_since', kembed_api.platform.db.UTCDateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.drop_column('running_since')
        batch_op.drop_column('run_seconds')
        batch_op.drop_column('log_bytes')
        batch_op.drop_column('checkpoint_bytes')
    with op.batch_alter_table('tenants', schema=None) as batch_op:
        batch_op.drop_column('stored_bytes')
        batch_op.drop_column('quota_max_run_seconds')
        batch_op.drop_column('quota_storage_bytes')
