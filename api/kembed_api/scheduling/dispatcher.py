"""The dispatcher: watches admitted jobs' trainers, ends or restarts them, and admits queued jobs.

One pass (`run_once`) is one database transaction under the dispatch lock, so passes of two API replicas on
one PostgreSQL never interleave and never admit past a quota. Passes are plain calls, so tests drive them step
by step; `Dispatcher.start()` runs them in a thread, woken early by `wake()` (a submit, a cancel, a trainer's exit: the
backend's `watch_exits`).
"""

from __future__ import annotations

import fcntl
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta
from pathlib import Path

from pydantic import ValidationError
from sqlalchemy import Row, and_, func, or_, select, update
from sqlalchemy.orm import Session

from kembed_api.backends.base import Backend, CannotStart, Launch, NotReady, Observed
from kembed_api.jobs import reports, storage_use, transitions
from kembed_api.jobs.models import Job, JobEvent
from kembed_api.platform.db import Database, utcnow
from kembed_api.platform.storage import PlatformStorage
from kembed_api.quota import preemption
from kembed_api.quota.demand import DEMAND_COLUMNS, HELD_SUMS, demand_of_row, describe
from kembed_api.scheduling.observability import Metrics
from kembed_api.tenants.models import Tenant
from kembed_api.tenants.service import policy_of, quota_spec, share_of, sharing_of, usage_status
from kembed_contract import lifecycle
from kembed_contract.lifecycle import ACTIVE_STATES, JobState
from kembed_contract.spec import JobSpec, read_stored
from kembed_contract.trainer_config import format_validation_error

__all__ = ["Dispatcher"]

log = logging.getLogger(__name__)
_ACTIVE = [s.value for s in ACTIVE_STATES]
# A wake-up (a submission, a cancel) is answered by a pass after _COALESCE_S, so that a burst lands first, and
# never sooner than _PASS_GAP_S (or the interval, if shorter) after the last pass: under a steady stream of
# submissions a pass per submission costs the API far more CPU than a pass per batch, and a gap this short admits
# as promptly as anyone watching a queue can tell (docs/benchmarks.md, dispatcher).
# What each tenant holds and has queued: when it changes, its usage is shown anew (Dispatcher._show_usage).
_HELD_BY_TENANT = (
    select(Tenant.id, Tenant.queued_jobs, *HELD_SUMS)
    .outerjoin(Job, (Job.tenant_id == Tenant.id) & Job.state.in_(_ACTIVE)).group_by(Tenant.id)
)
_COALESCE_S = 0.02
_PASS_GAP_S = 0.1
# A running job's log size is written down when it grew by this much since (and when the job ends): a write per
# pass for every job that logs would cost more than the quota needs to know.
_LOG_BYTES_STEP = 2**20


class _Leadership:
    """Which of the worker processes of one server dispatches: the one holding an exclusive `flock` of a file in
    its data dir. The kernel lets go of it when that process ends, however it ends, and another worker takes
    over on its next try (recovering the jobs the last one ran, as after a restart)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None

    def held(self) -> bool:
        """Whether this process leads, taking the lead if it is free (never waits)."""
        if self._fd is None:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                return False
            self._fd = fd
        return True

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the last descriptor of the file lets go of its lock
            self._fd = None


class Dispatcher:
    def __init__(
        self,
        *,
        db: Database,
        backend: Backend,
        public_url: str,
        interval_s: float = 0.5,
        clock: Callable[[], datetime] = utcnow,
        metrics: Metrics | None = None,
        admission_paused: bool = False,
        leader_lock: Path | None = None,
        queue_page: int = 256,
        priority_classes: dict[str, int] | None = None,
        protect_after: int = 3,
        protect_window_s: float = 24 * 3600.0,
        storage: PlatformStorage | None = None,
    ) -> None:
        """`leader_lock`: a file that chooses the one dispatching process among several workers of a server
        (`kembed serve --workers`); None when this process is the server's only one. `queue_page`: queued jobs
        a pass reads at a time. `storage`: the platform's side of the tenants' storage policies, handed to the
        trainers (None: trainers get no policy, for tests of the dispatcher alone)."""
        self.db, self.backend, self.public_url, self.metrics = db, backend, public_url, metrics
        self.storage = storage
        self._leadership = _Leadership(leader_lock) if leader_lock else None
        self._recovered = False
        self.admission_paused, self.queue_page = admission_paused, queue_page
        self.interval_s, self.clock = interval_s, clock
        self.priority_classes = priority_classes if priority_classes is not None else {}
        self.protect_after, self.protect_window_s = protect_after, protect_window_s
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._held: dict[int, tuple] = {}  # what each tenant held and queued when its usage was last shown

    # ------------------------------------------------------------------------------------------- thread
    def start(self) -> None:
        if self._leads():
            self.recover()
        self.backend.watch_exits(self.wake)
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
        if self._leadership:
            self._leadership.release()

    def _leads(self) -> bool:
        return self._leadership is None or self._leadership.held()

    def _loop(self) -> None:
        while not self._stopping.is_set():
            # A worker that does not lead only asks again each interval: the leader's passes admit its jobs.
            if self._leads():
                try:
                    if not self._recovered:
                        self.recover()
                    self.run_once()
                except Exception:  # a bad pass must not end dispatching; the next pass retries
                    log.exception("dispatcher pass failed")
            passed = time.monotonic()
            if self._wake.wait(self.interval_s):
                # Let a burst of submissions land first: one pass for many of them, not one pass each.
                gap = min(_PASS_GAP_S, self.interval_s)
                self._stopping.wait(max(_COALESCE_S, passed + gap - time.monotonic()))
            self._wake.clear()

    # ------------------------------------------------------------------------------------------- passes
    def recover(self) -> None:
        """On start: jobs that held an admission when the last server stopped resume from their checkpoint."""
        with self.db.session(write=True) as session:
            self.db.lock_across_replicas(session)
            for job in session.scalars(select(Job).where(Job.state.in_(_ACTIVE))):
                if not job.backend_state or not self.backend.reclaim(job.id, job.backend_state):
                    continue  # not started yet, or its trainers live on (Kubernetes) and are followed as before
                job.backend_state = {}
                if job.cancel_requested:
                    transitions.transition(session, job, JobState.CANCELLED, reason="Cancelled",
                                       message="cancelled while the server was down", now=self.clock())
                    continue
                if job.state == JobState.PREEMPTED:
                    transitions.requeue(session, job, now=self.clock())
                    continue
                where = f"checkpoint step {job.checkpoint_step}" if job.latest_checkpoint_uri else "the start (no checkpoint)"
                transitions.transition(session, job, JobState.RESTARTING, reason="ServerRestarted",
                                   message=f"the server restarted while the job ran; resuming from {where}",
                                   now=self.clock())
        self._recovered = True

    def run_once(self) -> None:
        self.backend.kill_overdue()
        with self.db.session(write=True) as session:
            self.db.lock_across_replicas(session)
            for job in session.scalars(select(Job).where(Job.state.in_(_ACTIVE))).all():
                self._observe(session, job)
            if not self.admission_paused:
                self._admit(session)
        if self.backend.shows_tenant_usage:
            self._show_usage()

    def _show_usage(self) -> None:
        """Hand the backend each tenant's use, borrowing and lending (its Tenant's status) when it changed: the
        tenants whose jobs or queue changed since the last pass, with every member of their cohorts (what one
        borrows, the others lend)."""
        with self.db.session() as session:
            held = {tenant_id: tuple(rest) for tenant_id, *rest in session.execute(_HELD_BY_TENANT)}
            changed = {t for t in held.keys() | self._held.keys() if held.get(t) != self._held.get(t)}
            if not changed:
                return
            tenants = session.scalars(select(Tenant)).all()
            cohorts = {t.cohort for t in tenants if t.id in changed and t.cohort}
            now = self.clock()
            for tenant in tenants:
                if tenant.id in changed or (tenant.cohort and tenant.cohort in cohorts):
                    try:
                        self.backend.show_usage(tenant.name, usage_status(session, tenant=tenant, now=now))
                    except Exception:  # shown at the next change; admission does not wait on it
                        log.warning("could not show the usage of tenant %s", tenant.name, exc_info=True)
                        held.pop(tenant.id, None)
        self._held = held

    def _observe(self, session: Session, job: Job) -> None:
        now = self.clock()
        if not job.backend_state:  # admitted (or restarting) but not started yet
            if job.cancel_requested:
                transitions.transition(session, job, JobState.CANCELLED, reason="Cancelled",
                                   message="cancelled before the trainers started", now=now)
            elif job.state == JobState.PREEMPTED:
                transitions.requeue(session, job, now=now)
            else:
                self._launch(session, job)
            return
        seen = self.backend.poll(job.id)
        ended = not (seen is None or isinstance(seen, Observed))
        self._count_logs(session, job, ended=ended)
        overrun = self._overrun(session, job, now=now)
        if not ended:  # still running (in the state its backend says)
            if job.cancel_requested:
                self.backend.stop(job.id)
            elif overrun and job.state in (JobState.RUNNING, JobState.RESTARTING):
                self.backend.stop(job.id)  # it saves a checkpoint first, as on cancel; it fails once it stopped
                stopping = f"{overrun}; stopping (saving a checkpoint first)"
                if job.message != stopping:  # written once, not on every pass of the grace period
                    job.message = stopping
            if seen is not None:
                self._follow(session, job, seen, now=now)
            return
        job.backend_state = {}
        checkpoint = f"; checkpoint at step {job.checkpoint_step}: {job.latest_checkpoint_uri}" if job.latest_checkpoint_uri else ""
        if job.cancel_requested:
            transitions.transition(session, job, JobState.CANCELLED, reason="Cancelled",
                               message=f"stopped at step {job.step}{checkpoint}", now=now)
        elif seen.succeeded:
            transitions.transition(session, job, JobState.SUCCEEDED, reason=seen.reason,
                               message=f"trained {job.step} steps{checkpoint}", now=now)
        elif overrun:  # stopped for it (or ended otherwise past it): never restarted nor queued again
            ran = f"ran {transitions.run_seconds(job, now=now):.0f} s, {overrun}"
            transitions.transition(session, job, JobState.FAILED, reason="DeadlineExceeded",
                               message=f"{ran}; stopped at step {job.step}{checkpoint}", now=now)
        elif job.state == JobState.PREEMPTED and seen.retryable:
            transitions.requeue(session, job, now=now)
        elif not seen.retryable:  # a final failure (the operator's, with its restarts spent), or a permanent one
            transitions.transition(session, job, JobState.FAILED, reason=seen.reason, message=seen.message, now=now)
        else:
            after = lifecycle.after_failure(lifecycle.Verdict(True, seen.reason, seen.message),
                                            restarts_used=job.restart_count,
                                            max_restarts=read_stored(job.spec).max_restarts)
            job.restart_count = after.restart_count
            transitions.transition(session, job, after.state, reason=after.reason, message=after.message, now=now)

    def _overrun(self, session: Session, job: Job, *, now: datetime) -> str | None:
        """Why the job is past its time limit (the shorter of its spec's max_run_seconds and its tenant's
        quota.max_run_seconds), counted in time running (transitions.run_seconds); None while within it."""
        tenant = session.get(Tenant, job.tenant_id)
        # Read from the stored JSON, not a validated spec: this runs for every active job on every pass.
        own = job.spec.get("max_run_seconds") if isinstance(job.spec, dict) else None
        limits = [v for v in (own, tenant.quota_max_run_seconds) if isinstance(v, int | float) and v > 0]
        if not limits:
            return None
        limit = min(limits)
        if transitions.run_seconds(job, now=now) < limit:
            return None
        which = "max_run_seconds" if own is not None and own <= limit else "the tenant's quota.max_run_seconds"
        return f"past its time limit of {limit:g} s ({which})"

    def _count_logs(self, session: Session, job: Job, *, ended: bool) -> None:
        """Keep the job's log size (its tenant's storage) current enough: see _LOG_BYTES_STEP."""
        size = self.backend.log_bytes(job.id)
        if size != job.log_bytes and (ended or abs(size - (job.log_bytes or 0)) >= _LOG_BYTES_STEP):
            storage_use.record_job_bytes(session, job, log_bytes=size)

    def _follow(self, session: Session, job: Job, seen: Observed, *, now: datetime) -> None:
        """Follow a backend that restarts and stops gangs itself (Kubernetes): its state becomes the job's, by
        the lifecycle's table; its restart count is the job's (max_restarts is spent there, once)."""
        current = JobState(job.state)
        job.restart_count = max(job.restart_count, seen.restart_count)
        if seen.state is current:
            return
        if seen.state is JobState.QUEUED:  # a suspended gang has stopped
            if current is not JobState.PREEMPTED:
                transitions.transition(session, job, JobState.PREEMPTED, reason=seen.reason, message=seen.message,
                                   now=now)
            transitions.requeue(session, job, now=now)
            return
        if seen.state is JobState.RUNNING and current is JobState.PREEMPTED:
            return  # the operator has not seen the suspension yet
        if seen.state is JobState.RUNNING:
            reason = "Resumed" if current is JobState.RESTARTING else seen.reason
            transitions.transition(session, job, JobState.RUNNING, reason=reason, message=seen.message, now=now)
            return
        if seen.state in lifecycle.TRANSITIONS[current]:
            transitions.transition(session, job, seen.state, reason=seen.reason, message=seen.message, now=now)

    def _launch(self, session: Session, job: Job) -> None:
        try:
            spec = JobSpec.model_validate(job.spec)
        except ValidationError as error:  # stored before a rule of today's spec: it would fail or hang
            transitions.transition(session, job, JobState.FAILED, reason="SpecInvalid",
                               message=f"the stored spec breaks today's rules: {format_validation_error(error)}",
                               now=self.clock())
            return
        tenant = session.get(Tenant, job.tenant_id)
        budget = storage_use.budget_bytes(session, tenant=tenant, job=job)
        if budget == 0:  # what the tenant keeps besides this job fills its quota: its first save could only fail
            elsewhere = storage_use.stored_bytes(session, tenant_id=tenant.id) - job.checkpoint_bytes
            transitions.transition(session, job, JobState.FAILED, reason="StorageQuotaExceeded", now=self.clock(),
                                   message=storage_use.over_quota(tenant, stored=elsewhere) or "")
            return
        token, token_hash = reports.new_report_token()
        resuming = job.state == JobState.RESTARTING or job.latest_checkpoint_uri is not None  # restarted or preempted
        try:
            if job.restart_count == 0 and not resuming:
                self.backend.sync_tenant(tenant.name, quota_spec(tenant), sharing_of(tenant),
                                         policy_of(tenant, self.storage) if self.storage else None)
            backend_state = self.backend.start(
                Launch(job_id=job.id, tenant=tenant.name, spec=spec, attempt=job.restart_count + 1,
                       report_url=f"{self.public_url}/v1/jobs/{job.id}/reports", report_token=token,
                       storage_policy=policy_of(tenant, self.storage) if self.storage else None,
                       storage_budget_bytes=budget)
            )
        except NotReady as error:
            job.message = f"admitted; waiting to start: {error}"  # retried on the next pass
            return
        except CannotStart as error:
            transitions.transition(session, job, JobState.FAILED, reason=error.reason, message=str(error),
                                   now=self.clock())
            return
        except Exception as error:  # one job's trouble must not undo the whole pass for every other job
            log.warning("starting %s failed; retrying on the next pass", job.id, exc_info=True)
            job.message = f"admitted; starting failed, retrying: {error}"[:2000]
            return
        job.report_token_hash, job.backend_state = token_hash, backend_state
        processes = f"{spec.resources.num_processes} trainer processes on {spec.resources.nodes} node(s)"
        if isinstance(backend_state, dict) and backend_state.get("confinement"):
            processes += f" ({backend_state['confinement']})"  # which layers enforce its limits here
        if resuming:
            transitions.transition(session, job, JobState.RUNNING, reason="Resumed",
                               message=f"{processes}, resuming from the latest complete checkpoint", now=self.clock())
        else:
            transitions.transition(session, job, JobState.RUNNING, reason="Started", message=processes, now=self.clock())

    def _admit(self, session: Session) -> None:
        """Per-tenant queues, priority then FIFO; each admission all-or-nothing against quota and capacity; the
        decisions are kembed_api.quota.preemption's (cohorts, borrowing, preemption), carried out here.

        Within a tenant the head of the queue is never overtaken (a smaller job behind it waits too); across
        tenants, one tenant's blocked head does not hold up the others. So once every tenant with jobs waiting
        (their own count, kept with the queue) has its head blocked, nothing further can be admitted, and the pass
        stops reading: the queue is read a page at a time, as plain columns, and a pass over a long queue that
        cannot move reads one page, not the whole queue.
        """
        now = self.clock()
        tenants = {t.id: t for t in session.scalars(select(Tenant).execution_options(populate_existing=True))}
        waiting = {t.id for t in tenants.values() if t.queued_jobs}
        if not waiting:
            return
        active = session.execute(
            select(Job.seq, Job.tenant_id, Job.state, Job.priority, Job.step, Job.checkpoint_step,
                   *DEMAND_COLUMNS).where(Job.state.in_(_ACTIVE))).all()
        protected = self._protected(session, [r.seq for r in active], now=now)
        running = [
            preemption.Running(
                r.seq, r.tenant_id, demand_of_row(r),
                self._class_rank(r.priority),
                # steps since its last complete checkpoint, times what it holds: lost if it were killed
                work_at_risk=max(0, r.step - (r.checkpoint_step or 0)) * max(r.gpus, r.processes, 1),
                stopping=r.state == JobState.PREEMPTED, protected=r.seq in protected)
            for r in active
        ]
        messages: dict[int, str] = {}

        def queue() -> Iterator[preemption.Pending]:
            for row in self._queue_in_admission_order(session):
                messages[row.seq] = row.message
                yield preemption.Pending(row.seq, row.tenant_id, demand_of_row(row), self._class_rank(row.priority))

        plan = preemption.decide(shares={t.id: share_of(t) for t in tenants.values()},
                                 capacity=self.backend.capacity(), running=running, queue=queue(),
                                 waiting_tenants=waiting)
        for preempt in plan.preempt:
            victim, preemptor = session.get(Job, preempt.victim), session.get(Job, preempt.preemptor)
            why = ("its tenant's cohort reclaims the quota it lent" if preempt.reason == "ReclaimedByLender"
                   else "a higher priority class")
            # Another team's job is never named to this one: its name, like its usage, is that team's own.
            whose = f"job {preemptor.id}" if preemptor.tenant_id == victim.tenant_id else "another team's job"
            transitions.transition(session, victim, JobState.PREEMPTED, reason=preempt.reason, now=now,
                               message=f"for {whose} ({why}); saving a checkpoint, then back to the queue at "
                                       f"its place")
            if victim.backend_state:
                self.backend.preempt(victim.id)
        for admit in plan.admit:
            job = session.get(Job, admit.key)
            demand = demand_of_row(job)
            borrowed = "; borrowing its cohort's idle quota" if admit.borrowed else ""
            transitions.transition(session, job, JobState.ADMITTED, reason="Admitted",
                               message=f"reserved {describe(demand)}{borrowed}", now=now)
            if self.metrics:
                self.metrics.observe_admission(tenant=tenants[job.tenant_id].name, created_at=job.created_at,
                                               admitted_at=job.admitted_at)
            self._launch(session, job)
        for wait in plan.wait:
            if messages.get(wait.key) != f"waiting for {wait.reason}":  # say why it waits, without an event per pass
                session.execute(update(Job).where(Job.seq == wait.key).values(message=f"waiting for {wait.reason}"))

    def _class_rank(self, priority: int) -> int:
        """The job's priority class, as a rank: jobs of one class never preempt each other."""
        return sum(1 for value in self.priority_classes.values() if value <= priority)

    def _protected(self, session: Session, seqs: list[int], *, now: datetime) -> set[int]:
        """Jobs preempted `protect_after` times within the window: never preempted again (no thrashing)."""
        if not seqs:
            return set()
        since = now - timedelta(seconds=self.protect_window_s)
        rows = session.execute(
            select(JobEvent.job_seq).where(JobEvent.state == JobState.PREEMPTED, JobEvent.time >= since,
                                           JobEvent.job_seq.in_(seqs))
            .group_by(JobEvent.job_seq).having(func.count() >= self.protect_after))
        return {seq for (seq,) in rows}

    def _queue_in_admission_order(self, session: Session) -> Iterator[Row]:
        """Queued jobs, higher priority first, then oldest first, `queue_page` at a time. Jobs admitted meanwhile
        are before the page mark, so a later page skips none."""
        query = (select(Job.seq, Job.priority, Job.tenant_id, Job.message, *DEMAND_COLUMNS)
                 .where(Job.state == JobState.QUEUED).order_by(Job.priority.desc(), Job.seq).limit(self.queue_page))
        page = session.execute(query).all()
        while True:
            yield from page
            if len(page) < self.queue_page:
                return
            last = page[-1]
            page = session.execute(query.where(or_(
                Job.priority < last.priority, and_(Job.priority == last.priority, Job.seq > last.seq)))).all()
