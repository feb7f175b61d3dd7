"""Kopf handlers for EmbeddingJob: one runner (daemon) per unfinished job, and the watch feeds of its children."""

from __future__ import annotations

import copy
from typing import Any

import kopf
import pydantic

from kembed_contract import resources
from kembed_contract.storage_policy import StoragePolicy
from kembed_operator import job_state
from kembed_operator.job_runner import JobRunner
from kembed_operator.views import JOB_LABEL

EMBEDDING_JOBS = (resources.GROUP, resources.VERSION, resources.EMBEDDING_JOB_PLURAL)


@kopf.index(resources.GROUP, resources.VERSION, resources.TENANT_PLURAL)
def tenant_s3_prefixes(name: str, spec: kopf.Spec, **_: Any) -> dict[str, str | None]:
    """Tenant name -> its S3 prefix, where jobs that name no checkpoint.uri checkpoint."""
    return {name: (spec.get("s3") or {}).get("prefix")}


@kopf.index(resources.GROUP, resources.VERSION, resources.TENANT_PLURAL)
def tenant_specs(name: str, spec: kopf.Spec, **_: Any) -> dict[str, dict[str, Any]]:
    """Tenant name -> its spec: its storage policy is built from it when its jobs start."""
    return {name: copy.deepcopy(dict(spec))}


def storage_policy(tenant: str, tenant_specs: kopf.Index, tenant_s3_prefixes: kopf.Index) -> str:
    """The storage policy a tenant's trainers enforce, as JSON: its s3.prefix and storage section, never another
    tenant's prefix. A tenant without a valid Tenant gets a policy that allows nothing (fail closed)."""
    raw = next(iter(tenant_specs.get(tenant, [])), None)
    try:
        spec = resources.TenantSpec.model_validate(raw)
        others = [p for name, prefixes in tenant_s3_prefixes.items() if name != tenant for p in prefixes if p]
        return resources.tenant_storage_policy(spec, other_prefixes=others).to_json()
    except (pydantic.ValidationError, ValueError):
        return StoragePolicy().to_json()


# Async on purpose: a sync handler runs in Kopf's thread pool (a thread hop per watch event, thousands a minute at
# scale), and `Observed` wakes the runners through asyncio.Events, which must be set from the event loop's thread.
@kopf.on.event("batch", "v1", "jobs", labels={JOB_LABEL: kopf.PRESENT})
async def batch_job_changed(type: str | None, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    memo.observed.record_job(type, dict(body))


@kopf.on.event("", "v1", "pods", labels={JOB_LABEL: kopf.PRESENT})
async def pod_changed(type: str | None, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    memo.observed.record_pod(type, dict(body))


def _not_cleaned_up(status: kopf.Status, **_: Any) -> bool:
    return not job_state.is_cleaned_up(dict(status))


@kopf.daemon(*EMBEDDING_JOBS, when=_not_cleaned_up, cancellation_timeout=10, backoff=5)
async def run_embedding_job(body: kopf.Body, memo: kopf.Memo, stopped: kopf.DaemonStopped,
                            tenant_s3_prefixes: kopf.Index, tenant_specs: kopf.Index, logger: Any,
                            **_: Any) -> None:
    def s3_prefix_of(tenant: str) -> str | None:
        return next(iter(tenant_s3_prefixes.get(tenant, [])), None)

    runner = JobRunner(kube=memo.kube, observed=memo.observed, settings=memo.settings, body=body,
                       s3_prefix_of=s3_prefix_of, logger=logger,
                       storage_policy_of=lambda tenant: storage_policy(tenant, tenant_specs, tenant_s3_prefixes))
    await runner.run(stopped)
