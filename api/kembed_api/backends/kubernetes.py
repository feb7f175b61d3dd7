"""The Kubernetes backend: an admitted job becomes an EmbeddingJob in its tenant's namespace; the operator runs it.

The contract with the operator is kembed_contract.resources. The API creates the per-job report-token Secret, then the
EmbeddingJob; it cancels by setting spec.cancel, preempts by setting spec.suspend (and admits a preempted job
again by clearing it); it follows the job by reading status. The operator restarts failed gangs itself (it spends
max_restarts, by kembed_contract.lifecycle's rule) and reports what it did: RESTARTING with its restartCount,
RUNNING again, PREEMPTED while a suspended gang stops, QUEUED once it has; the API's state machine follows
(kembed_api.scheduling.dispatcher), so a job reads the same on both backends. Jobs live on in the cluster when the API
restarts, so `reclaim` keeps following them instead of restarting them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any, assert_never

from kubernetes import client, config
from kubernetes.client.rest import ApiException

from kembed_api.backends.base import Exit, Launch, NotReady, Observed
from kembed_api.quota.admission import Quota
from kembed_contract import resources
from kembed_contract.lifecycle import JobState
from kembed_contract.quota import QuotaSpec, SharingSpec
from kembed_contract.spec import JobSpec, parse_quantity
from kembed_contract.storage_policy import StoragePolicy

__all__ = ["KubernetesBackend"]

def _load_client_config() -> None:
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()  # KUBECONFIG or ~/.kube/config


def _expired(read_at: float | None, ttl_s: float) -> bool:
    return read_at is None or time.monotonic() - read_at >= ttl_s


class KubernetesBackend:
    def __init__(self, *, api_client: client.ApiClient | None = None, cache_ttl_s: float = 0.5,
                 node_cache_ttl_s: float = 30.0) -> None:
        if api_client is None:
            _load_client_config()
            api_client = client.ApiClient()
        self.core = client.CoreV1Api(api_client)
        self.custom = client.CustomObjectsApi(api_client)
        self.cache_ttl_s, self.node_cache_ttl_s = cache_ttl_s, node_cache_ttl_s
        self._jobs: dict[str, dict[str, Any]] = {}
        # None until the first read: monotonic time is the machine's uptime, which may be smaller than a TTL
        # on a machine booted minutes ago (a zero here once kept a backend from ever listing).
        self._jobs_read_at: float | None = None
        self._largest_node: dict[str, float] | None = None
        self._nodes_read_at: float | None = None
        self._lock = threading.Lock()
        self._usage_shown: dict[str, dict[str, Any]] = {}  # tenant -> the usage last written into its status

    # ------------------------------------------------------------------------------------------- admission
    def _largest_node_allocatable(self) -> dict[str, float] | None:
        """The most GPUs, CPU and memory any one schedulable node offers (None if nodes cannot be read)."""
        if _expired(self._nodes_read_at, self.node_cache_ttl_s):
            try:
                nodes = self.core.list_node().items
            except ApiException:
                return None  # no permission to list nodes: leave the check to the scheduler
            largest = {"gpus": 0.0, "cpu": 0.0, "memory": 0.0}
            for node in nodes:
                if node.spec and node.spec.unschedulable:
                    continue
                allocatable = (node.status.allocatable or {}) if node.status else {}
                for key, resource in (("gpus", "nvidia.com/gpu"), ("cpu", "cpu"), ("memory", "memory")):
                    largest[key] = max(largest[key], parse_quantity(allocatable.get(resource, "0")))
            self._largest_node, self._nodes_read_at = largest, time.monotonic()
        return self._largest_node

    def check_fits(self, spec: JobSpec) -> None:
        largest = self._largest_node_allocatable()
        if not largest:
            return
        r = spec.resources
        for asked, key, field, dimension in ((r.gpus_per_node, "gpus", "gpus_per_node", QuotaSpec.dimension("gpus")),
                                             (r.cpu_per_node, "cpu", "cpu_per_node", QuotaSpec.dimension("cpu")),
                                             (r.memory_bytes_per_node, "memory", "memory_per_node",
                                              QuotaSpec.dimension("memory"))):
            if asked > largest[key]:
                raise ValueError(f"resources.{field}: each node of the job needs {dimension.in_words(asked)}, but "
                                 f"the largest node of the cluster offers {dimension.number(largest[key])}")

    def capacity(self) -> Quota:
        # The cluster itself is the limit: the namespace ResourceQuota and the scheduler enforce it.
        return Quota()

    # ------------------------------------------------------------------------------------------- tenants
    shows_tenant_usage = True

    def sync_tenant(self, name: str, quota: QuotaSpec, sharing: SharingSpec,
                    policy: StoragePolicy | None = None) -> None:
        """Create or update the tenant's Tenant resource: the API's quota and sharing, as they are (the operator
        makes the namespace's ResourceQuota of them), and its storage policy (its own folder as s3.prefix, the
        rest as storage), which reaches its trainers through it."""
        spec = resources.TenantSpec(quota=quota, sharing=sharing)
        if policy is not None:
            spec.storage = resources.TenantStorage(read=list(policy.read), write=list(policy.write),
                                                   deny=list(policy.deny))
            own = policy.own[0] if policy.own else ""
            if own.startswith("s3://"):
                spec.s3 = resources.TenantS3(prefix=own)
        manifest = resources.tenant_manifest(name, spec, labels={"app.kubernetes.io/managed-by": "kembed-api"})
        try:
            self.custom.create_cluster_custom_object(resources.GROUP, resources.VERSION, resources.TENANT_PLURAL,
                                                     manifest)
        except ApiException as error:
            if error.status != 409:
                raise
            self.custom.patch_cluster_custom_object(resources.GROUP, resources.VERSION, resources.TENANT_PLURAL,
                                                    name, {"spec": manifest["spec"]})

    def show_usage(self, name: str, usage: resources.TenantUsage) -> None:
        """Write the tenant's use, borrowing and lending into its Tenant's status (`kubectl get tenants`), when it
        changed since the last write (the time it was counted aside)."""
        shown = usage.model_dump(mode="json", by_alias=True, exclude={"time"})
        if self._usage_shown.get(name) == shown:
            return
        try:
            self.custom.patch_cluster_custom_object_status(
                resources.GROUP, resources.VERSION, resources.TENANT_PLURAL, name,
                {"status": {"usage": usage.model_dump(mode="json", by_alias=True)}})
        except ApiException as error:
            if error.status != 404:  # not synced yet: shown at the next change after it is
                raise
            return
        self._usage_shown[name] = shown

    # ------------------------------------------------------------------------------------------- lifecycle
    def start(self, launch: Launch) -> dict[str, Any]:
        namespace = resources.tenant_namespace(launch.tenant)
        try:
            self.core.read_namespace(namespace)
        except ApiException as error:
            if error.status == 404:
                raise NotReady(f"namespace {namespace} does not exist yet (is the Tenant reconciled?)") from None
            raise
        secret_name = f"{launch.job_id}-report-token"
        secret = {"metadata": {"name": secret_name, "labels": {"kembed.io/job": launch.job_id}},
                  "stringData": {"token": launch.report_token}}
        try:
            self.core.create_namespaced_secret(namespace, secret)
        except ApiException as error:
            if error.status != 409:
                raise
            self.core.patch_namespaced_secret(secret_name, namespace, {"stringData": secret["stringData"]})
        manifest = resources.embedding_job_manifest(
            launch.job_id, launch.tenant, launch.spec, report_url=launch.report_url,
            report_token_secret=secret_name, labels={"app.kubernetes.io/managed-by": "kembed-api"},
            storage_budget_bytes=launch.storage_budget_bytes,
        )
        try:
            created = self.custom.create_namespaced_custom_object(resources.GROUP, resources.VERSION, namespace,
                                                                  resources.EMBEDDING_JOB_PLURAL, manifest)
        except ApiException as error:
            if error.status != 409:
                raise
            # Already there: created by an earlier, interrupted attempt (follow that one), or preempted and now
            # admitted again (its gang starts anew and resumes from its checkpoint).
            created = self.custom.patch_namespaced_custom_object(
                resources.GROUP, resources.VERSION, namespace, resources.EMBEDDING_JOB_PLURAL, launch.job_id,
                {"spec": {"suspend": False, "report_url": launch.report_url,
                          "storage_budget_bytes": launch.storage_budget_bytes}})
        self._remember(created)
        return {"namespace": namespace, "name": launch.job_id, "attempt": launch.attempt}

    def _remember(self, obj: dict[str, Any]) -> None:
        """The EmbeddingJob as the API server answered a write of ours: newer than the pass's cached list, which
        must not show a later poll the spec from before that write."""
        with self._lock:
            self._jobs[obj["metadata"]["name"]] = obj

    def _refresh(self) -> None:
        """One cluster-wide list per dispatcher pass instead of one read per job."""
        with self._lock:
            if not _expired(self._jobs_read_at, self.cache_ttl_s):
                return
            listed = self.custom.list_cluster_custom_object(resources.GROUP, resources.VERSION,
                                                            resources.EMBEDDING_JOB_PLURAL)
            self._jobs = {item["metadata"]["name"]: item for item in listed.get("items", [])}
            self._jobs_read_at = time.monotonic()

    def _read_one(self, job_id: str) -> dict[str, Any] | None:
        """The EmbeddingJob read now (by name, across namespaces), bypassing the cached list: a job created
        after the list was taken, by another replica or before a restart, is missing from it but not lost."""
        listed = self.custom.list_cluster_custom_object(resources.GROUP, resources.VERSION,
                                                        resources.EMBEDDING_JOB_PLURAL,
                                                        field_selector=f"metadata.name={job_id}")
        items = listed.get("items", [])
        if not items:
            return None
        self._remember(items[0])
        return items[0]

    def _job(self, job_id: str) -> dict[str, Any] | None:
        self._refresh()
        return self._jobs.get(job_id) or self._read_one(job_id)

    def poll(self, job_id: str) -> Exit | Observed | None:
        obj = self._job(job_id)
        if obj is None:
            return Exit(succeeded=False, retryable=True, reason="Lost",
                        message="the EmbeddingJob disappeared from the cluster")
        status = resources.EmbeddingJobStatus.from_object(obj)
        detail = f"{status.reason or ''}: {status.message or ''}".strip(": ")
        generation = obj["metadata"].get("generation")
        # The operator has not acted on the latest spec yet (say, the API just admitted a preempted job again):
        # a live status is about the spec before, and its "suspended and stopped" would requeue the job just
        # started, again and again, each time with a new report token. A final one is final whatever the spec.
        stale = status.observed_generation is not None and bool(generation) and status.observed_generation < generation
        match status.phase:
            case None | JobState.ADMITTED:
                return None  # not yet seen by the operator, or its pods are starting
            case JobState.SUCCEEDED:
                return Exit(succeeded=True, retryable=False, reason="Completed", message=detail)
            case JobState.FAILED | JobState.CANCELLED:
                # The operator already spent the job's restarts; a failure here is final.
                return Exit(succeeded=False, retryable=False, reason=status.reason or "Failed", message=detail)
            case JobState.RUNNING | JobState.RESTARTING | JobState.PREEMPTED | JobState.QUEUED:
                if stale:
                    return None
                return Observed(state=status.phase, reason=status.reason or status.phase.title(),
                                message=status.message or "", restart_count=status.restart_count)
            case unknown:
                assert_never(unknown)

    def stop(self, job_id: str) -> None:
        self._patch_spec(job_id, {"cancel": True})

    def _patch_spec(self, job_id: str, fields: dict[str, Any]) -> None:
        obj = self._job(job_id)
        if obj is None:
            return
        self._remember(self.custom.patch_namespaced_custom_object(
            resources.GROUP, resources.VERSION, obj["metadata"]["namespace"], resources.EMBEDDING_JOB_PLURAL, job_id,
            {"spec": fields}))

    def preempt(self, job_id: str) -> None:
        self._patch_spec(job_id, {"suspend": True})  # the batch Job is suspended: pods get SIGTERM and save

    def kill_overdue(self) -> None:
        pass  # the operator enforces the pods' termination grace

    def watch_exits(self, wake) -> None:
        pass  # a pod's end reaches the API through the EmbeddingJob's status, read at each pass

    def reclaim(self, job_id: str, backend_state: dict[str, Any]) -> bool:
        return False  # the job runs on in the cluster; the dispatcher simply follows it again

    def log_bytes(self, job_id: str) -> int:
        return 0  # pods' logs are the cluster's (its kubelets rotate them), not kept by kembed

    def read_logs(self, job_id: str, *, tail_lines: int | None = None) -> str:
        obj = self._job(job_id)
        if obj is None:
            return ""
        namespace = obj["metadata"]["namespace"]
        pods = self.core.list_namespaced_pod(namespace, label_selector=f"kembed.io/job={job_id}").items
        parts = []
        for pod in sorted(pods, key=lambda p: p.metadata.name):
            try:
                text = self.core.read_namespaced_pod_log(pod.metadata.name, namespace, tail_lines=tail_lines)
            except ApiException as error:
                text = f"(no logs: {error.reason})\n"
            parts.append(f"=== pod {pod.metadata.name} ===\n{text}")
        return "".join(parts)

    def stream_logs(self, job_id: str) -> Iterator[bytes]:
        # Pod by pod: the kubelet bounds each container's log (containerLogMaxSize, 10 MiB by default).
        yield self.read_logs(job_id).encode()

    def shutdown(self) -> None:
        pass  # nothing runs inside the API process
