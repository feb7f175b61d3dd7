"""HTTP routes of /v1/jobs: thin, they validate and call the service."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Header, HTTPException, Query, Request, Response, status
from fastapi.responses import PlainTextResponse

from kembed_api.deps import CurrentTenant, DbSession
from kembed_api.jobs import service
from kembed_api.jobs.models import Job
from kembed_api.jobs.schemas import JobCreate, JobList, JobMetricRead, JobRead, ReportRecord
from kembed_api.spec import JobState

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])

_NOT_FOUND = {404: {"description": "No such job for this tenant."}}


def _not_found(job_id: str) -> HTTPException:
    return HTTPException(status.HTTP_404_NOT_FOUND, detail=f"job {job_id!r} not found")


@router.post(
    "",
    response_model=JobRead,
    status_code=status.HTTP_201_CREATED,
    responses={
        200: {"model": JobRead, "description": "A repeated Idempotency-Key: the job the first request created."},
        422: {"description": "The spec is invalid or the job could never run here; `detail` names the field."},
    },
    summary="Submit a job",
)
def submit_job(
    spec: JobCreate,
    request: Request,
    response: Response,
    session: DbSession,
    tenant: CurrentTenant,
    idempotency_key: Annotated[
        str | None,
        Header(max_length=200, description="Retries with the same key return the first job instead of a new one."),
    ] = None,
) -> JobRead:
    try:
        request.app.state.backend.check_fits(spec)
    except ValueError as error:
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, detail=str(error)) from error
    job, created = service.submit(
        session, tenant=tenant, spec=spec, checkpoint_root=request.app.state.settings.resolved_checkpoint_root,
        idempotency_key=idempotency_key,
    )
    session.commit()
    request.app.state.dispatcher.wake()
    if not created:
        response.status_code = status.HTTP_200_OK
    return service.read_job(session, tenant=tenant, job_id=job.id)


@router.get("", response_model=JobList, summary="List jobs, newest first")
def list_jobs(
    session: DbSession,
    tenant: CurrentTenant,
    state: Annotated[list[JobState] | None, Query(description="Only jobs in these states.")] = None,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
    cursor: Annotated[str | None, Query(max_length=64, description="`next_cursor` of the previous page.")] = None,
) -> JobList:
    try:
        return service.list_jobs(session, tenant=tenant, states=state, limit=limit, cursor=cursor)
    except ValueError as error:
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, detail=f"cursor: {error}") from error


@router.get("/{job_id}", response_model=JobRead, responses=_NOT_FOUND, summary="One job with its events")
def get_job(job_id: str, session: DbSession, tenant: CurrentTenant) -> JobRead:
    try:
        return service.read_job(session, tenant=tenant, job_id=job_id)
    except service.JobNotFound:
        raise _not_found(job_id) from None


@router.post(
    "/{job_id}/cancel",
    response_model=JobRead,
    status_code=status.HTTP_202_ACCEPTED,
    responses=_NOT_FOUND,
    summary="Cancel a job (a running one saves a checkpoint first)",
)
def cancel_job(job_id: str, request: Request, session: DbSession, tenant: CurrentTenant) -> JobRead:
    try:
        service.request_cancel(session, tenant=tenant, job_id=job_id)
    except service.JobNotFound:
        raise _not_found(job_id) from None
    session.commit()
    request.app.state.dispatcher.wake()
    return service.read_job(session, tenant=tenant, job_id=job_id)


@router.get(
    "/{job_id}/logs",
    response_class=PlainTextResponse,
    responses={**_NOT_FOUND, 200: {"content": {"text/plain": {}}, "description": "The trainers' output."}},
    summary="Trainer logs",
)
def job_logs(
    job_id: str,
    request: Request,
    session: DbSession,
    tenant: CurrentTenant,
    tail: Annotated[int | None, Query(ge=1, le=100_000, description="Only the last N lines of each node.")] = None,
) -> str:
    try:
        service.get_job(session, tenant=tenant, job_id=job_id)
    except service.JobNotFound:
        raise _not_found(job_id) from None
    return request.app.state.backend.read_logs(job_id, tail_lines=tail)


@router.get("/{job_id}/metrics", response_model=list[JobMetricRead], responses=_NOT_FOUND,
            summary="The series of records the trainer reported")
def job_metrics(
    job_id: str,
    session: DbSession,
    tenant: CurrentTenant,
    event: Annotated[str | None, Query(max_length=32, description="progress, eval, checkpoint, ...")] = None,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 1000,
) -> list[JobMetricRead]:
    try:
        job = service.get_job(session, tenant=tenant, job_id=job_id)
    except service.JobNotFound:
        raise _not_found(job_id) from None
    return service.list_metrics(session, job=job, event=event, limit=limit)


@router.post(
    "/{job_id}/reports",
    status_code=status.HTTP_204_NO_CONTENT,
    responses={**_NOT_FOUND, 401: {"description": "Missing or wrong per-job report token."}},
    summary="Trainer progress report (rank 0, per-job token)",
)
def report(
    job_id: str,
    record: ReportRecord,
    session: DbSession,
    authorization: Annotated[str | None, Header(description="Bearer <per-job report token>")] = None,
) -> Response:
    # Trainers hold a token for their own job only, so the job is found by id alone, then the token is checked.
    job = session.query(Job).filter(Job.id == job_id).with_for_update().one_or_none()
    if job is None:
        raise _not_found(job_id)
    token = (authorization or "").removeprefix("Bearer ").strip()
    if not token or not service.verify_report_token(job, token):
        raise HTTPException(status.HTTP_401_UNAUTHORIZED, detail="invalid report token for this job",
                            headers={"WWW-Authenticate": "Bearer"})
    service.apply_report(session, job=job, record=record)
    return Response(status_code=status.HTTP_204_NO_CONTENT)
