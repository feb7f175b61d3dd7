"""What the tenants, tokens and usage API accepts and returns."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, field_validator

from kembed_api.auth.roles import Role

# The quota model is the contract's (one definition for the API, the database and the Tenant resource).
from kembed_contract.quota import QuotaSpec, SharingSpec, UsageAmounts

__all__ = [
    "QuotaSpec", "SharingSpec", "SharingUsage", "StorageRead", "StorageSpec", "TenantCreate", "TenantList",
    "TenantRead", "TenantUpdate", "TokenCreate", "TokenCreated", "TokenList", "TokenRead", "Usage", "UsageAmounts",
]

_TENANT_NAME = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"


_Prefixes = Annotated[list[Annotated[str, Field(min_length=1, max_length=4096)]], Field(max_length=100)]


class StorageSpec(BaseModel):
    """A tenant's storage policy: URI prefixes (file:// or s3://, or absolute paths) its jobs may use.

    The tenant's own checkpoint folder is always readable and writable without being listed; the server's data
    dir, the checkpoint root and every other tenant's folder never are, whatever is listed (docs/security.md).
    """

    model_config = ConfigDict(extra="forbid", json_schema_extra={
        "examples": [{"read": ["s3://datasets/ctr"], "write": ["s3://exports/team-a"]}]})

    read: _Prefixes = Field(default_factory=list, description="Prefixes jobs may read (datasets).")
    write: _Prefixes = Field(default_factory=list,
                             description="Prefixes jobs may write and read (checkpoints, exports).")


class StorageRead(StorageSpec):
    own: str = Field(description="The tenant's own checkpoint folder: always readable and writable.")


class TenantCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: Annotated[str, Field(min_length=1, max_length=40, pattern=_TENANT_NAME)] = Field(
        description="DNS label; the tenant's namespace on Kubernetes is kembed-<name>."
    )
    quota: QuotaSpec = Field(default_factory=QuotaSpec)
    sharing: SharingSpec = Field(default_factory=SharingSpec)
    storage: StorageSpec | None = Field(None, description="Its storage policy; omitted: the platform's defaults.")


class TenantUpdate(BaseModel):
    """What is given replaces the tenant's; what is omitted stays."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [{"quota": {"gpus": 32}}]})

    quota: QuotaSpec | None = Field(
        None, description="Changes the quota fields given (a field set to null becomes unlimited); the fields "
        "left out keep their values. Admitted jobs keep running.")
    sharing: SharingSpec | None = Field(None, description="Replaces how the tenant shares; omitted: unchanged.")
    storage: StorageSpec | None = Field(
        None, description="Replaces the tenant's storage policy; it applies to jobs submitted (and started) later."
    )


class TenantRead(BaseModel):
    name: str
    quota: QuotaSpec
    sharing: SharingSpec
    storage: StorageRead
    created_at: datetime


class TenantList(BaseModel):
    items: list[TenantRead]
    next_cursor: str | None = None


class TokenCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[^\x00-\x1f\x7f]*$")] = Field(
        description="What the token is for (no control characters).")
    role: Role = Field(Role.MEMBER, description="viewer reads; member submits and cancels; tenant-admin also "
                                                "manages tokens; platform-admin also manages tenants.")
    expires_at: datetime | None = Field(None, description="When the token stops working; null = never.")

    @field_validator("expires_at")
    @classmethod
    def _aware(cls, value: datetime | None) -> datetime | None:
        if value is not None and value.tzinfo is None:
            raise ValueError("must include a time zone, e.g. 2027-01-01T00:00:00Z")
        return value


class TokenRead(BaseModel):
    id: int
    name: str
    role: Role
    prefix: str = Field(description="The first characters of the secret, to tell tokens apart.")
    created_at: datetime
    expires_at: datetime | None
    revoked_at: datetime | None


class TokenCreated(TokenRead):
    token: str = Field(description="The secret. Shown this once; only its hash is stored.")


class TokenList(BaseModel):
    items: list[TokenRead]
    next_cursor: str | None = None


class SharingUsage(BaseModel):
    """A cohort member's quota now: nominal is guaranteed; borrowed is what it holds beyond it (the cohort's idle
    quota, which its lenders may reclaim); lent is its share of what the others borrow (its idle quota)."""

    cohort: str
    nominal: QuotaSpec
    borrowed: UsageAmounts
    lent: UsageAmounts


class Usage(BaseModel):
    """A tenant's quota against what it uses now: what the dashboard draws."""

    tenant: str
    quota: QuotaSpec
    used: UsageAmounts
    queued_jobs: int
    stored_bytes: int = Field(0, description="Bytes the tenant keeps: its jobs' checkpoints (as their latest save "
                              "left them) and logs; against quota.storage.")
    gpu_hours_7d: float = Field(description="GPU-hours held by the tenant's jobs over the last 7 days.")
    sharing: SharingUsage | None = Field(None, description="For a tenant in a cohort: what it borrows and lends.")

