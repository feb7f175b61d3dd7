"""HTTP routes of /v1/jobs: thin, they validate and call the service."""

from __future__ import annotations

import json
import os
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Body, Header, HTTPException, Query, Request, Response, status
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, PlainTextResponse, StreamingResponse
from pydantic import ValidationError
from sqlalchemy import select
from starlette.background import BackgroundTask
from starlette.concurrency import run_in_threadpool

from kembed_api.auth.principal import Db, Reader, Submitter
from kembed_api.jobs import cancel, checkpoints, exports, ids, reads, reports, submissions
from kembed_api.jobs.errors import CannotRun, JobNotFound, KeyReused, QueueFull
from kembed_api.jobs.forecasts import Forecasts, QueueForecasts
from kembed_api.jobs.models import Job
from kembed_api.jobs.schemas import (
    JobCreate,
    JobEventRead,
    JobList,
    JobMetricRead,
    JobRead,
    Neighbour,
    NeighboursRead,
    ReportRecords,
)
from kembed_api.platform import bodies, errors
from kembed_api.platform.responses import ModelResponse
from kembed_api.tenants.service import policy_of
from kembed_contract import kinds
from kembed_contract import spec as job_spec
from kembed_contract.lifecycle import JobState
from kembed_contract.storage_policy import Access, StorageDenied, UriError

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])

_NOT_FOUND_JOB = "No such job for this tenant (another tenant's job answers exactly like a missing one)."
_READS = errors.responses(401, 404, s404=_NOT_FOUND_JOB)
_WRITES = errors.responses(401, 403, 404, s403="The token's role may not do this (viewers only read).",
                           s404=_NOT_FOUND_JOB)


def _forecast_of(principal, forecasts: Forecasts):
    return lambda job_seq, queue_version: forecasts.of(tenant=principal.tenant, job_seq=job_seq,
                                                       queue_version=queue_version)


def _not_found() -> HTTPException:
    # The id is not repeated: errors never echo input (docs/api.md).
    return HTTPException(status.HTTP_404_NOT_FOUND, detail="job not found")


def _invalid(found: list[dict[str, Any]]) -> RequestValidationError:
    # As FastAPI says it of a body; kembed_api.platform.errors leaves out what the body held.
    return RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in found])


def _read_spec(body: bytes, *, json_body: bool) -> JobCreate:
    """The submitted spec, validated on a worker thread: lengths first (`oversized`, microseconds), so that the
    expensive validation only ever sees a spec within its bounds. Raises RequestValidationError (a 422)."""
    if not json_body:
        raise _invalid([{"loc": (), "msg": "send the spec as application/json", "type": "content_type"}])
    if not body:
        raise _invalid([{"loc": (), "msg": "Field required", "type": "missing"}])
    try:
        raw = json.loads(body)  # well formed: the body guard parsed it already
    except (ValueError, RecursionError):
        raise _invalid([{"loc": (), "msg": "not JSON", "type": "json_invalid"}]) from None
    if too_long := job_spec.oversized(raw):
        raise _invalid(too_long)
    try:
        return JobCreate.model_validate(raw)
    except ValidationError as error:
        raise _invalid(error.errors(include_url=False)) from None


# The body is read by the route (to validate it off the event loop), so its schema is declared here; JobSpec is in
# the document's components as the `spec` of every JobRead.
_SPEC_BODY = {"requestBody": {"required": True, "content": {
    "application/json": {"schema": {"$ref": "#/components/schemas/JobSpec"}}}}}


@router.post(
    "",
    response_model=JobRead,
    status_code=status.HTTP_201_CREATED,
    responses={
        200: {"model": JobRead, "description": "A repeated Idempotency-Key: the job the first request created."},
        **errors.responses(401, 403, 429, s403="The token's role may not submit (viewers only read).",
                           s422="The spec is invalid, the job could never run here, or the Idempotency-Key was "
                           "used before with a different spec; `detail` names the field."),
    },
    summary="Submit a job",
    openapi_extra=_SPEC_BODY,
)
async def submit_job(
    request: Request,
    principal: Submitter,
    idempotency_key: Annotated[
        str | None,
        Header(min_length=1, max_length=200, pattern=r"^[!-~]+$",
               description="Retries with the same key (and the same spec) return the first job instead of a new "
               "one; the same key with a different spec is refused (422). 1-200 visible ASCII characters."),
    ] = None,
) -> Response:
    # Validated on a worker thread: a spec at its bounds takes milliseconds of CPU, which the event loop, serving
    # every other request, should not spend.
    spec = await run_in_threadpool(_read_spec, await request.body(), json_body=bodies.is_json(request.headers))
    # Stored by the intake's writer together with whatever else arrived meanwhile (kembed_api.jobs.intake).
    submission = submissions.Submission(tenant_id=principal.tenant.id, spec=spec, idempotency_key=idempotency_key)
    try:
        read, created = await request.app.state.intake.submit(submission)
    except (CannotRun, KeyReused) as error:
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, detail=str(error)) from error
    except QueueFull as error:
        raise HTTPException(status.HTTP_429_TOO_MANY_REQUESTS, detail=str(error)) from error
    request.app.state.dispatcher.wake()
    return ModelResponse(read, status_code=status.HTTP_201_CREATED if created else status.HTTP_200_OK)


@router.get("", response_model=JobList, responses=errors.responses(401), summary="List jobs, newest first")
def list_jobs(
    db: Db,
    principal: Reader,
    forecasts: QueueForecasts,
    state: Annotated[list[JobState] | None, Query(description="Only jobs in these states.")] = None,
    name: Annotated[str | None, Query(max_length=46, pattern=r"^[a-z0-9-]*$",
                                      description="Only jobs submitted with this name.")] = None,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
    cursor: Annotated[str | None, Query(pattern=r"^[0-9]{1,12}$",
                                        description="`next_cursor` of the previous page.")] = None,
) -> Response:
    with db.session() as session:
        return ModelResponse(reads.list_jobs(
            session, tenant=principal.tenant, states=state, name=name, limit=limit, cursor=cursor,
            forecast=lambda: forecasts.fresh(session, tenant=principal.tenant),
        ))


@router.get("/{job_id}", response_model=JobRead, responses=_READS, summary="One job with its events")
async def get_job(job_id: str, db: Db, principal: Reader, forecasts: QueueForecasts) -> Response:
    try:
        return ModelResponse(await db.read(lambda connection: reads.read_job(
            connection, tenant=principal.tenant, job_id=job_id, forecast=_forecast_of(principal, forecasts))))
    except JobNotFound:
        raise _not_found() from None


@router.post(
    "/{job_id}/cancel",
    response_model=JobRead,
    status_code=status.HTTP_202_ACCEPTED,
    responses=_WRITES,
    summary="Cancel a job (a running one saves a checkpoint first)",
)
def cancel_job(job_id: str, request: Request, db: Db, principal: Submitter, forecasts: QueueForecasts) -> Response:
    try:
        with db.session(write=True) as session:
            # One at a time with the dispatcher's passes: a cancel locks the job's row, then its tenant's (the
            # queue count), and a pass can hold them the other way round (PostgreSQL found the two deadlocked).
            db.lock_across_replicas(session)
            cancel.request_cancel(session, tenant=principal.tenant, job_id=job_id)
    except JobNotFound:
        raise _not_found() from None
    request.app.state.dispatcher.wake()
    with db.session() as session:
        return ModelResponse(reads.read_job(session, tenant=principal.tenant, job_id=job_id,
                                              forecast=_forecast_of(principal, forecasts)),
                             status_code=status.HTTP_202_ACCEPTED)


@router.get(
    "/{job_id}/logs",
    # Response, not PlainTextResponse, as the route's class: FastAPI would otherwise document the errors as text
    # too, while they are the one JSON error shape.
    response_class=Response,
    responses={**_READS, 200: {"content": {"text/plain": {"schema": {"type": "string"}}},
                               "description": "The trainers' output."}},
    summary="Trainer logs",
)
def job_logs(
    job_id: str,
    request: Request,
    db: Db,
    principal: Reader,
    tail: Annotated[int | None, Query(ge=1, le=100_000, description="Only the last N lines of each node.")] = None,
) -> Response:
    with db.session() as session:
        _job_of(session, principal, job_id)
    backend = request.app.state.backend
    if tail is not None:
        return PlainTextResponse(backend.read_logs(job_id, tail_lines=tail))
    # Streamed from the files (a sync iterator: Starlette reads it in its thread pool), never whole in memory.
    return StreamingResponse(backend.stream_logs(job_id), media_type="text/plain; charset=utf-8")


def job_checkpoint_uri(raw: dict) -> str | None:
    """The stored spec's checkpoint folder (read from the stored JSON: a spec from before today's rules too)."""
    uri = ((raw.get("trainer") or {}).get("checkpoint") or {}).get("uri")
    return uri if isinstance(uri, str) else None


def _policy(principal, request: Request):
    return policy_of(principal.tenant, request.app.state.storage)


def _readable_checkpoint_uri(job: Job, principal, request: Request) -> str | None:
    """The job's checkpoint folder, checked against its tenant's storage policy as it is now (409 outside it): a
    job stored before the policy (or before it was narrowed) reads nothing its tenant may no longer read."""
    uri = job_checkpoint_uri(job.spec)
    if not uri:
        return None
    try:
        return policy_of(principal.tenant, request.app.state.storage).check(
            uri, Access.READ, where="trainer.checkpoint.uri")
    except (StorageDenied, UriError) as error:
        raise HTTPException(status.HTTP_409_CONFLICT, detail=str(error)) from None


def _job_of(session, principal, job_id: str) -> Job:
    try:
        return reads.get_job(session, tenant=principal.tenant, job_id=job_id)
    except JobNotFound:
        raise _not_found() from None


@router.get("/{job_id}/events", response_model=list[JobEventRead], responses=_READS,
            summary="Every state change of a job, with time, reason and message")
def job_events(job_id: str, db: Db, principal: Reader) -> list[JobEventRead]:
    with db.session() as session:
        return reads.list_events(session, job=_job_of(session, principal, job_id))


@router.get("/{job_id}/checkpoints", response_model=list[checkpoints.CheckpointRead],
            responses=errors.responses(
                401, 404, 409, s404=_NOT_FOUND_JOB,
                s409="The job's checkpoint folder is outside its tenant's storage policy."),
            summary="Complete checkpoints with step, time and size")
def job_checkpoints(job_id: str, request: Request, db: Db, principal: Reader) -> list[checkpoints.CheckpointRead]:
    with db.session() as session:
        job = _job_of(session, principal, job_id)
    uri = _readable_checkpoint_uri(job, principal, request)
    return checkpoints.list_checkpoints(uri) if uri else []


_EXPORT_ERRORS = {
    409: {"description": "The job has no complete checkpoint yet (or none at `step`), it predates row indexes, or "
                         "a file in it lies outside the tenant's storage policy (a symlink)."},
    422: {"description": "A parameter is wrong (an unknown table, a word not in the vocabulary), or the checkpoint "
                         "cannot be read safely (`checkpoint step N refused`: it holds what no checkpoint does); "
                         "`detail` says which."},
    501: {"description": "This server cannot read checkpoints (no torch); export where the trainer runs."},
    503: {"description": "The server is reading as many checkpoints as it may at once; retry after `Retry-After`."},
}
_BUSY_RETRY_S = 10


def _export_failure(error: Exception) -> HTTPException:
    if isinstance(error, exports.NoCheckpoint):
        return HTTPException(status.HTTP_409_CONFLICT, detail=str(error))
    if isinstance(error, exports.ExportUnavailable):
        return HTTPException(status.HTTP_501_NOT_IMPLEMENTED, detail=str(error))
    if isinstance(error, exports.ExportBusy):
        return HTTPException(status.HTTP_503_SERVICE_UNAVAILABLE, detail=str(error),
                             headers={"Retry-After": str(_BUSY_RETRY_S)})
    message = str(error)
    if "predates" in message or "was written before" in message:
        return HTTPException(status.HTTP_409_CONFLICT, detail=message)
    return HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, detail=message)


def _result_step(job: Job) -> int | None:
    """A finished job's result checkpoint (its best eval's); a running job's latest is the newest anyway."""
    return job.checkpoint_step if JobState(job.state) is JobState.SUCCEEDED else None


@router.get(
    "/{job_id}/export",
    response_class=FileResponse,
    responses={**_READS, **_EXPORT_ERRORS,
               200: {"content": {"application/octet-stream": {}},
                     "description": "The file, with Content-Length and a file name (Content-Disposition)."}},
    summary=f"A job's embeddings as a file ({kinds.in_words(exports.FORMATS)})",
)
def export_job(
    job_id: str,
    request: Request,
    db: Db,
    principal: Reader,
    format: Annotated[Literal[exports.FORMATS], Query(description=f"{kinds.in_words(exports.FORMATS)}.")],  # noqa: A002
    table: Annotated[str | None, Query(max_length=200, description=kinds.DEFAULT_TABLE_HELP)] = None,
    step: Annotated[int | None, Query(ge=0, description="A complete checkpoint's step; default the job's result "
                                                          "(its best eval's) once it succeeded, else the latest.")] = None,
) -> FileResponse:
    with db.session() as session:
        job = _job_of(session, principal, job_id)
    uri = _readable_checkpoint_uri(job, principal, request)
    try:
        made = exports.export_file(uri, job_id=job_id, fmt=format, table=table, step=step,
                                   preferred=_result_step(job), policy=_policy(principal, request),
                                   sandbox=request.app.state.settings.trainer_sandbox)
    except (exports.NoCheckpoint, exports.ExportUnavailable, exports.ExportBusy, ValueError) as error:
        raise _export_failure(error) from error
    return FileResponse(made.path, filename=made.filename, media_type="application/octet-stream",
                        headers={"X-Kembed-Checkpoint-Step": str(made.step), "X-Kembed-Table": made.table},
                        background=BackgroundTask(os.unlink, made.path))


@router.get("/{job_id}/neighbours", response_model=NeighboursRead,
            responses={**_READS, **_EXPORT_ERRORS},
            summary="Nearest neighbours (cosine) of a word or id, from the latest checkpoint")
def job_neighbours(
    job_id: str,
    request: Request,
    db: Db,
    principal: Reader,
    word: Annotated[str, Query(min_length=1, max_length=1000, description="A word (a model with a vocabulary) or an id.")],
    k: Annotated[int, Query(ge=1, le=1000)] = 10,
    table: Annotated[str | None, Query(max_length=200)] = None,
) -> NeighboursRead:
    with db.session() as session:
        job = _job_of(session, principal, job_id)
    uri = _readable_checkpoint_uri(job, principal, request)
    try:
        step, name, found = exports.nearest(uri, word=word, k=k, table=table, preferred=_result_step(job),
                                            policy=_policy(principal, request),
                                            sandbox=request.app.state.settings.trainer_sandbox)
    except (exports.NoCheckpoint, exports.ExportUnavailable, exports.ExportBusy, ValueError) as error:
        raise _export_failure(error) from error
    return NeighboursRead(job=job_id, checkpoint_step=step, table=name, word=word,
                          neighbours=[Neighbour(key=key, similarity=sim) for key, sim in found])


@router.get("/{job_id}/metrics", response_model=list[JobMetricRead], responses=_READS,
            summary="The series of records the trainer reported")
def job_metrics(
    job_id: str,
    db: Db,
    principal: Reader,
    event: Annotated[str | None, Query(max_length=32, pattern=r"^[A-Za-z0-9_.-]*$",
                                       description="progress, eval, checkpoint, ...")] = None,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 1000,
) -> list[JobMetricRead]:
    with db.session() as session:
        return reads.list_metrics(session, job=_job_of(session, principal, job_id), event=event, limit=limit)


_NOT_THIS_JOBS = "wrong report token: not this job's (a missing job answers alike)"


@router.post(
    "/{job_id}/reports",
    status_code=status.HTTP_204_NO_CONTENT,
    responses=errors.responses(401, s401="No report token, or not this job's: a missing job and a wrong token "
                                         "answer alike."),
    summary="Trainer progress report (rank 0, per-job token)",
)
def report(
    job_id: str,
    records: Annotated[ReportRecords, Body(description="One record, or several in their order (at most "
                                                        "kembed_contract.runtime.MAX_RECORDS_PER_REPORT).")],
    db: Db,
    authorization: Annotated[str | None, Header(description="Bearer <per-job report token>")] = None,
) -> Response:
    token = (authorization or "").removeprefix("Bearer ").strip()
    if not token:  # said before the job is looked up: the answer is the same whether it exists or not
        raise HTTPException(status.HTTP_401_UNAUTHORIZED, detail="missing report token: send `Authorization: "
                            "Bearer <the job's report token>`", headers={"WWW-Authenticate": "Bearer"})
    # Trainers hold a token for their own job only, so the job is found by id alone, then the token checked. A
    # wrong token answers exactly as a missing job does (a report token of one job, or none, must not tell which
    # other jobs exist), and costs one indexed read: the write lock is only taken for a token that matched.
    known = ids.is_job_id(job_id)
    with db.session() as session:
        expected = session.scalar(select(Job.report_token_hash).where(Job.id == job_id)) if known else None
    if not reports.verify_report_token(expected, token):
        raise HTTPException(status.HTTP_401_UNAUTHORIZED, detail=_NOT_THIS_JOBS, headers={"WWW-Authenticate": "Bearer"})
    with db.session(write=True) as session:
        job = session.scalar(select(Job).where(Job.id == job_id).with_for_update())
        # Again under the lock: a restart since the read gives the job a new token, and the old one is refused.
        if job is None or not reports.verify_report_token(job.report_token_hash, token):
            raise HTTPException(status.HTTP_401_UNAUTHORIZED, detail=_NOT_THIS_JOBS,
                                headers={"WWW-Authenticate": "Bearer"})
        for record in records if isinstance(records, list) else [records]:
            reports.apply_report(session, job=job, record=record)
    return Response(status_code=status.HTTP_204_NO_CONTENT)
