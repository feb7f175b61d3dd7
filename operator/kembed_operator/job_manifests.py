"""The children of an EmbeddingJob, as manifests (pure): an Indexed batch Job, and only what it needs besides.

- The trainer's config (`CONFIG_FILE`, JSON) travels in the pod template's annotations and reaches the containers
  through a downward-API volume: no object of their own to write, watch and delete per job. A config too large
  for annotations (`MAX_INLINE_CONFIG_BYTES`) goes into a ConfigMap named after the job instead. The launcher is
  the trainer image's own (`python -m kembed_trainer.launch`): every pod object, and every write of it that the
  API server, etcd and each watcher handle, would otherwise carry a copy of its source.
- A gang of several nodes gets a headless Service: pod `<job>-<i>` of the Indexed Job gets host name `<job>-<i>`
  under the Service `<job>`, so every node finds rank 0's rendezvous store at `<job>-0.<job>`; each pod's node
  rank is its completion index. A one-node job rendezvouses on its own pod (127.0.0.1) and gets no Service.
- A job with local disk (resources.local_disk_per_node: its tiered tables' rows) gets a volume of that size in each
  pod, mounted at `LOCAL_MOUNT` and named to the trainer in runtime.ENV_LOCAL_DIR.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

from kembed_contract import resources, runtime, threads
from kembed_contract.storage_policy import POLICY_ENV
from kembed_operator.settings import OperatorSettings
from kembed_operator.views import ATTEMPT_LABEL, INDEX_ANNOTATION, JOB_LABEL

__all__ = ["CONFIG_FILE", "CONFIG_MOUNT", "LOCAL_MOUNT", "LOCAL_VOLUME", "S3_SECRET", "TrainerFiles", "batch_job", "config_map", "owner_reference",
           "service", "side_children", "trainer_files"]

CONFIG_MOUNT = "/etc/kembed"
# The pod's local disk for its trainers (runtime.ENV_LOCAL_DIR): their tiered tables' rows, on a volume of its own,
# never the container's root file system.
LOCAL_MOUNT = "/var/lib/kembed/local"
LOCAL_VOLUME = "local"
# JSON, which the trainer reads by this extension: written for every gang, and PyYAML's representer (even with
# libyaml's emitter) was a tenth of the operator's profile at scale.
CONFIG_FILE = "config.json"
CONFIG_ANNOTATION = "kembed.io/trainer-config"
# A pod's annotations hold at most 256 KiB in all (the API server refuses more), and the Job controller copies
# them into every pod of the gang: a config beyond this goes into a ConfigMap instead.
MAX_INLINE_CONFIG_BYTES = 64 * 1024
S3_SECRET = "kembed-s3"
TENANT_LABEL = "kembed.io/tenant"
_LABEL_KEY = re.compile(r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
                        r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
_LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$")


def owner_reference(name: str, uid: str) -> dict[str, Any]:
    return {"apiVersion": resources.API_VERSION, "kind": resources.EMBEDDING_JOB_KIND, "name": name, "uid": uid,
            "controller": True, "blockOwnerDeletion": True}


def _metadata(name: str, namespace: str, uid: str, tenant: str) -> dict[str, Any]:
    return {"name": name, "namespace": namespace, "labels": {JOB_LABEL: name, TENANT_LABEL: tenant},
            "ownerReferences": [owner_reference(name, uid)]}


def trainer_config(spec: resources.EmbeddingJobSpec, *, default_checkpoint_uri: str | None) -> dict[str, Any]:
    """The trainer's config file: the job's trainer section, checkpointing under the tenant's prefix if unset."""
    config = spec.trainer.model_dump(mode="json")
    if not config["checkpoint"].get("uri") and default_checkpoint_uri:
        config["checkpoint"]["uri"] = default_checkpoint_uri
    return config


@dataclasses.dataclass(frozen=True)
class TrainerFiles:
    """What the trainer container finds under CONFIG_MOUNT, and whether it fits in the pod's annotations."""

    config_text: str

    @property
    def inline(self) -> bool:
        return len(self.config_text.encode()) <= MAX_INLINE_CONFIG_BYTES


def trainer_files(spec: resources.EmbeddingJobSpec, *, default_checkpoint_uri: str | None) -> TrainerFiles:
    config = trainer_config(spec, default_checkpoint_uri=default_checkpoint_uri)
    return TrainerFiles(config_text=json.dumps(config, separators=(",", ":")))


def config_map(name: str, namespace: str, uid: str, tenant: str, files: TrainerFiles) -> dict[str, Any]:
    return {
        "apiVersion": "v1", "kind": "ConfigMap", "metadata": _metadata(name, namespace, uid, tenant),
        "data": {CONFIG_FILE: files.config_text},
    }


def side_children(name: str, namespace: str, uid: str, tenant: str, spec: resources.EmbeddingJobSpec,
                  files: TrainerFiles, settings: OperatorSettings) -> list[dict[str, Any]]:
    """What the batch Job needs besides itself: a ConfigMap for an oversized config, a Service for a gang."""
    children = [] if files.inline else [config_map(name, namespace, uid, tenant, files)]
    if spec.resources.nodes > 1:
        children.append(service(name, namespace, uid, tenant, settings))
    return children


def service(name: str, namespace: str, uid: str, tenant: str, settings: OperatorSettings) -> dict[str, Any]:
    return {
        "apiVersion": "v1", "kind": "Service", "metadata": _metadata(name, namespace, uid, tenant),
        "spec": {
            "clusterIP": "None",
            # Ranks look each other up before any of them is Ready: DNS must answer for not-ready pods too.
            "publishNotReadyAddresses": True,
            "selector": {JOB_LABEL: name},
            "ports": [{"name": "rendezvous", "port": settings.rendezvous_port, "protocol": "TCP"}],
        },
    }


def _user_labels(labels: dict[str, str]) -> dict[str, str]:
    """The job's free-form labels that are valid Kubernetes labels go on its pods (cost reports, selectors)."""
    return {k: v for k, v in labels.items() if _LABEL_KEY.match(k) and _LABEL_VALUE.match(v)
            and k not in (JOB_LABEL, ATTEMPT_LABEL, TENANT_LABEL)}


def _resources(spec: resources.EmbeddingJobSpec, settings: OperatorSettings) -> dict[str, Any]:
    res = spec.resources
    cpu = f"{int(res.cpu_per_node * 1000)}m"
    amounts = {"cpu": cpu, "memory": res.memory_per_node}
    if res.gpus_per_node:
        amounts["nvidia.com/gpu"] = str(res.gpus_per_node)
    if res.local_disk_per_node and settings.local_disk_storage_class is None:
        # The emptyDir, the container's writable layer and its logs: all of it counts in ephemeral-storage.
        amounts["ephemeral-storage"] = res.local_disk_per_node
    # Requests = limits: a training rank that bursts past its request only slows its peers in the gang.
    requests, limits = dict(amounts), dict(amounts)
    # A namespace whose quota limits local disk admits only pods that request some: these ask for none.
    requests.setdefault("ephemeral-storage", "0")
    return {"requests": requests, "limits": limits}


def _local_volume(spec: resources.EmbeddingJobSpec, settings: OperatorSettings) -> dict[str, Any]:
    """The pod's local disk, resources.local_disk_per_node: an emptyDir of that size (its sizeLimit; the kubelet
    evicts a pod past it), or a generic ephemeral volume of the platform's StorageClass for local disks."""
    size = spec.resources.local_disk_per_node
    if settings.local_disk_storage_class is None:
        return {"name": LOCAL_VOLUME, "emptyDir": {"sizeLimit": size}}
    return {"name": LOCAL_VOLUME, "ephemeral": {"volumeClaimTemplate": {
        "metadata": {"labels": {"app.kubernetes.io/managed-by": "kembed-operator"}},
        "spec": {"accessModes": ["ReadWriteOnce"], "storageClassName": settings.local_disk_storage_class,
                 "resources": {"requests": {"storage": size}}},
    }}}


def _env(name: str, spec: resources.EmbeddingJobSpec, settings: OperatorSettings,
         storage_policy: str | None) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = [
        {"name": "JOB_COMPLETION_INDEX",
         "valueFrom": {"fieldRef": {"fieldPath": f"metadata.annotations['{INDEX_ANNOTATION}']"}}},
        {"name": runtime.ENV_JOB_ID, "value": name},
        {"name": "PYTHONUNBUFFERED", "value": "1"},
        # What a rank may use, for tiers whose cache the job's memory sizes (kembed_contract.sizing).
        {"name": runtime.ENV_MEMORY_PER_RANK, "value": str(spec.resources.memory_bytes_per_rank)},
        # The trainer writes why it failed there; the kubelet puts it in the pod's status for the exit policy.
        {"name": runtime.ENV_TERMINATION_LOG, "value": runtime.TERMINATION_LOG_PATH},
        # Each rank's threads: its share of the pod's CPU request, never the node's cores (the one thread policy).
        *({"name": k, "value": v} for k, v in threads.thread_environ(
            spec.resources.cpu_per_node, spec.resources.procs_per_node or 1).items()),
    ]
    if spec.resources.local_disk_per_node:
        env.append({"name": runtime.ENV_LOCAL_DIR, "value": LOCAL_MOUNT})
    if spec.report_url:
        env.append({"name": runtime.ENV_REPORT_URL, "value": spec.report_url})
    if spec.storage_budget_bytes is not None:
        env.append({"name": runtime.ENV_STORAGE_BUDGET, "value": str(spec.storage_budget_bytes)})
    if spec.report_token_secret:
        env.append({"name": runtime.ENV_REPORT_TOKEN, "valueFrom": {"secretKeyRef": {
            "name": spec.report_token_secret, "key": "token", "optional": True}}})
    if settings.s3_endpoint_url:
        env.append({"name": "AWS_ENDPOINT_URL", "value": settings.s3_endpoint_url})
    if storage_policy is not None:  # the tenant's, from its Tenant: the trainers enforce it on every file
        env.append({"name": POLICY_ENV, "value": storage_policy})
    return env


def _config_volume(name: str, files: TrainerFiles) -> dict[str, Any]:
    if not files.inline:
        return {"name": "config", "configMap": {"name": name}}
    return {"name": "config", "downwardAPI": {"items": [
        {"path": CONFIG_FILE, "fieldRef": {"fieldPath": f"metadata.annotations['{CONFIG_ANNOTATION}']"}},
    ]}}


def batch_job(name: str, namespace: str, uid: str, tenant: str, spec: resources.EmbeddingJobSpec, *,
              attempt: int, settings: OperatorSettings, files: TrainerFiles,
              storage_policy: str | None = None) -> dict[str, Any]:
    res = spec.resources
    gpus = res.gpus_per_node > 0
    gang = res.nodes > 1  # several nodes: rank 0 is found through the headless Service (side_children)
    node_selector = {**settings.trainer_node_selector, **(settings.gpu_node_selector if gpus else {})}
    tolerations = [*settings.trainer_tolerations, *(settings.gpu_tolerations if gpus else [])]
    labels = {**_user_labels(spec.labels), JOB_LABEL: name, TENANT_LABEL: tenant, ATTEMPT_LABEL: str(attempt)}
    metadata = _metadata(name, namespace, uid, tenant)
    metadata["labels"][ATTEMPT_LABEL] = str(attempt)
    launcher_args = runtime.node_command(
        ["-m", runtime.LAUNCHER_MODULE], nnodes=res.nodes, node_rank="$(JOB_COMPLETION_INDEX)",
        nproc_per_node=res.procs_per_node, master_addr=f"{name}-0.{name}" if gang else "127.0.0.1",
        master_port=settings.rendezvous_port,
        config=f"{CONFIG_MOUNT}/{CONFIG_FILE}",
    )
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "serviceAccountName": settings.trainer_service_account,
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": settings.stop_grace_s,
        "securityContext": {
            "runAsNonRoot": True, "runAsUser": settings.trainer_uid, "runAsGroup": settings.trainer_uid,
            "fsGroup": settings.trainer_uid, "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [{
            "name": "trainer",
            "image": spec.image or settings.trainer_image,
            "imagePullPolicy": "IfNotPresent",
            "command": ["python"],
            "args": launcher_args,
            "env": _env(name, spec, settings, storage_policy),
            "terminationMessagePath": runtime.TERMINATION_LOG_PATH,
            "terminationMessagePolicy": "File",
            "envFrom": [{"secretRef": {"name": S3_SECRET, "optional": True}}],
            "ports": [{"name": "rendezvous", "containerPort": settings.rendezvous_port}],
            "resources": _resources(spec, settings),
            "securityContext": {
                "allowPrivilegeEscalation": False, "privileged": False, "runAsNonRoot": True,
                "capabilities": {"drop": ["ALL"]}, "seccompProfile": {"type": "RuntimeDefault"},
            },
            "volumeMounts": [
                {"name": "config", "mountPath": CONFIG_MOUNT, "readOnly": True},
                {"name": "shm", "mountPath": "/dev/shm"},
            ],
        }],
        "volumes": [
            _config_volume(name, files),
            # NCCL and DataLoader workers share tensors through /dev/shm; the runtime's default 64 MiB is too small.
            {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "1Gi"}},
        ],
    }
    if res.local_disk_per_node:
        pod_spec["volumes"].append(_local_volume(spec, settings))
        pod_spec["containers"][0]["volumeMounts"].append({"name": LOCAL_VOLUME, "mountPath": LOCAL_MOUNT})
    if gang:
        pod_spec["subdomain"] = name
    if node_selector:
        pod_spec["nodeSelector"] = node_selector
    if tolerations:
        pod_spec["tolerations"] = tolerations
    template_metadata: dict[str, Any] = {"labels": labels}
    if files.inline:
        template_metadata["annotations"] = {CONFIG_ANNOTATION: files.config_text}
    return {
        "apiVersion": "batch/v1", "kind": "Job", "metadata": metadata,
        "spec": {
            "completionMode": "Indexed",
            "completions": res.nodes,
            "parallelism": res.nodes,
            # One failed pod fails this Job; the operator then decides whether the whole gang restarts.
            "backoffLimit": 0,
            "podReplacementPolicy": "Failed",
            "template": {"metadata": template_metadata, "spec": pod_spec},
        },
    }
