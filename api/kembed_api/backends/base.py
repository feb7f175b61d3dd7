"""The contract between the dispatcher and a place that runs trainers."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from kembed_api.quota.admission import Quota
from kembed_contract.lifecycle import JobState
from kembed_contract.quota import QuotaSpec, SharingSpec
from kembed_contract.resources import TenantUsage
from kembed_contract.spec import JobSpec
from kembed_contract.storage_policy import StoragePolicy

__all__ = ["Backend", "CannotStart", "Exit", "Launch", "NotReady", "Observed"]


class NotReady(Exception):
    """The backend cannot start the job yet (e.g. its namespace is still being made); try again later."""


class CannotStart(Exception):
    """The backend cannot start the job, and waiting would not help (the local disk filled since it was accepted):
    the job fails with `reason` and this message."""

    def __init__(self, message: str, *, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class Launch:
    """Everything a backend needs to start (or restart) one job's gang of trainers."""

    job_id: str
    tenant: str
    spec: JobSpec
    attempt: int
    report_url: str
    report_token: str
    # The tenant's effective storage policy, which the trainers enforce too (kembed_contract.storage_policy).
    storage_policy: StoragePolicy | None = None
    # What the job's checkpoint folder may hold (kembed_api.jobs.storage_use.budget_bytes; runtime.ENV_STORAGE_BUDGET
    # for its trainers); None: no storage quota.
    storage_budget_bytes: int | None = None


@dataclass(frozen=True)
class Observed:
    """A gang that has not ended, in a state its backend decided (Kubernetes: the operator restarts gangs and
    stops suspended ones itself). The dispatcher moves the job there by the lifecycle's table."""

    state: JobState  # RUNNING, RESTARTING, PREEMPTED (stopping), QUEUED (suspended and stopped)
    reason: str
    message: str
    restart_count: int  # gang restarts the backend has spent (of the job's max_restarts)


@dataclass(frozen=True)
class Exit:
    """How a job's trainers ended."""

    succeeded: bool
    retryable: bool
    reason: str
    message: str


class Backend(Protocol):
    def check_fits(self, spec: JobSpec) -> None:
        """Raise ValueError saying why, if this job could never run here (too big for any capacity)."""

    # Whether show_usage shows anything (the dispatcher counts each tenant's use for it only then).
    shows_tenant_usage: bool

    def sync_tenant(self, name: str, quota: QuotaSpec, sharing: SharingSpec,
                    policy: StoragePolicy | None = None) -> None:
        """Make the backend's view of a tenant match the API's (its Kubernetes Tenant); may do nothing. `quota` is
        its nominal quota, `sharing` its cohort and borrowing limit (the most it may hold is both together: the
        cluster must let borrowed pods start), `policy` its storage policy, which its trainers enforce."""

    def show_usage(self, name: str, usage: TenantUsage) -> None:
        """Show what the tenant holds, borrows and lends (its Kubernetes Tenant's status); may do nothing."""

    def capacity(self) -> Quota:
        """What all admitted jobs together may hold here (unlimited where the cluster itself enforces it)."""

    def start(self, launch: Launch) -> dict[str, Any]:
        """Start the gang; returns what must be stored to find it again after a restart."""

    def poll(self, job_id: str) -> Exit | Observed | None:
        """How the gang ended; or, where the backend itself restarts or stops gangs, the state it is in; None while
        it runs (in the state the dispatcher gave it). Unknown jobs (not started by this process) end retryably."""

    def stop(self, job_id: str) -> None:
        """Ask the trainers to checkpoint and exit (SIGTERM); returns at once. The job ends (cancel)."""

    def preempt(self, job_id: str) -> None:
        """Ask the trainers to checkpoint and exit (SIGTERM), keeping the job to start again later; returns at
        once. Trainers still running after the grace period are killed (`kill_overdue`)."""

    def kill_overdue(self) -> None:
        """Force-stop trainers that ignored `stop` for longer than their grace period (called every pass)."""

    def reclaim(self, job_id: str, backend_state: dict[str, Any]) -> bool:
        """After a restart of the server, for a job an earlier server started.

        True: whatever was left of it has been ended, and the job must be started again (from its checkpoint).
        False: it lives on outside the server (e.g. on Kubernetes) and is simply followed again.
        """

    def read_logs(self, job_id: str, *, tail_lines: int | None = None) -> str:
        """The job's logs, oldest first; `tail_lines`: only the last lines of each node (read from the end)."""

    def stream_logs(self, job_id: str) -> Iterator[bytes]:
        """The job's whole logs (what is kept of them), oldest first, in chunks: never whole in memory."""

    def log_bytes(self, job_id: str) -> int:
        """Bytes of the job's logs this backend keeps (its tenant's storage); 0 where it keeps none."""

    def watch_exits(self, wake: Callable[[], None]) -> None:
        """Call `wake` (from any thread) when a gang's process ends, so that the dispatcher's next pass comes then
        and not at its interval; may do nothing (where an end is only seen by polling)."""

    def shutdown(self) -> None:
        """Stop every running gang (each writes its SIGTERM checkpoint) and wait for them, within the grace."""
