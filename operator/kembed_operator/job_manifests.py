"""The children of an EmbeddingJob, as manifests (pure): ConfigMap, headless Service, Indexed batch Job.

Pod `<job>-<i>` of the Indexed Job gets host name `<job>-<i>` under the headless Service `<job>`, so every node
of the gang finds rank 0's rendezvous store at `<job>-0.<job>`; each pod's node rank is its completion index.
"""

from __future__ import annotations

import pathlib
import re
from typing import Any

import yaml

from kembed_contract import resources
from kembed_operator.settings import OperatorSettings
from kembed_operator.views import ATTEMPT_LABEL, INDEX_ANNOTATION, JOB_LABEL
from kembed_trainer import launch, runtime
from kembed_trainer.storage_policy import POLICY_ENV

__all__ = ["CONFIG_MOUNT", "S3_SECRET", "batch_job", "config_map", "owner_reference", "service"]

CONFIG_MOUNT = "/etc/kembed"
S3_SECRET = "kembed-s3"
TENANT_LABEL = "kembed.io/tenant"
LAUNCHER = pathlib.Path(launch.__file__)
_LABEL_KEY = re.compile(r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
                        r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
_LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$")
# libyaml's emitter when PyYAML has it: the pure-Python one was the operator's largest CPU cost per job at scale.
_YAML_DUMPER = getattr(yaml, "CSafeDumper", yaml.SafeDumper)


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


def config_map(name: str, namespace: str, uid: str, tenant: str, spec: resources.EmbeddingJobSpec, *,
               default_checkpoint_uri: str | None) -> dict[str, Any]:
    return {
        "apiVersion": "v1", "kind": "ConfigMap", "metadata": _metadata(name, namespace, uid, tenant),
        "data": {
            "config.yaml": yaml.dump(trainer_config(spec, default_checkpoint_uri=default_checkpoint_uri),
                                     Dumper=_YAML_DUMPER, sort_keys=False),
            "launch.py": LAUNCHER.read_text(),
        },
    }


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


def _resources(spec: resources.EmbeddingJobSpec) -> dict[str, Any]:
    res = spec.resources
    cpu = f"{int(res.cpu_per_node * 1000)}m"
    amounts = {"cpu": cpu, "memory": res.memory_per_node}
    if res.gpus_per_node:
        amounts["nvidia.com/gpu"] = str(res.gpus_per_node)
    # Requests = limits: a training rank that bursts past its request only slows its peers in the gang.
    return {"requests": dict(amounts), "limits": dict(amounts)}


def _env(name: str, spec: resources.EmbeddingJobSpec, settings: OperatorSettings,
         storage_policy: str | None) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = [
        {"name": "JOB_COMPLETION_INDEX",
         "valueFrom": {"fieldRef": {"fieldPath": f"metadata.annotations['{INDEX_ANNOTATION}']"}}},
        {"name": runtime.ENV_JOB_ID, "value": name},
        {"name": "PYTHONUNBUFFERED", "value": "1"},
        # The trainer writes why it failed there; the kubelet puts it in the pod's status for the exit policy.
        {"name": runtime.ENV_TERMINATION_LOG, "value": runtime.TERMINATION_LOG_PATH},
    ]
    if spec.report_url:
        env.append({"name": runtime.ENV_REPORT_URL, "value": spec.report_url})
    if spec.report_token_secret:
        env.append({"name": runtime.ENV_REPORT_TOKEN, "valueFrom": {"secretKeyRef": {
            "name": spec.report_token_secret, "key": "token", "optional": True}}})
    if settings.s3_endpoint_url:
        env.append({"name": "AWS_ENDPOINT_URL", "value": settings.s3_endpoint_url})
    if storage_policy is not None:  # the tenant's, from its Tenant: the trainers enforce it on every file
        env.append({"name": POLICY_ENV, "value": storage_policy})
    return env


def batch_job(name: str, namespace: str, uid: str, tenant: str, spec: resources.EmbeddingJobSpec, *,
              attempt: int, settings: OperatorSettings, storage_policy: str | None = None) -> dict[str, Any]:
    res = spec.resources
    gpus = res.gpus_per_node > 0
    node_selector = {**settings.trainer_node_selector, **(settings.gpu_node_selector if gpus else {})}
    tolerations = [*settings.trainer_tolerations, *(settings.gpu_tolerations if gpus else [])]
    labels = {**_user_labels(spec.labels), JOB_LABEL: name, TENANT_LABEL: tenant, ATTEMPT_LABEL: str(attempt)}
    metadata = _metadata(name, namespace, uid, tenant)
    metadata["labels"][ATTEMPT_LABEL] = str(attempt)
    launcher_args = runtime.node_command(
        [f"{CONFIG_MOUNT}/launch.py"], nnodes=res.nodes, node_rank="$(JOB_COMPLETION_INDEX)",
        nproc_per_node=res.procs_per_node, master_addr=f"{name}-0.{name}", master_port=settings.rendezvous_port,
        config=f"{CONFIG_MOUNT}/config.yaml",
    )
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "subdomain": name,
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
            "resources": _resources(spec),
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
            {"name": "config", "configMap": {"name": name}},
            # NCCL and DataLoader workers share tensors through /dev/shm; the runtime's default 64 MiB is too small.
            {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "1Gi"}},
        ],
    }
    if node_selector:
        pod_spec["nodeSelector"] = node_selector
    if tolerations:
        pod_spec["tolerations"] = tolerations
    return {
        "apiVersion": "batch/v1", "kind": "Job", "metadata": metadata,
        "spec": {
            "completionMode": "Indexed",
            "completions": res.nodes,
            "parallelism": res.nodes,
            # One failed pod fails this Job; the operator then decides whether the whole gang restarts.
            "backoffLimit": 0,
            "podReplacementPolicy": "Failed",
            "template": {"metadata": {"labels": labels}, "spec": pod_spec},
        },
    }
