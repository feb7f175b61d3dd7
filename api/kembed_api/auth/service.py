"""Tokens: create (the secret is returned once), authenticate, revoke, and the bootstrap admin token."""

from __future__ import annotations

import hashlib
import secrets
from datetime import datetime

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from kembed_api.auth.models import ApiToken
from kembed_api.auth.roles import Role, may_hold
from kembed_api.platform.db import utcnow
from kembed_api.tenants.models import Tenant

__all__ = ["TOKEN_PREFIX", "authenticate", "hash_secret", "create_token", "ensure_bootstrap_token", "list_tokens", "revoke_token"]

# A recognisable prefix lets secret scanners and people spot a leaked kembed token.
TOKEN_PREFIX = "kmb_"


def hash_secret(secret: str) -> str:
    """What is stored of a token: its SHA-256 (tokens are random, so no salt or slow hash is needed)."""
    return hashlib.sha256(secret.encode()).hexdigest()


def create_token(
    session: Session, *, tenant: Tenant, name: str, role: Role, expires_at: datetime | None = None,
    secret: str | None = None,
) -> tuple[ApiToken, str]:
    """A new token; the secret is in the return value and nowhere else."""
    secret = secret or TOKEN_PREFIX + secrets.token_urlsafe(32)
    token = ApiToken(tenant_id=tenant.id, name=name, role=role.value, token_hash=hash_secret(secret),
                     prefix=secret[: len(TOKEN_PREFIX) + 4], expires_at=expires_at)
    session.add(token)
    session.flush()
    return token, secret


def authenticate(session: Session, *, secret: str, now: datetime | None = None) -> tuple[ApiToken, Tenant] | None:
    """The live token with this secret and its tenant; None if unknown, revoked or expired."""
    row = session.execute(
        select(ApiToken, Tenant).join(Tenant, Tenant.id == ApiToken.tenant_id).where(
            ApiToken.token_hash == hash_secret(secret)
        )
    ).first()
    if row is None:
        return None
    token, tenant = row
    now = now or utcnow()
    if token.revoked_at is not None or (token.expires_at is not None and token.expires_at <= now):
        return None
    return token, tenant


def _visible_roles(caller: Role) -> list[str]:
    return [role.value for role in Role if may_hold(caller, role)]


def list_tokens(session: Session, *, tenant: Tenant, caller: Role) -> list[ApiToken]:
    """The tenant's tokens the caller may see (never one that can do more than the caller)."""
    return list(session.scalars(select(ApiToken).where(
        ApiToken.tenant_id == tenant.id, ApiToken.role.in_(_visible_roles(caller))).order_by(ApiToken.id)))


def revoke_token(session: Session, *, tenant: Tenant, token_id: int, caller: Role,
                 now: datetime | None = None) -> ApiToken | None:
    """Revoke one of the tenant's tokens; None (as if it did not exist) for a token the caller may not see."""
    token = session.scalar(select(ApiToken).where(
        ApiToken.id == token_id, ApiToken.tenant_id == tenant.id, ApiToken.role.in_(_visible_roles(caller))))
    if token is not None and token.revoked_at is None:
        token.revoked_at = now or utcnow()
    return token


def ensure_bootstrap_token(session: Session, *, tenant: Tenant, secret: str | None) -> str | None:
    """The first platform-admin token.

    With `secret` (e.g. from a Kubernetes Secret) that exact token is made sure to exist. Without it, a token is
    minted only when the database has none at all, and returned so the server can show it once.
    """
    if secret:
        if session.scalar(select(ApiToken).where(ApiToken.token_hash == hash_secret(secret))) is None:
            create_token(session, tenant=tenant, name="bootstrap-admin", role=Role.PLATFORM_ADMIN, secret=secret)
        return None
    if session.scalar(select(func.count()).select_from(ApiToken)):
        return None
    _, minted = create_token(session, tenant=tenant, name="bootstrap-admin", role=Role.PLATFORM_ADMIN)
    return minted
