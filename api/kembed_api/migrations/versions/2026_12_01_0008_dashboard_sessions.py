"""dashboard sessions: a browser signed in with an API token

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-01 15:30:00
"""
import sqlalchemy as sa
from alembic import op

from kembed_api.platform.db import UTCDateTime

revision = '0008'
down_revision = '0007'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'dashboard_sessions',
        sa.Column('secret_hash', sa.String(length=64), nullable=False),
        sa.Column('token_id', sa.Integer(), nullable=False),
        sa.Column('created_at', UTCDateTime(timezone=True), nullable=False),
        sa.Column('expires_at', UTCDateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(['token_id'], ['api_tokens.id'], ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('secret_hash'),
    )
    with op.batch_alter_table('dashboard_sessions', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_dashboard_sessions_token_id'), ['token_id'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('dashboard_sessions', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_dashboard_sessions_token_id'))
    op.drop_table('dashboard_sessions')
