"""jobs, events, metrics and tenants

Revision ID: 0001
Revises: 
Create Date: 2026-11-30 03:43:59.613829
"""
from alembic import op
import sqlalchemy as sa
import kembed_api.platform.db


revision = '0001'
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('tenants',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('name', sa.String(length=48), nullable=False),
    sa.Column('created_at', kembed_api.platform.db.UTCDateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('name')
    )
    op.create_table('jobs',
    sa.Column('seq', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('id', sa.String(length=63), nullable=False),
    sa.Column('tenant_id', sa.Integer(), nullable=False),
    sa.Column('name', sa.String(length=48), nullable=False),
    sa.Column('spec', sa.JSON(), nullable=False),
    sa.Column('priority', sa.Integer(), nullable=False),
    sa.Column('idempotency_key', sa.String(length=200), nullable=True),
    sa.Column('state', sa.String(length=16), nullable=False),
    sa.Column('reason', sa.String(length=64), nullable=False),
    sa.Column('message', sa.Text(), nullable=False),
    sa.Column('cancel_requested', sa.Boolean(), nullable=False),
    sa.Column('restart_count', sa.Integer(), nullable=False),
    sa.Column('created_at', kembed_api.platform.db.UTCDateTime(timezone=True), nullable=False),
    sa.Column('admitted_at', kembed_api.platform.db.UTCDateTime(timezone=True), nullable=True),
    sa.Column('started_at', kembed_api.platform.db.UTCDateTime(timezone=True), nullable=True),
    sa.Column('finished_at', kembed_api.platform.db.UTCDateTime(timezone=True), nullable=True),
    sa.Column('step', sa.Integer(), nullable=False),
    sa.Column('total_steps', sa.Integer(), nullable=False),
    sa.Column('metrics', sa.JSON(), nullable=False),
    sa.Column('result', sa.JSON(), nullable=True),
    sa.Column('checkpoint_uri', sa.Text(), nullable=True),
    sa.Column('checkpoint_step', sa.Integer(), nullable=True),
    sa.Column('backend_state', sa.JSON(), nullable=False),
    sa.Column('report_token_hash', sa.String(length=64), nullable=True),
    sa.ForeignKeyConstraint(['tenant_id'], ['tenants.id'], ),
    sa.PrimaryKeyConstraint('seq'),
    sa.UniqueConstraint('id'),
    sa.UniqueConstraint('tenant_id', 'idempotency_key', name='uq_jobs_tenant_idempotency_key')
    )
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.create_index('ix_jobs_tenant_state', ['tenant_id', 'state'], unique=False)

    op.create_table('job_events',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('job_seq', sa.Integer(), nullable=False),
    sa.Column('time', kembed_api.platform.db.UTCDateTime(timezone=True), nullable=False),
    sa.Column('state', sa.String(length=16), nullable=False),
    sa.Column('reason', sa.String(length=64), nullable=False),
    sa.Column('message', sa.Text(), nullable=False),
    sa.ForeignKeyConstraint(['job_seq'], ['jobs.seq'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id')
    )
    with op.batch_alter_table('job_events', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_job_events_job_seq'), ['job_seq'], unique=False)

    op.create_table('job_metrics',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('job_seq', sa.Integer(), nullable=False),
    sa.Column('time', kembed_api.platform.db.UTCDateTime(timezone=True), nullable=False),
    sa.Column('event', sa.String(length=32), nullable=False),
    sa.Column('step', sa.Integer(), nullable=False),
    sa.Column('values', sa.JSON(), nullable=False),
    sa.ForeignKeyConstraint(['job_seq'], ['jobs.seq'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id')
    )
    with op.batch_alter_table('job_metrics', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_job_metrics_job_seq'), ['job_seq'], unique=False)



def downgrade() -> None:
    with op.batch_alter_table('job_metrics', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_job_metrics_job_seq'))

    op.drop_table('job_metrics')
    with op.batch_alter_table('job_events', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_job_events_job_seq'))

    op.drop_table('job_events')
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.drop_index('ix_jobs_tenant_state')

    op.drop_table('jobs')
    op.drop_table('tenants')
