"""FastAPI dependencies: who is calling (token or session -> tenant + role) and the database.

They are all `async` and do no blocking I/O on a warm cache, so a request reaches its route without a trip
through the worker threads; sync routes then open their own database session (`with db.session()`) in the one
worker thread they run on, and the `async` routes clients poll read through `Database.read`. A session opened
by a dependency would cost two more thread hops per request (enter and teardown), and a write lock released in
a teardown would wait for a free worker thread while every worker waits for the lock.
"""

from __future__ import annotations

import enum
import hmac
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Annotated

from fastapi import Depends, HTTPException, Request, status
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy import select
from starlette.concurrency import run_in_threadpool

from kembed_api.auth import ratelimit, sessions
from kembed_api.auth import service as auth_service
from kembed_api.auth.roles import Action, Role, allowed
from kembed_api.platform.db import Database, utcnow
from kembed_api.tenants.models import Tenant

__all__ = ["Admin", "Db", "MetricsCaller", "MetricsView", "Principal", "Reader", "Submitter", "TokenManager",
           "session_principal"]

_bearer = HTTPBearer(auto_error=False, description="An API token: `Authorization: Bearer kmb_...`")


async def _database(request: Request) -> Database:
    return request.app.state.db


Db = Annotated[Database, Depends(_database)]


@dataclass(frozen=True)
class Principal:
    """The caller: a tenant and a role (and the token, when tokens are on).

    `tenant` identifies the caller's tenant (id, name); its quota columns may be `token_cache_s` old, so code that
    enforces a quota reads the tenant's row again in its own transaction.
    """

    tenant: Tenant
    role: Role
    token_id: int | None = None
    expires_at: datetime | None = None


def _look_up(request: Request, secret: str | None) -> Principal | None:
    settings, db = request.app.state.settings, request.app.state.db
    with db.session() as session:
        if not settings.auth:
            # Tokens switched off (a private single-user server): everyone is the default tenant's admin.
            # The default tenant exists from the server's start (app bootstrap): read, never made, here.
            tenant = session.scalars(select(Tenant).where(Tenant.name == settings.default_tenant)).one()
            return Principal(tenant=tenant, role=Role.PLATFORM_ADMIN)
        found = auth_service.authenticate(session, secret=secret)
    if found is None:
        return None
    token, tenant = found
    return Principal(tenant=tenant, role=Role(token.role), token_id=token.id, expires_at=token.expires_at)


async def _principal(
    request: Request, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]
) -> Principal:
    settings = request.app.state.settings
    if settings.auth and credentials is None:
        if request.cookies.get(sessions.COOKIE_NAME):
            return await _from_cookie(request)
        raise HTTPException(status.HTTP_401_UNAUTHORIZED, "missing token: send `Authorization: Bearer <token>`",
                            headers={"WWW-Authenticate": "Bearer"})
    secret = credentials.credentials if settings.auth else None
    key = auth_service.hash_secret(secret) if secret else None
    principal = await request.app.state.principals.resolve(key, lambda: run_in_threadpool(_look_up, request, secret))
    if principal is None or (principal.expires_at is not None and principal.expires_at <= utcnow()):
        raise HTTPException(status.HTTP_401_UNAUTHORIZED, "invalid, expired or revoked token",
                            headers={"WWW-Authenticate": "Bearer"})
    ratelimit.note_tenant(request.scope, principal.tenant.id)  # the token's requests count for its tenant too
    return principal


class MetricsView(enum.Enum):
    PER_TENANT = "per-tenant"  # the scrape token or a platform admin: every series with its tenant label
    TOTALS = "totals"  # anonymous, with no scrape token configured: sums over tenants, no tenant named


async def _metrics_view(request: Request) -> MetricsView:
    """What /metrics shows this caller; 401 for a wrong token, and for no token once a scrape token is set.

    The header is read here rather than through the bearer scheme, so the OpenAPI document does not claim that
    /metrics needs a token: without a scrape token it does not."""
    settings = request.app.state.settings
    scheme, _, secret = request.headers.get("authorization", "").partition(" ")
    credentials = (HTTPAuthorizationCredentials(scheme=scheme, credentials=secret.strip())
                   if scheme.lower() == "bearer" and secret.strip() else None)
    if not settings.auth:
        return MetricsView.PER_TENANT
    expected = settings.metrics_token
    if credentials is None:
        if expected is None:
            return MetricsView.TOTALS
        raise HTTPException(status.HTTP_401_UNAUTHORIZED, "missing token: send `Authorization: Bearer <token>`",
                            headers={"WWW-Authenticate": "Bearer"})
    if expected is not None and hmac.compare_digest(credentials.credentials.encode(),
                                                    expected.get_secret_value().encode()):
        return MetricsView.PER_TENANT
    principal = await _principal(request, credentials)  # 401 for a wrong token
    if principal.role is not Role.PLATFORM_ADMIN:
        raise HTTPException(status.HTTP_403_FORBIDDEN, "per-tenant metrics are for the platform's monitoring: "
                            "the scrape token or a platform-admin token")
    return MetricsView.PER_TENANT


MetricsCaller = Annotated[MetricsView, Depends(_metrics_view)]


_SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


async def _from_cookie(request: Request) -> Principal:
    """A dashboard's request: its session stands for the token it signed in with. Writes must carry the
    session's CSRF token in a header (a form of another site cannot set one), besides SameSite=Strict."""
    secret = request.cookies[sessions.COOKIE_NAME]
    principal = await session_principal(request)
    if principal is None:
        raise HTTPException(status.HTTP_401_UNAUTHORIZED, "session ended: sign in again")
    if request.method not in _SAFE_METHODS and not sessions.csrf_matches(secret, request.headers.get(
            sessions.CSRF_HEADER)):
        raise HTTPException(status.HTTP_403_FORBIDDEN, f"missing or wrong {sessions.CSRF_HEADER} header")
    return principal


def _look_up_session(request: Request, secret: str) -> Principal | None:
    with request.app.state.db.session() as session:
        found = sessions.resolve(session, secret=secret)
    if found is None:
        return None
    token, tenant = found
    return Principal(tenant=tenant, role=Role(token.role), token_id=token.id, expires_at=token.expires_at)


async def session_principal(request: Request) -> Principal | None:
    """Who the request's session cookie signs in as; None without a live session (remembered like tokens).
    With tokens off, everyone is the default tenant's admin, signed in or not."""
    if not request.app.state.settings.auth:
        return await run_in_threadpool(_look_up, request, None)
    secret = request.cookies.get(sessions.COOKIE_NAME)
    if not secret:
        return None
    key = ("session", auth_service.hash_secret(secret))
    principal = await request.app.state.principals.resolve(
        key, lambda: run_in_threadpool(_look_up_session, request, secret))
    if principal is None or (principal.expires_at is not None and principal.expires_at <= utcnow()):
        return None
    ratelimit.note_tenant(request.scope, principal.tenant.id)
    return principal


def _require(action: Action) -> Callable[[Principal], Principal]:
    async def check(principal: Annotated[Principal, Depends(_principal)]) -> Principal:
        if not allowed(principal.role, action):
            raise HTTPException(status.HTTP_403_FORBIDDEN, f"role {principal.role.value} may not {action.value}")
        return principal

    return check


Reader = Annotated[Principal, Depends(_require(Action.READ))]
Submitter = Annotated[Principal, Depends(_require(Action.SUBMIT))]
TokenManager = Annotated[Principal, Depends(_require(Action.MANAGE_TOKENS))]
Admin = Annotated[Principal, Depends(_require(Action.MANAGE_TENANTS))]

