"""tenant quotas, api tokens, job resource columns

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30 04:01:06.429297
"""
from alembic import op
import sqlalchemy as sa
import kembed_api.platform.db
from kembed_contract.spec import parse_quantity


revision = '0002'
down_revision = '0001'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('api_tokens',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('tenant_id', sa.Integer(), nullable=False),
    sa.Column('name', sa.String(length=64), nullable=False),
    sa.Column('role', sa.String(length=16), nullable=False),
    sa.Column('token_hash', sa.String(length=64), nullable=False),
    sa.Column('prefix', sa.String(length=12), nullable=False),
    sa.Column('created_at', kembed_api.platform.db.UTCDateTime(timezone=True), nullable=False),
    sa.Column('expires_at', kembed_api.platform.db.UTCDateTime(timezone=True), nullable=True),
    sa.Column('revoked_at', kembed_api.platform.db.UTCDateTime(timezone=True), nullable=True),
    sa.ForeignKeyConstraint(['tenant_id'], ['tenants.id'], ),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('token_hash')
    )
    with op.batch_alter_table('api_tokens', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_api_tokens_tenant_id'), ['tenant_id'], unique=False)

    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('gpus', sa.Integer(), nullable=False, server_default='0'))
        batch_op.add_column(sa.Column('cpu', sa.Float(), nullable=False, server_default='0'))
        batch_op.add_column(sa.Column('memory_bytes', sa.BigInteger(), nullable=False, server_default='0'))
        batch_op.add_column(sa.Column('processes', sa.Integer(), nullable=False, server_default='0'))

    with op.batch_alter_table('tenants', schema=None) as batch_op:
        batch_op.add_column(sa.Column('updated_at', kembed_api.platform.db.UTCDateTime(timezone=True), nullable=True))
        batch_op.add_column(sa.Column('quota_gpus', sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column('quota_cpu', sa.Float(), nullable=True))
        batch_op.add_column(sa.Column('quota_memory_bytes', sa.BigInteger(), nullable=True))
        batch_op.add_column(sa.Column('quota_max_running_jobs', sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column('quota_max_queued_jobs', sa.Integer(), nullable=True))
    _backfill_job_resources()


def _backfill_job_resources() -> None:
    """Jobs stored before this revision get their resource columns from their spec."""
    jobs = sa.table("jobs", sa.column("seq", sa.Integer()), sa.column("spec", sa.JSON()),
                    sa.column("gpus", sa.Integer()), sa.column("cpu", sa.Float()),
                    sa.column("memory_bytes", sa.BigInteger()), sa.column("processes", sa.Integer()))
    connection = op.get_bind()
    for seq, spec in connection.execute(sa.select(jobs.c.seq, jobs.c.spec)).all():
        # From the raw JSON with the defaults of revision 0001, so later spec changes cannot break this.
        resources = spec.get("resources") or {}
        nodes, gpus = resources.get("nodes", 1), resources.get("gpus_per_node", 0)
        connection.execute(jobs.update().where(jobs.c.seq == seq).values(
            gpus=nodes * gpus, cpu=nodes * resources.get("cpu_per_node", 1.0),
            memory_bytes=int(nodes * parse_quantity(resources.get("memory_per_node", "2Gi"))),
            processes=nodes * (resources.get("procs_per_node") or gpus or 1)))


def downgrade() -> None:
    with op.batch_alter_table('tenants', schema=None) as batch_op:
        batch_op.drop_column('quota_max_queued_jobs')
        batch_op.drop_column('quota_max_running_jobs')
        batch_op.drop_column('quota_memory_bytes')
        batch_op.drop_column('quota_cpu')
        batch_op.drop_column('quota_gpus')
        batch_op.drop_column('updated_at')

    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.drop_column('processes')
        batch_op.drop_column('memory_bytes')
        batch_op.drop_column('cpu')
        batch_op.drop_column('gpus')

    with op.batch_alter_table('api_tokens', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_api_tokens_tenant_id'))

    op.drop_table('api_tokens')
