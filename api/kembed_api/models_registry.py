"""Imports every ORM model so Base.metadata knows all tables (for Alembic and tests)."""

from kembed_api.auth import models as auth_models
from kembed_api.auth import session_models as dashboard_models
from kembed_api.jobs import models as job_models
from kembed_api.tenants import models as tenant_models

__all__ = ["auth_models", "dashboard_models", "job_models", "tenant_models"]
