"""job spec hash: a repeated Idempotency-Key with a different spec is refused

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-01 15:40:00
"""
import sqlalchemy as sa
from alembic import op


revision = '0009'
down_revision = '0008'
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Nullable, no backfill: jobs stored before it keep answering any repeat of their key, as they did.
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('spec_hash', sa.String(length=64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.drop_column('spec_hash')
