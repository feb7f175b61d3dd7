"""Cancelling a job: at once while it waits, through the dispatcher (which lets it save first) once it runs."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy.orm import Session

from kembed_api.jobs.models import Job, JobEvent
from kembed_api.jobs.reads import get_job
from kembed_api.jobs.transitions import transition
from kembed_api.platform.db import utcnow
from kembed_api.tenants.models import Tenant
from kembed_contract.lifecycle import TERMINAL_STATES, JobState

__all__ = ["request_cancel"]


def request_cancel(session: Session, *, tenant: Tenant, job_id: str, now: datetime | None = None) -> Job:
    """Cancel at once what has not started; ask the dispatcher to stop what runs (it saves a checkpoint)."""
    job = get_job(session, tenant=tenant, job_id=job_id, for_update=True)
    state = JobState(job.state)
    if state in TERMINAL_STATES:
        return job
    if state is JobState.QUEUED:
        transition(session, job, JobState.CANCELLED, reason="Cancelled", message="cancelled before it started",
                   now=now)
    else:
        job.cancel_requested = True
        session.add(JobEvent(job_seq=job.seq, time=now or utcnow(), state=job.state, reason="CancelRequested",
                             message="stopping the trainer; it saves a checkpoint first"))
    return job
