"""The test kubelet's image mode: pods run from an image pulled from the local registry, with runc
(tests/cluster/oci.py). The platform image (`make images`) is the small one; the trainer's runs in
tests/operator/test_end_to_end_image.py."""

from __future__ import annotations

import pytest

from tests.cluster.fixture import Cluster, wait_for
from tests.images.registry import Images

pytestmark = [pytest.mark.cluster, pytest.mark.images]


def _pod(cluster: Cluster, name: str, image: str, script: str | None, **spec) -> dict:
    container = {"name": "main", "image": image, "imagePullPolicy": "IfNotPresent"}
    if script is not None:
        container |= {"command": ["sh", "-c"], "args": [script]}
    container |= spec.pop("container", {})
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
            "spec": {**cluster.local_node_placement(), "restartPolicy": "Never", "containers": [container], **spec}}


def _state(cluster: Cluster, namespace: str, name: str) -> dict:
    pod = cluster.core().read_namespaced_pod(name, namespace)
    statuses = pod.status.container_statuses or []
    return statuses[0].to_dict() if statuses else {}


def test_a_pod_runs_in_its_image_with_its_env_volumes_user_and_exit_code(cluster: Cluster, namespace: str,
                                                                        images: Images):
    core = cluster.core()
    core.create_namespaced_config_map(namespace, {"metadata": {"name": "settings"},
                                                  "data": {"app.yaml": "greeting: from-a-config-map\n"}})
    core.create_namespaced_secret(namespace, {"metadata": {"name": "token"}, "stringData": {"token": "s3cr3t-42"}})
    script = ("echo uid=$(id -u) gid=$(id -g) host=$(hostname) greeting=$GREETING; "
              "cat /etc/kembed/app.yaml /var/run/token/token; echo; "
              "echo scratch > /scratch/file && echo wrote-scratch; "
              "touch /opt/kembed/x 2>/dev/null && echo root-writable || echo root-read-only; "
              "python -c 'import kembed_api; print(kembed_api.__file__)'; exit 3")
    pod = _pod(cluster, "in-image", images.platform, script,
               container={"env": [{"name": "GREETING", "value": "hello-$(POD)"},
                                  {"name": "POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}],
                          "volumeMounts": [{"name": "settings", "mountPath": "/etc/kembed", "readOnly": True},
                                           {"name": "token", "mountPath": "/var/run/token", "readOnly": True},
                                           {"name": "scratch", "mountPath": "/scratch"}],
                          "securityContext": {"readOnlyRootFilesystem": True}},
               securityContext={"runAsNonRoot": True, "runAsUser": 10001, "runAsGroup": 10001},
               volumes=[{"name": "settings", "configMap": {"name": "settings"}},
                        {"name": "token", "secret": {"secretName": "token"}},
                        {"name": "scratch", "emptyDir": {}}])
    # POD is defined after GREETING: Kubernetes expands only variables defined before, so $(POD) stays as written.
    core.create_namespaced_pod(namespace, pod)
    done = cluster.wait_pod_phase(namespace, "in-image", timeout_s=180)

    assert done.status.phase == "Failed"
    status = done.status.container_statuses[0]
    assert status.state.terminated.exit_code == 3 and status.state.terminated.reason == "Error"
    assert status.container_id.startswith("runc://")
    repository = images.platform.rsplit(":", 1)[0]
    assert status.image_id.startswith(f"{repository}@sha256:"), status.image_id
    log = cluster.pod_log(namespace, "in-image")
    assert "uid=10001 gid=10001 host=in-image greeting=hello-$(POD)" in log, log
    assert "greeting: from-a-config-map" in log and "s3cr3t-42" in log
    assert "wrote-scratch" in log and "root-read-only" in log
    # The image's own venv (not this machine's): the package is where the Dockerfile installed it.
    assert "/opt/venv/lib/python3.11/site-packages/kembed_api/__init__.py" in log


def test_a_container_that_keeps_crashing_shows_crash_loop_back_off(cluster: Cluster, namespace: str,
                                                                    images: Images):
    cluster.core().create_namespaced_pod(namespace, _pod(cluster, "crashes", images.platform,
                                                         "echo starting; exit 7", restartPolicy="OnFailure"))

    def backing_off():
        state = _state(cluster, namespace, "crashes")
        waiting = (state.get("state") or {}).get("waiting") or {}
        return state if waiting.get("reason") == "CrashLoopBackOff" else None

    state = wait_for(backing_off, timeout_s=120, interval_s=0.3, what="CrashLoopBackOff")
    assert state["last_state"]["terminated"]["exit_code"] == 7
    wait_for(lambda: _state(cluster, namespace, "crashes").get("restart_count", 0) >= 1, timeout_s=60,
             what="a restart")
    assert cluster.core().read_namespaced_pod("crashes", namespace).status.phase in ("Pending", "Running")
    assert "starting" in cluster.pod_log(namespace, "crashes")


def test_an_image_that_cannot_be_pulled_is_reported_on_the_pod(cluster: Cluster, namespace: str, images: Images):
    missing = images.missing("trainer")
    cluster.core().create_namespaced_pod(namespace, _pod(cluster, "no-image", missing, "true"))
    seen: set[str] = set()

    def reported():
        waiting = (_state(cluster, namespace, "no-image").get("state") or {}).get("waiting") or {}
        if waiting.get("reason") in ("ErrImagePull", "ImagePullBackOff"):
            seen.add(waiting["reason"])
            return waiting
        return None

    waiting = wait_for(reported, timeout_s=60, interval_s=0.2, what="ErrImagePull on the pod")
    assert "manifest unknown" in waiting["message"], waiting
    wait_for(lambda: reported() and seen == {"ErrImagePull", "ImagePullBackOff"}, timeout_s=60, interval_s=0.2,
             what="ImagePullBackOff after ErrImagePull")
    assert cluster.core().read_namespaced_pod("no-image", namespace).status.phase == "Pending"
    # A pod that never started goes away at once when deleted (the pull loop notices).
    cluster.core().delete_namespaced_pod("no-image", namespace)
    wait_for(lambda: not cluster.core().list_namespaced_pod(namespace).items, timeout_s=30, what="pod removed")
