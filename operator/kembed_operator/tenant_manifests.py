"""What a Tenant becomes in the cluster, as manifests (pure): its namespace and the guard rails inside it."""

from __future__ import annotations

import base64
from typing import Any

from kembed_contract import resources
from kembed_operator.job_manifests import S3_SECRET, TENANT_LABEL
from kembed_operator.settings import OperatorSettings
from kembed_platform.tenant_credentials import S3Credentials

__all__ = ["MINTED_KEY_ANNOTATION", "ROTATION_ANNOTATION", "limit_range", "minted_s3_secret", "namespace",
           "network_policy", "quota", "s3_secret", "trainer_service_account"]

MANAGED_BY = {"app.kubernetes.io/managed-by": "kembed-operator"}
# On a minted kembed-s3 Secret: that its key is the tenant's own (not a copy of the platform's), and the
# spec.s3.credentials_rotation it was minted for (a new value there rotates the key).
MINTED_KEY_ANNOTATION = "kembed.io/minted-s3-key"
ROTATION_ANNOTATION = "kembed.io/credentials-rotation"


def _owner(tenant: str, uid: str) -> dict[str, Any]:
    return {"apiVersion": resources.API_VERSION, "kind": resources.TENANT_KIND, "name": tenant, "uid": uid,
            "controller": True, "blockOwnerDeletion": False}


def _meta(name: str, tenant: str, **extra: Any) -> dict[str, Any]:
    return {"name": name, "namespace": resources.tenant_namespace(tenant),
            "labels": {TENANT_LABEL: tenant, **MANAGED_BY}, **extra}


def namespace(tenant: str, uid: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1", "kind": "Namespace",
        "metadata": {
            "name": resources.tenant_namespace(tenant),
            "labels": {
                TENANT_LABEL: tenant, **MANAGED_BY,
                # Trainer pods meet the "restricted" Pod Security Standard; nothing less may run here.
                "pod-security.kubernetes.io/enforce": "restricted",
                "pod-security.kubernetes.io/enforce-version": "latest",
            },
            "ownerReferences": [_owner(tenant, uid)],
        },
    }


def quota(tenant: str, spec: resources.TenantSpec) -> dict[str, Any]:
    """The namespace's ResourceQuota: the tenant's quota plus, in a cohort, its borrowing limit (what the API's
    admission lets it borrow must be able to start); a dimension without a limit is not listed."""
    q = spec.resource_quota()
    hard = {name: d.quantity(value) for d in q.dimensions() if (value := getattr(q, d.field)) is not None
            for name in d.kubernetes}
    return {"apiVersion": "v1", "kind": "ResourceQuota", "metadata": _meta("kembed-quota", tenant),
            "spec": {"hard": hard}}


def limit_range(tenant: str, settings: OperatorSettings) -> dict[str, Any]:
    """Defaults for containers that name no requests: with a quota on requests.* they could not run at all."""
    defaults = {"cpu": settings.tenant_default_cpu_request, "memory": settings.tenant_default_memory_request}
    return {"apiVersion": "v1", "kind": "LimitRange", "metadata": _meta("kembed-defaults", tenant),
            "spec": {"limits": [{"type": "Container", "defaultRequest": defaults, "default": defaults}]}}


def network_policy(tenant: str) -> dict[str, Any]:
    """Ingress only from pods of the same namespace: another tenant's pods cannot reach these trainers."""
    return {
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": _meta("kembed-isolate-tenant", tenant),
        "spec": {"podSelector": {}, "policyTypes": ["Ingress"], "ingress": [{"from": [{"podSelector": {}}]}]},
    }


def trainer_service_account(tenant: str, settings: OperatorSettings) -> dict[str, Any]:
    """No Role binds it and no token is mounted: trainers have no Kubernetes API rights at all."""
    meta = _meta(settings.trainer_service_account, tenant)
    if settings.trainer_service_account_annotations:
        meta["annotations"] = dict(settings.trainer_service_account_annotations)
    return {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta, "automountServiceAccountToken": False}


def s3_secret(tenant: str, source: dict[str, Any]) -> dict[str, Any]:
    """A copy of the platform's S3 credentials Secret (its keys become the trainers' environment)."""
    data = dict(source.get("data") or {})
    for key, value in (source.get("stringData") or {}).items():
        data[key] = base64.b64encode(value.encode()).decode()
    return {"apiVersion": "v1", "kind": "Secret", "metadata": _meta(S3_SECRET, tenant), "type": "Opaque",
            "data": data}


def minted_s3_secret(tenant: str, credentials: S3Credentials, *, rotation: str | None) -> dict[str, Any]:
    """The tenant's own minted key, which the trainers get as environment variables (job_manifests)."""
    meta = _meta(S3_SECRET, tenant, annotations={MINTED_KEY_ANNOTATION: "true", ROTATION_ANNOTATION: rotation or ""})
    return {"apiVersion": "v1", "kind": "Secret", "metadata": meta, "type": "Opaque",
            "data": {k: base64.b64encode(v.encode()).decode() for k, v in credentials.environ().items()}}
