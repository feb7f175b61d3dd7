"""jobs.dataset: the training data's size as the trainer read it (rows, sentences, tokens, vocabulary)

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-01 15:40:00
"""
import sqlalchemy as sa
from alembic import op


revision = '0013'
down_revision = '0012'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('dataset', sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.drop_column('dataset')
