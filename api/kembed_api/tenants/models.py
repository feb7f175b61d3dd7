from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import JSON, BigInteger, Float, Integer, String
from sqlalchemy.orm import Mapped, mapped_column

from kembed_api.platform.db import Base, UTCDateTime, utcnow
from kembed_contract.quota import QuotaSpec, Stored

__all__ = ["Tenant", "quota_columns"]


_COLUMN_TYPES = {Stored.COUNT: Integer, Stored.CORES: Float, Stored.BYTES: BigInteger}
# One nullable column `quota_<amount>` for each dimension of the quota model (kembed_contract.quota.QuotaSpec),
# typed by how the model says it is stored: a dimension added there is a column here (and a migration).
_QuotaColumns = type("_QuotaColumns", (), {
    f"quota_{amount}": mapped_column(_COLUMN_TYPES[stored], default=None)
    for amount, stored in QuotaSpec.stored().items()
})


def quota_columns(tenant: Any) -> dict[str, Any]:
    """The tenant's quota, by amount name (a Tenant or a row of `tenants`: the same attribute names)."""
    return {amount: getattr(tenant, f"quota_{amount}") for amount in QuotaSpec.stored()}


class Tenant(_QuotaColumns, Base):
    """A team. Quota columns are limits; NULL means unlimited."""

    __tablename__ = "tenants"

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(48), unique=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    updated_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), default=None, onupdate=utcnow)

    # The quota columns (quota_gpus, quota_cpu, quota_memory_bytes, ...) come from the contract's QuotaSpec:
    # see _QuotaColumns above.
    # Sharing (kembed_api.quota.preemption): the quota columns are the tenant's nominal (guaranteed) share; in a cohort
    # it may borrow what the other members leave idle, up to `borrowing_limit` (a QuotaSpec as JSON; NULL:
    # unlimited), and they may reclaim it. `max_priority_class`: the highest of the platform's priority classes
    # its jobs may use (NULL: any).
    cohort: Mapped[str | None] = mapped_column(String(48), default=None)
    borrowing_limit: Mapped[dict | None] = mapped_column(JSON, default=None)
    max_priority_class: Mapped[str | None] = mapped_column(String(32), default=None)
    # The storage policy a platform admin set (canonical URI prefixes; kembed_api.platform.storage adds the tenant's own
    # checkpoint folder and the places no tenant may reach). NULL: not set yet, the platform's defaults; the
    # server writes them in at start (a tenant from before the policy existed).
    storage_read_prefixes: Mapped[list[str] | None] = mapped_column(JSON(none_as_null=True), default=None)
    storage_write_prefixes: Mapped[list[str] | None] = mapped_column(JSON(none_as_null=True), default=None)
    # The queue's bookkeeping, kept by kembed_api.jobs.transitions.queue_changed in the transactions that change it
    # (each is a count of the tenant's queue otherwise, which costs as much as the queue is long).
    # Raised by every change that moves jobs already queued (one leaves the queue, or one joins ahead of them):
    # a forecast of positions taken at the same version still holds (kembed_api.jobs.forecasts).
    queue_version: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    # QUEUED jobs now (the usage endpoint's queue length).
    queued_jobs: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    # Bytes the tenant keeps stored: the sum of its jobs' checkpoint_bytes and log_bytes, kept with them by
    # kembed_api.jobs.storage_use.record_job_bytes (against quota.storage; a sum of its jobs would cost as many rows).
    stored_bytes: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
