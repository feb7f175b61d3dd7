"""The dispatcher: watches admitted jobs' trainers, ends or restarts them, and admits queued jobs.

One pass (`run_once`) is a plain function of the database and the backend, so tests drive it step by step;
`Dispatcher.start()` runs passes in a thread, woken early by `wake()` (a submit, a cancel, a report).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from datetime import datetime

from sqlalchemy import select

from kembed_api.backends.base import Backend, Launch
from kembed_api.db import Database, utcnow
from kembed_api.jobs import service
from kembed_api.jobs.models import Job
from kembed_api.spec import ACTIVE_STATES, JobSpec, JobState
from kembed_api.tenants.models import Tenant

__all__ = ["Dispatcher"]

log = logging.getLogger(__name__)


class Dispatcher:
    def __init__(
        self,
        *,
        db: Database,
        backend: Backend,
        public_url: str,
        interval_s: float = 0.5,
        clock: Callable[[], datetime] = utcnow,
    ) -> None:
        self.db, self.backend, self.public_url = db, backend, public_url
        self.interval_s, self.clock = interval_s, clock
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------------------------------- thread
    def start(self) -> None:
        self.recover()
        self._thread = threading.Thread(target=self._loop, name="kembed-dispatcher", daemon=True)
        self._thread.start()

    def wake(self) -> None:
        self._wake.set()

    def stop(self) -> None:
        """Stop dispatching, then stop every running trainer (each saves a checkpoint first)."""
        self._stopping.set()
        self._wake.set()
        if self._thread:
            self._thread.join()
        self.backend.shutdown()

    def _loop(self) -> None:
        while not self._stopping.is_set():
            try:
                self.run_once()
            except Exception:  # a bad pass must not end dispatching; the next pass retries
                log.exception("dispatcher pass failed")
            self._wake.wait(self.interval_s)
            self._wake.clear()

    # ------------------------------------------------------------------------------------------- passes
    def recover(self) -> None:
        """On start: jobs that held an admission when the last server stopped resume from their checkpoint."""
        with self.db.session() as session:
            for job in session.scalars(select(Job).where(Job.state.in_([s.value for s in ACTIVE_STATES]))):
                self.backend.reclaim(job.id, job.backend_state)
                job.backend_state = {}
                if job.cancel_requested:
                    service.transition(session, job, JobState.CANCELLED, reason="Cancelled",
                                       message="cancelled while the server was down", now=self.clock())
                    continue
                where = f"checkpoint step {job.checkpoint_step}" if job.checkpoint_uri else "the start (no checkpoint)"
                service.transition(session, job, JobState.RESTARTING, reason="ServerRestarted",
                                   message=f"the server restarted while the job ran; resuming from {where}",
                                   now=self.clock())

    def run_once(self) -> None:
        self._observe_active_jobs()
        self._admit_queued_jobs()

    def _observe_active_jobs(self) -> None:
        kill_overdue = getattr(self.backend, "kill_overdue", None)
        if kill_overdue:
            kill_overdue()
        with self.db.session() as session:
            jobs = list(session.scalars(select(Job).where(Job.state.in_([s.value for s in ACTIVE_STATES]))))
            for job in jobs:
                self._observe(session, job)

    def _observe(self, session, job: Job) -> None:
        now = self.clock()
        if not job.backend_state:  # admitted (or restarting) but not started yet
            if job.cancel_requested:
                service.transition(session, job, JobState.CANCELLED, reason="Cancelled",
                                   message="cancelled before the trainers started", now=now)
            else:
                self._launch(session, job)
            return
        ended = self.backend.poll(job.id)
        if ended is None:
            if job.cancel_requested:
                self.backend.stop(job.id)
            return
        job.backend_state = {}
        checkpoint = f"; checkpoint at step {job.checkpoint_step}: {job.checkpoint_uri}" if job.checkpoint_uri else ""
        if job.cancel_requested:
            service.transition(session, job, JobState.CANCELLED, reason="Cancelled",
                               message=f"stopped at step {job.step}{checkpoint}", now=now)
        elif ended.succeeded:
            service.transition(session, job, JobState.SUCCEEDED, reason=ended.reason,
                               message=f"trained {job.step} steps{checkpoint}", now=now)
        elif ended.retryable and job.restart_count < JobSpec.model_validate(job.spec).max_restarts:
            job.restart_count += 1
            service.transition(session, job, JobState.RESTARTING, reason=ended.reason,
                               message=f"restart {job.restart_count}: {ended.message}", now=now)
        else:
            reason = ended.reason if not ended.retryable else "BackoffLimitExceeded"
            service.transition(session, job, JobState.FAILED, reason=reason, message=ended.message, now=now)

    def _launch(self, session, job: Job) -> None:
        token, token_hash = service.new_report_token()
        tenant = session.get(Tenant, job.tenant_id)
        spec = JobSpec.model_validate(job.spec)
        resuming = job.state == JobState.RESTARTING
        job.report_token_hash = token_hash
        job.backend_state = self.backend.start(
            Launch(
                job_id=job.id,
                tenant=tenant.name,
                spec=spec,
                attempt=job.restart_count + 1,
                report_url=f"{self.public_url}/v1/jobs/{job.id}/reports",
                report_token=token,
            )
        )
        processes = f"{spec.resources.num_processes} trainer processes on {spec.resources.nodes} node(s)"
        if resuming:
            service.transition(session, job, JobState.RUNNING, reason="Resumed",
                               message=f"{processes}, resuming from the latest complete checkpoint", now=self.clock())
        else:
            service.transition(session, job, JobState.RUNNING, reason="Started", message=processes, now=self.clock())

    def _admit_queued_jobs(self) -> None:
        with self.db.session() as session:
            in_use = service.count_active_processes(session)
            queued = session.scalars(
                select(Job).where(Job.state == JobState.QUEUED).order_by(Job.priority.desc(), Job.seq)
            )
            for job in queued:
                spec = JobSpec.model_validate(job.spec)
                if not self.backend.has_room(spec, num_processes_in_use=in_use):
                    break  # strict priority + FIFO: a smaller job never overtakes the head of the queue
                service.transition(session, job, JobState.ADMITTED, reason="Admitted",
                                   message=f"{spec.resources.num_processes} of the backend's slots reserved",
                                   now=self.clock())
                in_use += spec.resources.num_processes
                self._launch(session, job)
