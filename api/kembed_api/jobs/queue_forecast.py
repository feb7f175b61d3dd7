"""Where each queued job of a tenant stands: its position in admission order and, replaying the admission core
over what runs now, when it is expected to start."""

from __future__ import annotations

from datetime import datetime, timedelta

from sqlalchemy import bindparam, select
from sqlalchemy.orm import Session

from kembed_api.jobs.models import Job
from kembed_api.platform.db import utcnow
from kembed_api.quota.admission import Quota, RunningJob, estimate_start_times
from kembed_api.quota.demand import DEMAND_COLUMNS, demand_of_row
from kembed_api.tenants.models import Tenant
from kembed_api.tenants.service import quota_of
from kembed_contract.lifecycle import ACTIVE_STATES, JobState

__all__ = ["expected_end", "queue_forecast"]

_QUEUE_VERSION = select(Tenant.queue_version).where(Tenant.id == bindparam("tenant_id"))

def expected_end(*, started_at: datetime | None, step: int, total_steps: int, now: datetime) -> datetime | None:
    """Now plus the remaining steps at the pace the job has kept so far; None before it made progress."""
    if total_steps and step >= total_steps:
        return now
    if started_at is None or step <= 0:
        return None
    elapsed = (now - started_at).total_seconds()
    return now + timedelta(seconds=elapsed * (total_steps - step) / step)


def _last_durations(session: Session, *, tenant: Tenant) -> dict[str, timedelta]:
    """How long the latest successful run of each name in the tenant's queue took: the guess for its next run."""
    rows = session.execute(_LAST_RUNS, {"tenant_id": tenant.id})
    return {name: finished - started for name, started, finished in rows if started and finished}


# What one job holds, as columns: queries that sum or replay the queue read only these.
# The replay's statements (queue_forecast). The tenant's queue in admission order, from the index alone; then its
# names and demands in the same order; the jobs holding resources now; the latest successful runs of the names
# in the queue.
_QUEUE_ORDER = (select(Job.seq).where(Job.tenant_id == bindparam("tenant_id"), Job.state == JobState.QUEUED)
                .order_by(Job.priority.desc(), Job.seq))
_QUEUE_DEMANDS = (select(Job.name, *DEMAND_COLUMNS)
                  .where(Job.tenant_id == bindparam("tenant_id"), Job.state == JobState.QUEUED)
                  .order_by(Job.priority.desc(), Job.seq))
_ACTIVE_JOBS = (select(Job.tenant_id, Job.started_at, Job.step, Job.total_steps, *DEMAND_COLUMNS)
                .where(Job.state.in_([s.value for s in ACTIVE_STATES])))
_LAST_RUNS = (
    select(Job.name, Job.started_at, Job.finished_at)
    .where(Job.tenant_id == bindparam("tenant_id"), Job.state == JobState.SUCCEEDED,
           Job.name.in_(select(Job.name).where(Job.tenant_id == bindparam("tenant_id"),
                                               Job.state == JobState.QUEUED).scalar_subquery()))
    .order_by(Job.seq)
)


def queue_forecast(
    session: Session, *, tenant: Tenant, capacity: Quota, now: datetime | None = None
) -> tuple[int, dict[int, tuple[int, datetime | None]]]:
    """The tenant's queue version, and for its QUEUED jobs: (position in admission order, estimated start or None).

    Positions come from the queue-order index alone; the replay reads the queue's rows only as far as it can
    estimate (usually the head, up to the first job waiting behind one of unknown duration). The version is read
    first: a change committed meanwhile leaves positions newer than their version, which then go unused, never
    older ones passed off as current. Callers cache it (kembed_api.jobs.forecasts).
    """
    version = session.scalar(_QUEUE_VERSION, {"tenant_id": tenant.id})
    now = now or utcnow()
    order = session.scalars(_QUEUE_ORDER, {"tenant_id": tenant.id}).all()
    if not order:
        return version, {}
    active = session.execute(_ACTIVE_JOBS)
    running = [
        RunningJob(demand_of_row(r),
                   expected_end(started_at=r.started_at, step=r.step, total_steps=r.total_steps, now=now),
                   own=r.tenant_id == tenant.id)
        for r in active
    ]
    durations = _last_durations(session, tenant=tenant)
    # Streamed a few hundred rows at a time: the replay usually stops long before the end of a long queue.
    queued = session.execute(_QUEUE_DEMANDS, {"tenant_id": tenant.id}, execution_options={"yield_per": 256})
    starts = estimate_start_times(
        quota=quota_of(tenant), capacity=capacity, running=running, now=now,
        queued=((demand_of_row(r), durations.get(r.name))
                for r in queued),
    )
    queued.close()
    return version, {seq: (position, starts[position - 1] if position <= len(starts) else None)
                     for position, seq in enumerate(order, 1)}
