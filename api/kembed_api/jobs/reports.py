"""What trainers report: the per-job report token, and folding each record into the job (progress, metrics,
checkpoint, final result)."""

from __future__ import annotations

import hmac
import secrets
from datetime import datetime
from typing import Any

from sqlalchemy.orm import Session

from kembed_api.auth.service import hash_secret
from kembed_api.jobs import storage_use
from kembed_api.jobs.models import Job, JobMetric
from kembed_api.jobs.schemas import ReportRecord
from kembed_api.platform.db import utcnow
from kembed_contract import job_seconds, runtime
from kembed_contract.lifecycle import TERMINAL_STATES, JobState

__all__ = ["apply_report", "new_report_token", "verify_report_token"]


def new_report_token() -> tuple[str, str]:
    """A fresh per-job token and its hash; only the hash is stored."""
    token = secrets.token_urlsafe(32)
    return token, hash_secret(token)


def verify_report_token(expected_hash: str | None, token: str) -> bool:
    """Whether `token` is the one whose hash a job keeps (`Job.report_token_hash`); False for None (no job, or none
    started yet: the token is hashed and compared all the same, in constant time, so that the time taken does
    not tell a missing job from a wrong token)."""
    given = hash_secret(token)
    return hmac.compare_digest(expected_hash or "-" * len(given), given) and expected_hash is not None


# Runs of one job whose last sequence number is remembered: a job has a run per start (restarts, preemptions),
# and whoever holds its report token cannot grow the row without bound by inventing runs.
_RUNS_REMEMBERED = 64

# Keys of a report that are bookkeeping, not metric values.
_RECORD_KEYS = frozenset({"event", "step", "time", "total_steps", "run", "seq"})


def _checkpoint_at(job: Job, uri: str, step: int) -> None:
    """The job's latest checkpoint is this one, unless a later step's was reported already."""
    if job.checkpoint_step is None or step >= job.checkpoint_step:
        job.latest_checkpoint_uri, job.checkpoint_step = uri, step


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
    # The trainer's seconds by phase so far: the split of the job's wall time, not a metric.
    if (seconds := job_seconds.parse_trainer_seconds(values.pop("seconds", None))) is not None:
        job.trainer_seconds = seconds
    job.step = max(job.step, record.step) if record.event != runtime.EVENT_STARTED else record.step
    if record.model_extra and isinstance(record.model_extra.get("total_steps"), int):
        job.total_steps = record.model_extra["total_steps"]
    if record.event == runtime.EVENT_STARTED:
        job.trainer_done_at = None  # a new run: an earlier run's result no longer ends the job
    if record.event == runtime.EVENT_STARTED and isinstance(values.get("dataset"), dict):
        job.dataset = {k: v for k, v in values["dataset"].items() if isinstance(v, int)}
    if record.event == runtime.EVENT_PROGRESS:
        job.metrics = {**job.metrics, **values}
    elif record.event == runtime.EVENT_EVAL:
        job.metrics = {**job.metrics, **{f"eval_{k}": v for k, v in values.items()}}
    latest = runtime.latest_checkpoint_reported(record.event, values)
    if latest is not None:
        _checkpoint_at(job, latest, record.step)
    if record.event == runtime.EVENT_CHECKPOINT and latest is not None:
        stored = values.get("stored_bytes")
        if isinstance(stored, int) and not isinstance(stored, bool) and 0 <= stored < 2**63:
            storage_use.record_job_bytes(session, job, checkpoint_bytes=stored)
    elif record.event == runtime.EVENT_DONE:
        job.result = values.get("eval") if isinstance(values.get("eval"), dict) else {}
        job.trainer_done_at = now or utcnow()
    session.add(JobMetric(job_seq=job.seq, time=now or utcnow(), event=record.event, step=record.step,
                          values=values))
