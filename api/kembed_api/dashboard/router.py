"""Read endpoints the dashboard's pages poll (and any client may use): /v1/overview, /v1/usage/history, /v1/cluster.

The team overview is what every open team page asks for every 2 s; it is computed at most once a second per
tenant (and API process) and the same bytes are served to every page of that tenant meanwhile, with an ETag so
an unchanged answer costs a 304 (docs/benchmarks.md, dashboard).
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Callable
from enum import StrEnum
from typing import Annotated

from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import PlainTextResponse
from starlette.concurrency import run_in_threadpool

from kembed_api.auth.principal import Admin, Db, Reader
from kembed_api.dashboard import service
from kembed_api.dashboard.schemas import ClusterOverview, TeamOverview, UsageHistory
from kembed_api.jobs.forecasts import QueueForecasts
from kembed_api.platform import errors
from kembed_api.platform.responses import ModelResponse
from kembed_api.tenants.models import quota_columns

__all__ = ["RecentAnswers", "router"]

router = APIRouter(tags=["dashboard"])



class RecentAnswers:
    """The latest answer per key for `max_age_s`, so that many pages polling at once cost one computation.

    A fresh answer is served on the event loop without a trip through the worker threads; when it is stale, one
    computation runs in a worker thread and every request arriving meanwhile waits for that one.
    """

    def __init__(self, max_age_s: float) -> None:
        self.max_age_s = max_age_s
        self._answers: dict[object, tuple[float, bytes, str]] = {}  # touched on the event loop only
        self._computing: dict[object, asyncio.Future] = {}

    async def get(self, key: object, compute: Callable[[], tuple[bytes, bytes]]) -> tuple[bytes, str]:
        """`compute()` gives the answer and what its ETag is made of (the answer less what changes with no news,
        such as the time it was made: a weak ETag, equal for answers that say the same)."""
        found = self._answers.get(key)
        if found is not None and time.monotonic() - found[0] < self.max_age_s:
            return found[1], found[2]
        if key not in self._computing:
            self._computing[key] = asyncio.ensure_future(self._compute(key, compute))
        return await asyncio.shield(self._computing[key])  # one caller going away does not cancel the others'

    async def _compute(self, key: object, compute: Callable[[], tuple[bytes, bytes]]) -> tuple[bytes, str]:
        try:
            taken_at = time.monotonic()
            body, news = await run_in_threadpool(compute)
            etag = 'W/"' + hashlib.sha256(news).hexdigest()[:32] + '"'
            if len(self._answers) >= 10_000:
                self._answers.clear()  # keys retired by quota changes: start over rather than grow
            self._answers[key] = (taken_at, body, etag)
            return body, etag
        finally:
            del self._computing[key]


@router.get("/v1/overview", response_model=TeamOverview, responses={
    **errors.responses(401, 403), 304: {"description": "Unchanged since the ETag sent in If-None-Match."}},
            summary="The caller's tenant at a glance: usage, queue head, running and latest finished jobs")
async def team_overview(request: Request, db: Db, principal: Reader, forecasts: QueueForecasts) -> Response:
    tenant = principal.tenant

    def compute() -> tuple[bytes, bytes]:
        with db.session() as session:
            overview = service.overview(session, tenant=tenant, forecast=lambda: forecasts.latest(tenant=tenant))
        return overview.model_dump_json().encode(), overview.model_dump_json(exclude={"generated_at"}).encode()

    # Keyed by the quota too: a quota changed through this replica shows at once.
    key = (tenant.id, *quota_columns(tenant).values())
    body, etag = await request.app.state.overviews.get(key, compute)
    headers = {"ETag": etag, "Cache-Control": "private, no-cache"}
    if request.headers.get("if-none-match") == etag:
        return Response(status_code=304, headers=headers)
    return Response(body, media_type="application/json", headers=headers)


class HistoryFormat(StrEnum):
    json = "json"
    csv = "csv"


@router.get("/v1/usage/history", response_model=UsageHistory, responses={
    **errors.responses(401, 403), 200: {"content": {"text/csv": {}}, "description": "JSON, or with format=csv one line per day."}},
    summary="The caller's tenant over the last days: GPU-hours per day, queue waits, final states")
def usage_history(
    db: Db, principal: Reader,
    days: Annotated[int, Query(ge=1, le=90, description="Days ending today (UTC).")] = 7,
    fmt: Annotated[HistoryFormat, Query(alias="format", description="json, or csv for a download.")] = HistoryFormat.json,
) -> Response:
    with db.session() as session:
        history = service.history(session, tenant=principal.tenant, days=days)
    if fmt is HistoryFormat.csv:
        filename = f"kembed-{history.tenant}-{days}d.csv"
        return PlainTextResponse(service.to_csv(history), media_type="text/csv",
                                 headers={"Content-Disposition": f'attachment; filename="{filename}"'})
    return ModelResponse(history)


@router.get("/v1/cluster", response_model=ClusterOverview,
            responses=errors.responses(401, 403, s403="Platform admins only."),
    summary="Every tenant's quota, use, queue and wait, and the backend's capacity against the sum of quotas")
def cluster_overview(request: Request, db: Db, _: Admin) -> Response:
    with db.session() as session:
        return ModelResponse(service.cluster(session, capacity=request.app.state.backend.capacity()))
