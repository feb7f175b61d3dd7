"""Reading jobs: one job (with its events and a queued job's position), a tenant's jobs page by page, a job's
events and metrics, and the answer (JobRead) every route gives for a job."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime

from pydantic import BaseModel
from sqlalchemy import Row, bindparam, func, select
from sqlalchemy.orm import Session

from kembed_api.jobs import estimates
from kembed_api.jobs.errors import JobNotFound
from kembed_api.jobs.ids import is_job_id
from kembed_api.jobs.models import Job, JobEvent, JobMetric
from kembed_api.jobs.schemas import JobEstimates, JobEventRead, JobList, JobMetricRead, JobRead, Progress
from kembed_api.platform.db import Executor, utcnow
from kembed_api.tenants.models import Tenant
from kembed_contract import job_seconds, sizing
from kembed_contract.lifecycle import JobState
from kembed_contract.spec import JobSpec, read_stored

__all__ = ["get_job", "list_events", "list_jobs", "list_metrics", "no_forecast", "read_job", "seconds_split",
           "to_read"]

# Statements of the paths every read and submission takes, built once with bound parameters: building a select()
# and its cache key on each call costs about as much CPU as SQLite takes to run it.
_JOB_OF_TENANT = select(Job).where(Job.id == bindparam("job_id"), Job.tenant_id == bindparam("tenant_id"))
_JOB_OF_TENANT_FOR_UPDATE = _JOB_OF_TENANT.with_for_update()
# What a poll of one job reads, in Core statements (no ORM objects: a read only renders them): in one statement,
# the job's row with its tenant's queue version, once for each of its events (a handful: a state change each).
# Reading the events by a statement of their own was a fifth of a poll's CPU, for one more round trip; the job's
# columns repeated cost less. A queued job's position comes from the tenant's cached forecast
# when that was taken at the same queue version; otherwise it is counted: the queued jobs admitted before it
# (higher priority, or the same and older), two ranges of the queue-order index (an OR of the two would walk the
# tenant's whole queue). A count costs as much as the jobs ahead, which is why it is the fallback.
_JOBS, _TENANTS = Job.__table__, Tenant.__table__
_EVENTS = JobEvent.__table__
_JOB_ROWS_WITH_EVENTS = (
    select(_JOBS, _TENANTS.c.queue_version, _EVENTS.c.time.label("event_time"),
           _EVENTS.c.state.label("event_state"), _EVENTS.c.reason.label("event_reason"),
           _EVENTS.c.message.label("event_message"))
    .join(_TENANTS, _TENANTS.c.id == _JOBS.c.tenant_id).outerjoin(_EVENTS, _EVENTS.c.job_seq == _JOBS.c.seq)
    .where(_JOBS.c.id == bindparam("job_id"), _JOBS.c.tenant_id == bindparam("tenant_id")).order_by(_EVENTS.c.id)
)
_QUEUED_AHEAD = select(
    select(func.count()).where(_JOBS.c.tenant_id == bindparam("tenant_id"), _JOBS.c.state == JobState.QUEUED,
                               _JOBS.c.priority > bindparam("priority")).scalar_subquery()
    + select(func.count()).where(_JOBS.c.tenant_id == bindparam("tenant_id"), _JOBS.c.state == JobState.QUEUED,
                                 _JOBS.c.priority == bindparam("priority"),
                                 _JOBS.c.seq < bindparam("seq")).scalar_subquery()
)
_EVENT_ROWS_OF_JOB = (select(JobEvent.time, JobEvent.state, JobEvent.reason, JobEvent.message)
                      .where(JobEvent.job_seq == bindparam("job_seq")).order_by(JobEvent.id))



def get_job(session: Session, *, tenant: Tenant, job_id: str, for_update: bool = False) -> Job:
    if not is_job_id(job_id):
        raise JobNotFound(job_id)
    job = session.scalar(_JOB_OF_TENANT_FOR_UPDATE if for_update else _JOB_OF_TENANT,
                         {"job_id": job_id, "tenant_id": tenant.id})
    if job is None:
        raise JobNotFound(job_id)
    return job


def _encode_cursor(seq: int) -> str:
    return str(seq)


def _decode_cursor(cursor: str) -> int:
    """The job number a page continues below. Any number is a cursor (the route takes digits only): one past every
    job number (32-bit) continues from the newest."""
    return min(int(cursor), 2**31)


def list_jobs(
    session: Session, *, tenant: Tenant, forecast: Callable[[], dict[int, tuple[int, datetime | None]]],
    states: list[JobState] | None = None, limit: int = 50, cursor: str | None = None, name: str | None = None,
) -> JobList:
    """Newest first, `limit` at a time."""
    query = select(Job).where(Job.tenant_id == tenant.id).order_by(Job.seq.desc()).limit(limit + 1)
    if states:
        query = query.where(Job.state.in_([s.value for s in states]))
    if name:
        query = query.where(Job.name == name)
    if cursor:
        query = query.where(Job.seq < _decode_cursor(cursor))
    jobs = list(session.scalars(query))
    page, more = jobs[:limit], len(jobs) > limit
    queued = forecast() if any(j.state == JobState.QUEUED for j in page) else {}
    return JobList(
        items=[to_read(job, tenant_name=tenant.name, queue=queued.get(job.seq)) for job in page],
        next_cursor=_encode_cursor(page[-1].seq) if more else None,
    )


def list_events(session: Executor, *, job: Job | Row) -> list[JobEventRead]:
    events = session.execute(_EVENT_ROWS_OF_JOB, {"job_seq": job.seq})
    return [JobEventRead(time=e.time, state=JobState(e.state), reason=e.reason, message=e.message) for e in events]


def list_metrics(session: Session, *, job: Job, event: str | None = None, limit: int = 1000) -> list[JobMetricRead]:
    query = select(JobMetric).where(JobMetric.job_seq == job.seq).order_by(JobMetric.id).limit(limit)
    if event:
        query = query.where(JobMetric.event == event)
    return [JobMetricRead(time=m.time, event=m.event, step=m.step, values=m.values) for m in session.scalars(query)]


def to_read(
    job: Job | Row, *, tenant_name: str, queue: tuple[int, datetime | None] | None = None,
    events: list[JobEventRead] | None = None, spec: JobSpec | None = None,
) -> JobRead:
    """The answer for a job: an ORM object, or a row of the jobs table (the same attribute names)."""
    total = job.total_steps
    spec = spec or read_stored(job.spec)
    return JobRead(
        id=job.id,
        name=job.name,
        tenant=tenant_name,
        state=JobState(job.state),
        reason=job.reason,
        message=job.message,
        priority=job.priority,
        restart_count=job.restart_count,
        created_at=job.created_at,
        admitted_at=job.admitted_at,
        started_at=job.started_at,
        finished_at=job.finished_at,
        progress=Progress(step=job.step, total_steps=total, fraction=min(1.0, job.step / total) if total else 0.0),
        metrics=job.metrics,
        result=job.result,
        dataset=job.dataset,
        seconds=seconds_split(job),
        latest_checkpoint_uri=job.latest_checkpoint_uri,
        checkpoint_step=job.checkpoint_step,
        queue_position=queue[0] if queue else None,
        estimated_start_at=queue[1] if queue else None,
        estimates=_estimates(spec),
        spec=spec,
        events=events or [],
    )


def seconds_split(job: Job | Row, *, now: datetime | None = None) -> dict[str, float]:
    """The job's wall time by phase (kembed_contract.job_seconds): submission to its end, or to `now`."""
    end = job.finished_at or now or utcnow()
    queued_until = job.admitted_at or end  # never admitted: queued all along
    wall = (end - job.created_at).total_seconds()
    exited = (end - job.trainer_done_at).total_seconds() if job.trainer_done_at and job.finished_at else 0.0
    split = job_seconds.split(wall_seconds=wall, queued_seconds=(queued_until - job.created_at).total_seconds(),
                              trainer=job_seconds.parse_trainer_seconds(job.trainer_seconds), exit_seconds=exited)
    return {"wall": round(max(0.0, wall), 3), **split}


def _estimates(spec: JobSpec) -> JobEstimates:
    if not isinstance(spec.trainer, BaseModel):  # a spec stored before today's rules, read unchecked: no estimate
        return JobEstimates(table_memory_bytes_per_rank=0, memory_bytes_per_rank=0)
    try:
        trainer = estimates.sized_trainer(spec)
    except sizing.CacheTooSmall:  # stored before its memory was checked this way: it shows what its caches lack
        return JobEstimates(table_memory_bytes_per_rank=0, memory_bytes_per_rank=0,
                            local_disk_bytes_per_node=spec.resources.local_disk_bytes_per_node)
    world_size = spec.resources.num_processes
    return JobEstimates(
        table_memory_bytes_per_rank=sizing.table_memory_bytes_per_rank(trainer, world_size=world_size),
        memory_bytes_per_rank=estimates.memory_estimate(trainer, spec).total,
        tier_cache_rows_per_rank=estimates.tier_cache_rows(trainer, spec),
        local_disk_bytes_per_node=sizing.local_disk_bytes_per_node(
            trainer, procs_per_node=spec.resources.procs_per_node or 1, world_size=world_size))


def no_forecast(_job_seq: int, _queue_version: int) -> tuple[None, None]:
    """For read_job where no forecast is at hand: the position is counted, the start unknown."""
    return None, None


def read_job(
    session: Executor, *, tenant: Tenant, job_id: str,
    forecast: Callable[[int, int], tuple[int | None, datetime | None]],
) -> JobRead:
    """The job with its events, and a queued job's position and estimated start.

    `forecast(seq, queue_version)` gives what the tenant's cached forecast knows of a queued job: its position
    (None unless the forecast was taken at this queue version) and its estimated start (None if unknown).
    """
    rows = session.execute(_JOB_ROWS_WITH_EVENTS, {"job_id": job_id, "tenant_id": tenant.id}).all() if is_job_id(
        job_id) else []
    if not rows:
        raise JobNotFound(job_id)
    row = rows[0]
    queue = None
    if row.state == JobState.QUEUED:
        position, start = forecast(row.seq, row.queue_version)
        if position is None:
            ahead = session.scalar(_QUEUED_AHEAD, {"tenant_id": tenant.id, "priority": row.priority, "seq": row.seq})
            position = ahead + 1
        queue = (position, start)
    events = [JobEventRead(time=r.event_time, state=JobState(r.event_state), reason=r.event_reason,
                           message=r.event_message) for r in rows if r.event_state is not None]
    return to_read(row, tenant_name=tenant.name, queue=queue, events=events)
