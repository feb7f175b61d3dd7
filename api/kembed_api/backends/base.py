"""The contract between the dispatcher and a place that runs trainers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from kembed_api.admission import Quota
from kembed_api.spec import JobSpec

__all__ = ["Backend", "Exit", "Launch", "NotReady"]


class NotReady(Exception):
    """The backend cannot start the job yet (e.g. its namespace is still being made); try again later."""


@dataclass(frozen=True)
class Launch:
    """Everything a backend needs to start (or restart) one job's gang of trainers."""

    job_id: str
    tenant: str
    spec: JobSpec
    attempt: int
    report_url: str
    report_token: str


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

    def sync_tenant(self, name: str, quota: Quota) -> None:
        """Make the backend's view of a tenant match the API's (its Kubernetes Tenant); may do nothing."""

    def capacity(self) -> Quota:
        """What all admitted jobs together may hold here (unlimited where the cluster itself enforces it)."""

    def start(self, launch: Launch) -> dict[str, Any]:
        """Start the gang; returns what must be stored to find it again after a restart."""

    def poll(self, job_id: str) -> Exit | None:
        """None while it runs; how it ended otherwise. Unknown jobs (not started by this process) end retryably."""

    def stop(self, job_id: str) -> None:
        """Ask the trainers to checkpoint and exit (SIGTERM); returns at once."""

    def kill_overdue(self) -> None:
        """Force-stop trainers that ignored `stop` for longer than their grace period (called every pass)."""

    def reclaim(self, job_id: str, backend_state: dict[str, Any]) -> bool:
        """After a restart of the server, for a job an earlier server started.

        True: whatever was left of it has been ended, and the job must be started again (from its checkpoint).
        False: it lives on outside the server (e.g. on Kubernetes) and is simply followed again.
        """

    def read_logs(self, job_id: str, *, tail_lines: int | None = None) -> str:
        """The job's logs, oldest first."""

    def shutdown(self) -> None:
        """Stop every running gang (each writes its SIGTERM checkpoint) and wait for them, within the grace."""
