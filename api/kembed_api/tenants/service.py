"""Tenant lookups; creating and managing tenants over HTTP comes with the multi-tenant API."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from kembed_api.tenants.models import Tenant

__all__ = ["ensure_tenant"]


def ensure_tenant(session: Session, *, name: str) -> Tenant:
    """The tenant called `name`, created on first use (the embedded default's built-in tenant)."""
    tenant = session.scalar(select(Tenant).where(Tenant.name == name))
    if tenant is None:
        tenant = Tenant(name=name)
        session.add(tenant)
        session.flush()
    return tenant
