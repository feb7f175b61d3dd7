"""tenant queue version: counts the changes that move queued jobs, so a cached forecast knows when its positions hold

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


def downgrade() -> None:
    with op.batch_alter_table('tenants', schema=None) as batch_op:
        batch_op.drop_column('queue_version')
