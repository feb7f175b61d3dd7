"""The dashboard's aggregates: a tenant at a glance, its history, and every tenant against the cluster.

Each is a handful of statements whatever the tenant's size: the queue is read only as far as the page shows it
(its head, in admission order, from the queue-order index), finished jobs only the latest few, and the history
only jobs that held resources or ended inside the window.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Callable
from datetime import UTC, date, datetime, time, timedelta

from sqlalchemy import bindparam, func, or_, select

from kembed_api.dashboard.schemas import (
    Capacity,
    ClusterOverview,
    HistoryDay,
    JobSummary,
    TeamOverview,
    TenantOverview,
    UsageHistory,
)
from kembed_api.jobs.models import Job, JobEvent
from kembed_api.jobs.queue_forecast import expected_end
from kembed_api.jobs.schemas import Progress
from kembed_api.platform.db import Executor, utcnow
from kembed_api.quota.admission import DIMENSIONS, Quota
from kembed_api.quota.demand import HELD_SUMS, no_usage, usage_amounts
from kembed_api.tenants import service as tenants
from kembed_api.tenants.models import Tenant, quota_columns
from kembed_api.tenants.schemas import UsageAmounts
from kembed_contract.lifecycle import ACTIVE_STATES, TERMINAL_STATES, JobState

__all__ = ["QUEUE_LIMIT", "FINISHED_LIMIT", "cluster", "history", "overview", "to_csv"]

QUEUE_LIMIT = 50  # queued jobs a team page lists (the rest are counted); a page nobody scrolls past
FINISHED_LIMIT = 20  # the latest by finish time
RUNNING_LIMIT = 200  # far above any quota's max_running_jobs in practice; keeps a page bounded regardless

_SUMMARY_COLUMNS = (Job.seq, Job.id, Job.name, Job.state, Job.reason, Job.message, Job.priority, Job.created_at,
                    Job.started_at, Job.finished_at, Job.gpus, Job.step, Job.total_steps)
_QUEUE_HEAD = (select(*_SUMMARY_COLUMNS)
               .where(Job.tenant_id == bindparam("tenant_id"), Job.state == JobState.QUEUED)
               .order_by(Job.priority.desc(), Job.seq).limit(QUEUE_LIMIT))
_ACTIVE = (select(*_SUMMARY_COLUMNS, Job.metrics)
           .where(Job.tenant_id == bindparam("tenant_id"), or_(*(Job.state == s for s in ACTIVE_STATES)))
           .order_by(Job.seq).limit(RUNNING_LIMIT))
# Only finished jobs have a finish time: the latest are the tail of the (tenant, finished_at) index.
_FINISHED = (select(*_SUMMARY_COLUMNS, Job.result)
             .where(Job.tenant_id == bindparam("tenant_id"), Job.finished_at.is_not(None))
             .order_by(Job.finished_at.desc()).limit(FINISHED_LIMIT))
_BY_STATE = select(Job.state, func.count()).where(Job.tenant_id == bindparam("tenant_id")).group_by(Job.state)

Forecast = dict[int, tuple[int, datetime | None]]


def _summary(row, **extra) -> JobSummary:
    total = row.total_steps
    return JobSummary(
        id=row.id, name=row.name, state=JobState(row.state), reason=row.reason, message=row.message,
        priority=row.priority, created_at=row.created_at, started_at=row.started_at, finished_at=row.finished_at,
        gpus=row.gpus,
        progress=Progress(step=row.step, total_steps=total, fraction=min(1.0, row.step / total) if total else 0.0),
        **extra,
    )


def overview(session: Executor, *, tenant: Tenant, forecast: Callable[[], Forecast],
             now: datetime | None = None) -> TeamOverview:
    """`forecast()` gives estimated starts (kembed_api.jobs.forecasts); positions are counted here, exactly."""
    now = now or utcnow()
    params = {"tenant_id": tenant.id}
    head = session.execute(_QUEUE_HEAD, params).all()
    starts = forecast() if head else {}
    queue = [_summary(row, queue_position=position, estimated_start_at=starts.get(row.seq, (None, None))[1])
             for position, row in enumerate(head, 1)]
    running = [_summary(row, metrics=row.metrics or {},
                        estimated_end_at=expected_end(started_at=row.started_at, step=row.step,
                                                      total_steps=row.total_steps, now=now))
               for row in session.execute(_ACTIVE, params)]
    finished = [_summary(row, result=row.result) for row in session.execute(_FINISHED, params)]
    return TeamOverview(
        generated_at=now, usage=tenants.usage(session, tenant=tenant, now=now),
        quota_amounts=quota_columns(tenant),
        queue=queue, queue_limit=QUEUE_LIMIT,
        running=running, finished=finished, jobs_by_state=dict(session.execute(_BY_STATE, params).all()),
    )


# ------------------------------------------------------------------------------------------------ history
# Jobs that held resources during the window (admitted, not finished before it) or ended inside it.
_IN_WINDOW = select(Job.gpus, Job.cpu, Job.state, Job.created_at, Job.admitted_at, Job.finished_at).where(
    Job.tenant_id == bindparam("tenant_id"),
    or_(Job.admitted_at.is_not(None) & (Job.finished_at.is_(None) | (Job.finished_at >= bindparam("since"))),
        Job.finished_at >= bindparam("since")),
)


# Interruptions inside the window: a job preempted (back to the queue) or restarted after a retryable failure.
_INTERRUPTIONS = (select(JobEvent.time, JobEvent.state).join(Job, Job.seq == JobEvent.job_seq)
                  .where(Job.tenant_id == bindparam("tenant_id"), JobEvent.time >= bindparam("since"),
                         or_(JobEvent.state == JobState.PREEMPTED, JobEvent.state == JobState.RESTARTING)))


def _p90(values: list[float]) -> float | None:
    """The nearest-rank 90th percentile."""
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[max(0, math.ceil(0.9 * len(ordered)) - 1)], 3)


def _mean(values: list[float]) -> float | None:
    return round(sum(values) / len(values), 3) if values else None


def _hours_per_day(start: datetime, end: datetime, first: date, weight: float, into: dict[date, float]) -> None:
    """Add `weight` x the hours of [start, end) to each UTC day it covers."""
    while start < end:
        day = start.date()
        next_midnight = datetime.combine(day + timedelta(days=1), time(), tzinfo=UTC)
        cut = min(end, next_midnight)
        if day >= first:
            into[day] += weight * (cut - start).total_seconds() / 3600
        start = cut


def history(session: Executor, *, tenant: Tenant, days: int, now: datetime | None = None) -> UsageHistory:
    """GPU-hours and CPU-hours per UTC day, queue waits and final states, over the `days` ending today."""
    now = now or utcnow()
    first = now.date() - timedelta(days=days - 1)
    since = datetime.combine(first, time(), tzinfo=UTC)
    gpu_hours: dict[date, float] = defaultdict(float)
    cpu_hours: dict[date, float] = defaultdict(float)
    waits: dict[date, list[float]] = defaultdict(list)
    finished: dict[date, Counter] = defaultdict(Counter)
    for gpus, cpu, state, created_at, admitted_at, finished_at in session.execute(
            _IN_WINDOW, {"tenant_id": tenant.id, "since": since}):
        if admitted_at is not None:
            start, end = max(admitted_at, since), min(finished_at or now, now)
            _hours_per_day(start, end, first, gpus, gpu_hours)
            _hours_per_day(start, end, first, cpu, cpu_hours)
            if admitted_at >= since:
                waits[admitted_at.date()].append((admitted_at - created_at).total_seconds())
        if finished_at is not None and finished_at >= since and state in TERMINAL_STATES:
            finished[finished_at.date()][state] += 1
    per_day = []
    for offset in range(days):
        day = first + timedelta(days=offset)
        per_day.append(HistoryDay(
            day=day, gpu_hours=round(gpu_hours[day], 4), cpu_hours=round(cpu_hours[day], 4),
            jobs_admitted=len(waits[day]), avg_queue_wait_s=_mean(waits[day]), p90_queue_wait_s=_p90(waits[day]),
            finished=dict(finished[day]),
        ))
    interruptions: dict[date, Counter] = defaultdict(Counter)
    for at, state in session.execute(_INTERRUPTIONS, {"tenant_id": tenant.id, "since": since}):
        interruptions[at.date()][state] += 1
    for day in per_day:
        day.preemptions = interruptions[day.day][JobState.PREEMPTED]
        day.restarts = interruptions[day.day][JobState.RESTARTING]
    every_wait = [w for day_waits in waits.values() for w in day_waits]
    return UsageHistory(
        tenant=tenant.name, days=days, gpu_hours=round(sum(gpu_hours.values()), 4),
        cpu_hours=round(sum(cpu_hours.values()), 4), avg_queue_wait_s=_mean(every_wait),
        p90_queue_wait_s=_p90(every_wait), finished=dict(sum(finished.values(), Counter())),
        preemptions=sum(d.preemptions for d in per_day), restarts=sum(d.restarts for d in per_day), per_day=per_day,
    )


CSV_COLUMNS = ("day", "gpu_hours", "cpu_hours", "jobs_admitted", "avg_queue_wait_s", "p90_queue_wait_s",
               "preemptions", "restarts", *(s.value for s in sorted(TERMINAL_STATES)))


def to_csv(history: UsageHistory) -> str:
    """One line per day, final states as columns (for spreadsheets)."""
    lines = [",".join(CSV_COLUMNS)]
    for d in history.per_day:
        cells = [d.day.isoformat(), f"{d.gpu_hours:g}", f"{d.cpu_hours:g}", str(d.jobs_admitted),
                 "" if d.avg_queue_wait_s is None else f"{d.avg_queue_wait_s:g}",
                 "" if d.p90_queue_wait_s is None else f"{d.p90_queue_wait_s:g}", str(d.preemptions), str(d.restarts),
                 *(str(d.finished.get(s.value, 0)) for s in sorted(TERMINAL_STATES))]
        lines.append(",".join(cells))
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------------ cluster
_USED_PER_TENANT = select(Job.tenant_id, *HELD_SUMS).where(
    or_(*(Job.state == s for s in ACTIVE_STATES))).group_by(Job.tenant_id)
_WAITS_SINCE = select(Job.tenant_id, Job.created_at, Job.admitted_at).where(Job.admitted_at >= bindparam("since"))


def _sum_limits(values: list[float | None]) -> float | None:
    return None if any(v is None for v in values) else sum(values)


def cluster(session: Executor, *, capacity: Quota, now: datetime | None = None) -> ClusterOverview:
    now = now or utcnow()
    every = tenants.list_tenants(session)
    used = {tenant_id: usage_amounts(sums) for tenant_id, *sums in session.execute(_USED_PER_TENANT)}
    waits: dict[int, list[float]] = defaultdict(list)
    for tenant_id, created_at, admitted_at in session.execute(_WAITS_SINCE, {"since": now - timedelta(days=7)}):
        waits[tenant_id].append((admitted_at - created_at).total_seconds())
    nothing = no_usage()
    rows = [TenantOverview(name=t.name, quota=tenants.quota_spec(t), used=used.get(t.id, nothing),
                           queued_jobs=t.queued_jobs, stored_bytes=t.stored_bytes or 0,
                           avg_queue_wait_s_7d=_mean(waits[t.id])) for t in every]
    return ClusterOverview(
        capacity=Capacity(**{d.demand: getattr(capacity, d.limit) for d in DIMENSIONS}),
        sum_of_quotas=Capacity(**{d.demand: _sum_limits([getattr(t, f"quota_{d.limit}") for t in every])
                                  for d in DIMENSIONS if d.of_quota}),
        used=usage_amounts([sum(getattr(u, name) for u in used.values()) for name in UsageAmounts.model_fields]),
        tenants=rows,
    )
