"""HTTP routes of /v1/jobs: thin, they validate and call the service."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Header, HTTPException, Query, Request, Response, status
from fastapi.responses import PlainTextResponse
from sqlalchemy import select

from kembed_api import checkpoints
from kembed_api.deps import Db, QueueForecasts, Reader, Submitter
from kembed_api.jobs import service
from kembed_api.jobs.forecasts import Forecasts
from kembed_api.jobs.models import Job
from kembed_api.jobs.schemas import JobCreate, JobEventRead, JobList, JobMetricRead, JobRead, ReportRecord
from kembed_api.responses import ModelResponse
from kembed_api.spec import JobSpec
from kembed_contract.lifecycle import JobState

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])

_NOT_FOUND = {404: {"description": "No such job for this tenant (another tenant's job is not found either)."}}
_AUTH = {401: {"description": "Missing, invalid, expired or revoked token."},
         403: {"description": "The token's role may not do this (viewers only read)."}}


def _forecast_of(principal, forecasts: Forecasts):
    return lambda job_seq, queue_version: forecasts.of(tenant=principal.tenant, job_seq=job_seq,
                                                       queue_version=queue_version)


def _not_found(job_id: str) -> HTTPException:
    return HTTPException(status.HTTP_404_NOT_FOUND, detail=f"job {job_id!r} not found")


@router.post(
    "",
    response_model=JobRead,
    status_code=status.HTTP_201_CREATED,
    responses={
        200: {"model": JobRead, "description": "A repeated Idempotency-Key: the job the first request created."},
        422: {"description": "The spec is invalid or the job could never run here; `detail` names the field."},
        429: {"description": "The tenant's queue is full (quota.max_queued_jobs)."},
        **_AUTH,
    },
    summary="Submit a job",
)
async def submit_job(
    spec: JobCreate,
    request: Request,
    principal: Submitter,
    idempotency_key: Annotated[
        str | None,
        Header(max_length=200, description="Retries with the same key return the first job instead of a new one."),
    ] = None,
) -> Response:
    # Stored by the intake's writer together with whatever else arrived meanwhile (kembed_api.jobs.intake).
    submission = service.Submission(tenant_id=principal.tenant.id, spec=spec, idempotency_key=idempotency_key)
    try:
        read, created = await request.app.state.intake.submit(submission)
    except service.CannotRun as error:
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, detail=str(error)) from error
    except service.QueueFull as error:
        raise HTTPException(status.HTTP_429_TOO_MANY_REQUESTS, detail=str(error)) from error
    request.app.state.dispatcher.wake()
    return ModelResponse(read, status_code=status.HTTP_201_CREATED if created else status.HTTP_200_OK)


@router.get("", response_model=JobList, responses=_AUTH, summary="List jobs, newest first")
def list_jobs(
    db: Db,
    principal: Reader,
    forecasts: QueueForecasts,
    state: Annotated[list[JobState] | None, Query(description="Only jobs in these states.")] = None,
    name: Annotated[str | None, Query(max_length=46, pattern=r"^[a-z0-9-]*$",
                                      description="Only jobs submitted with this name.")] = None,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
    cursor: Annotated[str | None, Query(max_length=64, description="`next_cursor` of the previous page.")] = None,
) -> Response:
    try:
        with db.session() as session:
            return ModelResponse(service.list_jobs(
                session, tenant=principal.tenant, states=state, name=name, limit=limit, cursor=cursor,
                forecast=lambda: forecasts.fresh(session, tenant=principal.tenant),
            ))
    except ValueError as error:
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, detail=f"cursor: {error}") from error


@router.get("/{job_id}", response_model=JobRead, responses={**_NOT_FOUND, **_AUTH}, summary="One job with its events")
async def get_job(job_id: str, db: Db, principal: Reader, forecasts: QueueForecasts) -> Response:
    try:
        return ModelResponse(await db.read(lambda connection: service.read_job(
            connection, tenant=principal.tenant, job_id=job_id, forecast=_forecast_of(principal, forecasts))))
    except service.JobNotFound:
        raise _not_found(job_id) from None


@router.post(
    "/{job_id}/cancel",
    response_model=JobRead,
    status_code=status.HTTP_202_ACCEPTED,
    responses={**_NOT_FOUND, **_AUTH},
    summary="Cancel a job (a running one saves a checkpoint first)",
)
def cancel_job(job_id: str, request: Request, db: Db, principal: Submitter, forecasts: QueueForecasts) -> Response:
    try:
        with db.session(write=True) as session:
            service.request_cancel(session, tenant=principal.tenant, job_id=job_id)
    except service.JobNotFound:
        raise _not_found(job_id) from None
    request.app.state.dispatcher.wake()
    with db.session() as session:
        return ModelResponse(service.read_job(session, tenant=principal.tenant, job_id=job_id,
                                              forecast=_forecast_of(principal, forecasts)),
                             status_code=status.HTTP_202_ACCEPTED)


@router.get(
    "/{job_id}/logs",
    response_class=PlainTextResponse,
    responses={**_NOT_FOUND, **_AUTH, 200: {"content": {"text/plain": {}}, "description": "The trainers' output."}},
    summary="Trainer logs",
)
def job_logs(
    job_id: str,
    request: Request,
    db: Db,
    principal: Reader,
    tail: Annotated[int | None, Query(ge=1, le=100_000, description="Only the last N lines of each node.")] = None,
) -> str:
    with db.session() as session:
        _job_of(session, principal, job_id)
    return request.app.state.backend.read_logs(job_id, tail_lines=tail)


def _job_of(session, principal, job_id: str) -> Job:
    try:
        return service.get_job(session, tenant=principal.tenant, job_id=job_id)
    except service.JobNotFound:
        raise _not_found(job_id) from None


@router.get("/{job_id}/events", response_model=list[JobEventRead], responses={**_NOT_FOUND, **_AUTH},
            summary="Every state change of a job, with time, reason and message")
def job_events(job_id: str, db: Db, principal: Reader) -> list[JobEventRead]:
    with db.session() as session:
        return service.list_events(session, job=_job_of(session, principal, job_id))


@router.get("/{job_id}/checkpoints", response_model=list[checkpoints.CheckpointRead],
            responses={**_NOT_FOUND, **_AUTH}, summary="Complete checkpoints with step, time and size")
def job_checkpoints(job_id: str, db: Db, principal: Reader) -> list[checkpoints.CheckpointRead]:
    with db.session() as session:
        job = _job_of(session, principal, job_id)
    uri = JobSpec.model_validate(job.spec).trainer.checkpoint.uri
    return checkpoints.list_checkpoints(uri) if uri else []


@router.get("/{job_id}/metrics", response_model=list[JobMetricRead], responses={**_NOT_FOUND, **_AUTH},
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
        return service.list_metrics(session, job=_job_of(session, principal, job_id), event=event, limit=limit)


@router.post(
    "/{job_id}/reports",
    status_code=status.HTTP_204_NO_CONTENT,
    responses={**_NOT_FOUND, 401: {"description": "Missing or wrong per-job report token."}},
    summary="Trainer progress report (rank 0, per-job token)",
)
def report(
    job_id: str,
    record: ReportRecord,
    db: Db,
    authorization: Annotated[str | None, Header(description="Bearer <per-job report token>")] = None,
) -> Response:
    token = (authorization or "").removeprefix("Bearer ").strip()
    with db.session(write=True) as session:
        # Trainers hold a token for their own job only, so the job is found by id alone, then the token checked.
        job = session.scalar(select(Job).where(Job.id == job_id).with_for_update())
        if job is None:
            raise _not_found(job_id)
        if not token or not service.verify_report_token(job, token):
            raise HTTPException(status.HTTP_401_UNAUTHORIZED, detail="invalid report token for this job",
                                headers={"WWW-Authenticate": "Bearer"})
        service.apply_report(session, job=job, record=record)
    return Response(status_code=status.HTTP_204_NO_CONTENT)
