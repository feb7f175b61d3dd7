"""The Kubernetes custom resources of kembed: the contract between the API's Kubernetes backend and the operator.

Group ``kembed.io``, version ``v1alpha1``. Both sides build and read these objects only through this module; the
CRD schemas are generated from the pydantic models below (``python -m kembed_contract.crds``; ``make manifests``
writes them into the Helm chart, and tests/operator/test_manifests.py fails when the committed files drift).

Field names: a ``spec`` keeps the job spec's own snake_case names (it *is* ``kembed_contract.spec.JobSpec``, so a spec
that validates in the API is a spec the operator accepts, byte for byte); a ``status`` uses Kubernetes'
camelCase (``restartCount``, ``lastTransitionTime``), which kubectl and other tools expect.

Tenant (cluster-scoped, ``kubectl get tenants``)
    metadata.name   the tenant's name: a DNS label of at most 56 characters (its namespace is ``kembed-<name>``).
    spec.quota      the tenant's nominal quota, ``kembed_contract.quota.QuotaSpec`` (the model the API and its
                    database use): gpus (nvidia.com/gpu), cpu (cores), memory (a quantity), max_running_jobs,
                    max_queued_jobs, storage, max_run_seconds; omitted: unlimited. The operator writes gpus, cpu
                    and memory into the namespace's ResourceQuota (requests.* and limits.*; changes apply in
                    place); the job counts and the run time are enforced by the API, storage by the API and the
                    trainers (each told its budget), not by Kubernetes.
    spec.sharing    its cohort, borrowing limit and highest priority class (``kembed_contract.quota.SharingSpec``).
                    In a cohort the ResourceQuota is the quota plus the borrowing limit, so borrowed pods can
                    start; what it may borrow at a given moment is decided by the API's admission.
    spec.s3         prefix (``s3://bucket/path``; jobs without checkpoint.uri checkpoint under
                    ``<prefix>/<job>/``) and credentials_secret (a Secret in the operator's namespace whose keys,
                    e.g. AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, are copied into the tenant's namespace as
                    Secret ``kembed-s3`` and given to trainers as environment variables; unset = the platform's).
                    Where the operator mints credentials (its setting s3_mint_credentials) kembed-s3 holds the
                    tenant's own IAM key instead, and credentials_rotation (any new value) rotates it.
    spec.storage    the tenant's storage policy (docs/security.md): read and write URI prefixes, and deny, places
                    never reachable even inside them (the API's checkpoint root). ``spec.s3.prefix`` is the
                    tenant's own folder, always reachable; every other Tenant's prefix is denied. The operator
                    hands the result to the trainers (env KEMBED_STORAGE_POLICY), which enforce it.
    status          phase (Ready | Terminating | Failed), namespace, conditions, observedGeneration (the operator);
                    usage (the API, which decides admission and borrowing): what its jobs hold now (used), and in
                    a cohort what of it is borrowed from the cohort and what of its idle quota the others borrow
                    (lent), per dimension, and its queued jobs. ``kubectl get tenants`` shows them.
                    Where the operator mints credentials: s3AccessKeyId / s3CredentialsRotation (the minted key's id).
    Deleting a Tenant is refused (it stays Terminating, condition ``Deleting`` False, reason JobsStillRunning)
    while it has EmbeddingJobs that are not finished; once none are, its namespace and everything in it go.

EmbeddingJob (namespaced, in ``kembed-<tenant>``; ``kubectl get embeddingjobs`` / ``ej``)
    metadata.name   the API's job id (a DNS label of at most 52 characters: it names the Service, the batch Job
                    and the pods' host names ``<job>-<index>.<job>``).
    spec            every JobSpec field (name, priority, resources, max_restarts, image, labels, trainer), plus
      cancel        true: stop the trainers gracefully (SIGTERM, they checkpoint), then phase CANCELLED.
      suspend       true: stop the trainers gracefully and keep the job (phase PREEMPTED); false again: the
                    same attempt starts anew and resumes from its checkpoint.
      report_url    where rank 0 POSTs its records (env KEMBED_REPORT_URL); optional.
      report_token_secret  name of a Secret in the job's namespace holding the per-job report token under key
                    ``token`` (env KEMBED_REPORT_TOKEN). The API creates the Secret before the EmbeddingJob; the
                    operator makes the EmbeddingJob its owner, so it goes when the job is deleted.
      storage_budget_bytes  what the job's checkpoint folder may hold (env KEMBED_STORAGE_BUDGET_BYTES; the
                    tenant's quota.storage less what it keeps elsewhere, counted by the API); unset: no limit.
    The rest of spec is fixed once the job started: the operator reads only cancel and suspend afterwards.
    status
      phase         a JobState: ADMITTED (children created, pods starting), RUNNING (every pod of the gang
                    runs), RESTARTING (a retryable failure: the gang is being replaced, restartCount counts them),
                    PREEMPTED (suspended), SUCCEEDED, FAILED, CANCELLED (terminal; they never change again).
      reason, message   why the job is in its phase (for FAILED e.g. TrainerExitedPermanently, RestartLimitReached,
                    Unschedulable, ImagePullFailed, RendezvousTimeout, InvalidSpec).
      conditions    Kubernetes conditions (type, status, reason, message, lastTransitionTime, observedGeneration):
                    PodsReady, Suspended, Finished, CleanedUp.
      startTime / completionTime, restartCount, attempt, attemptStartTime,
      progress      {step, totalSteps, percent}, latestCheckpoint {step, uri} and trainerSeconds {phase: seconds}:
                    read from rank 0's records.
    Each change of phase is also a Kubernetes Event on the EmbeddingJob (reason = status.reason).

How the API drives a job: create the report-token Secret, then ``embedding_job_manifest(...)``; cancel by merge-
patching ``{"spec": {"cancel": true}}``; suspend/resume with ``{"spec": {"suspend": true|false}}``; read
``status`` with ``EmbeddingJobStatus.from_object(obj)`` (watch the resource to follow it). Deleting the object
also stops the trainers, but loses the status: cancel instead.
"""

from __future__ import annotations

import datetime
import re
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

from kembed_contract.lifecycle import JobState
from kembed_contract.quota import QuotaSpec, SharingSpec, UsageAmounts
from kembed_contract.spec import JobSpec, parse_quantity
from kembed_contract.storage_policy import StoragePolicy, UriError, canonical_uri, check_uri_syntax

__all__ = [
    "EMBEDDING_JOB_KIND",
    "EMBEDDING_JOB_PLURAL",
    "GROUP",
    "OPERATOR_FINALIZER",
    "TENANT_KIND",
    "TENANT_PLURAL",
    "VERSION",
    "Condition",
    "EmbeddingJobSpec",
    "EmbeddingJobStatus",
    "TenantS3",
    "TenantSpec",
    "TenantStatus",
    "TenantStorage",
    "TenantUsage",
    "embedding_job_manifest",
    "tenant_manifest",
    "tenant_namespace",
    "tenant_storage_policy",
]

GROUP = "kembed.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
TENANT_KIND, TENANT_PLURAL = "Tenant", "tenants"
EMBEDDING_JOB_KIND, EMBEDDING_JOB_PLURAL = "EmbeddingJob", "embeddingjobs"
# The operator's finalizer (its Kopf persistence finalizer). Jobs are created with it already in place: the
# operator would add it anyway, and then each new job costs it one write less.
OPERATOR_FINALIZER = f"{GROUP}/operator"
NAMESPACE_PREFIX = "kembed-"
MAX_TENANT_NAME = 63 - len(NAMESPACE_PREFIX)
# The pods' host names are "<job>-<index>" (a DNS label, at most 63): leaves room for up to 10 digits of index.
MAX_JOB_NAME = 52
_DNS_LABEL = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"


def tenant_namespace(tenant: str) -> str:
    """The namespace that holds a tenant's jobs."""
    return f"{NAMESPACE_PREFIX}{tenant}"


# ------------------------------------------------------------------------------------------------ shared
class _Status(BaseModel):
    """Status models speak Kubernetes' camelCase on the wire and snake_case in Python."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore")


class Condition(_Status):
    type: str = Field(description="What the condition is about, e.g. PodsReady, Finished.")
    status: Literal["True", "False", "Unknown"]
    reason: str = Field(description="CamelCase word a program can match on.")
    message: str = Field("", description="For people.")
    last_transition_time: str = Field(description="RFC 3339 time when status last changed.")
    observed_generation: int = Field(0, description="metadata.generation the condition was computed from.")


def _quantity(value: str) -> str:
    parse_quantity(value)
    return value


# ------------------------------------------------------------------------------------------------ Tenant
class TenantS3(BaseModel):
    model_config = ConfigDict(extra="forbid")

    prefix: str = Field(
        pattern=r"^s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/.*)?$",
        description="s3://bucket/path under which the tenant's checkpoints live.",
    )
    credentials_secret: str | None = Field(
        None,
        description="Secret in the operator's namespace copied into the tenant's namespace as kembed-s3 "
        "(unset: the platform's default Secret, if any). Ignored where the operator mints credentials.",
    )
    credentials_rotation: str | None = Field(
        None, max_length=63,
        description="Where the operator mints credentials: a new value here rotates the tenant's key (the previous "
        "one stays valid until the next rotation, so running trainers finish), e.g. a date.",
    )


_Prefixes = list[Annotated[str, Field(min_length=1, max_length=4096), AfterValidator(check_uri_syntax)]]


class TenantStorage(BaseModel):
    """The tenant's storage policy (canonical URI prefixes; see docs/security.md)."""

    model_config = ConfigDict(extra="forbid")

    read: _Prefixes = Field(default_factory=list, max_length=100, description="Prefixes trainers may read.")
    write: _Prefixes = Field(default_factory=list, max_length=100,
                             description="Prefixes trainers may write (and read).")
    deny: _Prefixes = Field(default_factory=list, max_length=100,
                            description="Never reachable, even inside read or write (e.g. the checkpoint root).")


class TenantSpec(BaseModel):
    """A team: its namespace, quota and checkpoint storage."""

    model_config = ConfigDict(extra="forbid")

    display_name: str | None = Field(None, max_length=200, description="Human-readable team name.")
    quota: QuotaSpec = Field(default_factory=QuotaSpec, description="The tenant's nominal (guaranteed) quota.")
    sharing: SharingSpec | None = Field(None, description="Its cohort and borrowing limit; unset: a rigid quota.")
    s3: TenantS3 | None = None
    storage: TenantStorage | None = Field(
        None, description="What the tenant's trainers may read and write besides s3.prefix; unset: only that."
    )

    def resource_quota(self) -> QuotaSpec:
        """What the namespace's ResourceQuota enforces: the quota, plus the borrowing limit in a cohort."""
        return (self.sharing or SharingSpec()).ceiling(self.quota)


def tenant_storage_policy(spec: TenantSpec, *, other_prefixes: list[str]) -> StoragePolicy:
    """The policy a tenant's trainers enforce: its own prefix, its storage section, never another tenant's prefix.

    Raises UriError for a prefix without a canonical form."""
    storage = spec.storage or TenantStorage()
    own = (canonical_uri(spec.s3.prefix),) if spec.s3 else ()
    others = []
    for prefix in other_prefixes:
        try:
            others.append(canonical_uri(prefix))
        except UriError:
            continue  # that tenant's own reconcile reports it; here it could not be reached anyway
    return StoragePolicy(own=own, read=tuple(canonical_uri(p) for p in storage.read),
                         write=tuple(canonical_uri(p) for p in storage.write),
                         deny=(*(canonical_uri(p) for p in storage.deny), *(p for p in others if p not in own)))


class Amounts(UsageAmounts, _Status):
    """Amounts of each dimension, in the status's camelCase."""


class TenantUsage(_Status):
    """The tenant's share of its cohort now, as the API's admission counts it (kembed_api.tenants.service.usage)."""

    cohort: str | None = Field(None, description="The cohort it shares with; null: a rigid quota.")
    used: Amounts = Field(description="What its admitted and running jobs hold.")
    borrowed: Amounts = Field(description="What of `used` lies beyond its nominal quota: borrowed from the cohort.")
    lent: Amounts = Field(description="Its part of what the cohort's other members borrow: its idle quota, lent.")
    queued_jobs: int = Field(0, description="Jobs waiting for admission.")
    time: str = Field(description="RFC 3339 time the API counted this.")


class TenantStatus(_Status):
    phase: Literal["Ready", "Terminating", "Failed"] | None = None
    namespace: str | None = None
    conditions: list[Condition] = Field(default_factory=list)
    observed_generation: int | None = None
    usage: TenantUsage | None = Field(None, description="Written by the API: use against quota, borrowed, lent.")
    s3_access_key_id: str | None = Field(
        None, description="Where the operator mints credentials: the id (not the secret) of the key in the tenant's "
        "Secret kembed-s3, so it knows the key without reading Secrets.")
    s3_credentials_rotation: str | None = Field(
        None, description="The spec.s3.credentials_rotation that key was minted for.")


def tenant_manifest(name: str, spec: TenantSpec, *, labels: dict[str, str] | None = None) -> dict[str, Any]:
    if not (len(name) <= MAX_TENANT_NAME and _matches(_DNS_LABEL, name)):
        raise ValueError(f"tenant name: must be a DNS label of at most {MAX_TENANT_NAME} characters")
    return {
        "apiVersion": API_VERSION, "kind": TENANT_KIND,
        "metadata": {"name": name, "labels": labels or {}},
        "spec": spec.model_dump(mode="json", exclude_none=True),
    }


# ------------------------------------------------------------------------------------------------ EmbeddingJob
class EmbeddingJobSpec(JobSpec):
    """The job spec as submitted, plus what only the cluster needs."""

    cancel: bool = Field(False, description="Stop the job gracefully; it ends CANCELLED.")
    suspend: bool = Field(False, description="Stop the pods gracefully and keep the job (PREEMPTED) until false.")
    report_url: str | None = Field(None, description="Where rank 0 reports its records (KEMBED_REPORT_URL).")
    report_token_secret: str | None = Field(
        None, description="Secret in this namespace with key 'token' (KEMBED_REPORT_TOKEN); owned by the job."
    )
    storage_budget_bytes: int | None = Field(
        None, ge=0, le=2**62, description="Bytes the job's checkpoints may take (KEMBED_STORAGE_BUDGET_BYTES); "
        "unset: no storage quota.")

    def job_spec(self) -> JobSpec:
        """The plain JobSpec (without the cluster-only fields)."""
        return JobSpec.model_validate(self.model_dump(include=set(JobSpec.model_fields)))


class Progress(_Status):
    step: int = 0
    total_steps: int | None = None
    percent: int | None = Field(None, ge=0, le=100)


class CheckpointRef(_Status):
    step: int
    uri: str


class EmbeddingJobStatus(_Status):
    phase: JobState | None = None
    reason: str | None = None
    message: str | None = None
    conditions: list[Condition] = Field(default_factory=list)
    observed_generation: int | None = None
    start_time: str | None = Field(None, description="When the first pod of the job started running.")
    completion_time: str | None = Field(None, description="When the job reached a terminal phase.")
    restart_count: int = Field(0, description="Gang restarts so far (retryable failures, rendezvous time-outs).")
    attempt: int = Field(0, description="The current gang's number; its pods carry label kembed.io/attempt.")
    attempt_start_time: str | None = Field(None, description="When the current gang was (re)started.")
    progress: Progress | None = None
    latest_checkpoint: CheckpointRef | None = Field(
        None, description="The latest complete checkpoint rank 0 reported (a step-N folder in the spec's checkpoint.uri).")
    trainer_seconds: dict[str, float] | None = Field(
        None, description="Rank 0's seconds by phase so far (process_start, imports, data, training, evaluation, "
        "saving: kembed_contract.job_seconds), from its latest record that gave them.")

    @classmethod
    def from_object(cls, obj: dict[str, Any]) -> EmbeddingJobStatus:
        return cls.model_validate(obj.get("status") or {})

    def condition(self, type_: str) -> Condition | None:
        return next((c for c in self.conditions if c.type == type_), None)


def embedding_job_manifest(
    job_id: str,
    tenant: str,
    spec: JobSpec,
    *,
    report_url: str | None = None,
    report_token_secret: str | None = None,
    labels: dict[str, str] | None = None,
    storage_budget_bytes: int | None = None,
) -> dict[str, Any]:
    """The EmbeddingJob the API creates for an admitted job (in namespace ``tenant_namespace(tenant)``)."""
    if not (len(job_id) <= MAX_JOB_NAME and _matches(_DNS_LABEL, job_id)):
        raise ValueError(f"job id: must be a DNS label of at most {MAX_JOB_NAME} characters")
    full = EmbeddingJobSpec.model_validate(
        {**spec.model_dump(mode="json"), "report_url": report_url, "report_token_secret": report_token_secret,
         "storage_budget_bytes": storage_budget_bytes}
    )
    return {
        "apiVersion": API_VERSION, "kind": EMBEDDING_JOB_KIND,
        "metadata": {
            "name": job_id, "namespace": tenant_namespace(tenant),
            "labels": {"kembed.io/tenant": tenant, **(labels or {})},
            "finalizers": [OPERATOR_FINALIZER],
        },
        "spec": full.model_dump(mode="json", exclude_none=True),
    }


def _matches(pattern: str, value: str) -> bool:
    return re.match(pattern, value) is not None


def now_rfc3339(clock: datetime.datetime | None = None) -> str:
    """Kubernetes' time format (seconds, UTC, trailing Z)."""
    moment = clock or datetime.datetime.now(datetime.UTC)
    return moment.astimezone(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
