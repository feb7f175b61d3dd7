"""Kopf handlers for Tenant: its namespace with quota, defaults, isolation, trainer identity and S3 credentials.

The operator owns the tenant's runtime identity: it reconciles every Tenant (also one applied by hand or GitOps,
without the API), retries until it holds, and runs the deletion. So it is the one that mints the tenant's S3
credentials on Kubernetes (docs/security.md).

Every step is a server-side apply, so a handler run twice (a retry, a take-over by the other replica) changes
nothing the second time, and a quota edit reaches the ResourceQuota in place.
"""

from __future__ import annotations

import datetime
from typing import Any

import kopf
import pydantic
from botocore.exceptions import BotoCoreError, ClientError

from kembed_contract import resources
from kembed_contract.lifecycle import TERMINAL_STATES
from kembed_contract.quota import QuotaSpec
from kembed_operator import tenant_manifests
from kembed_operator.conditions import set_condition
from kembed_operator.kube import Kube
from kembed_operator.settings import OperatorSettings
from kembed_platform.tenant_credentials import TenantCredentials

TENANTS = (resources.GROUP, resources.VERSION, resources.TENANT_PLURAL)
_TERMINAL = {s.value for s in TERMINAL_STATES}


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _status(kube: Kube, name: str, status: kopf.Status, generation: int, *, phase: str, ready: bool, reason: str,
            message: str) -> None:
    conditions = set_condition(list(status.get("conditions") or []), type_="Ready", status=ready, reason=reason,
                               message=message, generation=generation, now=_now())
    kube.patch_custom_status(resources.TENANT_PLURAL, name, None, {
        "phase": phase, "namespace": resources.tenant_namespace(name), "conditions": conditions,
        "observedGeneration": generation,
    })


@kopf.on.resume(*TENANTS)
@kopf.on.create(*TENANTS)
@kopf.on.update(*TENANTS, field="spec")
def reconcile_tenant(name: str, uid: str, spec: kopf.Spec, status: kopf.Status, meta: kopf.Meta, memo: kopf.Memo,
                     body: kopf.Body, tenant_s3_prefixes: kopf.Index, **_: Any) -> None:
    kube: Kube = memo.kube
    settings: OperatorSettings = memo.settings
    generation = int(meta.get("generation") or 0)
    try:
        tenant = resources.TenantSpec.model_validate(dict(spec))
        if len(name) > resources.MAX_TENANT_NAME:
            raise ValueError(f"name: at most {resources.MAX_TENANT_NAME} characters (namespace kembed-<name>)")
    except (pydantic.ValidationError, ValueError) as error:
        _status(kube, name, status, generation, phase="Failed", ready=False, reason="InvalidSpec", message=str(error))
        kopf.warn(body, reason="InvalidSpec", message=str(error)[:1000])
        raise kopf.PermanentError(f"invalid Tenant spec: {error}") from error

    kube.apply(tenant_manifests.namespace(name, uid))
    for manifest in (tenant_manifests.quota(name, tenant), tenant_manifests.limit_range(name, settings),
                     tenant_manifests.network_policy(name), tenant_manifests.trainer_service_account(name, settings)):
        kube.apply(manifest)

    source_name = (tenant.s3.credentials_secret if tenant.s3 else None) or settings.s3_credentials_secret
    if memo.credentials is not None:
        _mint_credentials(kube, memo.credentials, name, tenant, tenant_s3_prefixes, status, generation, body)
    elif source_name:
        source = kube.read_secret(source_name, settings.namespace)
        if source is None:
            message = f"S3 credentials Secret {settings.namespace}/{source_name} not found"
            _status(kube, name, status, generation, phase="Failed", ready=False, reason="S3SecretMissing",
                    message=message)
            kopf.warn(body, reason="S3SecretMissing", message=message)
            raise kopf.TemporaryError(message, delay=30)
        kube.apply(tenant_manifests.s3_secret(name, source))
    _status(kube, name, status, generation, phase="Ready", ready=True, reason="Reconciled",
            message=f"namespace {resources.tenant_namespace(name)} with quota {_describe(tenant.resource_quota())}")


def _describe(quota: QuotaSpec) -> str:
    """What its ResourceQuota enforces, in words."""
    shown = [f"{d.label} {d.quantity(value)}" for d in quota.dimensions()
             if d.kubernetes and (value := getattr(quota, d.field)) is not None]
    return ", ".join(shown) or "unlimited"


def _mint_credentials(kube: Kube, minter: TenantCredentials, name: str, tenant: resources.TenantSpec,
                      tenant_s3_prefixes: kopf.Index, status: kopf.Status, generation: int, body: kopf.Body) -> None:
    """The tenant's IAM user follows its storage policy; its Secret kembed-s3 holds its own key (minted if it has
    none or the one it has is gone, rotated when spec.s3.credentials_rotation changes). Secrets are never logged."""
    others = [p for other, prefixes in tenant_s3_prefixes.items() if other != name for p in prefixes if p]
    rotation = tenant.s3.credentials_rotation if tenant.s3 else None
    try:
        policy = resources.tenant_storage_policy(tenant, other_prefixes=others)
        # The key's id is kept in the Tenant's status: the operator may write Secrets in tenant namespaces, never
        # read them.
        current, minted_for = status.get("s3AccessKeyId"), status.get("s3CredentialsRotation")
        new = minter.ensure(name, policy, current=current)
        if new is None and minted_for != rotation:
            new = minter.rotate(name, current=current)
    except ValueError as error:  # a policy IAM cannot express: retrying changes nothing until the spec does
        message = f"S3 credentials: {error}"
        _status(kube, name, status, generation, phase="Failed", ready=False, reason="S3PolicyInexpressible",
                message=message)
        kopf.warn(body, reason="S3PolicyInexpressible", message=message[:1000])
        raise kopf.PermanentError(message) from None
    except (BotoCoreError, ClientError) as error:
        message = f"minting S3 credentials failed: {_aws_error(error)}"
        _status(kube, name, status, generation, phase="Failed", ready=False, reason="S3MintFailed", message=message)
        kopf.warn(body, reason="S3MintFailed", message=message)
        raise kopf.TemporaryError(message, delay=30) from None
    if new is not None:
        kube.apply(tenant_manifests.minted_s3_secret(name, new, rotation=rotation))
        kube.patch_custom_status(resources.TENANT_PLURAL, name, None, {
            "s3AccessKeyId": new.access_key_id, "s3CredentialsRotation": rotation})


def _aws_error(error: Exception) -> str:
    """The error's code and operation, never a request's parameters (they could hold a key)."""
    if isinstance(error, ClientError):
        return f"{error.operation_name}: {error.response.get('Error', {}).get('Code', 'unknown')}"
    return type(error).__name__


@kopf.on.delete(*TENANTS)
def delete_tenant(name: str, status: kopf.Status, meta: kopf.Meta, memo: kopf.Memo, body: kopf.Body,
                  **_: Any) -> None:
    """Refused (retried) while the tenant has unfinished jobs; then its namespace goes, with everything in it."""
    kube: Kube = memo.kube
    namespace = resources.tenant_namespace(name)
    jobs = kube.list_custom(resources.EMBEDDING_JOB_PLURAL, namespace)
    unfinished = [j["metadata"]["name"] for j in jobs if (j.get("status") or {}).get("phase") not in _TERMINAL]
    if unfinished:
        shown = ", ".join(sorted(unfinished)[:5]) + (" ..." if len(unfinished) > 5 else "")
        message = f"{len(unfinished)} jobs have not finished ({shown}); cancel them or wait for them to end"
        _status(kube, name, status, int(meta.get("generation") or 0), phase="Terminating", ready=False,
                reason="JobsStillRunning", message=message)
        kopf.warn(body, reason="JobsStillRunning", message=message)
        raise kopf.TemporaryError(message, delay=memo.settings.tenant_delete_retry_s)
    if memo.credentials is not None:
        try:
            memo.credentials.remove(name)  # its keys first: from here on nothing holds a working one
        except (BotoCoreError, ClientError) as error:
            raise kopf.TemporaryError(f"deleting the tenant's IAM user failed: {_aws_error(error)}", delay=30) from None
    kube.delete("v1", "Namespace", namespace)
