"""A job's state changes: the one way a job moves in the lifecycle (kembed_contract.lifecycle decides which moves
are allowed), its events, and the tenant's queue bookkeeping that every change of the queue keeps."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import Connection, bindparam, update
from sqlalchemy.orm import Session

from kembed_api.jobs.models import Job, JobEvent
from kembed_api.platform.db import utcnow
from kembed_api.tenants.models import Tenant
from kembed_contract import lifecycle
from kembed_contract.lifecycle import TERMINAL_STATES, JobState

__all__ = ["queue_changed", "requeue", "run_seconds", "transition"]

_TENANTS = Tenant.__table__
# The tenant's queue bookkeeping (kembed_api.tenants.models.Tenant.queue_version, .queued_jobs). Core, not ORM:
# both are read by statements of their own, and the tenant's settings are not what changed.
_COUNT_QUEUE_CHANGE = (update(_TENANTS).where(_TENANTS.c.id == bindparam("tenant_id"))
                       .values(queue_version=_TENANTS.c.queue_version + bindparam("moved"),
                               queued_jobs=_TENANTS.c.queued_jobs + bindparam("joined"),
                               updated_at=_TENANTS.c.updated_at))


def transition(
    session: Session, job: Job, state: JobState, *, reason: str, message: str = "", now: datetime | None = None
) -> None:
    """Move `job` to `state`, stamp the times and record the event."""
    current = JobState(job.state)
    lifecycle.check_transition(current, state, job=f"job {job.id}")
    now = now or utcnow()
    if JobState.QUEUED in (current, state):  # left the queue, or back in it at its old place
        queue_changed(session, tenant_id=job.tenant_id, joined=1 if state is JobState.QUEUED else -1, moved=True)
    job.state, job.reason, job.message = state, reason, message
    # Time running (max_run_seconds): from its trainers' first run in an admission until the job leaves it (done,
    # or preempted back to the queue). Gang restarts within an admission count: the job holds its place.
    if state is JobState.RUNNING and job.running_since is None:
        job.running_since = now
    elif state in TERMINAL_STATES or state is JobState.QUEUED:
        job.run_seconds, job.running_since = run_seconds(job, now=now), None
    if state is JobState.ADMITTED:
        job.admitted_at = now
    elif state is JobState.RUNNING and job.started_at is None:
        job.started_at = now
    elif state in TERMINAL_STATES:
        job.finished_at = now
    session.add(JobEvent(job_seq=job.seq, time=now, state=state, reason=reason, message=message))


def run_seconds(job: Job, *, now: datetime) -> float:
    """Seconds the job has spent running, over all its admissions, until `now`."""
    running = (now - job.running_since).total_seconds() if job.running_since is not None else 0.0
    return (job.run_seconds or 0.0) + max(0.0, running)


def requeue(session: Session, job: Job, *, now: datetime | None = None) -> None:
    """A preempted job whose trainers have stopped goes back to its tenant's queue at its old place (its priority
    and submission order are unchanged) and resumes from its latest complete checkpoint when admitted again. The
    event says how many reported steps that checkpoint is behind the last one (0 when the trainers saved on
    SIGTERM within the grace period; more when they were killed)."""
    job.backend_state = {}
    lost = max(0, job.step - (job.checkpoint_step or 0))
    where = f"checkpoint step {job.checkpoint_step}" if job.checkpoint_step is not None else "the start"
    transition(session, job, JobState.QUEUED, reason="Requeued",
               message=f"stopped at step {job.step}; resumes from {where}; lost_steps={lost}", now=now)


def queue_changed(session: Session | Connection, *, tenant_id: int, joined: int, moved: bool) -> None:
    """`joined` jobs more (or fewer) in the tenant's queue; `moved`: jobs already in it moved, so positions
    forecast before now no longer hold."""
    session.execute(_COUNT_QUEUE_CHANGE, {"tenant_id": tenant_id, "joined": joined, "moved": int(moved)})
