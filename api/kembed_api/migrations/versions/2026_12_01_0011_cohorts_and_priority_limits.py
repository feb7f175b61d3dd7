"""cohorts and priority limits: a tenant's cohort, how much it may borrow from it, and its highest priority class

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-01 16:00:00
"""
import sqlalchemy as sa
from alembic import op


revision = '0011'
down_revision = '0010'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('tenants', schema=None) as batch_op:
        batch_op.add_column(sa.Column('cohort', sa.String(length=48), nullable=True))
        batch_op.add_column(sa.Column('borrowing_limit', sa.JSON(), nullable=True))
        batch_op.add_column(sa.Column('max_priority_class', sa.String(length=32), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('tenants', schema=None) as batch_op:
        batch_op.drop_column('max_priority_class')
        batch_op.drop_column('borrowing_limit')
        batch_op.drop_column('cohort')
