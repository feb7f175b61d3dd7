"""Tenants and their quotas."""

from __future__ import annotations

from datetime import datetime, timedelta

from sqlalchemy import bindparam, or_, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from kembed_api.jobs.models import Job
from kembed_api.platform.db import Executor, utcnow
from kembed_api.platform.storage import PlatformStorage
from kembed_api.quota import preemption
from kembed_api.quota.admission import Quota
from kembed_api.quota.demand import HELD_SUMS, no_usage, usage_amounts
from kembed_api.tenants.models import Tenant, quota_columns
from kembed_api.tenants.schemas import (
    QuotaSpec,
    SharingSpec,
    SharingUsage,
    StorageRead,
    StorageSpec,
    TenantRead,
    Usage,
)
from kembed_contract.lifecycle import ACTIVE_STATES
from kembed_contract.resources import TenantUsage, now_rfc3339
from kembed_contract.storage_policy import StoragePolicy

__all__ = [
    "TenantExists", "TenantNotFound", "ceiling_of", "create_tenant", "ensure_tenant", "fill_unset_storage", "get_tenant",
    "list_tenants", "policy_of", "quota_of", "quota_spec", "set_quota", "set_sharing",
    "set_storage", "share_of", "sharing_of", "to_read", "usage", "usage_status",
]


class TenantNotFound(LookupError):
    pass


class TenantExists(ValueError):
    pass


def quota_of(tenant: Tenant) -> Quota:
    """What admission enforces for the tenant (a Tenant or a row of `tenants`)."""
    return Quota.of(quota_columns(tenant))


def share_of(tenant: Tenant) -> preemption.Share:
    """The tenant's place in admission: its quota is its nominal share; its cohort and borrowing limit."""
    borrowing = QuotaSpec.model_validate(tenant.borrowing_limit) if tenant.borrowing_limit else QuotaSpec()
    return preemption.Share(nominal=quota_of(tenant), cohort=tenant.cohort, borrowing_limit=Quota.of(borrowing.amounts()))


def ceiling_of(tenant: Tenant) -> Quota:
    """The most the tenant may ever hold: its quota, plus its borrowing limit in a cohort (a job up to this big
    can run, borrowing what it needs beyond the quota)."""
    return Quota.of(sharing_of(tenant).ceiling(quota_spec(tenant)).amounts())


def quota_spec(tenant: Tenant) -> QuotaSpec:
    return QuotaSpec.from_amounts(quota_columns(tenant))


def sharing_of(tenant: Tenant) -> SharingSpec:
    return SharingSpec(cohort=tenant.cohort, borrowing_limit=QuotaSpec.model_validate(tenant.borrowing_limit or {}),
                       max_priority_class=tenant.max_priority_class)


def set_sharing(tenant: Tenant, sharing: SharingSpec) -> None:
    tenant.cohort, tenant.max_priority_class = sharing.cohort, sharing.max_priority_class
    tenant.borrowing_limit = sharing.borrowing_limit.model_dump(exclude_none=True) or None


def policy_of(tenant: Tenant, storage: PlatformStorage) -> StoragePolicy:
    """The tenant's effective storage policy (a row of `tenants` will do: only its columns are read)."""
    return storage.policy(tenant.name, read=tenant.storage_read_prefixes, write=tenant.storage_write_prefixes)


def to_read(tenant: Tenant, *, storage: PlatformStorage) -> TenantRead:
    policy = policy_of(tenant, storage)
    return TenantRead(name=tenant.name, quota=quota_spec(tenant), sharing=sharing_of(tenant),
                      created_at=tenant.created_at,
                      storage=StorageRead(read=list(policy.read), write=list(policy.write), own=policy.own[0]))


def set_storage(tenant: Tenant, spec: StorageSpec, *, storage: PlatformStorage) -> None:
    """Store the policy's prefixes canonical; raises ValueError naming the prefix at fault."""
    tenant.storage_read_prefixes = list(storage.validate(spec.read, field="storage.read"))
    tenant.storage_write_prefixes = list(storage.validate(spec.write, field="storage.write"))


def grant_read(tenant: Tenant, prefixes: list[str], *, storage: PlatformStorage) -> None:
    """Add `prefixes` to what `tenant`'s jobs may read (its unset policy counts as the defaults); raises ValueError
    naming the prefix at fault."""
    current = storage.default_read if tenant.storage_read_prefixes is None else tenant.storage_read_prefixes
    tenant.storage_read_prefixes = list(storage.validate([*current, *prefixes], field="read prefixes"))


def fill_unset_storage(session: Session, *, storage: PlatformStorage) -> None:
    """Tenants without a policy (made before it existed) get the platform's defaults, once, explicitly."""
    session.execute(update(Tenant).where(Tenant.storage_read_prefixes.is_(None))
                    .values(storage_read_prefixes=list(storage.default_read)))
    session.execute(update(Tenant).where(Tenant.storage_write_prefixes.is_(None))
                    .values(storage_write_prefixes=list(storage.default_write)))


def set_quota(tenant: Tenant, quota: QuotaSpec) -> None:
    """Replace the tenant's quota (a patch is `quota_spec(tenant).merged(patch)`)."""
    for amount, value in quota.amounts().items():
        setattr(tenant, f"quota_{amount}", value)


def ensure_tenant(session: Session, *, name: str, quota: QuotaSpec | None = None) -> Tenant:
    """The tenant called `name`, created (with `quota`, by default unlimited; its storage policy unset, so the
    platform's defaults) on first use: the embedded default's built-in tenant."""
    tenant = session.scalar(select(Tenant).where(Tenant.name == name))
    if tenant is None:
        tenant = Tenant(name=name)
        set_quota(tenant, quota or QuotaSpec())
        session.add(tenant)
        session.flush()
    return tenant


def create_tenant(session: Session, *, name: str, quota: QuotaSpec, sharing: SharingSpec | None = None,
                  storage: PlatformStorage | None = None, storage_spec: StorageSpec | None = None) -> Tenant:
    """Raises TenantExists, or ValueError for a storage policy that cannot be granted. Without `storage` the
    tenant's policy is left unset: the platform's defaults."""
    tenant = Tenant(name=name)
    set_quota(tenant, quota)
    set_sharing(tenant, sharing or SharingSpec())
    if storage is not None:
        set_storage(tenant, storage_spec or StorageSpec(read=list(storage.default_read),
                                                        write=list(storage.default_write)), storage=storage)
    try:
        with session.begin_nested():
            session.add(tenant)
    except IntegrityError:
        raise TenantExists("a tenant of that name already exists") from None
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
# expanded on each execution, which the driver-level reads of kembed_api.platform.pg_reads leave out.
_QUEUE_LENGTH = select(Tenant.queued_jobs).where(Tenant.id == bindparam("tenant_id")).scalar_subquery()
_STORED = select(Tenant.stored_bytes).where(Tenant.id == bindparam("tenant_id")).scalar_subquery()
_USED_AND_QUEUED = select(
    _QUEUE_LENGTH, _STORED, *HELD_SUMS,
).where(Job.tenant_id == bindparam("tenant_id"), or_(*(Job.state == state for state in ACTIVE_STATES)))
# Jobs that held GPUs at some time since `since`: admitted, not finished before it.
_GPU_TIME = select(Job.gpus, Job.admitted_at, Job.finished_at).where(
    Job.tenant_id == bindparam("tenant_id"), Job.admitted_at.is_not(None),
    (Job.finished_at.is_(None)) | (Job.finished_at >= bindparam("since")), Job.gpus > 0,
)


def usage(session: Executor, *, tenant: Tenant, now: datetime | None = None) -> Usage:
    now = now or utcnow()
    queued, stored, *held = session.execute(_USED_AND_QUEUED, {"tenant_id": tenant.id}).one()
    return Usage(
        tenant=tenant.name, quota=quota_spec(tenant), used=usage_amounts(held),
        queued_jobs=queued, stored_bytes=stored or 0,
        gpu_hours_7d=_gpu_hours(session, tenant=tenant, since=now - timedelta(days=7), now=now),
        sharing=_sharing_usage(session, tenant=tenant) if tenant.cohort else None,
    )


# What each member of a cohort holds now, with its quota (one statement), in QuotaSpec.held()'s order.
_HELD = QuotaSpec.held()
_COHORT_USE = (
    select(Tenant.id, *(getattr(Tenant, f"quota_{d.amount}") for d in _HELD), *HELD_SUMS)
    .outerjoin(Job, (Job.tenant_id == Tenant.id) & or_(*(Job.state == state for state in ACTIVE_STATES)))
    .where(Tenant.cohort == bindparam("cohort")).group_by(Tenant.id)
)


def _sharing_usage(session: Executor, *, tenant: Tenant) -> SharingUsage:
    """Borrowed: what the tenant holds beyond its nominal quota. Lent: its part of what the cohort's borrowers
    hold, in proportion to the quota each lender leaves idle (a dimension without a limit is never lent)."""
    borrowed: dict[int, list[float]] = {}
    idle: dict[int, list[float]] = {}
    for tid, *row in session.execute(_COHORT_USE, {"cohort": tenant.cohort}):
        nominal, used = row[:len(_HELD)], row[len(_HELD):]
        borrowed[tid] = [0.0 if n is None else max(0.0, u - n) for n, u in zip(nominal, used, strict=True)]
        idle[tid] = [0.0 if n is None else max(0.0, n - u) for n, u in zip(nominal, used, strict=True)]
    lent = []
    for k in range(len(_HELD)):
        total_borrowed = sum(b[k] for b in borrowed.values())
        total_idle = sum(i[k] for i in idle.values())
        lent.append(total_borrowed * idle[tenant.id][k] / total_idle if total_idle else 0.0)
    return SharingUsage(cohort=tenant.cohort, nominal=quota_spec(tenant), borrowed=usage_amounts(borrowed[tenant.id]),
                        lent=usage_amounts(lent))


def usage_status(session: Executor, *, tenant: Tenant, now: datetime | None = None) -> TenantUsage:
    """What its Tenant resource's status shows (kembed_contract.resources.TenantUsage): what the tenant's jobs
    hold, and in a cohort what of it is borrowed and what of its idle quota the others borrow."""
    now = now or utcnow()
    queued, _, *held = session.execute(_USED_AND_QUEUED, {"tenant_id": tenant.id}).one()
    used, nothing = usage_amounts(held), no_usage()
    sharing = _sharing_usage(session, tenant=tenant) if tenant.cohort else None
    return TenantUsage(cohort=tenant.cohort, used=used.model_dump(), queued_jobs=queued, time=now_rfc3339(now),
                       borrowed=(sharing.borrowed if sharing else nothing).model_dump(),
                       lent=(sharing.lent if sharing else nothing).model_dump())


def _gpu_hours(session: Executor, *, tenant: Tenant, since: datetime, now: datetime) -> float:
    """GPU-hours held from admission to finish (or now), clipped to the window."""
    seconds = 0.0
    for gpus, admitted_at, finished_at in session.execute(_GPU_TIME, {"tenant_id": tenant.id, "since": since}):
        start, end = max(admitted_at, since), min(finished_at or now, now)
        if end > start:
            seconds += gpus * (end - start).total_seconds()
    return round(seconds / 3600, 4)
