"""The test control plane does what later tests rely on: GPU scheduling, quota, pods really run locally."""

from __future__ import annotations

import pathlib
import signal
import sys
import textwrap
from collections.abc import Iterator

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException

from tests.cluster import controlplane
from tests.cluster.fixture import Cluster, NodePool, wait_for

pytestmark = pytest.mark.cluster

CHART = pathlib.Path(__file__).parent / "chart" / "hello"
COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"


def gpu_job(name: str, *, completions: int, gpus: int, run_duration: str, pool: NodePool) -> dict:
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name},
        "spec": {
            "completionMode": "Indexed",
            "completions": completions,
            "parallelism": completions,
            "backoffLimit": 0,
            "template": {
                "metadata": {"annotations": {"kembed.io/test-run-duration": run_duration}},
                "spec": {
                    "restartPolicy": "Never",
                    "nodeSelector": pool.node_selector,
                    "tolerations": pool.tolerations,
                    "containers": [
                        {
                            "name": "trainer",
                            "image": "kembed/trainer",
                            "resources": {"limits": {controlplane.GPU_RESOURCE: str(gpus)}},
                        }
                    ],
                },
            },
        },
    }


def gpu_pod(name: str, *, gpus: int, labels: dict[str, str] | None = None) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": labels or {}},
        "spec": {
            "restartPolicy": "Never",
            "containers": [
                {
                    "name": "main",
                    "image": "kembed/trainer",
                    "resources": {"limits": {controlplane.GPU_RESOURCE: str(gpus)}},
                }
            ],
        },
    }


@pytest.fixture
def node_pool(cluster: Cluster) -> Iterator[NodePool]:
    """Two GPU nodes of the test's own: whole free nodes, whatever other tests left running on the shared ones."""
    pool = cluster.create_node_pool(2)
    yield pool
    cluster.delete_node_pool(pool)


def test_indexed_job_takes_two_whole_gpu_nodes_and_quota_refuses_a_third(cluster: Cluster, namespace: str,
                                                                          node_pool: NodePool):
    cluster.create_quota(namespace, {f"requests.{controlplane.GPU_RESOURCE}": "16"})
    core, batch = cluster.core(), cluster.batch()
    batch.create_namespaced_job(namespace, gpu_job("train", completions=2, gpus=8, run_duration="10s",
                                                   pool=node_pool))

    def both_running():
        pods = core.list_namespaced_pod(namespace, label_selector="job-name=train").items
        return pods if len(pods) == 2 and all(p.status.phase == "Running" for p in pods) else None

    pods = wait_for(both_running, timeout_s=30, what="both job pods Running")
    nodes = {pod.spec.node_name for pod in pods}
    assert nodes == set(node_pool.nodes), nodes  # 8 GPUs each: one whole node per pod
    indexes = {pod.metadata.annotations[COMPLETION_INDEX] for pod in pods}
    assert indexes == {"0", "1"}

    # The quota (16 GPUs) is used up while the job runs: the API server refuses a third 8-GPU pod outright.
    with pytest.raises(ApiException) as refused:
        core.create_namespaced_pod(namespace, gpu_pod("third", gpus=8))
    assert refused.value.status == 403
    assert "exceeded quota" in refused.value.body

    def complete():
        conditions = batch.read_namespaced_job_status("train", namespace).status.conditions or []
        return any(c.type == "Complete" and c.status == "True" for c in conditions)

    wait_for(complete, timeout_s=60, what="job train Complete")
    assert batch.read_namespaced_job("train", namespace).status.succeeded == 2


def test_failure_label_fails_a_fake_pod_with_that_exit_code(cluster: Cluster, namespace: str):
    core = cluster.core()
    core.create_namespaced_pod(
        namespace, gpu_pod("oom", gpus=1, labels={"kembed.io/test-fail-exit-code": "137"})
    )
    pod = cluster.wait_pod_phase(namespace, "oom", timeout_s=30)
    assert pod.status.phase == "Failed"
    assert pod.status.container_statuses[0].state.terminated.exit_code == 137


def test_run_forever_label_keeps_a_fake_pod_running(cluster: Cluster, namespace: str):
    core = cluster.core()
    pod = gpu_pod("forever", gpus=1, labels={"kembed.io/test-run-forever": "true"})
    pod["metadata"]["annotations"] = {"kembed.io/test-run-duration": "0s"}
    core.create_namespaced_pod(namespace, pod)
    cluster.wait_pod_phase(namespace, "forever", ("Running",), timeout_s=30)
    with pytest.raises(TimeoutError):
        cluster.wait_pod_phase(namespace, "forever", timeout_s=3)


def test_rbac_governs_a_service_account(cluster: Cluster, namespace: str):
    core = cluster.core()
    core.create_namespaced_service_account(namespace, {"metadata": {"name": "reader"}})
    reader = client.CoreV1Api(cluster.service_account_client(namespace, "reader"))
    with pytest.raises(ApiException) as forbidden:
        reader.list_namespaced_pod(namespace)
    assert forbidden.value.status == 403

    rbac = client.RbacAuthorizationV1Api(cluster.api_client())
    rbac.create_namespaced_role(
        namespace,
        {
            "metadata": {"name": "pod-reader"},
            "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]}],
        },
    )
    rbac.create_namespaced_role_binding(
        namespace,
        {
            "metadata": {"name": "reader-reads-pods"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "pod-reader"},
            "subjects": [{"kind": "ServiceAccount", "name": "reader", "namespace": namespace}],
        },
    )

    def allowed():
        try:
            return reader.list_namespaced_pod(namespace) is not None
        except ApiException as error:
            if error.status != 403:
                raise
            return False  # the RBAC authorizer sees a new binding within moments, not at once

    wait_for(allowed, timeout_s=10, what="the RoleBinding to take effect")
    with pytest.raises(ApiException) as still_forbidden:
        reader.list_namespaced_pod("default")
    assert still_forbidden.value.status == 403


def test_local_pod_runs_python_for_real_and_reports_exit_code_and_logs(cluster: Cluster, namespace: str):
    script = "import os, sys; print('hello from', os.environ['POD_NAME'], 'in', sys.prefix); sys.exit(3)"
    pod = cluster.local_pod("hello", ["python", "-c", script])
    pod["spec"]["containers"][0]["env"] = [
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
    ]
    core = cluster.core()
    core.create_namespaced_pod(namespace, pod)

    finished = cluster.wait_pod_phase(namespace, "hello", timeout_s=60)
    assert finished.spec.node_name == controlplane.LOCAL_NODE_NAME
    assert finished.status.phase == "Failed"
    assert finished.status.container_statuses[0].state.terminated.exit_code == 3
    logs = cluster.pod_log(namespace, "hello")
    # The kubelet runs `python` as its own interpreter: the venv this test run uses (not necessarily the checkout's).
    assert logs.strip() == f"hello from hello in {sys.prefix}"
    assert cluster.kubectl("logs", "-n", namespace, "hello").stdout == logs


def test_local_indexed_job_gets_config_files_index_and_cluster_dns(cluster: Cluster, namespace: str):
    """What a trainer pod of the operator needs: a ConfigMap file, its completion index, its peers' names."""
    core, batch = cluster.core(), cluster.batch()
    core.create_namespaced_config_map(
        namespace,
        {
            "metadata": {"name": "trainer-config"},
            "data": {"config.yaml": "api: http://kembed-api.kembed.svc.cluster.local:8000\n"},
        },
    )
    script = textwrap.dedent("""
        import os, sys
        print('index', os.environ['JOB_COMPLETION_INDEX'], 'master', os.environ['MASTER_ADDR'])
        print(open(sys.argv[2]).read().strip())
    """)
    job = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": "trainer"},
        "spec": {
            "completionMode": "Indexed",
            "completions": 2,
            "parallelism": 2,
            "backoffLimit": 0,
            "template": {
                "spec": {
                    **cluster.local_node_placement(),
                    "restartPolicy": "Never",
                    "subdomain": "trainer",
                    "volumes": [{"name": "config", "configMap": {"name": "trainer-config"}}],
                    "containers": [
                        {
                            "name": "trainer",
                            "image": "kembed/trainer",
                            "command": ["python", "-c", script, "--config", "/etc/kembed/config.yaml"],
                            "env": [
                                {"name": "MASTER_ADDR", "value": "trainer-0.trainer"},
                                {
                                    "name": "JOB_COMPLETION_INDEX",
                                    "valueFrom": {
                                        "fieldRef": {
                                            "fieldPath": f"metadata.annotations['{COMPLETION_INDEX}']"
                                        }
                                    },
                                },
                            ],
                            "volumeMounts": [{"name": "config", "mountPath": "/etc/kembed"}],
                        }
                    ],
                }
            },
        },
    }
    batch.create_namespaced_job(namespace, job)

    def complete():
        status = batch.read_namespaced_job_status("trainer", namespace).status
        return status.succeeded == 2 or status.failed

    wait_for(complete, timeout_s=60, what="local job trainer finished")
    pods = core.list_namespaced_pod(namespace, label_selector="job-name=trainer").items
    logs = sorted(cluster.pod_log(namespace, p.metadata.name) for p in pods)
    assert logs == [f"index {i} master 127.0.0.1\napi: http://127.0.0.1:8000\n" for i in (0, 1)]


def test_a_local_pod_waits_for_a_config_map_created_after_it(cluster: Cluster, namespace: str):
    core = cluster.core()
    pod = cluster.local_pod("late", ["python", "-c", "import os; print(os.environ['GREETING'])"])
    pod["spec"]["containers"][0]["env"] = [
        {"name": "GREETING", "valueFrom": {"configMapKeyRef": {"name": "late-config", "key": "greeting"}}}
    ]
    core.create_namespaced_pod(namespace, pod)
    wait_for(
        lambda: (
            "waiting for a ConfigMap" in (core.read_namespaced_pod("late", namespace).status.message or "")
        ),
        timeout_s=60,
        what="the kubelet to report the missing ConfigMap",
    )
    assert core.read_namespaced_pod("late", namespace).status.phase == "Pending"

    core.create_namespaced_config_map(
        namespace, {"metadata": {"name": "late-config"}, "data": {"greeting": "hi"}}
    )
    assert cluster.wait_pod_phase(namespace, "late", timeout_s=60).status.phase == "Succeeded"
    assert cluster.pod_log(namespace, "late") == "hi\n"


def test_deleting_a_local_pod_sends_sigterm_to_its_processes(cluster: Cluster, namespace: str, tmp_path):
    marker = tmp_path / "got-sigterm"
    script = textwrap.dedent(f"""
        import pathlib, signal, sys, time
        def on_term(signum, frame):
            pathlib.Path({str(marker)!r}).write_text(str(signum))
            sys.exit(0)
        signal.signal(signal.SIGTERM, on_term)
        print('ready', flush=True)
        time.sleep(600)
    """)
    core = cluster.core()
    core.create_namespaced_pod(namespace, cluster.local_pod("sleeper", ["python", "-c", script]))
    cluster.wait_pod_phase(namespace, "sleeper", ("Running",), timeout_s=60)
    wait_for(lambda: "ready" in cluster.pod_log(namespace, "sleeper"), timeout_s=60, what="ready")

    core.delete_namespaced_pod("sleeper", namespace, grace_period_seconds=20)

    def gone():
        try:
            core.read_namespaced_pod("sleeper", namespace)
        except ApiException as error:
            return error.status == 404
        return False

    wait_for(gone, timeout_s=60, what="pod sleeper removed by the kubelet")
    assert marker.read_text() == str(int(signal.SIGTERM))


def test_helm_installs_and_uninstalls_a_chart(cluster: Cluster, namespace: str):
    core = cluster.core()
    cluster.helm("install", "demo", str(CHART), "--namespace", namespace, "--set", "greeting=hi", "--wait")
    config_map = core.read_namespaced_config_map("demo-hello", namespace)
    assert config_map.data["greeting"] == "hi"
    assert config_map.data["kubeVersion"] == controlplane.read_versions()["KUBERNETES_VERSION"]
    assert "demo" in cluster.helm("list", "--namespace", namespace, "--short").stdout

    cluster.helm("uninstall", "demo", "--namespace", namespace, "--wait")
    with pytest.raises(ApiException) as missing:
        core.read_namespaced_config_map("demo-hello", namespace)
    assert missing.value.status == 404
