"""Tenants on the real control plane: what the namespace gets, quota edits in place, deletion refused while busy."""

from __future__ import annotations

import base64

import pytest
from kubernetes.client.rest import ApiException

from kembed_contract import resources
from tests.builders import operator_job
from tests.cluster.fixture import Cluster, wait_for
from tests.operator import harness
from tests.operator.harness import RUN_FOREVER, wait_phase

pytestmark = pytest.mark.cluster


def test_a_tenant_gets_an_isolated_namespace_with_quota_defaults_and_credentials(platform: Cluster,
                                                                                 operator: harness.OperatorProcess,
                                                                                 make_tenant):
    name, namespace = make_tenant(gpus=16, cpu=64, memory="256Gi")
    core = platform.core()

    labels = core.read_namespace(namespace).metadata.labels
    assert labels["kembed.io/tenant"] == name and labels["pod-security.kubernetes.io/enforce"] == "restricted"
    hard = core.read_namespaced_resource_quota("kembed-quota", namespace).spec.hard
    assert hard["requests.nvidia.com/gpu"] == "16" and hard["requests.cpu"] == "64" and hard["limits.memory"] == "256Gi"
    assert core.read_namespaced_limit_range("kembed-defaults", namespace).spec.limits[0].default_request["cpu"]
    policy = platform.kubectl("get", "networkpolicy", "kembed-isolate-tenant", "-n", namespace, "-o",
                              "jsonpath={.spec.ingress}").stdout
    assert policy == '[{"from":[{"podSelector":{}}]}]'  # same namespace only: no other tenant gets in
    account = core.read_namespaced_service_account("kembed-trainer", namespace)
    assert account.automount_service_account_token is False
    can_list = platform.kubectl("auth", "can-i", "list", "pods", "-n", namespace,
                                f"--as=system:serviceaccount:{namespace}:kembed-trainer", check=False).stdout
    assert can_list.strip() == "no"
    secret = core.read_namespaced_secret("kembed-s3", namespace)
    assert base64.b64decode(secret.data["AWS_ACCESS_KEY_ID"]).decode() == "testing"
    status = harness.read_tenant(platform, name)["status"]
    assert status["namespace"] == namespace and status["conditions"][0]["observedGeneration"] == 1


def test_a_quota_change_applies_in_place_and_the_cluster_enforces_it(platform: Cluster,
                                                                     operator: harness.OperatorProcess, make_tenant):
    name, namespace = make_tenant(gpus=2)
    harness.custom(platform).patch_cluster_custom_object(
        resources.GROUP, resources.VERSION, resources.TENANT_PLURAL, name, {"spec": {"quota": {"gpus": 1}}},
        _content_type="application/merge-patch+json")

    def gpus_hard():
        quota = platform.core().read_namespaced_resource_quota("kembed-quota", namespace)
        return quota.status.hard and quota.status.hard.get("requests.nvidia.com/gpu") == "1"

    wait_for(gpus_hard, timeout_s=30, what="quota lowered to 1 GPU")
    assert harness.read_tenant(platform, name)["status"]["observedGeneration"] == 2
    # A 2-GPU gang can no longer get its pods: it is never stuck silently, it fails with the reason.
    job = operator_job("over-quota").with_gpus(2).with_max_restarts(0).create(platform, name)
    failed = wait_phase(platform, namespace, job, "FAILED", timeout_s=60)
    assert failed["reason"] == "RestartLimitReached" and "never created" in failed["message"]


def test_deleting_a_tenant_waits_for_its_jobs_then_removes_the_namespace(platform: Cluster,
                                                                         operator: harness.OperatorProcess,
                                                                         make_tenant):
    name, namespace = make_tenant()
    job = operator_job("busy").with_gpus(1).with_labels(**RUN_FOREVER).create(platform, name)
    wait_phase(platform, namespace, job, "RUNNING", timeout_s=30)

    harness.custom(platform).delete_cluster_custom_object(resources.GROUP, resources.VERSION,
                                                          resources.TENANT_PLURAL, name)
    refused = wait_for(lambda: (harness.read_tenant(platform, name).get("status") or {}).get("phase") == "Terminating",
                       timeout_s=30, what="tenant Terminating")
    assert refused
    status = harness.read_tenant(platform, name)["status"]
    assert status["conditions"][0]["reason"] == "JobsStillRunning" and job in status["conditions"][0]["message"]
    assert platform.core().read_namespace(namespace).status.phase == "Active"

    harness.patch_job_spec(platform, namespace, job, cancel=True)

    def tenant_gone():
        try:
            harness.read_tenant(platform, name)
        except ApiException as error:
            return error.status == 404
        return False

    wait_for(tenant_gone, timeout_s=60, what="tenant deleted after its job was cancelled")

    def namespace_going():
        try:
            return platform.core().read_namespace(namespace).status.phase == "Terminating"
        except ApiException as error:
            return error.status == 404

    wait_for(namespace_going, timeout_s=30, what=f"namespace {namespace} deleted with its tenant")
