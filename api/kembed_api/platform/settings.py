"""Settings of the API server, one typed object read from the environment (prefix ``KEMBED_``)."""

from __future__ import annotations

import os
from enum import StrEnum
from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from kembed_contract.quota import QuotaSpec
from kembed_platform.tenant_credentials import MintingSettings

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
    trainer_server_s3_credentials: bool = Field(
        False,
        description="Give the local backend's trainers this server's own AWS credentials (the AWS_* credential "
        "variables of its environment: keys, session token, profile). For a single-team installation with s3:// "
        "storage that does not mint per-tenant keys: every trainer can then reach whatever the server's key can. "
        "Off: trainers get only a minted key (s3_mint_credentials) or none, never the server's (docs/security.md).",
    )
    trainer_limits: Literal["auto", "cgroup", "rlimit"] = Field(
        "auto",
        description="How the local backend enforces each node's resources (memory_per_node, cpu_per_node, "
        "processes, open files; docs/security.md#limits): auto = a cgroup (v2 delegated, else v1) where this "
        "server may make one, else rlimits and a memory watchdog; cgroup = refuse to start without one; rlimit = "
        "rlimits and the watchdog even where cgroups exist.",
    )
    trainer_kernel_cache: bool = Field(
        True,
        description="Compile the trainer's numba kernels once per installation (at the local backend's start, into "
        "kernel_cache_dir) and let every local job load them, read-only, instead of compiling them in each job "
        "(seconds per job of a model kind with compiled kernels). Off: each job compiles its own, in its own folder.",
    )
    kernel_cache_dir: Path = Field(
        Path("~/.cache/kembed/kernels"),
        description="Where the local backend keeps the trainer's compiled kernels (trainer_kernel_cache), one folder "
        "per installation (a key of the interpreter, numba and the trainer's source). Outside data_dir: the trainers "
        "may read it; only this server writes it.",
    )
    trainer_log_bytes_per_node: int = Field(
        16 * 2**20,
        ge=4096,
        description="Bytes of each trainer node's log kept on disk by the local backend; beyond it the oldest half "
        "is dropped (a line says how much). 16 MiB keeps ~60,000 progress records, far more than a job's "
        "`log_every` usually writes, and bounds a flood to 16 MiB x nodes per job.",
    )
    trainer_sandbox: Literal["auto", "landlock", "off"] = Field(
        "auto",
        description="The local backend's kernel sandbox for trainers (docs/security.md): landlock = every trainer "
        "runs under Landlock, reading and writing only its tenant's folders, never the data dir, and (Linux 6.7+) "
        "connecting only to the report, storage and rendezvous ports and the ephemeral range (the server "
        "refuses to start without it); auto = Landlock where the kernel has it, else a warning at start; off = "
        "none (the storage policy is still enforced by the API and the trainer).",
    )
    default_quota: QuotaSpec = Field(
        default_factory=lambda: QuotaSpec(max_queued_jobs=1000),
        description="The quota a new tenant starts with, as JSON (the quota model, docs/api.md): what its "
        "creation leaves out is taken from here, then a platform admin changes it. By default only the queue "
        "is bounded: 1,000 waiting jobs are far more than a team plans, and a bound keeps one tenant's script "
        "from filling the database. Setting it replaces the whole default (keep max_queued_jobs in it), e.g. "
        '{"max_queued_jobs": 1000, "storage": "1Ti", "max_run_seconds": 86400}.',
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
    # Fair use (kembed_api.auth.ratelimit, docs/api.md#rate-limits). A unit is one request, about a millisecond of the
    # server's CPU (plus one per 4 KiB of its body and per 64 KiB of its answer; 10 for exports, neighbours, logs
    # and checkpoint listings). Each worker process counts for itself.
    rate_limits: bool = Field(
        True, description="Enforce the rate limits below. Off only for load tests of the API alone.")
    rate_token_per_s: float = Field(
        20.0, gt=0, description="Units per second one token (or dashboard session) may spend, sustained. A "
        "dashboard polling every 2 s spends about 1.5, a CLI following a job about 1: 20 leaves ten times that.")
    rate_token_burst: float = Field(
        200.0, ge=1, description="Units one token may spend at once after a quiet while (a script listing "
        "everything, a sweep of submissions). A request costing more waits for a full bucket.")
    rate_tenant_per_s: float = Field(
        50.0, gt=0, description="Units per second all of a tenant's tokens may spend together, sustained: ~30 "
        "open dashboards. What one tenant may take of the server (a request costs it 1-2 ms of CPU).")
    rate_tenant_burst: float = Field(500.0, ge=1, description="Units a tenant may spend at once.")
    rate_report_per_s: float = Field(
        20.0, gt=0, description="Reports per second one job's trainer may send, sustained (it reports every "
        "training.log_every steps, and retries a 429 after a pause, losing nothing).")
    rate_report_burst: float = Field(200.0, ge=1, description="Reports one job may send at once.")
    rate_auth_failures_per_s: float = Field(
        1.0, gt=0, description="Failed sign-ins (401s) per second one client address may have, sustained. An "
        "address past it gets 429 for requests made without a token that worked before: guessing is bounded.")
    rate_auth_failures_burst: float = Field(
        100.0, ge=1, description="Failed sign-ins one address may have at once (mistyped tokens, expired "
        "sessions of a whole office behind one NAT).")
    in_flight_per_tenant: int = Field(
        16, ge=1, le=1000, description="Reads (GET) of one tenant under way at once. A read takes milliseconds, "
        "so 30 polling dashboards have well under one under way; 16 bounds how many answers one tenant's many "
        "connections can have built at once, before their sizes are counted.")
    heavy_in_flight_per_tenant: int = Field(
        4, ge=1, le=64, description="Heavy requests (exports, neighbours, logs, checkpoint listings) one tenant "
        "may have under way at once; each holds one of the worker threads all tenants share (40) while it reads, "
        "so one tenant never holds more than a tenth of them.")
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
    def _one_source_of_s3_credentials(self) -> Settings:
        if self.s3_mint_credentials and self.trainer_server_s3_credentials:
            raise ValueError("s3_mint_credentials and trainer_server_s3_credentials: choose one; minted keys give "
                             "each tenant's trainers only their own prefixes")
        return self

    @model_validator(mode="after")
    def _resolve_paths(self) -> Settings:
        self.data_dir = self.data_dir.expanduser().resolve()
        self.kernel_cache_dir = self.kernel_cache_dir.expanduser().resolve()
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
