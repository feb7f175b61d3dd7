"""local disk quota: a tenant's quota of nodes' local disk, and what each job holds of it (its tiered tables'
rows on the nodes, resources.local_disk_per_node x nodes)

Jobs stored before hold none: no job asked for local disk then.

Revision ID: 0018
Revises: 0017
Create Date: 2026-12-04 14:30:00
"""
import sqlalchemy as sa
from alembic import op

revision = '0018'
down_revision = '0017'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('tenants', schema=None) as batch_op:
        batch_op.add_column(sa.Column('quota_local_disk_bytes', sa.BigInteger(), nullable=True))
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('local_disk_bytes', sa.BigInteger(), server_default='0', nullable=False))


def downgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.drop_column('local_disk_bytes')
    with op.batch_alter_table('tenants', schema=None) as batch_op:
        batch_op.drop_column('quota_local_disk_bytes')
