"""Kopf handlers for EmbeddingJob: one runner (daemon) per unfinished job, and the watch feeds of its children."""

from __future__ import annotations

from typing import Any

import kopf

from kembed_contract import resources
from kembed_operator import job_state
from kembed_operator.job_runner import JobRunner
from kembed_operator.views import JOB_LABEL

EMBEDDING_JOBS = (resources.GROUP, resources.VERSION, resources.EMBEDDING_JOB_PLURAL)


@kopf.index(resources.GROUP, resources.VERSION, resources.TENANT_PLURAL)
def tenant_s3_prefixes(name: str, spec: kopf.Spec, **_: Any) -> dict[str, str | None]:
    """Tenant name -> its S3 prefix, where jobs that name no checkpoint.uri checkpoint."""
    return {name: (spec.get("s3") or {}).get("prefix")}


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
                            tenant_s3_prefixes: kopf.Index, logger: Any, **_: Any) -> None:
    def s3_prefix_of(tenant: str) -> str | None:
        return next(iter(tenant_s3_prefixes.get(tenant, [])), None)

    runner = JobRunner(kube=memo.kube, observed=memo.observed, settings=memo.settings, body=body,
                       s3_prefix_of=s3_prefix_of, logger=logger)
    await runner.run(stopped)
