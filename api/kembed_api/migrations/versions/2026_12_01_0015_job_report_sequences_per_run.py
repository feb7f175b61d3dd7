"""job report sequences per run: the last sequence number applied of each trainer run of a job, so that a record
replayed after another run has reported is still applied once (one (run, seq) pair forgot the earlier runs)

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-01 18:40:00
"""
import sqlalchemy as sa
from alembic import op


revision = '0015'
down_revision = '0014'
branch_labels = None
depends_on = None

jobs = sa.table('jobs', sa.column('seq', sa.BigInteger()), sa.column('report_run', sa.String(32)),
                sa.column('report_seq', sa.BigInteger()), sa.column('report_seqs', sa.JSON()))


def upgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('report_seqs', sa.JSON(), nullable=True))
    connection = op.get_bind()
    rows = connection.execute(sa.select(jobs.c.seq, jobs.c.report_run, jobs.c.report_seq)
                              .where(jobs.c.report_run.is_not(None))).all()
    for seq, run, last in rows:
        connection.execute(jobs.update().where(jobs.c.seq == seq).values(report_seqs={run: last or 0}))
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.drop_column('report_seq')
        batch_op.drop_column('report_run')


def downgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('report_run', sa.String(length=32), nullable=True))
        batch_op.add_column(sa.Column('report_seq', sa.BigInteger(), nullable=True))
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.drop_column('report_seqs')
