"""What a tenant keeps stored, against its storage quota (quota.storage), and each job's share of the quota.

What counts: each job's checkpoint folder as it stands after its latest save and the pruning after it, and on the
local backend each job's logs. (Exports are written to a temporary file for the one request that streams them,
never kept.) How it is counted, cheaply, without listing anyone's storage on a request:

- the trainer counts its folder at every save from the sizes its checkpoints' markers record (no listing
  beyond the one a save makes to prune), and reports it in its checkpoint record (`stored_bytes`);
- the dispatcher reads the local backend's log sizes (a stat per node) on its passes;
- each is kept on the job (`checkpoint_bytes`, `log_bytes`), and the tenant's total (`Tenant.stored_bytes`)
  moves by the difference in the same transaction, so the usage endpoint and admission read one column.

Enforced in three places: a submission is refused while the tenant is at or over its quota, a job whose launch
finds nothing left of it fails at once (StorageQuotaExceeded), and a trainer is told at launch how much its
folder may hold (`runtime.ENV_STORAGE_BUDGET`: the quota less what the tenant keeps
elsewhere) and fails a save that would pass it (StorageQuotaExceeded), keeping its earlier checkpoints. Jobs of
one tenant running side by side each get what was free at their launch, so together they may pass the quota by
what one job's budget allows; the next submission is then refused until space is freed.
"""

from __future__ import annotations

from sqlalchemy import bindparam, select, update
from sqlalchemy.orm import Session

from kembed_api.jobs.models import Job
from kembed_api.tenants.models import Tenant

__all__ = ["budget_bytes", "over_quota", "record_job_bytes", "stored_bytes"]

_TENANTS = Tenant.__table__
_MOVE_TOTAL = (update(_TENANTS).where(_TENANTS.c.id == bindparam("tenant_id"))
               .values(stored_bytes=_TENANTS.c.stored_bytes + bindparam("delta"), updated_at=_TENANTS.c.updated_at))
_TOTAL = select(Tenant.stored_bytes).where(Tenant.id == bindparam("tenant_id"))


def record_job_bytes(session: Session, job: Job, *, checkpoint_bytes: int | None = None,
                     log_bytes: int | None = None) -> None:
    """The job now takes these bytes (None: unchanged); its tenant's total moves by the difference."""
    delta = 0
    if checkpoint_bytes is not None:
        delta += checkpoint_bytes - (job.checkpoint_bytes or 0)
        job.checkpoint_bytes = checkpoint_bytes
    if log_bytes is not None:
        delta += log_bytes - (job.log_bytes or 0)
        job.log_bytes = log_bytes
    if delta:
        session.execute(_MOVE_TOTAL, {"tenant_id": job.tenant_id, "delta": delta})


def stored_bytes(session: Session, *, tenant_id: int) -> int:
    return session.execute(_TOTAL, {"tenant_id": tenant_id}).scalar_one()


def budget_bytes(session: Session, *, tenant: Tenant, job: Job) -> int | None:
    """What the job's checkpoint folder may hold: the tenant's quota less what it keeps besides that folder
    (None: no quota)."""
    if tenant.quota_storage_bytes is None:
        return None
    elsewhere = stored_bytes(session, tenant_id=tenant.id) - (job.checkpoint_bytes or 0)
    return max(0, tenant.quota_storage_bytes - elsewhere)


def over_quota(tenant: Tenant, *, stored: int | None = None) -> str | None:
    """Why the tenant may not submit now (its stored bytes fill its quota), or None. `tenant`: a Tenant or a row
    of `tenants` read just now (its stored_bytes current), or `stored` given."""
    if tenant.quota_storage_bytes is None:
        return None
    used = tenant.stored_bytes if stored is None else stored
    if used < tenant.quota_storage_bytes:
        return None
    return (f"quota.storage: the tenant keeps {used} bytes of checkpoints and logs, its quota is "
            f"{tenant.quota_storage_bytes} bytes; free space or raise the quota, then submit again")
