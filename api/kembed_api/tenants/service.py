"""Tenants and their quotas."""

from __future__ import annotations

from datetime import datetime, timedelta

from sqlalchemy import bindparam, func, or_, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from kembed_api.admission import Quota
from kembed_api.db import Executor, utcnow
from kembed_api.jobs.models import Job
from kembed_api.spec import parse_quantity
from kembed_api.tenants.models import Tenant
from kembed_api.tenants.schemas import QuotaSpec, TenantRead, Usage, UsageAmounts
from kembed_contract.lifecycle import ACTIVE_STATES

__all__ = [
    "TenantExists", "TenantNotFound", "create_tenant", "ensure_tenant", "get_tenant", "list_tenants", "quota_of",
    "set_quota", "to_read", "usage",
]


class TenantNotFound(LookupError):
    pass


class TenantExists(ValueError):
    pass


def quota_of(tenant: Tenant) -> Quota:
    return Quota(gpus=tenant.quota_gpus, cpu=tenant.quota_cpu, memory_bytes=tenant.quota_memory_bytes,
                 max_running_jobs=tenant.quota_max_running_jobs)


def _quota_spec(tenant: Tenant) -> QuotaSpec:
    memory = tenant.quota_memory_bytes
    return QuotaSpec(
        gpus=tenant.quota_gpus, cpu=tenant.quota_cpu,
        memory=None if memory is None else (f"{memory // 2**30}Gi" if memory % 2**30 == 0 else str(memory)),
        max_running_jobs=tenant.quota_max_running_jobs, max_queued_jobs=tenant.quota_max_queued_jobs,
    )


def to_read(tenant: Tenant) -> TenantRead:
    return TenantRead(name=tenant.name, quota=_quota_spec(tenant), created_at=tenant.created_at)


def set_quota(tenant: Tenant, quota: QuotaSpec) -> None:
    tenant.quota_gpus, tenant.quota_cpu = quota.gpus, quota.cpu
    tenant.quota_memory_bytes = None if quota.memory is None else int(parse_quantity(quota.memory))
    tenant.quota_max_running_jobs, tenant.quota_max_queued_jobs = quota.max_running_jobs, quota.max_queued_jobs


def ensure_tenant(session: Session, *, name: str) -> Tenant:
    """The tenant called `name`, created (unlimited) on first use: the embedded default's built-in tenant."""
    tenant = session.scalar(select(Tenant).where(Tenant.name == name))
    if tenant is None:
        tenant = Tenant(name=name)
        session.add(tenant)
        session.flush()
    return tenant


def create_tenant(session: Session, *, name: str, quota: QuotaSpec) -> Tenant:
    tenant = Tenant(name=name)
    set_quota(tenant, quota)
    try:
        with session.begin_nested():
            session.add(tenant)
    except IntegrityError:
        raise TenantExists(f"tenant {name!r} already exists") from None
    return tenant


def get_tenant(session: Session, *, name: str) -> Tenant:
    tenant = session.scalar(select(Tenant).where(Tenant.name == name))
    if tenant is None:
        raise TenantNotFound(name)
    return tenant


def list_tenants(session: Session) -> list[Tenant]:
    return list(session.scalars(select(Tenant).order_by(Tenant.name)))


# The usage endpoint's statements, built once with bound parameters: building them is most of its cost. What
# the tenant's active jobs hold, with the queue's length beside it (in one round trip): the tenant's own count,
# not a count of its queue (as costly as the queue is long). The active states are ORs, not an IN list: a list is
# expanded on each execution, which the driver-level reads of kembed_api.pg_reads leave out.
_QUEUE_LENGTH = select(Tenant.queued_jobs).where(Tenant.id == bindparam("tenant_id")).scalar_subquery()
_USED_AND_QUEUED = select(
    func.count(), func.coalesce(func.sum(Job.gpus), 0), func.coalesce(func.sum(Job.cpu), 0.0),
    func.coalesce(func.sum(Job.memory_bytes), 0), _QUEUE_LENGTH,
).where(Job.tenant_id == bindparam("tenant_id"), or_(*(Job.state == state for state in ACTIVE_STATES)))
# Jobs that held GPUs at some time since `since`: admitted, not finished before it.
_GPU_TIME = select(Job.gpus, Job.admitted_at, Job.finished_at).where(
    Job.tenant_id == bindparam("tenant_id"), Job.admitted_at.is_not(None),
    (Job.finished_at.is_(None)) | (Job.finished_at >= bindparam("since")), Job.gpus > 0,
)


def usage(session: Executor, *, tenant: Tenant, now: datetime | None = None) -> Usage:
    now = now or utcnow()
    running, gpus, cpu, memory, queued = session.execute(_USED_AND_QUEUED, {"tenant_id": tenant.id}).one()
    return Usage(
        tenant=tenant.name, quota=_quota_spec(tenant),
        used=UsageAmounts(gpus=gpus, cpu=cpu, memory_bytes=memory, running_jobs=running),
        queued_jobs=queued,
        gpu_hours_7d=_gpu_hours(session, tenant=tenant, since=now - timedelta(days=7), now=now),
    )


def _gpu_hours(session: Executor, *, tenant: Tenant, since: datetime, now: datetime) -> float:
    """GPU-hours held from admission to finish (or now), clipped to the window."""
    seconds = 0.0
    for gpus, admitted_at, finished_at in session.execute(_GPU_TIME, {"tenant_id": tenant.id, "since": since}):
        start, end = max(admitted_at, since), min(finished_at or now, now)
        if end > start:
            seconds += gpus * (end - start).total_seconds()
    return round(seconds / 3600, 4)
