"""The operator's settings: one typed object read from the environment (prefix ``KEMBED_OPERATOR_``).

Dicts and lists are JSON in the environment, e.g.
``KEMBED_OPERATOR_TRAINER_NODE_SELECTOR='{"kembed.io/local-node": "true"}'``.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from kembed_platform.tenant_credentials import MintingSettings

__all__ = ["OperatorSettings"]


class OperatorSettings(MintingSettings, BaseSettings):
    model_config = SettingsConfigDict(env_prefix="KEMBED_OPERATOR_", extra="forbid")

    # ---- where the operator lives ------------------------------------------------------------------------------
    namespace: str = Field(
        "kembed-system",
        description="The operator's own namespace: where it finds the S3 credentials Secrets it copies to tenants.",
    )
    peering_name: str = Field(
        "kembed", description="ClusterKopfPeering object the replicas use to elect the active one."
    )
    peering_lifetime_s: int = Field(
        30,
        ge=15,
        description="Seconds after which a silent replica counts as dead and a standby takes over. Kopf renews "
        "5-10 s before expiry, so below 15 s replicas would flap.",
    )
    standalone: bool = Field(False, description="Run without peering (one replica only, e.g. on a laptop).")
    health_port: int = Field(8080, description="Port of the liveness endpoint /healthz (0 = none).")
    api_workers: int = Field(
        32, ge=1, description="Threads for Kubernetes API calls; bounds the calls in flight at once."
    )

    # ---- trainer pods -------------------------------------------------------------------------------------------
    trainer_image: str = Field(
        "kembed/trainer:0.1.0", description="Image of jobs that do not name their own (spec.image)."
    )
    trainer_service_account: str = Field(
        "kembed-trainer", description="ServiceAccount (no API rights) the operator creates in each tenant namespace."
    )
    trainer_service_account_annotations: dict[str, str] = Field(
        default_factory=dict,
        description="Annotations on each tenant's trainer ServiceAccount: workload identity for S3 instead of keys "
        "(e.g. eks.amazonaws.com/role-arn).",
    )
    trainer_uid: int = Field(10001, description="UID/GID the trainer runs as (the trainer image's user).")
    trainer_node_selector: dict[str, str] = Field(
        default_factory=dict, description="nodeSelector for every trainer pod (e.g. a node pool)."
    )
    trainer_tolerations: list[dict[str, Any]] = Field(
        default_factory=list, description="Tolerations for every trainer pod."
    )
    gpu_node_selector: dict[str, str] = Field(
        default_factory=dict, description="Extra nodeSelector for pods that request GPUs (e.g. a GPU node pool)."
    )
    gpu_tolerations: list[dict[str, Any]] = Field(
        default_factory=lambda: [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        description="Tolerations for pods that request GPUs; the default matches the usual GPU node taint.",
    )
    local_disk_storage_class: str | None = Field(
        None, min_length=1, max_length=253, pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$",
        description="Where a trainer pod's local disk (resources.local_disk_per_node: its tiered tables' rows) "
        "lives. Unset: an emptyDir of that size on the node's own ephemeral storage, requested and limited as "
        "ephemeral-storage (counted by the namespace's ResourceQuota). Set: a generic ephemeral volume claimed "
        "from this StorageClass (local NVMe through a local-volume provisioner, say), made and deleted with the "
        "pod; its size is the claim's, which the tenant's local_disk quota counts in the API's admission only.",
    )
    rendezvous_port: int = Field(29500, description="Port of rank 0's rendezvous store (torchrun --master-port).")
    stop_grace_s: int = Field(
        120,
        ge=1,
        description="terminationGracePeriodSeconds: time a trainer gets to write its SIGTERM checkpoint. "
        "torchrun itself kills its workers 30 s after SIGTERM, so that is the effective bound per rank.",
    )
    s3_credentials_secret: str | None = Field(
        None, description="Default Secret (in `namespace`) copied to tenants whose spec names none."
    )
    s3_mint_credentials: bool = Field(
        False,
        description="Mint each tenant's own S3 key (docs/security.md): an IAM user allowed only the tenant's storage "
        "policy, its key in Secret kembed-s3 of the tenant's namespace, instead of copying a credentials Secret. "
        "The operator mints with its own AWS credentials (environment or workload identity), which never reach a "
        "trainer.",
    )
    s3_endpoint_url: str | None = Field(
        None, description="AWS_ENDPOINT_URL given to trainers (MinIO, Ceph, a test server); unset = AWS."
    )

    # ---- never stuck silently -----------------------------------------------------------------------------------
    unschedulable_timeout_s: float = Field(
        300, gt=0, description="A pod unschedulable for this long fails the job (reason Unschedulable)."
    )
    image_pull_timeout_s: float = Field(
        45, gt=0, description="A pod that cannot pull its image for this long fails the job (ImagePullFailed); "
        "until then the job's PodsReady condition names the pull error. A slow pull is no failure (the pod shows "
        "ContainerCreating); a registry error is retried by the kubelet for this long, so the job's status says "
        "why within a minute."
    )
    rendezvous_timeout_s: float = Field(
        600,
        gt=0,
        description="The whole gang must be running this long after its start, or it is restarted "
        "(RendezvousTimeout; FAILED once max_restarts is used up).",
    )
    gang_failure_settle_s: float = Field(
        10, gt=0, description="How long a failed batch Job may show no failed pod before it counts as disrupted."
    )

    # ---- housekeeping -------------------------------------------------------------------------------------------
    ttl_after_finished_s: float = Field(
        3600, ge=0, description="A finished job's pods, Job, Service and ConfigMap are deleted this long after it "
        "ended; the EmbeddingJob and its status stay."
    )
    resync_interval_s: float = Field(
        30, gt=0, description="A job is re-examined at least this often even if nothing changed (time-outs)."
    )
    first_status_delay_s: float = Field(
        30, ge=0, description="How long the first status of a new gang (ADMITTED) is held back: a gang whose pods "
        "all run within it gets one status write (RUNNING) instead of two. ADMITTED is for people only (the API "
        "reads RUNNING and the ends; a restarted operator treats a job without a phase as admitted), and pods "
        "that wait for nodes under load often take more than a few seconds: with 5 s, most jobs of a loaded "
        "control plane got the extra write and Event. 0 = write it at once."
    )
    progress_interval_s: float = Field(
        30, gt=0, description="How often rank 0's log is read for progress and checkpoints while a job runs."
    )
    tenant_delete_retry_s: float = Field(
        10, gt=0, description="How often a refused Tenant deletion (jobs still running) is tried again."
    )
    tenant_default_cpu_request: str = Field("100m", description="LimitRange default CPU request per container.")
    tenant_default_memory_request: str = Field(
        "256Mi", description="LimitRange default memory request per container."
    )

    @model_validator(mode="after")
    def _minted_keys_alone(self) -> OperatorSettings:
        if self.s3_mint_credentials and self.trainer_service_account_annotations:
            raise ValueError("s3_mint_credentials: trainers get their tenant's minted key, so their ServiceAccount "
                             "must carry no workload identity (trainer_service_account_annotations would give every "
                             "tenant's trainers the same role)")
        return self
