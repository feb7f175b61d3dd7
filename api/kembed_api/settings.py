"""Settings of the API server, one typed object read from the environment (prefix ``KEMBED_``)."""

from __future__ import annotations

import os
from enum import StrEnum
from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from kembed_contract.tenant_credentials import MintingSettings

__all__ = ["Backend", "Settings"]


class Backend(StrEnum):
    local = "local"
    kubernetes = "kubernetes"


def _default_local_slots() -> int:
    # One slot is one trainer process; more processes than cores only makes every job slower.
    return max(2, os.cpu_count() or 2)


class Settings(MintingSettings, BaseSettings):
    model_config = SettingsConfigDict(env_prefix="KEMBED_", extra="forbid")

    data_dir: Path = Field(
        Path(".kembed"),
        description="Where the embedded default keeps its SQLite database, job logs and file:// checkpoints.",
    )
    database_url: str | None = Field(
        None,
        description="SQLAlchemy URL. Unset means SQLite at <data_dir>/kembed.db (the embedded default); "
        "production uses postgresql+psycopg://...",
    )
    host: str = Field("127.0.0.1", description="Address the HTTP server binds to; loopback unless asked.")
    port: int = Field(8080, ge=1, le=65535, description="TCP port of the HTTP server.")
    public_url: str | None = Field(
        None,
        description="URL trainers use to report progress back. Unset means http://<host>:<port> "
        "(127.0.0.1 when bound to all interfaces).",
    )
    backend: Backend = Field(Backend.local, description="Where admitted jobs run.")
    local_slots: int = Field(
        default_factory=_default_local_slots,
        ge=1,
        description="Trainer processes the local backend runs at once (nodes x procs_per_node per job); "
        "jobs that do not fit wait in the queue. Defaults to the number of cores (at least 2).",
    )
    checkpoint_root: str | None = Field(
        None,
        description="Where jobs without their own checkpoint.uri write checkpoints, as a URI "
        "(file:// or s3://). Unset means file://<data_dir>/checkpoints.",
    )
    storage_read_prefixes: list[str] = Field(
        default_factory=list,
        description="URI prefixes (file:// or s3://) a new tenant's jobs may read, e.g. a shared datasets bucket: "
        "the platform's default storage policy; a platform admin sets each tenant's own. Every tenant may always "
        "read and write its own checkpoint folder <checkpoint_root>/<tenant>, never the data dir or another "
        "tenant's folder (docs/security.md). JSON list in the environment.",
    )
    default_tenant_read_prefixes: list[str] = Field(
        default_factory=list,
        description="URI prefixes (or absolute paths) added at start to what the default tenant's jobs may read "
        "(kept in its policy afterwards): `kembed serve --read-prefix ~/data` lets a newcomer train on their own "
        "files. JSON list in the environment.",
    )
    storage_write_prefixes: list[str] = Field(
        default_factory=list,
        description="URI prefixes a new tenant's jobs may write (and read): checkpoints and exports outside "
        "their own checkpoint folder. JSON list in the environment.",
    )
    s3_mint_credentials: bool = Field(
        False,
        description="Mint per-tenant S3 credentials for the local backend's trainers (docs/security.md): each "
        "tenant gets an IAM user allowed only its storage policy's S3 prefixes, and its trainers get that user's "
        "key instead of this server's AWS credentials, which mint it. Needs s3:// storage and IAM rights; off for "
        "the file:// default. (On Kubernetes the operator mints: KEMBED_OPERATOR_S3_MINT_CREDENTIALS.)",
    )
    trainer_sandbox: Literal["auto", "landlock", "off"] = Field(
        "auto",
        description="The local backend's kernel sandbox for trainers (docs/security.md): landlock = every trainer "
        "runs under Landlock, reading and writing only its tenant's folders, never the data dir (the server "
        "refuses to start without it); auto = Landlock where the kernel has it, else a warning at start; off = "
        "none (the storage policy is still enforced by the API and the trainer).",
    )
    dispatch_interval_s: float = Field(
        0.5, gt=0, description="Seconds between dispatcher passes (it also wakes at once on submit/exit)."
    )
    stop_grace_s: float = Field(
        60.0,
        gt=0,
        description="Seconds a stopping trainer gets to write its SIGTERM checkpoint before it is killed.",
    )
    default_tenant: str = Field(
        "default", description="The tenant created on first start; the bootstrap admin token belongs to it."
    )
    auth: bool = Field(
        True,
        description="Require API tokens. Off only for a private single-user server: then every caller is the "
        "default tenant's platform admin.",
    )
    bootstrap_admin_token: SecretStr | None = Field(
        None,
        description="A platform-admin token to make sure exists (e.g. from a Kubernetes Secret). Unset: on "
        "first start a token is minted, printed once and written to <data_dir>/admin-token (mode 0600).",
    )
    metrics_token: SecretStr | None = Field(
        None,
        description="Bearer token Prometheus sends to /metrics (its scrape config's authorization.credentials_file). "
        "Set: /metrics answers only it or a platform-admin token (401 otherwise). Unset: /metrics stays open, but an "
        "anonymous caller gets platform totals without the tenant label; per-tenant series need a platform-admin "
        "token (docs/security.md).",
    )
    token_cache_s: float = Field(
        5.0,
        ge=0,
        description="Seconds a replica remembers what a token resolved to. A token revoked (or a quota changed) "
        "through another replica takes effect here within this time; 0 asks the database on every request.",
    )
    workers: int = Field(
        1,
        ge=1,
        le=64,
        description="HTTP worker processes of `kembed serve`, sharing its port: more use more cores. One of them "
        "at a time runs the dispatcher (a lock in data_dir chooses it); the others serve requests only, so a job "
        "submitted through them is admitted on the dispatcher's next pass (dispatch_interval_s).",
    )
    max_body_bytes: int = Field(
        1_048_576,
        ge=1024,
        le=64 * 1_048_576,
        description="Largest request body accepted, in bytes (413 beyond it, checked before the body is parsed). "
        "A job spec is a few kilobytes; 1 MiB leaves room for large table lists and refuses floods.",
    )
    session_ttl_s: float = Field(
        12 * 3600,
        gt=0,
        le=30 * 24 * 3600,
        description="Seconds a dashboard sign-in lasts (a working day by default); signing out, or revoking the "
        "token it was made with, ends it sooner.",
    )
    secure_cookies: bool | None = Field(
        None,
        description="Mark the dashboard's session cookie Secure. Unset: when the request came over HTTPS (behind "
        "an Ingress that terminates TLS, set it true, since the API itself then sees plain HTTP).",
    )
    json_logs: bool = Field(False, description="Log one JSON object per line (for log collectors).")
    priority_classes: dict[str, int] = Field(
        default_factory=lambda: {"low": -100, "normal": 0, "high": 100},
        description="The platform's priority classes (name -> priority, -1000..1000), as JSON. A job names one "
        "(priority_class) or gives a priority; a job of a higher class may preempt jobs of lower classes "
        "(jobs whose priorities fall in one class never preempt each other). The defaults leave every "
        "priority from 0 to 99 in one class, so plain priorities only order a queue.",
    )
    preemption_protect_after: int = Field(
        3, ge=1, description="A job preempted this many times within preemption_protect_window_s is not "
        "preempted again (never thrashing).")
    preemption_protect_window_s: float = Field(
        24 * 3600.0, gt=0, description="The window of preemption_protect_after, in seconds (one day: a job "
        "preempted three times today runs on).")
    admission_paused: bool = Field(
        False,
        description="Admit no new jobs (they queue); running jobs go on. For maintenance, and for load tests "
        "of the API alone.",
    )

    @model_validator(mode="after")
    def _priority_classes_fit(self) -> Settings:
        for name, value in self.priority_classes.items():
            if not -1000 <= value <= 1000 or not name or len(name) > 32:
                raise ValueError(f"priority_classes: {name!r}: a name of 1-32 characters and a priority "
                                 "between -1000 and 1000")
        return self

    @model_validator(mode="after")
    def _resolve_paths(self) -> Settings:
        self.data_dir = self.data_dir.expanduser().resolve()
        return self

    @property
    def resolved_database_url(self) -> str:
        return self.database_url or f"sqlite:///{self.data_dir / 'kembed.db'}"

    @property
    def resolved_public_url(self) -> str:
        if self.public_url:
            return self.public_url.rstrip("/")
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host
        return f"http://{host}:{self.port}"

    @property
    def resolved_checkpoint_root(self) -> str:
        return (self.checkpoint_root or (self.data_dir / "checkpoints").as_uri()).rstrip("/")

    @property
    def logs_dir(self) -> Path:
        return self.data_dir / "logs"
