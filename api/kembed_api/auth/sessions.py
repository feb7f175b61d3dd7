"""Browser sessions: an API token given once at sign-in becomes a random cookie secret kept server-side.

The cookie carries only a random secret (HttpOnly, SameSite=Strict, Secure under HTTPS); the database keeps its
SHA-256 and the token it stands for. Write requests made with the cookie carry a CSRF token derived from the
secret (HMAC), which a page of another site can neither read nor compute, so nothing per-session beyond the row
needs storing.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from datetime import datetime, timedelta

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from kembed_api.auth.models import ApiToken
from kembed_api.auth.service import hash_secret
from kembed_api.auth.session_models import DashboardSession
from kembed_api.platform.db import utcnow
from kembed_api.tenants.models import Tenant

__all__ = ["COOKIE_NAME", "CSRF_FIELD", "CSRF_HEADER", "csrf_matches", "csrf_token", "end", "resolve", "start"]

COOKIE_NAME = "kembed_session"
CSRF_HEADER = "X-CSRF-Token"  # write requests of the pages' scripts
CSRF_FIELD = "csrf_token"  # the same, in a form (sign out)


def start(session: Session, *, token: ApiToken, ttl: timedelta, now: datetime | None = None) -> str:
    """A new session for `token`; the secret goes into the cookie and nowhere else."""
    now = now or utcnow()
    secret = secrets.token_urlsafe(32)
    session.add(DashboardSession(secret_hash=hash_secret(secret), token_id=token.id, created_at=now,
                                 expires_at=now + ttl))
    # Sessions that ran out are removed as new ones start, so the table holds only live ones.
    session.execute(delete(DashboardSession).where(DashboardSession.expires_at <= now))
    return secret


def resolve(session: Session, *, secret: str, now: datetime | None = None) -> tuple[ApiToken, Tenant] | None:
    """The token (and tenant) a live session stands for; None when the session or its token has ended."""
    row = session.execute(
        select(DashboardSession.expires_at, ApiToken, Tenant)
        .join(ApiToken, ApiToken.id == DashboardSession.token_id)
        .join(Tenant, Tenant.id == ApiToken.tenant_id)
        .where(DashboardSession.secret_hash == hash_secret(secret))
    ).first()
    if row is None:
        return None
    expires_at, token, tenant = row
    now = now or utcnow()
    if expires_at <= now or token.revoked_at is not None or (token.expires_at is not None and token.expires_at <= now):
        return None
    return token, tenant


def end(session: Session, *, secret: str) -> None:
    session.execute(delete(DashboardSession).where(DashboardSession.secret_hash == hash_secret(secret)))


def csrf_token(secret: str) -> str:
    return hmac.new(secret.encode(), b"kembed-csrf", hashlib.sha256).hexdigest()


def csrf_matches(secret: str, presented: str | None) -> bool:
    return presented is not None and hmac.compare_digest(csrf_token(secret), presented)
