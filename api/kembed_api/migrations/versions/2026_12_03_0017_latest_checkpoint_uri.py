"""latest checkpoint uri: the job's `checkpoint_uri` column is renamed `latest_checkpoint_uri` (the latest complete
step its trainers reported), so that it is never mistaken for the spec's `checkpoint.uri` (the job's checkpoint
folder). A rename in place: every value stays.

Revision ID: 0017
Revises: 0016
Create Date: 2026-12-03 11:00:00
"""
from alembic import op

revision = '0017'
down_revision = '0016'
branch_labels = None
depends_on = None


def upgrade() -> None:
    # ALTER TABLE ... RENAME COLUMN on both databases (SQLite has it since 3.25): no copy of the table.
    op.alter_column('jobs', 'checkpoint_uri', new_column_name='latest_checkpoint_uri')


def downgrade() -> None:
    op.alter_column('jobs', 'latest_checkpoint_uri', new_column_name='checkpoint_uri')
