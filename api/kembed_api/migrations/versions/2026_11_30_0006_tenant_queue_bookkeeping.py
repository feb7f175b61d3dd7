"""tenant queue bookkeeping: a version raised whenever queued jobs move, and the number of queued jobs

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-30 16:10:00
"""
import sqlalchemy as sa
from alembic import op


revision = '0006'
down_revision = '0005'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('tenants', schema=None) as batch_op:
        batch_op.add_column(sa.Column('queue_version', sa.Integer(), server_default='0', nullable=False))
        batch_op.add_column(sa.Column('queued_jobs', sa.Integer(), server_default='0', nullable=False))
    # Counted once here; from now on kept by the transactions that change a queue.
    op.execute("UPDATE tenants SET queued_jobs = "
               "(SELECT count(*) FROM jobs WHERE jobs.tenant_id = tenants.id AND jobs.state = 'QUEUED')")


def downgrade() -> None:
    with op.batch_alter_table('tenants', schema=None) as batch_op:
        batch_op.drop_column('queued_jobs')
        batch_op.drop_column('queue_version')
