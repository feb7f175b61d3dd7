"""EmbeddingJobs on the real control plane with fake GPU nodes: the gang, its failures, suspension, cancel."""

from __future__ import annotations

import json

import pytest

from kembed_operator import job_manifests
from tests.builders import operator_job
from tests.cluster.fixture import Cluster, exists, wait_for
from tests.operator import harness
from tests.operator.harness import RUN_FOREVER, fail_with, job_pods, wait_phase

pytestmark = pytest.mark.cluster


def test_a_gang_runs_as_an_indexed_job_on_gpu_nodes_and_succeeds(platform: Cluster, tenant: str):
    job = operator_job("gang").with_nodes(2).with_gpus(4).create(platform, tenant.removeprefix("kembed-"))

    running = wait_phase(platform, tenant, job, "RUNNING", "SUCCEEDED", timeout_s=30)
    assert running["attempt"] == 0
    pods = job_pods(platform, tenant, job)
    assert len(pods) == 2
    assert {p.spec.node_name for p in pods} <= set(platform.gpu_nodes)
    for pod in pods:
        container = pod.spec.containers[0]
        assert container.resources.limits["nvidia.com/gpu"] == "4"
        index = pod.metadata.annotations["batch.kubernetes.io/job-completion-index"]
        assert pod.spec.hostname == f"{job}-{index}" and pod.spec.subdomain == job
        assert "--nnodes=2" in container.args and "--nproc-per-node=4" in container.args
        assert "--node-rank=$(JOB_COMPLETION_INDEX)" in container.args
        assert f"--master-addr={job}-0.{job}" in container.args
        assert pod.spec.security_context.run_as_non_root and pod.spec.automount_service_account_token is False
        assert container.security_context.allow_privilege_escalation is False
        assert container.security_context.capabilities.drop == ["ALL"]
        assert pod.spec.service_account_name == "kembed-trainer"

    done = wait_phase(platform, tenant, job, "SUCCEEDED", timeout_s=30)
    assert done["restartCount"] == 0 and done["completionTime"]
    finished = {c["type"]: c for c in done["conditions"]}["Finished"]
    assert finished["status"] == "True" and finished["reason"] == "Completed" and finished["observedGeneration"] == 1
    # One Event per phase the status showed ("Created" only if ADMITTED was written: a gang that runs within
    # first_status_delay_s goes straight to RUNNING, see test_job_runner.py).
    harness.wait_events(platform, tenant, job, "GangRunning", "Completed")
    service = platform.core().read_namespaced_service(job, tenant)
    assert service.spec.cluster_ip == "None" and service.spec.publish_not_ready_addresses
    # The trainer's config travels in the pods' annotations (a downward-API volume): no ConfigMap per job.
    config = json.loads(pods[0].metadata.annotations[job_manifests.CONFIG_ANNOTATION])
    assert config["checkpoint"]["uri"] == f"s3://kembed-test/{tenant.removeprefix('kembed-')}/{job}"
    assert not exists(lambda: platform.core().read_namespaced_config_map(job, tenant))


def test_a_one_node_job_is_only_its_batch_job(platform: Cluster, tenant: str):
    job = operator_job("single").with_gpus(1).create(platform, tenant.removeprefix("kembed-"))
    done = wait_phase(platform, tenant, job, "SUCCEEDED", "FAILED", timeout_s=30)
    assert done["phase"] == "SUCCEEDED", done
    [pod] = job_pods(platform, tenant, job)
    assert "--master-addr=127.0.0.1" in pod.spec.containers[0].args and not pod.spec.subdomain
    assert not exists(lambda: platform.core().read_namespaced_service(job, tenant))
    assert not exists(lambda: platform.core().read_namespaced_config_map(job, tenant))


def test_a_killed_pod_restarts_the_whole_gang_from_the_next_attempt(platform: Cluster, tenant: str):
    job = operator_job("restart").with_nodes(2).with_gpus(1).with_labels(**{"kembed.io/test-run-forever": "true"}).create(
        platform, tenant.removeprefix("kembed-"))
    wait_phase(platform, tenant, job, "RUNNING", timeout_s=30)
    first_gang = {p.metadata.name for p in job_pods(platform, tenant, job)}
    victim = sorted(first_gang)[1]
    # The fake kubelet ends this pod with 137 (SIGKILL, e.g. an OOM kill): retryable.
    platform.kubectl("label", "pod", "-n", tenant, victim, "kembed.io/test-fail-exit-code=137",
                     "kembed.io/test-run-forever-")

    # RESTARTING can pass between two polls, so wait for its outcome and read the reason from the Events.
    running = wait_for(lambda: (status := harness.job_status(platform, tenant, job)).get("restartCount") == 1
                       and status.get("phase") == "RUNNING" and status, timeout_s=60, what=f"{job} restarted")
    assert running["attempt"] == 1
    restarts = [e for e in harness.events_of(platform, tenant, job) if e.reason == "TrainerExitedRetryably"]
    assert restarts and "137 (SIGKILL)" in restarts[0].message
    new_gang = job_pods(platform, tenant, job)
    assert len(new_gang) == 2 and not first_gang & {p.metadata.name for p in new_gang}
    assert {p.metadata.labels["kembed.io/attempt"] for p in new_gang} == {"1"}
    assert len(platform.batch().list_namespaced_job(tenant, label_selector=f"kembed.io/job={job}").items) == 1


@pytest.mark.parametrize("exit_code", [pytest.param(2, id="bad-config"), pytest.param(1, id="crash")])
def test_a_permanent_exit_code_fails_the_job_at_once(platform: Cluster, tenant: str, exit_code: int):
    job = operator_job("permanent").with_nodes(2).with_gpus(1).with_max_restarts(3).with_labels(**fail_with(exit_code)).create(
        platform, tenant.removeprefix("kembed-"))
    failed = wait_phase(platform, tenant, job, "FAILED", "RESTARTING", timeout_s=30)
    assert failed["phase"] == "FAILED" and failed["reason"] == "TrainerExitedPermanently"
    assert f"exit code {exit_code}" in failed["message"] and failed["restartCount"] == 0


def test_retryable_failures_stop_after_max_restarts(platform: Cluster, tenant: str):
    job = operator_job("flaky").with_gpus(1).with_max_restarts(1).with_labels(**fail_with(143)).create(
        platform, tenant.removeprefix("kembed-"))
    failed = wait_phase(platform, tenant, job, "FAILED", timeout_s=60)
    assert failed["reason"] == "RestartLimitReached" and failed["restartCount"] == 1
    harness.wait_events(platform, tenant, job, "TrainerExitedRetryably", "RestartLimitReached")


def test_suspend_stops_the_pods_then_queues_and_resume_starts_the_same_attempt_again(platform: Cluster, tenant: str):
    job = operator_job("preempt").with_nodes(2).with_gpus(1).with_labels(**RUN_FOREVER).create(platform, tenant.removeprefix("kembed-"))
    wait_phase(platform, tenant, job, "RUNNING", timeout_s=30)

    harness.patch_job_spec(platform, tenant, job, suspend=True)
    wait_for(lambda: not job_pods(platform, tenant, job), timeout_s=30, what="pods stopped")
    stopped = wait_phase(platform, tenant, job, "QUEUED", timeout_s=30)  # PREEMPTED while they stopped
    assert {c["type"]: c["status"] for c in stopped["conditions"]}["Suspended"] == "True"
    harness.wait_events(platform, tenant, job, "Suspended", "Stopped")

    harness.patch_job_spec(platform, tenant, job, suspend=False)
    running = wait_phase(platform, tenant, job, "RUNNING", timeout_s=30)
    assert running["attempt"] == 0 and running["restartCount"] == 0  # a preemption is not a failure
    assert len(job_pods(platform, tenant, job)) == 2


def test_cancel_stops_the_pods_gracefully_and_ends_cancelled(platform: Cluster, tenant: str):
    job = operator_job("cancel").with_gpus(1).with_labels(**RUN_FOREVER).create(platform, tenant.removeprefix("kembed-"))
    wait_phase(platform, tenant, job, "RUNNING", timeout_s=30)
    harness.patch_job_spec(platform, tenant, job, cancel=True)
    cancelled = wait_phase(platform, tenant, job, "CANCELLED", timeout_s=30)
    assert cancelled["reason"] == "Cancelled" and cancelled["completionTime"]
    assert not [p for p in job_pods(platform, tenant, job) if p.status.phase in ("Pending", "Running")]


def test_an_unschedulable_gang_fails_with_the_schedulers_reason(platform: Cluster, tenant: str):
    # 16 GPUs on one node: no node has more than 8.
    job = operator_job("huge").with_gpus(16).create(platform, tenant.removeprefix("kembed-"))
    failed = wait_phase(platform, tenant, job, "FAILED", timeout_s=40)
    assert failed["reason"] == "Unschedulable" and "nvidia.com/gpu" in failed["message"]
    harness.wait_events(platform, tenant, job, "Unschedulable")


def test_an_invalid_spec_fails_with_the_field_at_fault(platform: Cluster, tenant: str):
    builder = operator_job("invalid").with_gpus(1)
    manifest = builder.manifest(tenant.removeprefix("kembed-"))
    manifest["spec"]["trainer"]["model"] = {"kind": "dlrm", "bottom_mlp": [16, 4]}  # must end in embedding_dim
    harness.custom(platform).create_namespaced_custom_object("kembed.io", "v1alpha1", tenant, "embeddingjobs",
                                                             manifest)
    failed = wait_phase(platform, tenant, builder.job_id, "FAILED", timeout_s=30)
    assert failed["reason"] == "InvalidSpec" and "bottom_mlp" in failed["message"]
    assert not job_pods(platform, tenant, builder.job_id)
