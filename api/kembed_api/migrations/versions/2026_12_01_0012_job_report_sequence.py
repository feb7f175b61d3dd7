"""job report sequence: the last trainer report applied (run, seq), so a retried report is applied once

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-01 16:10:00
"""
import sqlalchemy as sa
from alembic import op


revision = '0012'
down_revision = '0011'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('report_run', sa.String(length=32), nullable=True))
        batch_op.add_column(sa.Column('report_seq', sa.BigInteger(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.drop_column('report_seq')
        batch_op.drop_column('report_run')
