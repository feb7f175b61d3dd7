"""pytest fixtures for the real Kubernetes control plane (tests/cluster/controlplane.py).

    @pytest.mark.cluster
    def test_something(cluster, namespace):
        core = cluster.core()
        core.create_namespaced_pod(namespace, cluster.local_pod("hello", ["python", "-c", "print('hi')"]))

`cluster` (session): one control plane for the whole test run, started on first use and ended at teardown.
`namespace` (function): a fresh namespace, ready for pods (its default ServiceAccount exists), deleted
afterwards.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pathlib
import shutil
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from kubernetes import client, config
from kubernetes.client.rest import ApiException

from tests.cluster import controlplane

__all__ = ["Cluster", "NodePool", "cluster", "exists", "namespace", "wait_for"]


def wait_for(
    predicate: Callable[[], Any], *, timeout_s: float = 30.0, interval_s: float = 0.2, what: str = ""
) -> Any:
    """Polls until `predicate()` returns something truthy, which is returned; TimeoutError names `what`."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = predicate()
        if result:
            return result
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s}s waiting for {what or predicate}")
        time.sleep(interval_s)


@dataclasses.dataclass(frozen=True)
class NodePool:
    """Fake GPU nodes of one test alone: tainted so that no other test's pod lands on them, and labelled so that
    this test's pods can be sent there (`node_selector` and `tolerations` go into a pod spec, or into the
    operator's trainer settings)."""

    name: str
    nodes: list[str]

    @property
    def node_selector(self) -> dict[str, str]:
        return {NODE_POOL_LABEL: self.name}

    @property
    def tolerations(self) -> list[dict[str, str]]:
        return [{"key": NODE_POOL_LABEL, "operator": "Equal", "value": self.name, "effect": "NoSchedule"}]


NODE_POOL_LABEL = "kembed.io/test-node-pool"  # label and taint of a NodePool's nodes, value: the pool's name


@dataclasses.dataclass
class Cluster:
    """What a test needs of the running control plane."""

    plane: controlplane.ControlPlane

    @property
    def kubeconfig(self) -> pathlib.Path:
        """Admin kubeconfig (group system:masters): `KUBECONFIG=... kubectl ...`, helm, any client."""
        return self.plane.kubeconfig

    @property
    def server(self) -> str:
        return self.plane.server

    @property
    def run_dir(self) -> pathlib.Path:
        return self.plane.run_dir

    @property
    def kubectl_path(self) -> pathlib.Path:
        return self.plane.binaries.kubectl

    @property
    def helm_path(self) -> pathlib.Path:
        return self.plane.binaries.helm

    @property
    def env(self) -> dict[str, str]:
        """os.environ plus KUBECONFIG and PATH (kubectl and helm first), for subprocesses."""
        return {**os.environ, **self.plane.env()}

    @property
    def gpu_nodes(self) -> list[str]:
        return [f"gpu-node-{i}" for i in range(self.plane.config.num_gpu_nodes)]

    # -- clients --
    def api_client(self) -> client.ApiClient:
        """A new kubernetes ApiClient for the admin user (close it, or use it in a `with`)."""
        return config.new_client_from_config(config_file=str(self.kubeconfig))

    def core(self) -> client.CoreV1Api:
        return client.CoreV1Api(self._shared_client())

    def batch(self) -> client.BatchV1Api:
        return client.BatchV1Api(self._shared_client())

    def _shared_client(self) -> client.ApiClient:
        if not hasattr(self, "_client"):
            self._client = self.api_client()
        return self._client

    def kubectl(self, *args: str, check: bool = True, timeout_s: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run(
            [str(self.kubectl_path), *args],
            env=self.env,
            capture_output=True,
            text=True,
            check=check,
            timeout=timeout_s,
        )

    def helm(self, *args: str, check: bool = True, timeout_s: float = 120) -> subprocess.CompletedProcess:
        # helm keeps its caches and config under the run dir, never in the user's home.
        helm_home = self.run_dir / "helm"
        env = {
            **self.env,
            "HELM_CACHE_HOME": str(helm_home / "cache"),
            "HELM_CONFIG_HOME": str(helm_home / "config"),
            "HELM_DATA_HOME": str(helm_home / "data"),
        }
        return subprocess.run(
            [str(self.helm_path), *args],
            env=env,
            capture_output=True,
            text=True,
            check=check,
            timeout=timeout_s,
        )

    # -- namespaces and quotas --
    def create_namespace(
        self,
        name: str | None = None,
        *,
        quota: dict[str, str] | None = None,
        labels: dict[str, str] | None = None,
        timeout_s: float = 30.0,
    ) -> str:
        """Creates a namespace and waits until pods can be created in it.

        It waits for the `default` ServiceAccount (the ServiceAccount admission plugin refuses pods until it
        exists) and, with `quota` (ResourceQuota `spec.hard`, e.g. {"requests.nvidia.com/gpu": "16",
        "pods": "3"}), for the quota's status.hard (pods are refused as "status unknown" until the quota
        controller fills it in). Returns the name.
        """
        name = name or f"test-{uuid.uuid4().hex[:8]}"
        core = self.core()
        core.create_namespace({"metadata": {"name": name, "labels": labels or {}}})
        wait_for(
            lambda: exists(lambda: core.read_namespaced_service_account("default", name)),
            timeout_s=timeout_s,
            what=f"default ServiceAccount in {name}",
        )
        if quota:
            self.create_quota(name, quota, timeout_s=timeout_s)
        return name

    def create_quota(
        self, namespace: str, hard: dict[str, str], *, name: str = "quota", timeout_s: float = 30.0
    ) -> None:
        core = self.core()
        core.create_namespaced_resource_quota(namespace, {"metadata": {"name": name}, "spec": {"hard": hard}})
        wait_for(
            lambda: core.read_namespaced_resource_quota(name, namespace).status.hard or None,
            timeout_s=timeout_s,
            what=f"status of ResourceQuota {namespace}/{name}",
        )

    def delete_namespace(self, name: str, *, wait_s: float = 0.0) -> None:
        """Deletes the namespace; with `wait_s`, waits (that long at most) until none of its pods is left.

        While waiting it deletes the pods itself (gracefully, as the namespace controller would): the namespace
        controller gets to them only after going through every resource type, 5 s per namespace here. A
        terminating namespace admits no new pod, so no Job controller puts one back."""
        core = self.core()
        with contextlib.suppress(ApiException):
            core.delete_namespace(name)
        if not wait_s:
            return

        def no_pods_left() -> bool:
            pods = core.list_namespaced_pod(name).items
            for pod in pods:
                if pod.metadata.deletion_timestamp is None:
                    with contextlib.suppress(ApiException):
                        core.delete_namespaced_pod(pod.metadata.name, name)
            return not pods

        wait_for(no_pods_left, timeout_s=wait_s, interval_s=0.3, what=f"the pods of namespace {name} gone")

    # -- private nodes --
    def create_node_pool(self, num_nodes: int, *, timeout_s: float = 30.0) -> NodePool:
        """`num_nodes` fake GPU nodes (like gpu-node-N) that only pods tolerating the pool's taint may use, so a
        test that needs whole free nodes has them whatever other tests leave running. Ready when returned."""
        name = f"pool-{uuid.uuid4().hex[:6]}"
        pool = NodePool(name, [f"{name}-{i}" for i in range(num_nodes)])
        core = self.core()
        taint = {"key": NODE_POOL_LABEL, "value": name, "effect": "NoSchedule"}
        for node in pool.nodes:
            core.create_node(controlplane.gpu_node_manifest(node, self.plane.config,
                                                            labels=pool.node_selector, taints=[taint]))

        def ready(node: str) -> bool:
            # Ready, and the node controller's not-ready taint (set on every new node) taken off again.
            read = core.read_node(node)
            taints = read.spec.taints or []
            return any(c.type == "Ready" and c.status == "True" for c in read.status.conditions or []) and not any(
                t.key.startswith("node.kubernetes.io/") for t in taints)

        wait_for(lambda: all(ready(node) for node in pool.nodes), timeout_s=timeout_s, what=f"{name} Ready")
        return pool

    def delete_node_pool(self, pool: NodePool) -> None:
        for node in pool.nodes:
            with contextlib.suppress(ApiException):
                self.core().delete_node(node)

    # -- identities other than admin --
    def service_account_kubeconfig(
        self, namespace: str, name: str, *, expiration_s: int = 3600
    ) -> pathlib.Path:
        """A kubeconfig that acts as ServiceAccount `namespace/name` (a TokenRequest token), so a test can run
        a process (the operator, say) with exactly the RBAC rights that a chart or a Role grants."""
        token = self.core().create_namespaced_service_account_token(
            name, namespace, {"spec": {"expirationSeconds": expiration_s}}
        )
        user = f"system:serviceaccount:{namespace}:{name}"
        path = self.run_dir / "service-accounts" / f"{namespace}.{name}.kubeconfig"
        path.parent.mkdir(exist_ok=True)
        path.write_text(
            json.dumps(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "clusters": [
                        {
                            "name": "kembed-test",
                            "cluster": {
                                "server": self.server,
                                "certificate-authority": str(self.plane.pki.ca_cert),
                            },
                        }
                    ],
                    "users": [{"name": user, "user": {"token": token.status.token}}],
                    "contexts": [
                        {"name": "kembed-test", "context": {"cluster": "kembed-test", "user": user}}
                    ],
                    "current-context": "kembed-test",
                }
            )
        )
        path.chmod(0o600)
        return path

    def service_account_client(self, namespace: str, name: str) -> client.ApiClient:
        """A new ApiClient acting as ServiceAccount `namespace/name`."""
        return config.new_client_from_config(
            config_file=str(self.service_account_kubeconfig(namespace, name))
        )

    # -- pods on the local node (really run by tests/cluster/kubelet.py) --
    @staticmethod
    def local_node_placement() -> dict:
        """Pod spec fields that put a pod on the `local` node: its nodeSelector, a toleration of its taint."""
        return {
            "nodeSelector": {controlplane.LOCAL_NODE_LABEL: "true"},
            "tolerations": [
                {"key": controlplane.LOCAL_NODE_TAINT_KEY, "operator": "Exists", "effect": "NoSchedule"}
            ],
        }

    def local_pod(
        self,
        name: str,
        command: list[str],
        *,
        env: dict[str, str] | None = None,
        labels: dict[str, str] | None = None,
        restart_policy: str = "Never",
    ) -> dict:
        """A Pod manifest whose one container runs `command` on this machine (python: the repo's venv)."""
        return {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "labels": labels or {}},
            "spec": {
                **self.local_node_placement(),
                "restartPolicy": restart_policy,
                "containers": [
                    {
                        "name": "main",
                        "image": "kembed/local",
                        "command": command,
                        "env": [{"name": k, "value": v} for k, v in (env or {}).items()],
                    }
                ],
            },
        }

    def pod_log(self, namespace: str, name: str, container: str | None = None) -> str:
        """A pod's log as text, read through the API server.

        kubernetes client 36 returns the repr of bytes ("b'...'") from read_namespaced_pod_log (a regression,
        kubernetes-client/python#2596); reading the raw response avoids it.
        """
        kwargs = {"container": container} if container else {}
        response = self.core().read_namespaced_pod_log(name, namespace, _preload_content=False, **kwargs)
        return response.data.decode()

    def wait_pod_phase(
        self,
        namespace: str,
        name: str,
        phases: tuple[str, ...] = ("Succeeded", "Failed"),
        *,
        timeout_s: float = 60.0,
    ) -> client.V1Pod:
        core = self.core()

        def reached():
            pod = core.read_namespaced_pod(name, namespace)
            return pod if pod.status.phase in phases else None

        return wait_for(reached, timeout_s=timeout_s, what=f"pod {namespace}/{name} in {phases}")


def exists(read: Callable[[], Any]) -> bool:
    """Whether `read()` finds the object (404 means no; any other error is raised)."""
    try:
        read()
    except ApiException as error:
        if error.status == 404:
            return False
        raise
    return True


@pytest.fixture(scope="session")
def cluster() -> Iterator[Cluster]:
    """The control plane of this test run: up in about 10 s with cached binaries; ended at teardown."""
    controlplane.cleanup_stale_runs()
    run_dir = controlplane.runs_root() / f"pytest-{os.getpid()}"
    plane = controlplane.ControlPlane(run_dir, owner_pid=os.getpid())
    plane.start()
    try:
        yield Cluster(plane)
    finally:
        plane.stop()
        if os.environ.get("KEMBED_KEEP_CLUSTER_LOGS"):
            shutil.rmtree(run_dir / "etcd", ignore_errors=True)
        else:
            shutil.rmtree(run_dir, ignore_errors=True)


@pytest.fixture
def namespace(cluster: Cluster) -> Iterator[str]:
    """A fresh namespace, ready for pods; deleted after the test, which ends once none of its pods is left (so
    nothing of it holds a node or a GPU in the tests after it)."""
    name = cluster.create_namespace()
    yield name
    cluster.delete_namespace(name, wait_s=60)
