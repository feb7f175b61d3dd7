"""FastAPI dependencies: database sessions and who is calling (token -> tenant + role)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, HTTPException, Request, status
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session

from kembed_api.auth import service as auth_service
from kembed_api.auth.roles import Action, Role, allowed
from kembed_api.db import Database
from kembed_api.jobs.forecasts import Forecasts
from kembed_api.tenants.models import Tenant
from kembed_api.tenants.service import ensure_tenant

__all__ = [
    "Admin", "Db", "DbSession", "Principal", "QueueForecasts", "Reader", "Submitter", "TokenManager",
]

_bearer = HTTPBearer(auto_error=False, description="An API token: `Authorization: Bearer kmb_...`")


def _db_session(request: Request) -> Iterator[Session]:
    with request.app.state.db.session() as session:
        yield session


def _database(request: Request) -> Database:
    return request.app.state.db


# Reads get a request-long session. Writes open `with db.session(write=True)` inside the route instead: that
# releases SQLite's write lock in the route's own thread. Released in a dependency's teardown, it would wait for
# a free worker thread while every worker waits for the lock.
DbSession = Annotated[Session, Depends(_db_session)]
Db = Annotated[Database, Depends(_database)]


@dataclass(frozen=True)
class Principal:
    """The caller: a tenant and a role (and the token, when tokens are on)."""

    tenant: Tenant
    role: Role
    token_id: int | None = None


def _principal(
    request: Request, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]
) -> Principal:
    settings = request.app.state.settings
    if settings.auth and credentials is None:
        raise HTTPException(status.HTTP_401_UNAUTHORIZED, "missing token: send `Authorization: Bearer <token>`",
                            headers={"WWW-Authenticate": "Bearer"})
    # A session of its own, closed at once: a request must never hold two pooled connections, or concurrent
    # requests each holding one and waiting for a second would drain the pool.
    with request.app.state.db.session() as session:
        if not settings.auth:
            # Tokens switched off (a private single-user server): everyone is the default tenant's admin.
            return Principal(tenant=ensure_tenant(session, name=settings.default_tenant), role=Role.PLATFORM_ADMIN)
        found = auth_service.authenticate(session, secret=credentials.credentials)
    if found is None:
        raise HTTPException(status.HTTP_401_UNAUTHORIZED, "invalid, expired or revoked token",
                            headers={"WWW-Authenticate": "Bearer"})
    token, tenant = found
    return Principal(tenant=tenant, role=Role(token.role), token_id=token.id)


def _require(action: Action) -> Callable[[Principal], Principal]:
    def check(principal: Annotated[Principal, Depends(_principal)]) -> Principal:
        if not allowed(principal.role, action):
            raise HTTPException(status.HTTP_403_FORBIDDEN, f"role {principal.role.value} may not {action.value}")
        return principal

    return check


Reader = Annotated[Principal, Depends(_require(Action.READ))]
Submitter = Annotated[Principal, Depends(_require(Action.SUBMIT))]
TokenManager = Annotated[Principal, Depends(_require(Action.MANAGE_TOKENS))]
Admin = Annotated[Principal, Depends(_require(Action.MANAGE_TENANTS))]


def _forecasts(request: Request) -> Forecasts:
    return request.app.state.forecasts


QueueForecasts = Annotated[Forecasts, Depends(_forecasts)]
