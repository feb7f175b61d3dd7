from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import JSON, BigInteger, Float, ForeignKey, Index, Integer, String, Text, UniqueConstraint
from sqlalchemy.orm import Mapped, mapped_column

from kembed_api.platform.db import Base, UTCDateTime, utcnow
from kembed_contract.quota import QuotaSpec, Stored

__all__ = ["HELD_COLUMNS", "Job", "JobEvent", "JobMetric"]

_COLUMN_TYPES = {Stored.COUNT: Integer, Stored.CORES: Float, Stored.BYTES: BigInteger}
# What the whole gang holds of each dimension of the quota that running jobs hold (nodes x per node, from the
# contract's QuotaSpec.held(): `gpus`, `cpu`, `memory_bytes`, ...), kept as columns so quota sums are one query. A
# dimension that counts jobs has none: each job holds one.
HELD_COLUMNS = tuple(d.used for d in QuotaSpec.held() if not d.counts_jobs)
_HeldColumns = type("_HeldColumns", (), {
    d.used: mapped_column(_COLUMN_TYPES[d.stored], default=0, nullable=False)
    for d in QuotaSpec.held() if not d.counts_jobs
})


class Job(_HeldColumns, Base):
    __tablename__ = "jobs"
    __table_args__ = (
        UniqueConstraint("tenant_id", "idempotency_key", name="uq_jobs_tenant_idempotency_key"),
        Index("ix_jobs_tenant_state", "tenant_id", "state"),
        # GPU-hours of a tenant (the usage endpoint) from the index alone; queued jobs (not admitted) are skipped.
        Index("ix_jobs_gpu_time", "tenant_id", "admitted_at", "finished_at", "gpus"),
    )

    # `seq` orders the queue (FIFO within a priority) and pages lists; `id` is the public, DNS-safe name.
    seq: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    id: Mapped[str] = mapped_column(String(63), unique=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id"))
    name: Mapped[str] = mapped_column(String(48))
    spec: Mapped[dict[str, Any]] = mapped_column(JSON)
    priority: Mapped[int] = mapped_column(Integer, default=0)
    # What the whole gang holds: a column per dimension of the quota (`gpus`, `cpu`, `memory_bytes`, ...; see
    # _HeldColumns above), and of the backend's, its trainer processes.
    processes: Mapped[int] = mapped_column(Integer, default=0)
    idempotency_key: Mapped[str | None] = mapped_column(String(200), default=None)
    # SHA-256 of the submitted spec (JobSpec.canonical_hash) of a keyed submission: a repeat of the key must
    # send the same spec. NULL without a key, and for jobs stored before it was kept.
    spec_hash: Mapped[str | None] = mapped_column(String(64), default=None)

    state: Mapped[str] = mapped_column(String(16))
    reason: Mapped[str] = mapped_column(String(64))
    message: Mapped[str] = mapped_column(Text, default="")
    cancel_requested: Mapped[bool] = mapped_column(default=False)
    restart_count: Mapped[int] = mapped_column(Integer, default=0)

    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    admitted_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), default=None)
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), default=None)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), default=None)

    step: Mapped[int] = mapped_column(Integer, default=0)
    total_steps: Mapped[int] = mapped_column(Integer, default=0)
    metrics: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    result: Mapped[dict[str, Any] | None] = mapped_column(JSON, default=None)
    # The latest complete checkpoint its trainers reported (a `step-N` folder) and its step; not the spec's
    # trainer.checkpoint.uri, which is the folder they all go in.
    latest_checkpoint_uri: Mapped[str | None] = mapped_column(Text, default=None)
    checkpoint_step: Mapped[int | None] = mapped_column(Integer, default=None)
    # Storage the job takes (kembed_api.jobs.storage_use): its checkpoint folder after its latest save and pruning, as
    # its trainer counted it; its logs on this server (local backend).
    checkpoint_bytes: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    log_bytes: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    # Time spent running (against max_run_seconds): seconds of the admissions that ended, and when the current
    # one's trainers first ran (NULL: not running). Restarts within an admission count; time queued does not.
    run_seconds: Mapped[float] = mapped_column(Float, default=0.0, server_default="0")
    running_since: Mapped[datetime | None] = mapped_column(UTCDateTime(), default=None)
    # The training data's size as the trainer read it (rows, sentences, tokens, vocabulary); null until it starts.
    dataset: Mapped[dict[str, Any] | None] = mapped_column(JSON, default=None)
    # The latest run's trainer seconds by phase (kembed_contract.job_seconds.TRAINER_PHASES); null until it reports.
    trainer_seconds: Mapped[dict[str, float] | None] = mapped_column(JSON, default=None)
    # When its `done` record (the result) arrived: the job's exit phase runs from here to its end.
    trainer_done_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), default=None)

    # What the backend needs to find the job's processes or resources again after a restart.
    backend_state: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    # Trainers authenticate their progress reports with a per-job token; only its hash is stored.
    report_token_hash: Mapped[str | None] = mapped_column(String(64), default=None)
    # The last sequence number applied of each trainer run ({run: seq}, the latest runs only): a retried or
    # replayed record is applied once, even after another run of the job has reported.
    report_seqs: Mapped[dict[str, int] | None] = mapped_column(JSON, default=dict)


# The queue in admission order (higher priority first, then oldest first) is these indexes read forwards, with no
# sort: the order mixes directions, which an index of ascending columns cannot give (SQLite would sort the whole
# queue for every page a dispatcher pass reads; docs/benchmarks.md, dispatcher).
# Within a tenant's queue: positions and forecasts read only its index. Across tenants: every dispatcher pass reads
# the active jobs and the queue; without an index led by the state it read the whole table, finished jobs included.
Index("ix_jobs_queue_order", Job.tenant_id, Job.state, Job.priority.desc(), Job.seq)
Index("ix_jobs_state_order", Job.state, Job.priority.desc(), Job.seq)
# A tenant's latest finished jobs (the dashboard's team page) read backwards from here, whatever its history's
# length: without it, every finished job of the tenant is read and sorted.
Index("ix_jobs_tenant_finished", Job.tenant_id, Job.finished_at)


class JobEvent(Base):
    """One state change (or notable moment) of a job, with when and why."""

    __tablename__ = "job_events"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_seq: Mapped[int] = mapped_column(ForeignKey("jobs.seq", ondelete="CASCADE"), index=True)
    time: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    state: Mapped[str] = mapped_column(String(16))
    reason: Mapped[str] = mapped_column(String(64))
    message: Mapped[str] = mapped_column(Text, default="")


class JobMetric(Base):
    """One record the trainer reported (progress, eval, checkpoint), kept as a series."""

    __tablename__ = "job_metrics"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_seq: Mapped[int] = mapped_column(ForeignKey("jobs.seq", ondelete="CASCADE"), index=True)
    time: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    event: Mapped[str] = mapped_column(String(32))
    step: Mapped[int] = mapped_column(Integer)
    values: Mapped[dict[str, Any]] = mapped_column(JSON)
