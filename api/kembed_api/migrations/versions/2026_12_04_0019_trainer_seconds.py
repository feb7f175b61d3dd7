"""trainer seconds: what a job's trainer measured of its phases (kembed_contract.job_seconds), the latest run's,
and when its result arrived, from which a job's read splits its wall time by phase.

Jobs stored before have none: their split counts everything after the queue as `other`.

Revision ID: 0019
Revises: 0018
Create Date: 2026-12-04 16:00:00
"""
import sqlalchemy as sa
from alembic import op

import kembed_api.platform.db

revision = '0019'
down_revision = '0018'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('trainer_seconds', sa.JSON(), nullable=True))
        batch_op.add_column(sa.Column('trainer_done_at', kembed_api.platform.db.UTCDateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.drop_column('trainer_done_at')
        batch_op.drop_column('trainer_seconds')
