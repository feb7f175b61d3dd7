"""FastAPI dependencies: the per-request database session and the caller's tenant."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, Request
from sqlalchemy.orm import Session

from kembed_api.tenants.models import Tenant
from kembed_api.tenants.service import ensure_tenant

__all__ = ["CurrentTenant", "DbSession", "current_tenant", "db_session"]


def db_session(request: Request) -> Iterator[Session]:
    with request.app.state.db.session() as session:
        yield session


DbSession = Annotated[Session, Depends(db_session)]


def current_tenant(request: Request, session: DbSession) -> Tenant:
    # The embedded default has one built-in tenant and no tokens; token auth replaces this for multi-tenant use.
    return ensure_tenant(session, name=request.app.state.settings.default_tenant)


CurrentTenant = Annotated[Tenant, Depends(current_tenant)]
