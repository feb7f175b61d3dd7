"""Running the operator against the test control plane exactly as the Helm chart installs it.

The operator is a real `python -m kembed_operator` process that authenticates as the chart's operator
ServiceAccount (a token from the TokenRequest API, with only the chart's RBAC rules), so any missing permission
fails the tests. Builders for Tenants and EmbeddingJobs, and waits on their status, live here too.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import uuid
from typing import Any

import yaml
from kubernetes import client
from kubernetes.client.rest import ApiException

from kembed_contract import crds, resources
from kembed_contract.lifecycle import TERMINAL_STATES
from kembed_contract.quota import QuotaSpec
from tests.cluster.fixture import Cluster, exists, wait_for

REPO = pathlib.Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "kembed"
PLATFORM_NAMESPACE = "kembed-system"
RELEASE = "kembed"
OPERATOR_SA = f"{RELEASE}-operator"
S3_SOURCE_SECRET = "kembed-s3-credentials"
GPU_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
TERMINAL = {s.value for s in TERMINAL_STATES}


def install_platform(cluster: Cluster) -> None:
    """CRDs, the operator's ServiceAccount and RBAC from the chart, and an S3 credentials Secret to copy."""
    manifests = yaml.safe_dump_all(crds.render_crds())
    subprocess.run([str(cluster.kubectl_path), "apply", "--server-side", "-f", "-"], input=manifests, text=True,
                   env=cluster.env, check=True, capture_output=True)
    if not exists(lambda: cluster.core().read_namespace(PLATFORM_NAMESPACE)):
        cluster.create_namespace(PLATFORM_NAMESPACE)
    rendered = cluster.helm(
        "template", RELEASE, str(CHART), "--namespace", PLATFORM_NAMESPACE, "--kube-version", "1.35.4",
        "--set", "s3.bucket=kembed-test", "--set", f"s3.credentials.existingSecret={S3_SOURCE_SECRET}",
        "--show-only", "templates/operator-rbac.yaml", "--show-only", "templates/crds/crd-clusterkopfpeerings.yaml",
    ).stdout
    subprocess.run([str(cluster.kubectl_path), "apply", "-n", PLATFORM_NAMESPACE, "-f", "-"], input=rendered,
                   text=True, env=cluster.env, check=True, capture_output=True)
    # A new CRD answers 429 "storage is (re)initializing" for a moment: operators started then would see errors
    # no real installation (CRDs long in place) ever shows them.
    for resource in ("tenants.kembed.io", "embeddingjobs.kembed.io", "clusterkopfpeerings.kopf.dev"):
        wait_for(lambda r=resource: cluster.kubectl("get", r, "-A", check=False).returncode == 0,
                 timeout_s=30, what=f"{resource} served")
    secret = {"metadata": {"name": S3_SOURCE_SECRET},
              "stringData": {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}}
    if not exists(lambda: cluster.core().read_namespaced_secret(S3_SOURCE_SECRET, PLATFORM_NAMESPACE)):
        cluster.core().create_namespaced_secret(PLATFORM_NAMESPACE, secret)


def service_account_kubeconfig(cluster: Cluster, path: pathlib.Path, *, account: str = OPERATOR_SA,
                               namespace: str = PLATFORM_NAMESPACE) -> pathlib.Path:
    """A kubeconfig that *is* the operator's ServiceAccount (bearer token), not the admin."""
    token = cluster.core().create_namespaced_service_account_token(
        account, namespace, {"spec": {"expirationSeconds": 24 * 3600}}).status.token
    admin = yaml.safe_load(cluster.kubeconfig.read_text())
    admin["users"] = [{"name": account, "user": {"token": token}}]
    admin["contexts"][0]["context"]["user"] = account
    path.write_text(json.dumps(admin))
    path.chmod(0o600)
    return path


class OperatorProcess:
    """One operator replica as a child process, with its log in a file."""

    def __init__(self, cluster: Cluster, work_dir: pathlib.Path, name: str = "operator", *,
                 account: str = OPERATOR_SA, namespace: str = PLATFORM_NAMESPACE, **settings: Any) -> None:
        self.cluster, self.name = cluster, name
        self.log_path = work_dir / f"{name}-{uuid.uuid4().hex[:6]}.log"
        self.kubeconfig = service_account_kubeconfig(cluster, work_dir / f"{name}.kubeconfig", account=account,
                                                     namespace=namespace)
        defaults = {
            # A peering of its own: a replica of an earlier test that died without leaving it (kill -9) stays
            # there for peering_lifetime_s and would pause this one. Replicas of one test share theirs (test_ha).
            "namespace": namespace, "peering_name": f"kembed-test-{uuid.uuid4().hex[:6]}", "peering_lifetime_s": 15,
            "health_port": 0, "s3_credentials_secret": S3_SOURCE_SECRET,
            # Every fake node is a tainted GPU node: CPU-only jobs need the toleration too.
            "trainer_tolerations": [GPU_TOLERATION],
            "unschedulable_timeout_s": 4, "image_pull_timeout_s": 4, "rendezvous_timeout_s": 30,
            "ttl_after_finished_s": 3600, "resync_interval_s": 2, "progress_interval_s": 2,
            "gang_failure_settle_s": 3, "stop_grace_s": 20, "tenant_delete_retry_s": 1,
        }
        self.settings = {**defaults, **settings}
        self.process: subprocess.Popen | None = None

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("KEMBED_OPERATOR_")}
        env["KUBECONFIG"] = str(self.kubeconfig)
        for key, value in self.settings.items():
            env[f"KEMBED_OPERATOR_{key.upper()}"] = value if isinstance(value, str) else json.dumps(value)
        return env

    def start(self) -> OperatorProcess:
        log = open(self.log_path, "ab")  # noqa: SIM115 - the child writes to it until stopped
        self.process = subprocess.Popen([sys.executable, "-m", "kembed_operator"], env=self.env(), stdout=log,
                                        stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True)
        log.close()
        return self

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def kill9(self) -> None:
        os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=10)

    def stop(self) -> None:
        if self.alive():
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=10)

    @property
    def priority(self) -> int | None:
        """The Kopf peering priority this replica drew (it logs it at start-up); the highest one is active."""
        match = re.search(r"\(priority (\d+)\)", self.log())
        return int(match.group(1)) if match else None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def forbidden_lines(self) -> list[str]:
        """Lines where the API server refused the operator something: the chart's RBAC lacks a rule. (A namespace
        being deleted refuses new objects with a 403 too, to any user: that is no missing rule.)"""
        return [line for line in self.log().splitlines()
                if "403" in line and "orbidden" in line and "because it is being terminated" not in line]


# ------------------------------------------------------------------------------------------------ builders
def tenant_name() -> str:
    return f"t{uuid.uuid4().hex[:8]}"


def create_tenant(cluster: Cluster, name: str, *, gpus: int = 32, cpu: float = 400, memory: str = "2000Gi",
                  max_running_jobs: int = 200) -> str:
    spec = resources.TenantSpec(
        quota=QuotaSpec(gpus=gpus, cpu=cpu, memory=memory, max_running_jobs=max_running_jobs),
        s3=resources.TenantS3(prefix=f"s3://kembed-test/{name}"))
    custom(cluster).create_cluster_custom_object(resources.GROUP, resources.VERSION, resources.TENANT_PLURAL,
                                                  resources.tenant_manifest(name, spec))
    wait_for(lambda: (read_tenant(cluster, name).get("status") or {}).get("phase") == "Ready", timeout_s=30,
             what=f"tenant {name} Ready")
    return resources.tenant_namespace(name)


def remove_tenant(cluster: Cluster, name: str, *, timeout_s: float = 60) -> None:
    """A test's clean-up, whether an operator still runs or not: the Tenant, its EmbeddingJobs and its namespace go
    at once (finalizers dropped, no waiting for jobs to end), and it returns only when no pod of the tenant is left,
    so nothing of it holds a node, a GPU or an operator's attention in the tests after it."""
    api, core = custom(cluster), cluster.core()
    namespace = resources.tenant_namespace(name)
    no_finalizers = {"metadata": {"finalizers": []}}
    merge = {"_content_type": "application/merge-patch+json"}
    # The Tenant first, so that no operator makes its namespace again.
    with contextlib.suppress(ApiException):
        api.delete_cluster_custom_object(resources.GROUP, resources.VERSION, resources.TENANT_PLURAL, name)
    with contextlib.suppress(ApiException):
        api.patch_cluster_custom_object(resources.GROUP, resources.VERSION, resources.TENANT_PLURAL, name,
                                        no_finalizers, **merge)
    cluster.delete_namespace(namespace)

    def gone() -> bool:
        # The namespace controller gets to everything in the end, but slowly on a busy machine: delete the jobs
        # here, drop the finalizers that an operator (EmbeddingJobs) or the Job controller (their pods, whose
        # batch Job is gone) would be slow to take off, until nothing is left.
        jobs = api.list_namespaced_custom_object(resources.GROUP, resources.VERSION, namespace,
                                                 resources.EMBEDDING_JOB_PLURAL)["items"]
        for job in jobs:
            with contextlib.suppress(ApiException):
                api.delete_namespaced_custom_object(resources.GROUP, resources.VERSION, namespace,
                                                    resources.EMBEDDING_JOB_PLURAL, job["metadata"]["name"])
            with contextlib.suppress(ApiException):
                api.patch_namespaced_custom_object(resources.GROUP, resources.VERSION, namespace,
                                                   resources.EMBEDDING_JOB_PLURAL, job["metadata"]["name"],
                                                   no_finalizers, **merge)
        pods = core.list_namespaced_pod(namespace).items
        for pod in pods:
            with contextlib.suppress(ApiException):
                core.delete_namespaced_pod(pod.metadata.name, namespace)
            if pod.metadata.deletion_timestamp and pod.metadata.finalizers:
                with contextlib.suppress(ApiException):
                    core.patch_namespaced_pod(pod.metadata.name, namespace, no_finalizers, **merge)
        return not jobs and not pods

    try:
        wait_for(gone, timeout_s=timeout_s, interval_s=0.5, what=f"tenant {name}'s jobs and pods gone")
    except TimeoutError as error:
        jobs = api.list_namespaced_custom_object(resources.GROUP, resources.VERSION, namespace,
                                                 resources.EMBEDDING_JOB_PLURAL)["items"]
        pods = core.list_namespaced_pod(namespace).items
        left = [(j["metadata"]["name"], j["metadata"].get("finalizers"), j["metadata"].get("deletionTimestamp"))
                for j in jobs] + [(p.metadata.name, p.metadata.finalizers, p.metadata.deletion_timestamp,
                                   p.status.phase, p.spec.node_name) for p in pods]
        raise TimeoutError(f"{error}; left: {left[:6]}") from None


def fail_with(code: int) -> dict[str, str]:
    return {"kembed.io/test-fail-exit-code": str(code)}


RUN_FOREVER = {"kembed.io/test-run-forever": "true"}


# ------------------------------------------------------------------------------------------------ reading
def custom(cluster: Cluster) -> client.CustomObjectsApi:
    return client.CustomObjectsApi(cluster._shared_client())


def read_tenant(cluster: Cluster, name: str) -> dict[str, Any]:
    return custom(cluster).get_cluster_custom_object(resources.GROUP, resources.VERSION, resources.TENANT_PLURAL,
                                                     name)


def read_job(cluster: Cluster, namespace: str, name: str) -> dict[str, Any]:
    return custom(cluster).get_namespaced_custom_object(resources.GROUP, resources.VERSION, namespace,
                                                        resources.EMBEDDING_JOB_PLURAL, name)


def patch_job_spec(cluster: Cluster, namespace: str, name: str, **fields: Any) -> None:
    custom(cluster).patch_namespaced_custom_object(resources.GROUP, resources.VERSION, namespace,
                                                   resources.EMBEDDING_JOB_PLURAL, name, {"spec": fields},
                                                   _content_type="application/merge-patch+json")


def job_status(cluster: Cluster, namespace: str, name: str) -> dict[str, Any]:
    return read_job(cluster, namespace, name).get("status") or {}


def wait_phase(cluster: Cluster, namespace: str, name: str, *phases: str, timeout_s: float = 60) -> dict[str, Any]:
    def reached():
        status = job_status(cluster, namespace, name)
        return status if status.get("phase") in phases else None

    try:
        return wait_for(reached, timeout_s=timeout_s, interval_s=0.3, what=f"job {name} in {phases}")
    except TimeoutError as error:
        raise TimeoutError(f"{error}; last status: {job_status(cluster, namespace, name)}") from None


def job_pods(cluster: Cluster, namespace: str, name: str) -> list[client.V1Pod]:
    return cluster.core().list_namespaced_pod(namespace, label_selector=f"kembed.io/job={name}").items


def events_of(cluster: Cluster, namespace: str, name: str) -> list[client.CoreV1Event]:
    return cluster.core().list_namespaced_event(
        namespace, field_selector=f"involvedObject.kind=EmbeddingJob,involvedObject.name={name}").items


def wait_events(cluster: Cluster, namespace: str, name: str, *reasons: str,
                timeout_s: float = 20) -> list[client.CoreV1Event]:
    """The job's Events once all `reasons` are among them. Events are posted after the status write they
    describe (Kopf's poster queue), so a test that has just seen a phase may not see its Event yet."""
    def posted():
        events = events_of(cluster, namespace, name)
        return events if set(reasons) <= {e.reason for e in events} else None

    try:
        return wait_for(posted, timeout_s=timeout_s, interval_s=0.3, what=f"events {reasons} of {name}")
    except TimeoutError as error:
        seen = [e.reason for e in events_of(cluster, namespace, name)]
        raise TimeoutError(f"{error}; events seen: {seen}") from None
