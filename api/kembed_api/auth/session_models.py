from __future__ import annotations

from datetime import datetime

from sqlalchemy import ForeignKey, String
from sqlalchemy.orm import Mapped, mapped_column

from kembed_api.platform.db import Base, UTCDateTime, utcnow

__all__ = ["DashboardSession"]


class DashboardSession(Base):
    """A browser signed in with an API token. Only the SHA-256 of the cookie's secret is stored.

    The session acts as its token: revoking or expiring the token ends every session made with it.
    """

    __tablename__ = "dashboard_sessions"

    secret_hash: Mapped[str] = mapped_column(String(64), primary_key=True)
    token_id: Mapped[int] = mapped_column(ForeignKey("api_tokens.id", ondelete="CASCADE"), index=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    expires_at: Mapped[datetime] = mapped_column(UTCDateTime())
