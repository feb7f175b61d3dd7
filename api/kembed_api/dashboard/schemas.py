"""What the dashboard's read endpoints return: one answer per page section, sized for a browser polling it."""

from __future__ import annotations

from datetime import date, datetime
from typing import Any

from pydantic import BaseModel, Field, create_model

from kembed_api.jobs.schemas import Progress
from kembed_api.quota.admission import DIMENSIONS
from kembed_api.tenants.schemas import QuotaSpec, Usage, UsageAmounts
from kembed_contract.lifecycle import JobState

__all__ = ["Capacity", "ClusterOverview", "HistoryDay", "JobSummary", "TeamOverview", "TenantOverview", "UsageHistory"]


class JobSummary(BaseModel):
    """A job as a row of the team page: no spec and no events (GET /v1/jobs/{id} has them)."""

    id: str
    name: str
    state: JobState
    reason: str
    message: str = Field(description="For a queued job: what it waits for.")
    priority: int
    created_at: datetime
    started_at: datetime | None = None
    finished_at: datetime | None = None
    gpus: int
    progress: Progress
    metrics: dict[str, Any] = Field(default_factory=dict, description="Latest progress and eval values (active "
                                    "jobs only).")
    result: dict[str, Any] | None = Field(None, description="Final eval metrics (finished jobs only).")
    queue_position: int | None = Field(None, description="1 = next to be admitted (queued jobs only).")
    estimated_start_at: datetime | None = Field(None, description="Queued jobs: when expected to start; null when "
                                                "unknown yet.")
    estimated_end_at: datetime | None = Field(None, description="Active jobs: now plus the remaining steps at the "
                                              "pace kept so far.")


class TeamOverview(BaseModel):
    """The caller's tenant at a glance: what the team page draws and polls."""

    generated_at: datetime
    usage: Usage
    quota_amounts: dict[str, int | float | None] = Field(
        description="usage.quota as numbers, by amount name (memory_bytes, storage_bytes, ...; null = unlimited).")
    queue: list[JobSummary] = Field(description="The head of the queue in admission order (at most `queue_limit`).")
    queue_limit: int
    running: list[JobSummary] = Field(description="Jobs holding quota now (admitted, running, restarting).")
    finished: list[JobSummary] = Field(description="The latest finished jobs, newest first.")
    jobs_by_state: dict[str, int] = Field(description="How many of the tenant's jobs are in each state.")


class HistoryDay(BaseModel):
    day: date = Field(description="A UTC day.")
    gpu_hours: float = Field(description="GPU-hours the tenant's jobs held that day.")
    cpu_hours: float = Field(description="CPU-core-hours the tenant's jobs held that day.")
    jobs_admitted: int
    avg_queue_wait_s: float | None = Field(description="Mean time from submission to admission of the jobs "
                                           "admitted that day; null when none was.")
    p90_queue_wait_s: float | None
    finished: dict[str, int] = Field(description="Jobs that ended that day, by final state.")
    preemptions: int = Field(0, description="Times a job was preempted that day (saved and sent back to the queue).")
    restarts: int = Field(0, description="Times a job restarted from its checkpoint after a retryable failure.")


class UsageHistory(BaseModel):
    tenant: str
    days: int = Field(description="Length of the window, ending today (UTC).")
    gpu_hours: float = Field(description="GPU-hours over the whole window.")
    cpu_hours: float = Field(description="CPU-core-hours over the whole window.")
    avg_queue_wait_s: float | None = Field(description="Over every job admitted in the window.")
    p90_queue_wait_s: float | None
    finished: dict[str, int] = Field(description="Jobs that ended in the window, by final state.")
    preemptions: int = Field(description="Preemptions in the window.")
    restarts: int = Field(description="Restarts after retryable failures in the window.")
    per_day: list[HistoryDay] = Field(description="Oldest first, one entry per day of the window.")


class TenantOverview(BaseModel):
    name: str
    quota: QuotaSpec
    used: UsageAmounts
    queued_jobs: int
    stored_bytes: int = Field(0, description="Bytes its jobs keep (checkpoints, logs), against quota.storage.")
    avg_queue_wait_s_7d: float | None = Field(description="Mean submission-to-admission wait over 7 days.")


# Amounts where null means unbounded (or not known to the backend): one per dimension of admission (the quota's
# that running jobs hold, and the backend's trainer processes), named like UsageAmounts' fields.
Capacity = create_model(
    "Capacity", __module__=__name__, __doc__="Amounts where null means unbounded (or not known to the backend).",
    **{d.demand: (int | None if d.whole else float | None, Field(None, description=f"In {d.unit}."))
       for d in DIMENSIONS},
)


class ClusterOverview(BaseModel):
    """Every tenant, and what the backend can hold against the sum of their quotas (platform admins)."""

    capacity: Capacity = Field(description="What the backend can run at once.")
    sum_of_quotas: Capacity = Field(description="Quotas added over tenants; null when any tenant is unlimited.")
    used: UsageAmounts = Field(description="Held by every tenant's active jobs now.")
    tenants: list[TenantOverview]
