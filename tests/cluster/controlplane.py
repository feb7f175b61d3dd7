"""Starts and stops a real Kubernetes control plane as local processes, for tests and by hand.

    .venv/bin/python -m tests.cluster.controlplane up    # prints the run dir (state.json, admin.kubeconfig)
    eval "$(.venv/bin/python -m tests.cluster.controlplane env)"   # KUBECONFIG and PATH for kubectl/helm
    .venv/bin/python -m tests.cluster.controlplane down

Parts: etcd, kube-apiserver (TLS, client certs, Node+RBAC), kube-controller-manager, kube-scheduler, kwok
(fake GPU nodes) and the test kubelet (tests/cluster/kubelet.py, node `local`). Everything listens on
127.0.0.1 on free ports, so two clusters (two test runs, or a test run beside a hand-started one) never
collide. Each process leads its own process group, recorded in state.json, so `down` — or the next `up` after
a crash — can end it and all it spawned.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import pathlib
import shutil
import signal
import ssl
import subprocess
import sys
import time
import urllib.request

from kembed_api.platform.ports import free_port
from tests.cluster import oci
from tests.cluster import pki as pki_mod

__all__ = [
    "GPU_NODE_LABEL",
    "GPU_RESOURCE",
    "GPU_TAINT_KEY",
    "LOCAL_NODE_LABEL",
    "LOCAL_NODE_NAME",
    "LOCAL_NODE_TAINT_KEY",
    "Binaries",
    "ClusterConfig",
    "ControlPlane",
    "cleanup_stale_runs",
    "gpu_node_manifest",
    "runs_root",
]

HERE = pathlib.Path(__file__).resolve().parent
GPU_RESOURCE = "nvidia.com/gpu"
GPU_NODE_LABEL = "kembed.io/gpu-node"  # value "true" on every fake GPU node
GPU_TAINT_KEY = "nvidia.com/gpu"  # value "present", effect NoSchedule, as GPU node pools do
LOCAL_NODE_NAME = "local"
LOCAL_NODE_LABEL = "kembed.io/local-node"  # value "true"
LOCAL_NODE_TAINT_KEY = "kembed.io/local-node"  # value "true", effect NoSchedule
KWOK_NODE_ANNOTATION = "kwok.x-k8s.io/node"
# Addresses that only ever appear inside API objects. Nothing dials them: fake pods have no processes, and the
# benchmarking range 198.18.0.0/15 (RFC 2544) is neither loopback (which Endpoint validation refuses) nor a
# private range that could reach a real host.
FAKE_POD_CIDR = "198.18.0.0/16"
SERVICE_CIDR = "198.19.0.0/16"
SERVICE_DNS_DOMAIN = "cluster.local"


def cache_dir() -> pathlib.Path:
    return pathlib.Path(os.environ.get("KEMBED_CACHE", pathlib.Path.home() / ".cache" / "kembed"))


def runs_root() -> pathlib.Path:
    """Where run dirs live; one known place so a later run can find and end the leftovers of a crashed one."""
    return pathlib.Path(os.environ.get("KEMBED_CLUSTER_RUNS", cache_dir() / "clusters"))


def read_versions() -> dict[str, str]:
    versions = {}
    for line in (HERE / "versions.env").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            versions[key] = value
    return versions


@dataclasses.dataclass(frozen=True)
class Binaries:
    etcd: pathlib.Path
    kube_apiserver: pathlib.Path
    kube_controller_manager: pathlib.Path
    kube_scheduler: pathlib.Path
    kubectl: pathlib.Path
    kwok: pathlib.Path
    helm: pathlib.Path

    @classmethod
    def from_cache(cls) -> Binaries:
        """The binaries tests/cluster/build.sh (`make cluster-bins`) put under $KEMBED_CACHE/bin/."""
        versions = read_versions()
        component_version = {
            "etcd": versions["ETCD_VERSION"],
            "kube-apiserver": versions["KUBERNETES_VERSION"],
            "kube-controller-manager": versions["KUBERNETES_VERSION"],
            "kube-scheduler": versions["KUBERNETES_VERSION"],
            "kubectl": versions["KUBERNETES_VERSION"],
            "kwok": versions["KWOK_VERSION"],
            "helm": versions["HELM_VERSION"],
        }
        paths = {
            name.replace("-", "_"): cache_dir() / "bin" / f"{name}-{version}" / name
            for name, version in component_version.items()
        }
        missing = [str(path) for path in paths.values() if not os.access(path, os.X_OK)]
        if missing:
            raise FileNotFoundError(
                "control plane binaries missing; build them with `make cluster-bins` "
                f"(tests/cluster/build.sh): {', '.join(missing)}"
            )
        return cls(**paths)


@dataclasses.dataclass(frozen=True)
class ClusterConfig:
    num_gpu_nodes: int = 4
    gpus_per_node: int = 8
    gpu_node_cpu: str = "96"
    gpu_node_memory: str = "1024Gi"
    # Local disk (ephemeral-storage) a node offers pods: what jobs with tiered tables request. The local node's is
    # advertised, not checked against the test machine's disk (tests keep their tiers small).
    gpu_node_disk: str = "3500Gi"
    # The local node advertises fake GPUs too, so a GPU-requesting job can be pinned there (toleration +
    # nodeSelector) and really run on CPU; its taint keeps everything else away.
    local_node_gpus: int = 8
    local_node_cpu: str = "16"
    local_node_memory: str = "64Gi"
    local_node_disk: str = "100Gi"
    # Extra kube-apiserver flags, after the defaults (the last of a repeated flag wins), e.g. ("--profiling=true",)
    # for benchmarks/operator_scale.py --pprof.
    apiserver_flags: tuple[str, ...] = ()



def _process_start_time(pid: int) -> str | None:
    """The kernel's start time of a process: with the pid it names one process, even after pid reuse."""
    try:
        stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def _is_running(pid: int) -> bool:
    try:
        stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _group_members(pgid: int) -> list[int]:
    members = []
    for entry in pathlib.Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                members.append(int(entry.name))
    return members


def _reap(pid: int) -> None:
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)


def end_process_group(pgid: int, *, grace_s: float = 10.0) -> None:
    """SIGTERM to a whole process group, then SIGKILL to whatever is left after the grace period."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        _reap(pgid)
        if not _group_members(pgid):
            return
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)
    for _ in range(50):
        _reap(pgid)
        if not _group_members(pgid):
            return
        time.sleep(0.1)


def _kubeconfig(server: str, ca: pathlib.Path, cert: pathlib.Path, key: pathlib.Path, user: str) -> str:
    # JSON is YAML, and every client (Go, Python, helm) reads it.
    return json.dumps(
        {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {"name": "kembed-test", "cluster": {"server": server, "certificate-authority": str(ca)}}
            ],
            "users": [{"name": user, "user": {"client-certificate": str(cert), "client-key": str(key)}}],
            "contexts": [{"name": "kembed-test", "context": {"cluster": "kembed-test", "user": user}}],
            "current-context": "kembed-test",
        },
        indent=2,
    )


def gpu_node_manifest(
    name: str,
    config: ClusterConfig,
    *,
    labels: dict[str, str] | None = None,
    taints: list[dict[str, str]] | None = None,
) -> dict:
    """A fake GPU node that kwok runs (its annotation), labelled `GPU_NODE_LABEL` and tainted like a GPU node pool;
    `labels` and `taints` are added to those (a test's private node pool, say)."""
    capacity = {
        "cpu": config.gpu_node_cpu,
        "memory": config.gpu_node_memory,
        "ephemeral-storage": config.gpu_node_disk,
        "pods": "110",
        GPU_RESOURCE: str(config.gpus_per_node),
    }
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "annotations": {KWOK_NODE_ANNOTATION: "fake"},
            "labels": {
                GPU_NODE_LABEL: "true",
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
                "type": "kwok",
                **(labels or {}),
            },
        },
        "spec": {
            "taints": [{"key": GPU_TAINT_KEY, "value": "present", "effect": "NoSchedule"}, *(taints or [])]
        },
        "status": {"capacity": capacity, "allocatable": capacity},
    }


class ControlPlane:
    """One cluster's processes and files under `run_dir`. Build it with `start()`, end it with `stop()`."""

    def __init__(
        self, run_dir: pathlib.Path, config: ClusterConfig | None = None, *, owner_pid: int | None = None
    ):
        self.run_dir = run_dir
        self.config = config or ClusterConfig()
        # A cluster with an owner (a pytest process) is stale once that process is gone; one without an owner
        # (started by hand) lives until `down`.
        self.owner_pid = owner_pid
        self.binaries = Binaries.from_cache()
        self.ports: dict[str, int] = {}
        self.pgids: dict[str, int] = {}

    # ---- paths ------------------------------------------------------------------------------------
    @property
    def state_file(self) -> pathlib.Path:
        return self.run_dir / "state.json"

    @property
    def kubeconfig(self) -> pathlib.Path:
        """The admin kubeconfig (user in group system:masters)."""
        return self.run_dir / "admin.kubeconfig"

    @property
    def pki(self) -> pki_mod.Pki:
        return pki_mod.Pki(self.run_dir / "pki")

    @property
    def kubelet_dir(self) -> pathlib.Path:
        return self.run_dir / "kubelet"

    @property
    def server(self) -> str:
        return f"https://127.0.0.1:{self.ports['apiserver']}"

    def log_file(self, component: str) -> pathlib.Path:
        return self.run_dir / "logs" / f"{component}.log"

    # ---- start ------------------------------------------------------------------------------------
    def start(self, *, timeout_s: float = 60.0) -> ControlPlane:
        stop_run_dir(self.run_dir)
        shutil.rmtree(self.run_dir, ignore_errors=True)
        (self.run_dir / "logs").mkdir(parents=True)
        self.ports = {
            name: free_port()
            for name in (
                "etcd",
                "etcd_peer",
                "apiserver",
                "controller_manager",
                "scheduler",
                "kwok",
                "kubelet",
            )
        }
        try:
            self._write_pki_and_kubeconfigs()
            self._start_etcd()
            self._wait_etcd(timeout_s)
            self._start_apiserver()
            self._wait_ready(timeout_s)
            self._start_controller_manager()
            self._start_scheduler()
            self._create_gpu_nodes()
            self._start_kwok()
            self._start_kubelet()
            self._wait_nodes_ready(timeout_s)
            self._wait_default_service_account(timeout_s)
        except BaseException:
            self.stop(remove=False)
            raise
        return self

    def _write_pki_and_kubeconfigs(self) -> None:
        identities = {
            # name: (user, group)
            "admin": ("kembed-admin", "system:masters"),
            "controller-manager": ("system:kube-controller-manager", None),
            "scheduler": ("system:kube-scheduler", None),
            "kwok": ("kembed-kwok", "system:masters"),
            "kubelet": (f"system:node:{LOCAL_NODE_NAME}", "system:nodes"),
            "apiserver-kubelet-client": ("kube-apiserver-kubelet-client", "system:masters"),
            "front-proxy-client": ("front-proxy-client", None),
        }
        pki = pki_mod.make_pki(
            self.pki.directory,
            servers={
                "apiserver": [
                    "IP:127.0.0.1",
                    "DNS:localhost",
                    "DNS:kubernetes",
                    "DNS:kubernetes.default",
                    "DNS:kubernetes.default.svc",
                    f"DNS:kubernetes.default.svc.{SERVICE_DNS_DOMAIN}",
                ],
                # The API server reaches the kubelet at the node's InternalIP (127.0.0.1) for logs and exec.
                "kubelet-serving": ["IP:127.0.0.1", "DNS:localhost", f"DNS:{LOCAL_NODE_NAME}"],
            },
            clients=[pki_mod.ClientIdentity(name, user, group) for name, (user, group) in identities.items()],
        )
        for name, (user, _) in identities.items():
            if name in ("apiserver-kubelet-client", "front-proxy-client"):
                continue
            path = self.kubeconfig if name == "admin" else self.run_dir / f"{name}.kubeconfig"
            path.write_text(_kubeconfig(self.server, pki.ca_cert, pki.cert(name), pki.key(name), user))
            path.chmod(0o600)

    def _spawn(self, component: str, argv: list[str], env: dict[str, str] | None = None) -> None:
        with open(self.log_file(component), "ab") as log:
            process = subprocess.Popen(
                [str(arg) for arg in argv],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                cwd=self.run_dir,
                env=env,
            )
        self.pgids[component] = process.pid
        self._save_state()

    def _save_state(self) -> None:
        state = {
            "server": self.server,
            "kubeconfig": str(self.kubeconfig),
            "ports": self.ports,
            "pgids": self.pgids,
            "owner": None
            if self.owner_pid is None
            else {
                "pid": self.owner_pid,
                "start_time": _process_start_time(self.owner_pid),
            },
            "binaries": {k: str(v) for k, v in dataclasses.asdict(self.binaries).items()},
        }
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=2))
        tmp.replace(self.state_file)

    def _start_etcd(self) -> None:
        peer = f"http://127.0.0.1:{self.ports['etcd_peer']}"
        client = f"http://127.0.0.1:{self.ports['etcd']}"
        self._spawn(
            "etcd",
            [
                self.binaries.etcd,
                "--name=kembed",
                f"--data-dir={self.run_dir / 'etcd'}",
                f"--listen-client-urls={client}",
                f"--advertise-client-urls={client}",
                f"--listen-peer-urls={peer}",
                f"--initial-advertise-peer-urls={peer}",
                f"--initial-cluster=kembed={peer}",
                "--initial-cluster-state=new",
                # Test data is thrown away: skipping fsync makes etcd as fast as tmpfs on a busy disk.
                "--unsafe-no-fsync",
                "--log-level=warn",
            ],
        )

    def _start_apiserver(self) -> None:
        pki = self.pki
        self._spawn(
            "kube-apiserver",
            [
                self.binaries.kube_apiserver,
                f"--etcd-servers=http://127.0.0.1:{self.ports['etcd']}",
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",
                f"--secure-port={self.ports['apiserver']}",
                f"--tls-cert-file={pki.cert('apiserver')}",
                f"--tls-private-key-file={pki.key('apiserver')}",
                f"--client-ca-file={pki.ca_cert}",
                # The aggregation layer's front-proxy settings; without them every component that reads
                # extension-apiserver-authentication logs "missing content for CA bundle" forever.
                f"--requestheader-client-ca-file={pki.ca_cert}",
                "--requestheader-allowed-names=front-proxy-client",
                "--requestheader-username-headers=X-Remote-User",
                "--requestheader-group-headers=X-Remote-Group",
                "--requestheader-extra-headers-prefix=X-Remote-Extra-",
                f"--proxy-client-cert-file={pki.cert('front-proxy-client')}",
                f"--proxy-client-key-file={pki.key('front-proxy-client')}",
                "--authorization-mode=Node,RBAC",
                # The defaults (ResourceQuota, LimitRanger, ServiceAccount, ...) stay on; these two come on
                # top: NodeRestriction as on every real cluster, and ExtendedResourceToleration so that a pod
                # requesting
                # nvidia.com/gpu tolerates the GPU nodes' taint, as GPU node pools do.
                "--enable-admission-plugins=NodeRestriction,ExtendedResourceToleration",
                f"--service-account-issuer=https://kubernetes.default.svc.{SERVICE_DNS_DOMAIN}",
                f"--service-account-key-file={pki.service_account_pub}",
                f"--service-account-signing-key-file={pki.service_account_key}",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                # With an advertise address of 127.0.0.1 the `kubernetes` Endpoints would be invalid.
                "--endpoint-reconciler-type=none",
                "--allow-privileged=true",
                f"--kubelet-client-certificate={pki.cert('apiserver-kubelet-client')}",
                f"--kubelet-client-key={pki.key('apiserver-kubelet-client')}",
                f"--kubelet-certificate-authority={pki.ca_cert}",
                "--kubelet-preferred-address-types=InternalIP",
                "--profiling=false",
                *self.config.apiserver_flags,
            ],
        )

    def _component_auth_flags(self, name: str) -> list[str]:
        kubeconfig = self.run_dir / f"{name}.kubeconfig"
        return [
            f"--kubeconfig={kubeconfig}",
            f"--authentication-kubeconfig={kubeconfig}",
            f"--authorization-kubeconfig={kubeconfig}",
            "--bind-address=127.0.0.1",
            "--leader-elect=false",
        ]

    def _start_controller_manager(self) -> None:
        pki = self.pki
        self._spawn(
            "kube-controller-manager",
            [
                self.binaries.kube_controller_manager,
                *self._component_auth_flags("controller-manager"),
                f"--secure-port={self.ports['controller_manager']}",
                "--controllers=*",
                # Each controller acts as its own service account, as on kubeadm clusters: RBAC is exercised.
                "--use-service-account-credentials=true",
                f"--root-ca-file={pki.ca_cert}",
                f"--service-account-private-key-file={pki.service_account_key}",
                f"--cluster-signing-cert-file={pki.ca_cert}",
                f"--cluster-signing-key-file={pki.ca_key}",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                "--allocate-node-cidrs=false",
                "--profiling=false",
                # The default client limit (20 requests/s) makes the Job controller the bottleneck of any
                # scale test long before the operator is; a real cluster's control plane is tuned likewise.
                "--kube-api-qps=200",
                "--kube-api-burst=400",
                # Five Job syncs at a time (the default) bound pod creation to 5 per API round trip; clusters
                # that run thousands of batch Jobs raise it likewise.
                "--concurrent-job-syncs=50",
            ],
        )

    def _start_scheduler(self) -> None:
        # The client limit lives in a KubeSchedulerConfiguration (the --kube-api-qps flags are deprecated and
        # ignored with --config). The default, 50 requests/s, is a binding and an Event per pod: ~25 pods/s.
        kubeconfig = self.run_dir / "scheduler.kubeconfig"
        config = self.run_dir / "scheduler-config.yaml"
        config.write_text(json.dumps({
            "apiVersion": "kubescheduler.config.k8s.io/v1", "kind": "KubeSchedulerConfiguration",
            "clientConnection": {"kubeconfig": str(kubeconfig), "qps": 200, "burst": 400},
            "leaderElection": {"leaderElect": False},
        }))
        self._spawn(
            "kube-scheduler",
            [
                self.binaries.kube_scheduler,
                f"--config={config}",
                *(flag for flag in self._component_auth_flags("scheduler") if not flag.startswith("--kubeconfig=")),
                f"--secure-port={self.ports['scheduler']}",
                "--profiling=false",
            ],
        )

    def _start_kwok(self) -> None:
        self._spawn(
            "kwok",
            [
                self.binaries.kwok,
                f"--kubeconfig={self.run_dir / 'kwok.kubeconfig'}",
                f"--config={HERE / 'kwok-stages.yaml'}",
                "--manage-all-nodes=false",
                f"--manage-nodes-with-annotation-selector={KWOK_NODE_ANNOTATION}=fake",
                f"--cidr={FAKE_POD_CIDR}",
                "--node-ip=127.0.0.1",
                f"--node-port={self.ports['kwok']}",
                f"--server-address=127.0.0.1:{self.ports['kwok']}",
                "--node-lease-duration-seconds=40",
            ],
        )

    def _start_kubelet(self) -> None:
        pki = self.pki
        cfg = self.config
        env = dict(
            os.environ,
            PYTHONPATH=os.pathsep.join(filter(None, [str(HERE.parents[1]), os.environ.get("PYTHONPATH")])),
        )
        self._spawn(
            "kubelet",
            [
                sys.executable,
                "-m",
                "tests.cluster.kubelet",
                f"--kubeconfig={self.run_dir / 'kubelet.kubeconfig'}",
                f"--node-name={LOCAL_NODE_NAME}",
                f"--port={self.ports['kubelet']}",
                f"--state-dir={self.kubelet_dir}",
                f"--serving-cert={pki.cert('kubelet-serving')}",
                f"--serving-key={pki.key('kubelet-serving')}",
                f"--client-ca={pki.ca_cert}",
                f"--label={LOCAL_NODE_LABEL}=true",
                f"--taint={LOCAL_NODE_TAINT_KEY}=true:NoSchedule",
                f"--capacity=cpu={cfg.local_node_cpu}",
                f"--capacity=memory={cfg.local_node_memory}",
                f"--capacity=ephemeral-storage={cfg.local_node_disk}",
                f"--capacity={GPU_RESOURCE}={cfg.local_node_gpus}",
                "--capacity=pods=110",
            ],
            env=env,
        )

    def _create_gpu_nodes(self) -> None:
        for index in range(self.config.num_gpu_nodes):
            self._api("POST", "/api/v1/nodes", gpu_node_manifest(f"gpu-node-{index}", self.config))

    # ---- talking to the API server without the Python client, so `up` needs only the standard library ---
    def _ssl_context(self) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=str(self.pki.ca_cert))
        context.load_cert_chain(str(self.pki.cert("admin")), str(self.pki.key("admin")))
        return context

    def _api(
        self, method: str, path: str, body: dict | None = None, *, timeout_s: float = 10.0
    ) -> tuple[int, dict | str]:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.server + path, data=data, method=method)
        request.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(request, context=self._ssl_context(), timeout=timeout_s) as response:
                text = response.read().decode()
                status = response.status
        except urllib.error.HTTPError as error:
            text = error.read().decode()
            status = error.code
        try:
            return status, json.loads(text)
        except ValueError:
            return status, text

    def _wait_etcd(self, timeout_s: float) -> None:
        """The API server retries etcd by itself; starting it against a live etcd is faster and quieter."""
        deadline = time.monotonic() + timeout_s
        url = f"http://127.0.0.1:{self.ports['etcd']}/health"
        while time.monotonic() < deadline:
            self._check_alive()
            with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=2) as response:
                if json.loads(response.read()).get("health") == "true":
                    return
            time.sleep(0.1)
        raise TimeoutError(f"etcd not healthy after {timeout_s}s")

    def _wait_default_service_account(self, timeout_s: float) -> None:
        """Pods are refused until their namespace's `default` ServiceAccount exists (controller-manager)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self._check_alive()
            if self._api("GET", "/api/v1/namespaces/default/serviceaccounts/default")[0] == 200:
                return
            time.sleep(0.2)
        raise TimeoutError(
            f"no default ServiceAccount after {timeout_s}s: is kube-controller-manager working?"
        )

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        last = ""
        while time.monotonic() < deadline:
            self._check_alive()
            try:
                status, body = self._api("GET", "/readyz", timeout_s=2.0)
                if status == 200:
                    return
                last = str(body)
            except OSError as error:
                last = str(error)
            time.sleep(0.2)
        raise TimeoutError(f"kube-apiserver not ready after {timeout_s}s: {last[-2000:]}")

    def _wait_nodes_ready(self, timeout_s: float) -> None:
        expected = {f"gpu-node-{i}" for i in range(self.config.num_gpu_nodes)} | {LOCAL_NODE_NAME}
        deadline = time.monotonic() + timeout_s
        ready: set[str] = set()
        while time.monotonic() < deadline:
            self._check_alive()
            _, body = self._api("GET", "/api/v1/nodes")
            ready = {
                node["metadata"]["name"]
                for node in body.get("items", [])
                if any(
                    c["type"] == "Ready" and c["status"] == "True"
                    for c in node.get("status", {}).get("conditions", [])
                )
            }
            if expected <= ready:
                return
            time.sleep(0.2)
        raise TimeoutError(f"nodes not Ready after {timeout_s}s: missing {sorted(expected - ready)}")

    def _check_alive(self) -> None:
        for component, pid in self.pgids.items():
            if not _is_running(pid):
                _reap(pid)
                tail = self.log_file(component).read_text(errors="replace")[-3000:]
                raise RuntimeError(f"{component} exited during start-up; end of its log:\n{tail}")

    # ---- stop -------------------------------------------------------------------------------------
    def stop(self, *, remove: bool = False) -> None:
        stop_run_dir(self.run_dir)
        if remove:
            shutil.rmtree(self.run_dir, ignore_errors=True)

    def env(self) -> dict[str, str]:
        return {
            "KUBECONFIG": str(self.kubeconfig),
            "PATH": os.pathsep.join(
                [
                    str(self.binaries.kubectl.parent),
                    str(self.binaries.helm.parent),
                    os.environ.get("PATH", ""),
                ]
            ),
        }


def _pod_pgids(run_dir: pathlib.Path) -> list[int]:
    """Process groups of pods the test kubelet started (it records one file per container)."""
    pgids = []
    for pid_file in (run_dir / "kubelet" / "pods").glob("*/*.pgid"):
        with contextlib.suppress(ValueError, OSError):
            pgids.append(int(pid_file.read_text()))
    return pgids


def _belongs_to(pid: int, run_dir: pathlib.Path) -> bool:
    """True when the process is still one of this run's (its command line or working directory is in the
    run dir) rather than an unrelated process that was given the same pid later."""
    try:
        cmdline = pathlib.Path(f"/proc/{pid}/cmdline").read_bytes()
        cwd = os.readlink(f"/proc/{pid}/cwd")
    except OSError:
        return False
    inside = str(run_dir).rstrip("/") + "/"  # with the slash: run dir pytest-12 is no prefix of pytest-123
    cwd = cwd.removesuffix(" (deleted)") + "/"
    return inside.encode() in cmdline or cwd.startswith(inside)


def stop_run_dir(run_dir: pathlib.Path) -> None:
    """Ends every process of the cluster in `run_dir`: the kubelet first (it ends its pods), then the rest."""
    state_file = run_dir / "state.json"
    if not state_file.exists():
        return
    state = json.loads(state_file.read_text())
    order = ["kubelet", "kwok", "kube-scheduler", "kube-controller-manager", "kube-apiserver", "etcd"]
    pgids = state.get("pgids", {})
    for component in sorted(pgids, key=lambda c: order.index(c) if c in order else -1):
        pgid = pgids[component]
        if _belongs_to(pgid, run_dir):
            end_process_group(pgid)
        else:
            _reap(pgid)
    for pgid in _pod_pgids(run_dir):
        # Left over only when the kubelet died without ending its pods. A pod's process runs in its pod dir
        # (or one of its volumes), which tells it from an unrelated process that got the same id later.
        if any(_belongs_to(pid, run_dir) for pid in _group_members(pgid)):
            end_process_group(pgid, grace_s=2.0)
    # Image-mode containers of a kubelet that died: runc deletes them (killing what is left); their root
    # filesystems are overlay mounts in the run dir, which must go before the run dir can be removed.
    oci.delete_all(run_dir / "kubelet" / "runc")
    oci.unmount_all(run_dir)
    state["pgids"] = {}
    state_file.write_text(json.dumps(state, indent=2))


def cleanup_stale_runs(root: pathlib.Path | None = None) -> list[pathlib.Path]:
    """Ends clusters whose owning process has died (a crashed or killed test run); removes their run dirs."""
    root = root or runs_root()
    cleaned = []
    for state_file in root.glob("*/state.json"):
        with contextlib.suppress(OSError, ValueError):
            owner = json.loads(state_file.read_text()).get("owner")
            if owner is None or _process_start_time(owner["pid"]) == owner["start_time"]:
                continue  # started by hand, or its owner is alive
            stop_run_dir(state_file.parent)
            shutil.rmtree(state_file.parent, ignore_errors=True)
            cleaned.append(state_file.parent)
            # A record of who ended which cluster and why, for the day a cluster vanishes under a test.
            with open(root / "cleanup.log", "a") as record:
                record.write(
                    f"{time.strftime('%Y-%m-%dT%H:%M:%S')} pid {os.getpid()} ({' '.join(sys.argv)[:200]}) ended "
                    f"{state_file.parent.name}: owner {owner} not running "
                    f"(its start time now {_process_start_time(owner['pid'])})\n"
                )
    return cleaned


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.cluster.controlplane", description=__doc__.split("\n")[0]
    )
    parser.add_argument("command", choices=["up", "down", "env"])
    parser.add_argument(
        "--run-dir", type=pathlib.Path, default=None, help="default: $KEMBED_CLUSTER_RUNS/manual"
    )
    parser.add_argument("--gpu-nodes", type=int, default=ClusterConfig.num_gpu_nodes)
    parser.add_argument("--gpus-per-node", type=int, default=ClusterConfig.gpus_per_node)
    args = parser.parse_args(argv)
    run_dir = (args.run_dir or runs_root() / "manual").resolve()
    if args.command == "up":
        cleanup_stale_runs()
        started = time.monotonic()
        plane = ControlPlane(
            run_dir, ClusterConfig(num_gpu_nodes=args.gpu_nodes, gpus_per_node=args.gpus_per_node)
        )
        plane.start()
        print(
            f"cluster up in {time.monotonic() - started:.1f}s at {plane.server}; run dir {run_dir}",
            file=sys.stderr,
        )
        print(
            f'eval "$({sys.executable} -m tests.cluster.controlplane env --run-dir {run_dir})"',
            file=sys.stderr,
        )
        print(run_dir)
    elif args.command == "down":
        stop_run_dir(run_dir)
        shutil.rmtree(run_dir, ignore_errors=True)
    else:
        state = json.loads((run_dir / "state.json").read_text())
        bin_dirs = {str(pathlib.Path(state["binaries"][name]).parent) for name in ("kubectl", "helm")}
        print(f"export KUBECONFIG={state['kubeconfig']}")
        print(f"export PATH={os.pathsep.join(sorted(bin_dirs))}{os.pathsep}$PATH")
    return 0


if __name__ == "__main__":
    sys.exit(main())
