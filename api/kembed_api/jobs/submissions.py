"""Storing submissions: a batch of specs becomes QUEUED jobs (or refusals) in a few statements, with the tenant's
priority classes, quota and storage policy applied and Idempotency-Keys answered."""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, Row, bindparam, func, insert, literal, select, tuple_, union_all
from sqlalchemy.orm import Session

from kembed_api.jobs import estimates, storage_use
from kembed_api.jobs.errors import CannotRun, KeyReused, QueueFull
from kembed_api.jobs.ids import new_job_id
from kembed_api.jobs.models import Job, JobEvent
from kembed_api.jobs.reads import no_forecast, read_job, to_read
from kembed_api.jobs.schemas import JobEventRead, JobRead
from kembed_api.jobs.transitions import queue_changed
from kembed_api.platform.db import Executor, utcnow
from kembed_api.platform.storage import PlatformStorage, how_to_grant
from kembed_api.quota.admission import Demand, never_fits
from kembed_api.quota.demand import demand_columns
from kembed_api.tenants.models import Tenant
from kembed_api.tenants.service import ceiling_of, policy_of
from kembed_contract import runtime
from kembed_contract.lifecycle import JobState
from kembed_contract.spec import JobSpec
from kembed_contract.storage_policy import StorageDenied, UriError, canonicalize_fields

__all__ = ["Outcome", "Submission", "submit", "submit_many"]

_JOBS, _TENANTS, _EVENTS = Job.__table__, Tenant.__table__, JobEvent.__table__


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
                outcomes[i] = _key_reused()
            else:
                outcomes[i] = (_read_stored(session, known[key], tenant=tenant), False)
            continue
        if key in first_with_key:
            if submissions[first_with_key[key]].spec_hash != submission.spec_hash:
                outcomes[i] = _key_reused()
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


def _key_reused() -> KeyReused:
    return KeyReused("header.idempotency-key: this key was used before with a different spec; resend the same "
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
    # Not in `row`: a JSON column stores None as the JSON value null; left out, these stay SQL NULL.
    result: None = None
    trainer_seconds: None = None
    trainer_done_at: None = None

    def __getattr__(self, column: str) -> Any:  # job.priority, ...: what to_read reads of a job
        try:
            return self.row[column]
        except KeyError:
            raise AttributeError(column) from None


def _new_job(spec: JobSpec, *, tenant: Row, storage: PlatformStorage, now: datetime, idempotency_key: str | None,
             spec_hash: str | None, taken_ids: set[str]) -> _NewJob:
    """The QUEUED job a valid submission becomes (not yet stored); raises CannotRun."""
    _check_can_run(spec, tenant=tenant)
    job_id = new_job_id(spec.name)
    while job_id in taken_ids:
        job_id = new_job_id(spec.name)
    taken_ids.add(job_id)
    try:
        # Every URI of the spec, canonical and inside the tenant's policy; the spec is stored with those forms.
        canonicalize_fields(spec, policy_of(tenant, storage))
    except StorageDenied as refused:
        raise CannotRun(f"{refused}; {how_to_grant(tenant.name, refused.access)}") from None
    except UriError as refused:
        raise CannotRun(str(refused)) from None
    checkpoint = spec.trainer.checkpoint
    if checkpoint.uri is None:
        # Checkpoints are namespaced by tenant so no tenant is ever handed another's path.
        checkpoint = checkpoint.model_copy(
            update={"uri": runtime.job_checkpoint_folder(storage.own_folder(tenant.name), job_id)})
        spec = spec.model_copy(update={"trainer": spec.trainer.model_copy(update={"checkpoint": checkpoint})})
    demand = Demand.of(spec)
    return _NewJob(row=dict(
        id=job_id, tenant_id=tenant.id, name=spec.name, spec=spec.model_dump(mode="json"), priority=spec.priority,
        **demand_columns(demand),
        idempotency_key=idempotency_key, spec_hash=spec_hash, state=JobState.QUEUED, reason="Submitted",
        message="waiting for admission",
        cancel_requested=False, restart_count=0, created_at=now, admitted_at=None, started_at=None,
        finished_at=None, step=0, total_steps=spec.trainer.training.steps or 0, metrics={},
        latest_checkpoint_uri=None, checkpoint_step=None, dataset=None, backend_state={}, report_token_hash=None,
        report_seqs={}, checkpoint_bytes=0, log_bytes=0, run_seconds=0.0, running_since=None,
    ), spec=spec)


def _with_priority_class(spec: JobSpec, *, tenant: Row, classes: dict[str, int]) -> JobSpec:
    """The spec with the priority its class gives it; raises CannotRun for an unknown class or one above the
    tenant's limit (max_priority_class), or a priority above that limit."""
    names = ", ".join(sorted(classes, key=classes.get)) or "none"
    priority = spec.priority
    if spec.priority_class is not None:
        if spec.priority_class not in classes:
            raise CannotRun(f"priority_class: not one of the platform's classes ({names})")
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
    ceiling = "the tenant's quota plus its borrowing limit" if tenant.cohort else "the tenant's quota"
    why = never_fits(ceiling_of(tenant), Demand.of(spec), ceiling=ceiling)
    if why:
        raise CannotRun(f"resources: {why}")
    limit = tenant.quota_max_run_seconds
    if limit is not None and spec.max_run_seconds is not None and spec.max_run_seconds > limit:
        raise CannotRun(f"max_run_seconds: the tenant's jobs may run at most {limit} seconds "
                        f"(quota.max_run_seconds); this job asks for {spec.max_run_seconds}")
    if full := storage_use.over_quota(tenant):
        raise CannotRun(full)
    if why := estimates.why_memory_cannot_fit(spec):
        raise CannotRun(why)
