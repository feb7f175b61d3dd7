"""tenant storage policy: the URI prefixes a tenant's jobs may read and write

Existing tenants get NULL (not set yet): the server fills in the platform's configured defaults at its next start
(kembed_api.app), and every tenant may always use its own checkpoint folder, so nothing a tenant already has is
lost.

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-01 15:40:00
"""
import sqlalchemy as sa
from alembic import op


revision = '0014'
down_revision = '0013'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('tenants', schema=None) as batch_op:
        batch_op.add_column(sa.Column('storage_read_prefixes', sa.JSON(), nullable=True))
        batch_op.add_column(sa.Column('storage_write_prefixes', sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('tenants', schema=None) as batch_op:
        batch_op.drop_column('storage_write_prefixes')
        batch_op.drop_column('storage_read_prefixes')
