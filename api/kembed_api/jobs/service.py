"""Jobs: the state machine and everything that reads or changes a job. Pure logic over a Session."""

from __future__ import annotations

import dataclasses
import hmac
import re
import secrets
import string
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from pydantic import BaseModel
from sqlalchemy import Connection, Row, bindparam, func, insert, literal, select, tuple_, union_all, update
from sqlalchemy.orm import Session

from kembed_api import estimates
from kembed_api.admission import Demand, Quota, RunningJob, estimate_start_times, never_fits
from kembed_api.auth.service import hash_secret
from kembed_api.db import Executor, utcnow
from kembed_api.jobs.models import Job, JobEvent, JobMetric
from kembed_api.jobs.schemas import (
    JobEstimates,
    JobEventRead,
    JobList,
    JobMetricRead,
    JobRead,
    Progress,
    ReportRecord,
)
from kembed_api.storage import PlatformStorage
from kembed_api.tenants.models import Tenant
from kembed_api.tenants.service import policy_of, quota_of
from kembed_contract import lifecycle
from kembed_contract.lifecycle import ACTIVE_STATES, TERMINAL_STATES, JobState
from kembed_contract.spec import JobSpec, read_stored
from kembed_trainer import runtime
from kembed_trainer.storage_policy import StorageDenied, UriError, canonicalize_fields

__all__ = [
    "CannotRun",
    "KeyReused",
    "QueueFull",
    "DEMAND_COLUMNS",
    "demand_from_columns",
    "describe",
    "expected_end",
    "JobNotFound",
    "apply_report",
    "get_job",
    "is_job_id",
    "list_events",
    "list_jobs",
    "list_metrics",
    "new_report_token",
    "no_forecast",
    "queue_changed",
    "queue_forecast",
    "read_job",
    "request_cancel",
    "requeue",
    "Outcome",
    "Submission",
    "submit",
    "submit_many",
    "to_read",
    "transition",
    "verify_report_token",
]

Clock = Callable[[], datetime]

class JobNotFound(LookupError):
    """No such job for this tenant (another tenant's job is indistinguishable from a missing one)."""


class CannotRun(ValueError):
    """The job could never run for this tenant (422): bigger than its quota or than the memory it asks for."""


class QueueFull(RuntimeError):
    """The tenant already has as many queued jobs as its quota allows (429)."""


class KeyReused(ValueError):
    """An Idempotency-Key the tenant used before, now with a different spec (422): a retry must send the same
    request, and a different job needs a key of its own."""


# What a job id can be (a DNS label: the name, '-', 5 characters). Anything else is no job, answered before any
# statement runs (PostgreSQL refuses NUL characters outright).
_JOB_ID = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")


def is_job_id(job_id: str) -> bool:
    return _JOB_ID.match(job_id) is not None


# Statements of the paths every read and submission takes, built once with bound parameters: building a select()
# and its cache key on each call costs about as much CPU as SQLite takes to run it.
_JOB_OF_TENANT = select(Job).where(Job.id == bindparam("job_id"), Job.tenant_id == bindparam("tenant_id"))
_JOB_OF_TENANT_FOR_UPDATE = _JOB_OF_TENANT.with_for_update()
# What a poll of one job reads, in Core statements (no ORM objects: a read only renders them): in one statement,
# the job's row with its tenant's queue version, once for each of its events (a handful: a state change each).
# Reading the events by a statement of their own was a fifth of a poll's CPU, for one more round trip; the job's
# columns repeated cost less. A queued job's position comes from the tenant's cached forecast
# when that was taken at the same queue version; otherwise it is counted: the queued jobs admitted before it
# (higher priority, or the same and older), two ranges of the queue-order index (an OR of the two would walk the
# tenant's whole queue). A count costs as much as the jobs ahead, which is why it is the fallback.
_JOBS, _TENANTS = Job.__table__, Tenant.__table__
_EVENTS = JobEvent.__table__
_JOB_ROWS_WITH_EVENTS = (
    select(_JOBS, _TENANTS.c.queue_version, _EVENTS.c.time.label("event_time"),
           _EVENTS.c.state.label("event_state"), _EVENTS.c.reason.label("event_reason"),
           _EVENTS.c.message.label("event_message"))
    .join(_TENANTS, _TENANTS.c.id == _JOBS.c.tenant_id).outerjoin(_EVENTS, _EVENTS.c.job_seq == _JOBS.c.seq)
    .where(_JOBS.c.id == bindparam("job_id"), _JOBS.c.tenant_id == bindparam("tenant_id")).order_by(_EVENTS.c.id)
)
_QUEUED_AHEAD = select(
    select(func.count()).where(_JOBS.c.tenant_id == bindparam("tenant_id"), _JOBS.c.state == JobState.QUEUED,
                               _JOBS.c.priority > bindparam("priority")).scalar_subquery()
    + select(func.count()).where(_JOBS.c.tenant_id == bindparam("tenant_id"), _JOBS.c.state == JobState.QUEUED,
                                 _JOBS.c.priority == bindparam("priority"),
                                 _JOBS.c.seq < bindparam("seq")).scalar_subquery()
)
# The tenant's queue bookkeeping (kembed_api.tenants.models.Tenant.queue_version, .queued_jobs). Core, not ORM:
# both are read by statements of their own, and the tenant's settings are not what changed.
_COUNT_QUEUE_CHANGE = (update(_TENANTS).where(_TENANTS.c.id == bindparam("tenant_id"))
                       .values(queue_version=_TENANTS.c.queue_version + bindparam("moved"),
                               queued_jobs=_TENANTS.c.queued_jobs + bindparam("joined"),
                               updated_at=_TENANTS.c.updated_at))
_QUEUE_VERSION = select(_TENANTS.c.queue_version).where(_TENANTS.c.id == bindparam("tenant_id"))
_EVENT_ROWS_OF_JOB = (select(JobEvent.time, JobEvent.state, JobEvent.reason, JobEvent.message)
                      .where(JobEvent.job_seq == bindparam("job_seq")).order_by(JobEvent.id))


def _new_job_id(name: str) -> str:
    alphabet = string.ascii_lowercase + string.digits
    return f"{name}-{''.join(secrets.choice(alphabet) for _ in range(5))}"


def new_report_token() -> tuple[str, str]:
    """A fresh per-job token and its hash; only the hash is stored."""
    token = secrets.token_urlsafe(32)
    return token, hash_secret(token)


def verify_report_token(job: Job | None, token: str) -> bool:
    """Whether `token` is the report token of `job`; False for no job (the token is hashed all the same, so that
    the time taken does not tell a missing job from a wrong token)."""
    given = hash_secret(token)
    expected = job.report_token_hash if job is not None else None
    return hmac.compare_digest(expected or "-" * len(given), given) and expected is not None


def transition(
    session: Session, job: Job, state: JobState, *, reason: str, message: str = "", now: datetime | None = None
) -> None:
    """Move `job` to `state`, stamp the times and record the event."""
    current = JobState(job.state)
    lifecycle.check_transition(current, state, job=f"job {job.id}")
    now = now or utcnow()
    if JobState.QUEUED in (current, state):  # left the queue, or back in it at its old place
        queue_changed(session, tenant_id=job.tenant_id, joined=1 if state is JobState.QUEUED else -1, moved=True)
    job.state, job.reason, job.message = state, reason, message
    if state is JobState.ADMITTED:
        job.admitted_at = now
    elif state is JobState.RUNNING and job.started_at is None:
        job.started_at = now
    elif state in TERMINAL_STATES:
        job.finished_at = now
    session.add(JobEvent(job_seq=job.seq, time=now, state=state, reason=reason, message=message))


def requeue(session: Session, job: Job, *, now: datetime | None = None) -> None:
    """A preempted job whose trainers have stopped goes back to its tenant's queue at its old place (its priority
    and submission order are unchanged) and resumes from its latest complete checkpoint when admitted again. The
    event says how many reported steps that checkpoint is behind the last one (0 when the trainers saved on
    SIGTERM within the grace period; more when they were killed)."""
    job.backend_state = {}
    lost = max(0, job.step - (job.checkpoint_step or 0))
    where = f"checkpoint step {job.checkpoint_step}" if job.checkpoint_step is not None else "the start"
    transition(session, job, JobState.QUEUED, reason="Requeued",
               message=f"stopped at step {job.step}; resumes from {where}; lost_steps={lost}", now=now)


def queue_changed(session: Session | Connection, *, tenant_id: int, joined: int, moved: bool) -> None:
    """`joined` jobs more (or fewer) in the tenant's queue; `moved`: jobs already in it moved, so positions
    forecast before now no longer hold."""
    session.execute(_COUNT_QUEUE_CHANGE, {"tenant_id": tenant_id, "joined": joined, "moved": int(moved)})


@dataclass(frozen=True)
class Submission:
    """One job to store for a tenant (see submit_many)."""

    tenant_id: int
    spec: JobSpec
    idempotency_key: str | None = None

    @property
    def spec_hash(self) -> str | None:
        """What a repeated Idempotency-Key is compared by (only keyed submissions need it)."""
        return self.spec.canonical_hash() if self.idempotency_key is not None else None


# What storing one submission came to: the job's answer and whether it was created (False: an Idempotency-Key
# seen before), or why it was refused.
Outcome = tuple[JobRead, bool] | CannotRun | QueueFull | KeyReused

_JOBS_OF_KEYS = (select(_JOBS.c.id, _JOBS.c.tenant_id, _JOBS.c.idempotency_key, _JOBS.c.spec_hash)
                 .where(tuple_(_JOBS.c.tenant_id, _JOBS.c.idempotency_key).in_(bindparam("keys", expanding=True))))
# The tenants' rows as they are now (locked), as plain rows: a batch reads their quotas and queue lengths.
_TENANTS_FOR_UPDATE = select(_TENANTS).where(_TENANTS.c.id.in_(bindparam("ids", expanding=True))).with_for_update()
# (priority, queued jobs) for each priority above the given one, then (None, queued jobs below it): two ranges of
# the queue-order index in one round trip.
_QUEUED_AROUND = union_all(
    select(_JOBS.c.priority, func.count())
    .where(_JOBS.c.tenant_id == bindparam("tenant_id"), _JOBS.c.state == JobState.QUEUED,
           _JOBS.c.priority > bindparam("priority")).group_by(_JOBS.c.priority),
    select(literal(None, type_=_JOBS.c.priority.type), func.count())
    .where(_JOBS.c.tenant_id == bindparam("tenant_id"), _JOBS.c.state == JobState.QUEUED,
           _JOBS.c.priority < bindparam("priority")),
)


@dataclass
class _Queue:
    """What a batch needs to know of a tenant's queue. Its length is the tenant's own count; jobs are counted
    by priority only where a new job can land (from the batch's lowest priority up) and, of the rest, only how
    many there are. Usually every job has the same priority, and both counts are empty ranges of the
    queue-order index: counting the queue itself would cost as much as it is long, on every batch."""

    length: int
    by_priority: Counter[int]  # queued jobs of each priority from the batch's lowest one up
    below: int  # queued jobs of a lower priority than any of the batch's

    @classmethod
    def of(cls, session: Session | Connection, tenant: Row, lowest_priority: int) -> _Queue:
        by_priority, below = Counter(), 0
        for priority, count in session.execute(_QUEUED_AROUND, {"tenant_id": tenant.id, "priority": lowest_priority}):
            if priority is None:
                below = count
            else:
                by_priority[priority] = count
        by_priority[lowest_priority] = tenant.queued_jobs - below - by_priority.total()
        return cls(tenant.queued_jobs, by_priority, below)

    def overtakes(self, priority: int) -> bool:
        """Whether a new job of this priority goes ahead of jobs already queued."""
        return self.below > 0 or any(n for p, n in self.by_priority.items() if p < priority)

    def ahead(self, priority: int) -> int:
        """Queued jobs of a higher priority than this one."""
        return sum(n for p, n in self.by_priority.items() if p > priority)

    def add(self, priority: int) -> None:
        self.by_priority[priority] += 1
        self.length += 1


# Core inserts into the tables (the ORM's bulk insert would redo per statement what these rows already are: half
# a millisecond of a batch's CPU), each one statement of one row executed for every row: no RETURNING, so the
# driver sends the rows of a batch in one round trip (psycopg's pipeline) to one statement the server parsed once.
# (Returning the new jobs' sequence numbers took a multi-row VALUES instead, of a different text for each size of
# batch: parsed anew each time by the driver and by PostgreSQL; the driver's split of that text alone was a tenth
# of the API's CPU.) A job's first event finds the job's number by its id, a unique index.
_INSERT_JOBS = insert(_JOBS)
_INSERT_FIRST_EVENTS = insert(_EVENTS).from_select(
    [_EVENTS.c.job_seq, _EVENTS.c.time, _EVENTS.c.state, _EVENTS.c.reason, _EVENTS.c.message],
    select(_JOBS.c.seq, _JOBS.c.created_at, _JOBS.c.state, _JOBS.c.reason, _JOBS.c.message)
    .where(_JOBS.c.id == bindparam("job_id")),
)


def submit_many(
    session: Session | Connection, submissions: Sequence[Submission], *, storage: PlatformStorage,
    now: datetime | None = None, priority_classes: dict[str, int] | None = None,
) -> list[Outcome]:
    """Store QUEUED jobs, one outcome per submission in order; the caller commits (kembed_api.jobs.intake, on
    a bare Connection: every statement here is Core, and tenants and jobs are read as plain rows).

    A handful of statements serve the whole batch: the tenants (locked, so that concurrent batches of one tenant,
    also from another replica, count its queue one at a time), the jobs of repeated Idempotency-Keys, what the
    batch needs of each tenant's queue (`_Queue`) and its new length, and two inserts (the jobs, then their first
    events), each one statement run for every row. Job ids are random and not checked first: a clash with a
    stored id (or a concurrent request with the same key) fails the insert with IntegrityError, and the caller
    retries.
    """
    now = now or utcnow()
    tenant_ids = list({s.tenant_id for s in submissions})
    tenants = {t.id: t for t in session.execute(_TENANTS_FOR_UPDATE, {"ids": tenant_ids})}
    classes = priority_classes or {}
    refused_class: dict[int, CannotRun] = {}  # submissions whose priority class is refused
    resolved = []
    for i, submission in enumerate(submissions):
        try:
            spec = _with_priority_class(submission.spec, tenant=tenants[submission.tenant_id], classes=classes)
        except CannotRun as error:
            refused_class[i], spec = error, submission.spec
        resolved.append(dataclasses.replace(submission, spec=spec))
    submissions = resolved
    keys = list({(s.tenant_id, s.idempotency_key) for s in submissions if s.idempotency_key is not None})
    known = ({(j.tenant_id, j.idempotency_key): j for j in session.execute(_JOBS_OF_KEYS, {"keys": keys})}
             if keys else {})
    lowest: dict[int, int] = {}
    for submission in submissions:
        lowest[submission.tenant_id] = min(lowest.get(submission.tenant_id, submission.spec.priority),
                                           submission.spec.priority)
    queues = {tenant_id: _Queue.of(session, tenants[tenant_id], priority) for tenant_id, priority in lowest.items()}

    outcomes: list[Outcome | None] = [None] * len(submissions)
    new: list[tuple[int, _NewJob, int]] = []  # (submission index, job, queued jobs of its priority ahead)
    first_with_key: dict[tuple[int, str], int] = {}  # a key repeated within the batch answers the first's job
    repeats: list[tuple[int, int]] = []  # (submission index, index of the first with its key)
    taken_ids: set[str] = set()
    moved: set[int] = set()  # tenants whose queued jobs a new one overtakes
    for i, submission in enumerate(submissions):
        tenant, key = tenants[submission.tenant_id], (submission.tenant_id, submission.idempotency_key)
        if key in known:
            # A job stored before spec hashes were kept (NULL) answers any repeat, as it always did.
            if known[key].spec_hash not in (None, submission.spec_hash):
                outcomes[i] = _key_reused(submission.idempotency_key)
            else:
                outcomes[i] = (_read_stored(session, known[key], tenant=tenant), False)
            continue
        if key in first_with_key:
            if submissions[first_with_key[key]].spec_hash != submission.spec_hash:
                outcomes[i] = _key_reused(submission.idempotency_key)
            else:
                repeats.append((i, first_with_key[key]))  # answered below, from the job the first one creates
            continue
        if i in refused_class:
            outcomes[i] = refused_class[i]
            continue
        try:
            job = _new_job(submission.spec, tenant=tenant, storage=storage, now=now,
                           idempotency_key=submission.idempotency_key, spec_hash=submission.spec_hash,
                           taken_ids=taken_ids)
        except CannotRun as refused:
            outcomes[i] = refused
            continue
        queue = queues[tenant.id]
        if tenant.quota_max_queued_jobs is not None and queue.length >= tenant.quota_max_queued_jobs:
            outcomes[i] = QueueFull(
                f"tenant {tenant.name!r} already has {queue.length} queued jobs (quota.max_queued_jobs is "
                f"{tenant.quota_max_queued_jobs}); retry when some have started")
            continue
        new.append((i, job, queue.by_priority[job.priority]))
        if queue.overtakes(job.priority):
            moved.add(tenant.id)
        queue.add(job.priority)
        if submission.idempotency_key is not None:
            first_with_key[key] = i

    for tenant_id, joined in Counter(job.tenant_id for _, job, _ in new).items():
        queue_changed(session, tenant_id=tenant_id, joined=joined, moved=tenant_id in moved)
    if new:
        session.execute(_INSERT_JOBS, [job.row for _, job, _ in new])
        session.execute(_INSERT_FIRST_EVENTS, [{"job_id": job.id} for _, job, _ in new])
    for i, job, same_priority_ahead in new:
        # Ahead of a new job: every queued job of a higher priority (this batch's included), and the older ones
        # of its own priority.
        ahead = same_priority_ahead + queues[job.tenant_id].ahead(job.priority)
        tenant = tenants[job.tenant_id]
        events = [JobEventRead(time=now, state=JobState.QUEUED, reason=job.reason, message=job.message)]
        outcomes[i] = (to_read(job, tenant_name=tenant.name, queue=(ahead + 1, None), events=events, spec=job.spec),
                       True)
    for i, first in repeats:
        outcomes[i] = (outcomes[first][0], False)
    return outcomes


def _key_reused(key: str | None) -> KeyReused:
    return KeyReused(f"header.idempotency-key: {key!r} was used before with a different spec; resend the same "
                     "spec to get that job, or use a new key for a new job")


def submit(
    session: Session, *, tenant: Tenant, spec: JobSpec, storage: PlatformStorage, idempotency_key: str | None = None,
    now: datetime | None = None,
) -> tuple[JobRead, bool]:
    """One submission (see submit_many); raises CannotRun, QueueFull or KeyReused."""
    outcome = submit_many(session, [Submission(tenant.id, spec, idempotency_key)], storage=storage, now=now)[0]
    if isinstance(outcome, Exception):
        raise outcome
    return outcome


@dataclass
class _NewJob:
    """A job a submission becomes, before it is stored: the columns it is inserted with (`row`), and its spec as
    stored (what its answer shows, validated once)."""

    row: dict[str, Any]  # every column a new job sets (an insert run for many rows needs the same keys in each)
    spec: JobSpec
    # Not in `row`: a JSON column stores None as the JSON value null; left out, `result` stays SQL NULL.
    result: None = None

    def __getattr__(self, column: str) -> Any:  # job.priority, ...: what to_read reads of a job
        try:
            return self.row[column]
        except KeyError:
            raise AttributeError(column) from None


def _new_job(spec: JobSpec, *, tenant: Row, storage: PlatformStorage, now: datetime, idempotency_key: str | None,
             spec_hash: str | None, taken_ids: set[str]) -> _NewJob:
    """The QUEUED job a valid submission becomes (not yet stored); raises CannotRun."""
    _check_can_run(spec, tenant=tenant)
    job_id = _new_job_id(spec.name)
    while job_id in taken_ids:
        job_id = _new_job_id(spec.name)
    taken_ids.add(job_id)
    try:
        # Every URI of the spec, canonical and inside the tenant's policy; the spec is stored with those forms.
        canonicalize_fields(spec, policy_of(tenant, storage))
    except (StorageDenied, UriError) as refused:
        raise CannotRun(str(refused)) from None
    checkpoint = spec.trainer.checkpoint
    if checkpoint.uri is None:
        # Checkpoints are namespaced by tenant so no tenant is ever handed another's path.
        checkpoint = checkpoint.model_copy(update={"uri": f"{storage.own_folder(tenant.name)}/{job_id}"})
        spec = spec.model_copy(update={"trainer": spec.trainer.model_copy(update={"checkpoint": checkpoint})})
    demand = Demand.of(spec)
    return _NewJob(row=dict(
        id=job_id, tenant_id=tenant.id, name=spec.name, spec=spec.model_dump(mode="json"), priority=spec.priority,
        gpus=demand.gpus, cpu=demand.cpu, memory_bytes=demand.memory_bytes, processes=demand.processes,
        idempotency_key=idempotency_key, spec_hash=spec_hash, state=JobState.QUEUED, reason="Submitted",
        message="waiting for admission",
        cancel_requested=False, restart_count=0, created_at=now, admitted_at=None, started_at=None,
        finished_at=None, step=0, total_steps=spec.trainer.training.steps or 0, metrics={},
        checkpoint_uri=None, checkpoint_step=None, dataset=None, backend_state={}, report_token_hash=None,
        report_seqs={},
    ), spec=spec)


def _with_priority_class(spec: JobSpec, *, tenant: Row, classes: dict[str, int]) -> JobSpec:
    """The spec with the priority its class gives it; raises CannotRun for an unknown class or one above the
    tenant's limit (max_priority_class), or a priority above that limit."""
    names = ", ".join(sorted(classes, key=classes.get)) or "none"
    priority = spec.priority
    if spec.priority_class is not None:
        if spec.priority_class not in classes:
            raise CannotRun(f"priority_class: {spec.priority_class!r} is not one of the platform's classes ({names})")
        priority = classes[spec.priority_class]
    limit = getattr(tenant, "max_priority_class", None)
    if limit is not None and limit in classes and priority > classes[limit]:
        raise CannotRun(f"priority_class: the tenant may use priority classes up to {limit!r} "
                        f"(priority {classes[limit]}); this job asks for priority {priority}")
    return spec if priority == spec.priority else spec.model_copy(update={"priority": priority})


def _read_stored(session: Executor, job: Row, *, tenant: Row) -> JobRead:
    """The answer for a job already stored (a repeated Idempotency-Key): as a read of it answers."""
    return read_job(session, tenant=tenant, job_id=job.id, forecast=no_forecast)


def _check_can_run(spec: JobSpec, *, tenant: Row) -> None:
    why = never_fits(quota_of(tenant), Demand.of(spec))
    if why:
        raise CannotRun(f"resources: {why}")
    estimate = estimates.memory_per_rank(spec.trainer, world_size=spec.resources.num_processes)
    ranks = spec.resources.procs_per_node or 1
    if estimate.total * ranks > spec.resources.memory_bytes_per_node:
        raise CannotRun(
            f"resources.memory_per_node: the job needs about {estimate.describe()}, "
            f"{estimate.total * ranks / 2**30:.2f} GiB for {ranks} rank(s) per node, more than memory_per_node "
            f"({spec.resources.memory_per_node})"
        )


def describe(demand: Demand) -> str:
    parts = [f"{demand.processes} trainer processes", f"{demand.cpu:g} CPU", f"{demand.memory_bytes / 2**30:g} GiB"]
    if demand.gpus:
        parts.insert(0, f"{demand.gpus} GPUs")
    return ", ".join(parts)


def get_job(session: Session, *, tenant: Tenant, job_id: str, for_update: bool = False) -> Job:
    if not is_job_id(job_id):
        raise JobNotFound(job_id)
    job = session.scalar(_JOB_OF_TENANT_FOR_UPDATE if for_update else _JOB_OF_TENANT,
                         {"job_id": job_id, "tenant_id": tenant.id})
    if job is None:
        raise JobNotFound(job_id)
    return job


def _encode_cursor(seq: int) -> str:
    return str(seq)


def _decode_cursor(cursor: str) -> int:
    """The job number a page continues below. Any number is a cursor (the route takes digits only): one past every
    job number (32-bit) continues from the newest."""
    return min(int(cursor), 2**31)


def list_jobs(
    session: Session, *, tenant: Tenant, forecast: Callable[[], dict[int, tuple[int, datetime | None]]],
    states: list[JobState] | None = None, limit: int = 50, cursor: str | None = None, name: str | None = None,
) -> JobList:
    """Newest first, `limit` at a time."""
    query = select(Job).where(Job.tenant_id == tenant.id).order_by(Job.seq.desc()).limit(limit + 1)
    if states:
        query = query.where(Job.state.in_([s.value for s in states]))
    if name:
        query = query.where(Job.name == name)
    if cursor:
        query = query.where(Job.seq < _decode_cursor(cursor))
    jobs = list(session.scalars(query))
    page, more = jobs[:limit], len(jobs) > limit
    queued = forecast() if any(j.state == JobState.QUEUED for j in page) else {}
    return JobList(
        items=[to_read(job, tenant_name=tenant.name, queue=queued.get(job.seq)) for job in page],
        next_cursor=_encode_cursor(page[-1].seq) if more else None,
    )


def expected_end(*, started_at: datetime | None, step: int, total_steps: int, now: datetime) -> datetime | None:
    """Now plus the remaining steps at the pace the job has kept so far; None before it made progress."""
    if total_steps and step >= total_steps:
        return now
    if started_at is None or step <= 0:
        return None
    elapsed = (now - started_at).total_seconds()
    return now + timedelta(seconds=elapsed * (total_steps - step) / step)


def _last_durations(session: Session, *, tenant: Tenant) -> dict[str, timedelta]:
    """How long the latest successful run of each name in the tenant's queue took: the guess for its next run."""
    rows = session.execute(_LAST_RUNS, {"tenant_id": tenant.id})
    return {name: finished - started for name, started, finished in rows if started and finished}


# What one job holds, as columns: queries that sum or replay the queue read only these.
DEMAND_COLUMNS = (Job.gpus, Job.cpu, Job.memory_bytes, Job.processes)

# The replay's statements (queue_forecast). The tenant's queue in admission order, from the index alone; then its
# names and demands in the same order; the jobs holding resources now; the latest successful runs of the names
# in the queue.
_QUEUE_ORDER = (select(Job.seq).where(Job.tenant_id == bindparam("tenant_id"), Job.state == JobState.QUEUED)
                .order_by(Job.priority.desc(), Job.seq))
_QUEUE_DEMANDS = (select(Job.name, *DEMAND_COLUMNS)
                  .where(Job.tenant_id == bindparam("tenant_id"), Job.state == JobState.QUEUED)
                  .order_by(Job.priority.desc(), Job.seq))
_ACTIVE_JOBS = (select(Job.tenant_id, Job.started_at, Job.step, Job.total_steps, *DEMAND_COLUMNS)
                .where(Job.state.in_([s.value for s in ACTIVE_STATES])))
_LAST_RUNS = (
    select(Job.name, Job.started_at, Job.finished_at)
    .where(Job.tenant_id == bindparam("tenant_id"), Job.state == JobState.SUCCEEDED,
           Job.name.in_(select(Job.name).where(Job.tenant_id == bindparam("tenant_id"),
                                               Job.state == JobState.QUEUED).scalar_subquery()))
    .order_by(Job.seq)
)


def demand_from_columns(gpus: int, cpu: float, memory_bytes: int, processes: int) -> Demand:
    return Demand(gpus=gpus, cpu=cpu, memory_bytes=memory_bytes, jobs=1, processes=processes)


def queue_forecast(
    session: Session, *, tenant: Tenant, capacity: Quota, now: datetime | None = None
) -> tuple[int, dict[int, tuple[int, datetime | None]]]:
    """The tenant's queue version, and for its QUEUED jobs: (position in admission order, estimated start or None).

    Positions come from the queue-order index alone; the replay reads the queue's rows only as far as it can
    estimate (usually the head, up to the first job waiting behind one of unknown duration). The version is read
    first: a change committed meanwhile leaves positions newer than their version, which then go unused, never
    older ones passed off as current. Callers cache it (kembed_api.jobs.forecasts).
    """
    version = session.scalar(_QUEUE_VERSION, {"tenant_id": tenant.id})
    now = now or utcnow()
    order = session.scalars(_QUEUE_ORDER, {"tenant_id": tenant.id}).all()
    if not order:
        return version, {}
    active = session.execute(_ACTIVE_JOBS)
    running = [
        RunningJob(demand_from_columns(r.gpus, r.cpu, r.memory_bytes, r.processes),
                   expected_end(started_at=r.started_at, step=r.step, total_steps=r.total_steps, now=now),
                   own=r.tenant_id == tenant.id)
        for r in active
    ]
    durations = _last_durations(session, tenant=tenant)
    # Streamed a few hundred rows at a time: the replay usually stops long before the end of a long queue.
    queued = session.execute(_QUEUE_DEMANDS, {"tenant_id": tenant.id}, execution_options={"yield_per": 256})
    starts = estimate_start_times(
        quota=quota_of(tenant), capacity=capacity, running=running, now=now,
        queued=((demand_from_columns(r.gpus, r.cpu, r.memory_bytes, r.processes), durations.get(r.name))
                for r in queued),
    )
    queued.close()
    return version, {seq: (position, starts[position - 1] if position <= len(starts) else None)
                     for position, seq in enumerate(order, 1)}


def list_events(session: Executor, *, job: Job | Row) -> list[JobEventRead]:
    events = session.execute(_EVENT_ROWS_OF_JOB, {"job_seq": job.seq})
    return [JobEventRead(time=e.time, state=JobState(e.state), reason=e.reason, message=e.message) for e in events]


def list_metrics(session: Session, *, job: Job, event: str | None = None, limit: int = 1000) -> list[JobMetricRead]:
    query = select(JobMetric).where(JobMetric.job_seq == job.seq).order_by(JobMetric.id).limit(limit)
    if event:
        query = query.where(JobMetric.event == event)
    return [JobMetricRead(time=m.time, event=m.event, step=m.step, values=m.values) for m in session.scalars(query)]


def to_read(
    job: Job | Row, *, tenant_name: str, queue: tuple[int, datetime | None] | None = None,
    events: list[JobEventRead] | None = None, spec: JobSpec | None = None,
) -> JobRead:
    """The answer for a job: an ORM object, or a row of the jobs table (the same attribute names)."""
    total = job.total_steps
    spec = spec or read_stored(job.spec)
    return JobRead(
        id=job.id,
        name=job.name,
        tenant=tenant_name,
        state=JobState(job.state),
        reason=job.reason,
        message=job.message,
        priority=job.priority,
        restart_count=job.restart_count,
        created_at=job.created_at,
        admitted_at=job.admitted_at,
        started_at=job.started_at,
        finished_at=job.finished_at,
        progress=Progress(step=job.step, total_steps=total, fraction=min(1.0, job.step / total) if total else 0.0),
        metrics=job.metrics,
        result=job.result,
        dataset=job.dataset,
        checkpoint=job.checkpoint_uri,
        checkpoint_step=job.checkpoint_step,
        queue_position=queue[0] if queue else None,
        estimated_start_at=queue[1] if queue else None,
        estimates=_estimates(spec),
        spec=spec,
        events=events or [],
    )


def _estimates(spec: JobSpec) -> JobEstimates:
    if not isinstance(spec.trainer, BaseModel):  # a spec stored before today's rules, read unchecked: no estimate
        return JobEstimates(table_memory_bytes_per_rank=0, memory_bytes_per_rank=0)
    world_size = spec.resources.num_processes
    return JobEstimates(
        table_memory_bytes_per_rank=estimates.table_memory_bytes_per_rank(spec.trainer, world_size=world_size),
        memory_bytes_per_rank=estimates.memory_per_rank(spec.trainer, world_size=world_size).total)


def no_forecast(_job_seq: int, _queue_version: int) -> tuple[None, None]:
    """For read_job where no forecast is at hand: the position is counted, the start unknown."""
    return None, None


def read_job(
    session: Executor, *, tenant: Tenant, job_id: str,
    forecast: Callable[[int, int], tuple[int | None, datetime | None]],
) -> JobRead:
    """The job with its events, and a queued job's position and estimated start.

    `forecast(seq, queue_version)` gives what the tenant's cached forecast knows of a queued job: its position
    (None unless the forecast was taken at this queue version) and its estimated start (None if unknown).
    """
    rows = session.execute(_JOB_ROWS_WITH_EVENTS, {"job_id": job_id, "tenant_id": tenant.id}).all() if is_job_id(
        job_id) else []
    if not rows:
        raise JobNotFound(job_id)
    row = rows[0]
    queue = None
    if row.state == JobState.QUEUED:
        position, start = forecast(row.seq, row.queue_version)
        if position is None:
            ahead = session.scalar(_QUEUED_AHEAD, {"tenant_id": tenant.id, "priority": row.priority, "seq": row.seq})
            position = ahead + 1
        queue = (position, start)
    events = [JobEventRead(time=r.event_time, state=JobState(r.event_state), reason=r.event_reason,
                           message=r.event_message) for r in rows if r.event_state is not None]
    return to_read(row, tenant_name=tenant.name, queue=queue, events=events)


def request_cancel(session: Session, *, tenant: Tenant, job_id: str, now: datetime | None = None) -> Job:
    """Cancel at once what has not started; ask the dispatcher to stop what runs (it saves a checkpoint)."""
    job = get_job(session, tenant=tenant, job_id=job_id, for_update=True)
    state = JobState(job.state)
    if state in TERMINAL_STATES:
        return job
    if state is JobState.QUEUED:
        transition(session, job, JobState.CANCELLED, reason="Cancelled", message="cancelled before it started",
                   now=now)
    else:
        job.cancel_requested = True
        session.add(JobEvent(job_seq=job.seq, time=now or utcnow(), state=job.state, reason="CancelRequested",
                             message="stopping the trainer; it saves a checkpoint first"))
    return job


# Runs of one job whose last sequence number is remembered: a job has a run per start (restarts, preemptions),
# and whoever holds its report token cannot grow the row without bound by inventing runs.
_RUNS_REMEMBERED = 64

# Keys of a report that are bookkeeping, not metric values.
_RECORD_KEYS = frozenset({"event", "step", "time", "total_steps", "run", "seq"})


def _checkpoint_at(job: Job, uri: str, step: int) -> None:
    """The job's latest checkpoint is this one, unless a later step's was reported already."""
    if job.checkpoint_step is None or step >= job.checkpoint_step:
        job.checkpoint_uri, job.checkpoint_step = uri, step


def apply_report(session: Session, *, job: Job, record: ReportRecord, now: datetime | None = None) -> None:
    """Fold one trainer record into the job: progress, latest metrics, checkpoint, final result.

    Applying a record twice changes nothing: trainers retry until acknowledged, so a record whose first try was
    committed (its answer lost) comes again. A record is applied only if it is newer than the last one applied of
    its run (`seq`), whichever runs reported in between; and a checkpoint never moves back to an older step,
    whoever reports it.
    """
    values: dict[str, Any] = {k: v for k, v in record.model_dump().items() if k not in _RECORD_KEYS}
    if JobState(job.state) in TERMINAL_STATES:
        return  # late records of a finished job change nothing
    if record.run is not None and record.seq is not None:
        seen = dict(job.report_seqs or {})
        if record.seq <= seen.get(record.run, 0):
            return  # applied already (a retry), or older than one applied of the same run
        seen.pop(record.run, None)
        seen[record.run] = record.seq  # the most recent run last, so the oldest is forgotten first
        job.report_seqs = dict(list(seen.items())[-_RUNS_REMEMBERED:])
    job.step = max(job.step, record.step) if record.event != runtime.EVENT_STARTED else record.step
    if record.model_extra and isinstance(record.model_extra.get("total_steps"), int):
        job.total_steps = record.model_extra["total_steps"]
    if record.event == runtime.EVENT_STARTED and isinstance(values.get("dataset"), dict):
        job.dataset = {k: v for k, v in values["dataset"].items() if isinstance(v, int)}
    if record.event == runtime.EVENT_PROGRESS:
        job.metrics = {**job.metrics, **values}
    elif record.event == runtime.EVENT_EVAL:
        job.metrics = {**job.metrics, **{f"eval_{k}": v for k, v in values.items()}}
    elif record.event == runtime.EVENT_CHECKPOINT and isinstance(values.get("uri"), str):
        _checkpoint_at(job, values["uri"], record.step)
    elif record.event == runtime.EVENT_DONE:
        job.result = values.get("eval") if isinstance(values.get("eval"), dict) else {}
        if isinstance(values.get("checkpoint"), str):
            _checkpoint_at(job, values["checkpoint"], record.step)
    session.add(JobMetric(job_seq=job.seq, time=now or utcnow(), event=record.event, step=record.step,
                          values=values))
