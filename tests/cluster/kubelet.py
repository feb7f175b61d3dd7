"""A small kubelet for tests: runs the pods bound to one node as local processes on this machine.

It registers its Node (Ready, with a lease heartbeat), watches the pods bound to it and runs each container's
command + args as a process group of its own, with the pod's environment. Phase, container states and exit
codes go back to the pod status; logs go to files that the API server reads through this kubelet's HTTPS
endpoint (`kubectl logs`, read_namespaced_pod_log). Deleting a pod sends SIGTERM to its process groups,
SIGKILL after the grace period, then removes the pod, as a real kubelet does.

Two ways to run a container, chosen by its image reference:
- Image mode, for an image on a registry of this machine (`127.0.0.1:PORT/...`, see tests/images/registry.py): the
  image is pulled (ErrImagePull / ImagePullBackOff while it cannot be, with the registry's reason), its layers are
  unpacked once into a cache shared by all runs, and the container runs with runc from the image: its entrypoint,
  user, environment and PATH, the pod's command/args/env, volumes bind-mounted at their mountPath, the pod's
  securityContext user, host network (tests/cluster/oci.py).
- Process mode, for every other image name (fast, for tests that need no image): described below.

What differs from a real kubelet, because there are no network namespaces here (and no images in process mode):
- Commands (process mode): the image is ignored. `python`, `python3`, `python3.X` (bare or as any absolute path) run this
  kubelet's own interpreter (the repo's venv); other bare names, e.g. `torchrun`, are looked up first in the
  venv's bin directory (it leads PATH). A container without `command` cannot run (there is no image
  entrypoint).
- Cluster DNS: every host name ending in `.svc` or `.svc.cluster.local`, and `<hostname>.<subdomain>` (also
  with `.<namespace>`) for the pod's own `spec.subdomain`, is rewritten to 127.0.0.1 in command, args, env
  values and ConfigMap/Secret file contents. Ports are kept, so a test serves `svc:PORT` on 127.0.0.1:PORT.
- Volumes: configMap, secret, emptyDir, downwardAPI and projected (configMap, secret, downwardAPI,
  serviceAccountToken) volumes are written under <state-dir>/pods/<uid>/volumes/<name>/; in process mode each
  volumeMount's mountPath is rewritten to that directory wherever it appears in command, args, env values and workingDir.
  The directory of each mount is also exported as KEMBED_MOUNT_<NAME> (name upper-cased, `-` -> `_`).
- Restarts: a container waiting for its restart back-off shows CrashLoopBackOff with its last termination.
- Networking: pods share the host network. The pod gets hostIP 127.0.0.1 and no podIP (Endpoint validation
  refuses loopback addresses); a downward-API `status.podIP` resolves to 127.0.0.1.
- In-cluster clients: KUBERNETES_SERVICE_HOST/PORT point at the API server on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import datetime
import http.server
import json
import logging
import os
import pathlib
import re
import signal
import ssl
import subprocess
import sys
import threading
import time
import urllib.parse

from kubernetes import client, config, watch
from kubernetes.client.rest import ApiException

from tests.cluster import oci

log = logging.getLogger("kembed.test-kubelet")

LEASE_DURATION_S = 40
# A failed pull is retried after this back-off, doubled up to the cap (a real kubelet: 10 s to 300 s; shorter here,
# so that a test's image that appears late is picked up soon).
PULL_BACKOFF_S, PULL_BACKOFF_MAX_S = 5.0, 40.0
DEFAULT_IMAGE_CACHE = pathlib.Path(os.environ.get("KEMBED_CACHE", pathlib.Path.home() / ".cache" / "kembed")) / "oci"
HEARTBEAT_INTERVAL_S = 10
VENV_BIN = pathlib.Path(sys.executable).parent
PYTHON_NAME = re.compile(r"python(3(\.\d+)?)?")
SMP = "application/strategic-merge-patch+json"
DNS_LABEL = r"[a-z0-9](?:[-a-z0-9]*[a-z0-9])?"


def now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def now_micro() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


# ---- the pure part: how a pod spec becomes local processes ----------------------------------------


def dns_rewriter(pod: dict):
    """Returns a function that maps cluster DNS names in a string to 127.0.0.1 (see the module docstring)."""
    patterns = [rf"(?<![\w.-])(?:{DNS_LABEL}\.)+svc(?:\.cluster\.local)?(?![\w-])"]
    subdomain = pod["spec"].get("subdomain")
    if subdomain:
        namespace = pod["metadata"]["namespace"]
        patterns.append(
            rf"(?<![\w.-]){DNS_LABEL}\.{re.escape(subdomain)}(?:\.{re.escape(namespace)})?(?![\w.-])"
        )
    regex = re.compile("|".join(patterns))
    return lambda text: regex.sub("127.0.0.1", text)


def path_rewriter(mounts: dict[str, pathlib.Path]):
    """Maps each mountPath (as a whole path component) to its local directory, longest mountPath first."""
    ordered = sorted(mounts, key=len, reverse=True)
    if not ordered:
        return lambda text: text
    regex = re.compile("|".join(rf"(?<![\w./-]){re.escape(p.rstrip('/'))}(?=/|$|[^\w.-])" for p in ordered))
    lookup = {p.rstrip("/"): str(mounts[p]) for p in ordered}
    return lambda text: regex.sub(lambda m: lookup[m.group(0)], text)


def expand_references(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion: defined names are replaced, $$ escapes, unknown references stay."""
    return re.sub(
        r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)",
        lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)),
        text,
    )


def field_value(pod: dict, field_path: str) -> str:
    """The downward API's fieldRef paths."""
    metadata = pod["metadata"]
    match = re.fullmatch(r"metadata\.(labels|annotations)\['(.+)'\]", field_path)
    if match:
        return (metadata.get(match.group(1)) or {}).get(match.group(2), "")
    simple = {
        "metadata.name": metadata["name"],
        "metadata.namespace": metadata["namespace"],
        "metadata.uid": metadata["uid"],
        "spec.nodeName": pod["spec"].get("nodeName", ""),
        "spec.serviceAccountName": pod["spec"].get("serviceAccountName", ""),
        "status.hostIP": "127.0.0.1",
        "status.hostIPs": "127.0.0.1",
        "status.podIP": "127.0.0.1",
        "status.podIPs": "127.0.0.1",
    }
    if field_path in simple:
        return simple[field_path]
    if field_path in ("metadata.labels", "metadata.annotations"):
        items = metadata.get(field_path.split(".")[1]) or {}
        return "\n".join(f'{k}="{v}"' for k, v in sorted(items.items()))
    raise ValueError(f"unsupported fieldRef {field_path!r}")


def resolve_command(argv0: str) -> str:
    name = os.path.basename(argv0)
    if PYTHON_NAME.fullmatch(name):
        return sys.executable
    if (VENV_BIN / name).exists() and (not os.path.isabs(argv0) or not os.path.exists(argv0)):
        return str(VENV_BIN / name)
    return argv0


# ---- the kubelet ----------------------------------------------------------------------------------


class ContainerRun:
    """One container of a pod: its process, restarts and last state."""

    def __init__(
        self,
        spec: dict,
        argv: list[str],
        env: dict[str, str],
        cwd: str,
        log_path: pathlib.Path,
        pgid_path: pathlib.Path,
    ):
        self.spec, self.argv, self.env, self.cwd = spec, argv, env, cwd
        self.log_path, self.pgid_path = log_path, pgid_path
        self.process: subprocess.Popen | None = None
        self.started_at: str | None = None
        self.finished_at: str | None = None
        self.exit_code: int | None = None
        self.restart_count = 0
        self.last_terminated: dict | None = None
        self.waiting_reason = "ContainerCreating"
        self.waiting_message: str | None = None
        self.backing_off = False

    @property
    def name(self) -> str:
        return self.spec["name"]

    def start(self) -> None:
        if self.exit_code is not None:  # a restart: keep the previous termination as lastState
            self.last_terminated = self.terminated_state()
            self.restart_count += 1
        self.exit_code = self.finished_at = None
        with open(self.log_path, "ab") as log_file:
            self.process = subprocess.Popen(
                self.argv,
                env=self.env,
                cwd=self.cwd,
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.pgid_path.write_text(str(self.process.pid))
        self.started_at = now()

    def wait(self) -> int:
        code = self.process.wait()
        # Killed by a signal: report 128+N as container runtimes do (SIGKILL -> 137, SIGTERM -> 143).
        self.exit_code = 128 - code if code < 0 else code
        self.finished_at = now()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)  # children it left behind
        self.pgid_path.unlink(missing_ok=True)
        return self.exit_code

    def signal(self, signum: int) -> None:
        if self.process is not None and self.exit_code is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signum)

    def terminated_state(self) -> dict:
        return {
            "terminated": {
                "exitCode": self.exit_code,
                "reason": "Completed" if self.exit_code == 0 else "Error",
                "startedAt": self.started_at,
                "finishedAt": self.finished_at,
            }
        }

    @property
    def container_id(self) -> str | None:
        return f"kembed-local://{self.process.pid}" if self.process else None

    @property
    def image_id(self) -> str:
        return ""

    def status(self) -> dict:
        if self.backing_off:  # exited, waiting for its restart: the termination moves to lastState
            state = {"waiting": {"reason": "CrashLoopBackOff",
                                 "message": f"back-off restarting failed container {self.name}"}}
        elif self.process is None:
            state = {"waiting": {"reason": self.waiting_reason}}
            if self.waiting_message:
                state["waiting"]["message"] = self.waiting_message
        elif self.exit_code is None:
            state = {"running": {"startedAt": self.started_at}}
        else:
            state = self.terminated_state()
        running = "running" in state
        status = {
            "name": self.name,
            "image": self.spec.get("image", ""),
            "imageID": self.image_id,
            "ready": running,
            "started": running,
            "restartCount": self.restart_count,
            "state": state,
            "containerID": self.container_id,
        }
        if self.backing_off:
            status["lastState"] = self.terminated_state()
        elif self.last_terminated:
            status["lastState"] = self.last_terminated
        return {k: v for k, v in status.items() if v is not None}


class OciContainerRun(ContainerRun):
    """A container of an image (image mode): `runc run` in the foreground on a bundle of its own.

    The pid file holds the container's init process as the host sees it: SIGKILL to it ends the container's whole
    pid namespace, as a runtime's kill does (`pgid_path` is the pid file here). The terminationMessagePath is a
    file of the pod's, mounted writable, read into the terminated state as a real kubelet does."""

    TERMINATION_MESSAGE_LIMIT = 4096  # bytes, as Kubernetes caps it

    def __init__(self, spec: dict, *, env: dict[str, str], rewrite, mounts: list[dict], bundle: pathlib.Path,
                 runc_root: pathlib.Path, container_id: str, pod: dict, log_path: pathlib.Path,
                 pid_path: pathlib.Path):
        super().__init__(spec, [], env, "", log_path, pid_path)
        self.rewrite, self.bundle, self.runc_root, self.id, self.pod = rewrite, bundle, runc_root, container_id, pod
        self.termination_log = bundle.parent / f"{spec['name']}.termination-log"
        path = spec.get("terminationMessagePath") or "/dev/termination-log"
        self.mounts = [*mounts, oci.bind_mount(self.termination_log, path, readonly=False)]
        self.image: oci.Image | None = None
        self.termination_message = ""

    def terminated_state(self) -> dict:
        state = super().terminated_state()
        if self.termination_message:
            state["terminated"]["message"] = self.termination_message
        return state

    def _read_termination_message(self) -> str:
        with contextlib.suppress(OSError):
            message = self.termination_log.read_bytes()[: self.TERMINATION_MESSAGE_LIMIT]
            if message.strip():
                return message.decode(errors="replace")
        if self.spec.get("terminationMessagePolicy") == "FallbackToLogsOnError" and self.exit_code:
            with contextlib.suppress(OSError):
                return self.log_path.read_bytes()[-self.TERMINATION_MESSAGE_LIMIT:].decode(errors="replace")
        return ""

    @property
    def container_id(self) -> str | None:
        return f"runc://{self.id}" if self.process else None

    @property
    def image_id(self) -> str:
        if self.image is None:
            return ""
        reference = oci.Reference.parse(self.spec["image"])
        return f"{reference.registry}/{reference.repository}@{self.image.digest}"

    def _process_config(self, rootfs: pathlib.Path) -> dict:
        """The runtime config from the image config and the pod spec (Kubernetes' rules: `command` replaces the
        entrypoint and drops the image's CMD; `args` replaces CMD)."""
        image = self.image.config
        pod_security = self.pod["spec"].get("securityContext") or {}
        security = {**pod_security, **(self.spec.get("securityContext") or {})}
        uid, gid, home = oci.resolve_user(rootfs, image.get("User", ""), security.get("runAsUser"),
                                          security.get("runAsGroup"))
        if security.get("runAsNonRoot") and uid == 0:
            raise ValueError("container has runAsNonRoot and the image will run as root")
        env = dict(item.split("=", 1) for item in image.get("Env") or [])
        env.setdefault("HOME", home)
        env.update(self.env)
        command = self.spec.get("command")
        args = self.spec.get("args")
        argv = [*(command or image.get("Entrypoint") or []),
                *(args if args is not None else [] if command else image.get("Cmd") or [])]
        argv = [self.rewrite(expand_references(a, env)) for a in argv]
        if not argv:
            raise ValueError(f"container {self.name!r}: neither the pod nor the image names a command")
        groups = [*pod_security.get("supplementalGroups", []),
                  *([pod_security["fsGroup"]] if "fsGroup" in pod_security else [])]
        return oci.runtime_config(
            args=argv, env=env, cwd=self.spec.get("workingDir") or image.get("WorkingDir") or "/", uid=uid,
            gid=gid, supplemental_groups=groups, hostname=env.get("HOSTNAME", self.pod["metadata"]["name"]),
            rootfs=rootfs, readonly_rootfs=bool(security.get("readOnlyRootFilesystem")), mounts=self.mounts)

    def start(self) -> None:
        if self.exit_code is not None:
            self.last_terminated = self.terminated_state()
            self.restart_count += 1
        self.exit_code = self.finished_at = None
        self.pgid_path.unlink(missing_ok=True)
        self.termination_log.parent.mkdir(parents=True, exist_ok=True)
        self.termination_log.write_bytes(b"")
        self.termination_log.chmod(0o666)  # whatever user the container runs as writes it
        self.termination_message = ""
        rootfs = oci.mount_rootfs(self.image, self.bundle)  # a fresh writable layer for every start
        try:
            (self.bundle / "config.json").write_text(json.dumps(self._process_config(rootfs)))
        except Exception:
            oci.unmount_rootfs(self.bundle)
            raise
        with open(self.log_path, "ab") as log_file:
            self.process = subprocess.Popen(
                ["runc", "--root", str(self.runc_root), "run", "--bundle", str(self.bundle),
                 "--pid-file", str(self.pgid_path), self.id],
                stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True,
            )
        self.started_at = now()

    def wait(self) -> int:
        # runc's own status is the container's: its exit code, 128+N when a signal N ended it.
        self.exit_code = self.process.wait()
        self.finished_at = now()
        self.pgid_path.unlink(missing_ok=True)
        self.termination_message = self._read_termination_message()
        oci.unmount_rootfs(self.bundle)
        return self.exit_code

    def signal(self, signum: int) -> None:
        if self.process is None or self.exit_code is not None:
            return
        with contextlib.suppress(OSError, ValueError):
            os.kill(int(self.pgid_path.read_text()), signum)
            return
        # Not started far enough to have written its pid: ask runc (the container may not exist yet either).
        subprocess.run(["runc", "--root", str(self.runc_root), "kill", self.id, str(signum)],
                       capture_output=True, check=False)


class PodWorker(threading.Thread):
    def __init__(self, kubelet: Kubelet, pod: dict):
        super().__init__(name=f"pod-{pod['metadata']['namespace']}/{pod['metadata']['name']}", daemon=True)
        self.kubelet = kubelet
        self.pod = pod
        self.uid = pod["metadata"]["uid"]
        self.dir = kubelet.state_dir / "pods" / self.uid
        self.init_runs: list[ContainerRun] = []
        self.runs: list[ContainerRun] = []
        self.stopping = threading.Event()
        self.lock = threading.Lock()
        self.phase = "Pending"
        self.start_time = now()
        self.message: str | None = None

    # -- preparing: volumes, env, argv --
    def _api(self):
        return self.kubelet.core

    def _config_map(self, name: str, optional: bool) -> dict:
        try:
            cm = self._api().read_namespaced_config_map(name, self.pod["metadata"]["namespace"])
        except ApiException as error:
            if error.status == 404 and optional:
                return {}
            raise
        return {**(cm.data or {}), **{k: base64.b64decode(v) for k, v in (cm.binary_data or {}).items()}}

    def _secret(self, name: str, optional: bool) -> dict:
        try:
            secret = self._api().read_namespaced_secret(name, self.pod["metadata"]["namespace"])
        except ApiException as error:
            if error.status == 404 and optional:
                return {}
            raise
        return {k: base64.b64decode(v) for k, v in (secret.data or {}).items()}

    def _write_items(self, directory: pathlib.Path, data: dict, items: list | None, rewrite) -> None:
        selected = [(item["key"], item["path"]) for item in items] if items else [(k, k) for k in data]
        for key, rel_path in selected:
            if key not in data:
                raise ValueError(f"key {key!r} not found for volume {directory.name!r}")
            value = data[key]
            if isinstance(value, bytes):
                with contextlib.suppress(UnicodeDecodeError):
                    value = value.decode()
            if isinstance(value, str):
                value = rewrite(value).encode()
            target = directory / rel_path
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(value)

    def _service_account_token(self, source: dict) -> bytes:
        metadata = self.pod["metadata"]
        body = {
            "spec": {
                "audiences": [source["audience"]] if source.get("audience") else None,
                "expirationSeconds": source.get("expirationSeconds", 3607),
                "boundObjectRef": {
                    "kind": "Pod",
                    "apiVersion": "v1",
                    "name": metadata["name"],
                    "uid": metadata["uid"],
                },
            }
        }
        result = self._api().create_namespaced_service_account_token(
            self.pod["spec"].get("serviceAccountName", "default"), metadata["namespace"], body
        )
        return result.status.token.encode()

    def _materialize_volume(self, volume: dict, rewrite) -> pathlib.Path:
        directory = self.dir / "volumes" / volume["name"]
        directory.mkdir(parents=True, exist_ok=True)
        if "configMap" in volume:
            src = volume["configMap"]
            self._write_items(
                directory,
                self._config_map(src["name"], src.get("optional", False)),
                src.get("items"),
                rewrite,
            )
        elif "secret" in volume:
            src = volume["secret"]
            self._write_items(
                directory,
                self._secret(src["secretName"], src.get("optional", False)),
                src.get("items"),
                rewrite,
            )
        elif "downwardAPI" in volume:
            self._write_downward(directory, volume["downwardAPI"].get("items", []))
        elif "projected" in volume:
            for source in volume["projected"].get("sources", []):
                if "configMap" in source:
                    src = source["configMap"]
                    self._write_items(
                        directory,
                        self._config_map(src["name"], src.get("optional", False)),
                        src.get("items"),
                        rewrite,
                    )
                elif "secret" in source:
                    src = source["secret"]
                    self._write_items(
                        directory,
                        self._secret(src["name"], src.get("optional", False)),
                        src.get("items"),
                        rewrite,
                    )
                elif "downwardAPI" in source:
                    self._write_downward(directory, source["downwardAPI"].get("items", []))
                elif "serviceAccountToken" in source:
                    (directory / source["serviceAccountToken"]["path"]).write_bytes(
                        self._service_account_token(source["serviceAccountToken"])
                    )
        elif "emptyDir" in volume:
            directory.chmod(0o777)  # as a real kubelet makes it: writable by whatever user the container runs as
        else:
            raise ValueError(
                f"volume {volume['name']!r}: only configMap, secret, emptyDir, downwardAPI and projected "
                "volumes run locally"
            )
        return directory

    def _write_downward(self, directory: pathlib.Path, items: list) -> None:
        for item in items:
            if "fieldRef" in item:
                target = directory / item["path"]
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_text(field_value(self.pod, item["fieldRef"]["fieldPath"]))

    def _container_env(self, container: dict, rewrite_text, in_image: bool) -> dict[str, str]:
        """The container's environment; in image mode, what the image's own environment is overlaid with."""
        spec = self.pod["spec"]
        local = {
            "PATH": os.pathsep.join([str(VENV_BIN), os.environ.get("PATH", "/usr/bin:/bin")]),
            "HOME": os.path.expanduser("~"),
            "LANG": "C.UTF-8",
        }
        env = {
            **({} if in_image else local),
            "HOSTNAME": spec.get("hostname") or self.pod["metadata"]["name"],
            "KUBERNETES_SERVICE_HOST": "127.0.0.1",
            "KUBERNETES_SERVICE_PORT": str(self.kubelet.api_port),
            "KUBERNETES_SERVICE_PORT_HTTPS": str(self.kubelet.api_port),
        }
        for source in container.get("envFrom", []):
            prefix = source.get("prefix", "")
            if "configMapRef" in source:
                data = self._config_map(
                    source["configMapRef"]["name"], source["configMapRef"].get("optional", False)
                )
            else:
                data = self._secret(source["secretRef"]["name"], source["secretRef"].get("optional", False))
            env.update({prefix + k: v.decode() if isinstance(v, bytes) else v for k, v in data.items()})
        for var in container.get("env", []):
            if "valueFrom" not in var:
                env[var["name"]] = expand_references(var.get("value", ""), env)
                continue
            source = var["valueFrom"]
            if "fieldRef" in source:
                value = field_value(self.pod, source["fieldRef"]["fieldPath"])
            elif "configMapKeyRef" in source:
                ref = source["configMapKeyRef"]
                value = self._config_map(ref["name"], ref.get("optional", False)).get(ref["key"])
            elif "secretKeyRef" in source:
                ref = source["secretKeyRef"]
                value = self._secret(ref["name"], ref.get("optional", False)).get(ref["key"])
            elif "resourceFieldRef" in source:
                resources = container.get("resources", {})
                kind, _, resource = source["resourceFieldRef"]["resource"].partition(".")
                value = (resources.get(kind) or {}).get(resource, "0")
            else:
                raise ValueError(f"env {var['name']}: unsupported valueFrom {source}")
            if value is None:  # an optional key that is absent leaves the variable unset
                continue
            env[var["name"]] = value.decode() if isinstance(value, bytes) else str(value)
        return {k: rewrite_text(v) for k, v in env.items()}

    def _prepare_until_ready(self) -> bool:
        """Prepares the pod's containers. A ConfigMap or Secret that cannot be read yet keeps the pod Pending and
        is retried, as a real kubelet does: it may not exist yet (404), or the Node authorizer may not have seen
        the pod's binding to this node yet (403, "no relationship found"). A spec this kubelet cannot run fails
        the pod at once."""
        delay_s, reported = 0.5, None
        while not self.stopping.is_set():
            try:
                self._prepare()
                return True
            except Exception as error:
                if not (isinstance(error, ApiException) and error.status in (403, 404)):
                    log.exception("preparing %s", self.name)
                    for run in self.runs:
                        run.waiting_reason = "CreateContainerConfigError"
                    self.phase, self.message = "Failed", f"kembed test kubelet cannot run this pod: {error}"
                    self.push_status()
                    return False
                self.message = f"waiting for a ConfigMap or Secret that cannot be read yet: {error.body}"
                if self.message != reported:
                    reported = self.message
                    self.push_status()
            self.stopping.wait(delay_s)
            delay_s = min(delay_s * 2, 5.0)
        return False

    def _prepare(self) -> None:
        self.init_runs, self.runs, self.message = [], [], None
        spec = self.pod["spec"]
        (self.dir / "logs").mkdir(parents=True, exist_ok=True)
        rewrite_dns = dns_rewriter(self.pod)
        volumes = {v["name"]: self._materialize_volume(v, rewrite_dns) for v in spec.get("volumes", [])}
        for group, target in (("initContainers", self.init_runs), ("containers", self.runs)):
            for container in spec.get(group, []):
                if oci.Reference.parse(container.get("image", "")):
                    target.append(self._image_container(container, volumes, rewrite_dns))
                    continue
                mounts = {}
                for mount in container.get("volumeMounts", []):
                    local = volumes[mount["name"]] / mount.get("subPath", "")
                    mounts[mount["mountPath"]] = local
                rewrite_paths = path_rewriter(mounts)

                def rewrite(text: str, rewrite_paths=rewrite_paths) -> str:
                    return rewrite_paths(rewrite_dns(text))

                env = self._container_env(container, rewrite, in_image=False)
                for mount_path, local in mounts.items():
                    key = re.sub(r"\W", "_", pathlib.PurePath(mount_path).name or "root").upper()
                    env[f"KEMBED_MOUNT_{key}"] = str(local)
                command = container.get("command") or []
                if not command:
                    raise ValueError(
                        f"container {container['name']!r} has no command (no image entrypoint runs here)"
                    )
                argv = [rewrite(expand_references(a, env)) for a in [*command, *container.get("args", [])]]
                argv[0] = resolve_command(argv[0])
                cwd = rewrite(container.get("workingDir", "")) or str(self.dir)
                if not os.path.isdir(cwd):
                    cwd = str(self.dir)
                name = container["name"]
                target.append(
                    ContainerRun(
                        container,
                        argv,
                        env,
                        cwd,
                        self.dir / "logs" / f"{name}.log",
                        self.dir / f"{name}.pgid",
                    )
                )

    def _image_container(self, container: dict, volumes: dict[str, pathlib.Path], rewrite_dns) -> OciContainerRun:
        """Image mode: volumes bind-mounted where the pod mounts them, the pod's hostname in its /etc/hosts."""
        name = container["name"]
        hostname = self.pod["spec"].get("hostname") or self.pod["metadata"]["name"]
        hosts = self.dir / "etc-hosts"
        hosts.write_text(f"127.0.0.1\tlocalhost {hostname}\n::1\tlocalhost ip6-localhost ip6-loopback\n")
        mounts = [oci.bind_mount(hosts, "/etc/hosts", readonly=True),
                  oci.bind_mount(pathlib.Path("/etc/resolv.conf"), "/etc/resolv.conf", readonly=True)]
        for mount in container.get("volumeMounts", []):
            source = volumes[mount["name"]] / mount.get("subPath", "")
            mounts.append(oci.bind_mount(source, mount["mountPath"], readonly=bool(mount.get("readOnly"))))
        return OciContainerRun(
            container, env=self._container_env(container, rewrite_dns, in_image=True), rewrite=rewrite_dns,
            mounts=mounts,
            bundle=self.dir / "bundles" / name, runc_root=self.kubelet.state_dir / "runc",
            # runc's ids are global to its root: the pod's uid keeps them apart
            container_id=f"{self.uid}-{name}", pod=self.pod,
            log_path=self.dir / "logs" / f"{name}.log", pid_path=self.dir / f"{name}.pid")

    def _pull_until_ready(self) -> bool:
        """Pulls every image-mode container's image. While one cannot be pulled, its container waits with
        ErrImagePull (the registry's reason in the message), then ImagePullBackOff until the next try, as a real
        kubelet reports it; the pod stays Pending. False when the pod is stopped meanwhile."""
        backoff_s = PULL_BACKOFF_S
        for run in [*self.init_runs, *self.runs]:
            if not isinstance(run, OciContainerRun):
                continue
            while not self.stopping.is_set():
                started = time.monotonic()
                try:
                    run.image = self.kubelet.images.pull(run.spec["image"])
                except Exception as error:  # ImagePullError, or anything else that stops this pull: say so
                    if isinstance(error, oci.ImagePullError):
                        log.warning("pulling %s for %s: %s", run.spec["image"], self.name, error)
                    else:
                        log.exception("pulling %s for %s", run.spec["image"], self.name)
                    run.waiting_reason, run.waiting_message = "ErrImagePull", str(error)
                    self.push_status()
                    if self.stopping.wait(1.0):
                        return False
                    run.waiting_reason = "ImagePullBackOff"
                    run.waiting_message = f"Back-off pulling image {run.spec['image']!r}: {error}"
                    self.push_status()
                    self.stopping.wait(backoff_s)
                    backoff_s = min(backoff_s * 2, PULL_BACKOFF_MAX_S)
                    continue
                log.info("pulled %s (%s) for %s in %.1f s", run.spec["image"], run.image.digest, self.name,
                         time.monotonic() - started)
                run.waiting_reason, run.waiting_message = "ContainerCreating", None
                break
        if not self.stopping.is_set():
            self.push_status()
        return not self.stopping.is_set()

    # -- status --
    def _status(self) -> dict:
        started = self.phase != "Pending"
        all_ready = bool(self.runs) and all(
            run.process is not None and run.exit_code is None for run in self.runs
        )
        t = now()

        def condition(kind: str, ok: bool) -> dict:
            return {"type": kind, "status": "True" if ok else "False", "lastTransitionTime": t}

        status = {
            "phase": self.phase,
            "hostIP": "127.0.0.1",
            "hostIPs": [{"ip": "127.0.0.1"}],
            "startTime": self.start_time,
            "conditions": [
                condition("PodReadyToStartContainers", True),
                condition("Initialized", started),
                condition("ContainersReady", all_ready),
                condition("Ready", all_ready),
            ],
            "containerStatuses": [run.status() for run in self.runs],
        }
        if self.init_runs:
            status["initContainerStatuses"] = [run.status() for run in self.init_runs]
        if self.message:
            status["message"] = self.message
        return status

    def push_status(self) -> None:
        with self.lock:
            body = {"status": self._status()}
            metadata = self.pod["metadata"]
            try:
                self._api().patch_namespaced_pod_status(
                    metadata["name"], metadata["namespace"], body, _content_type=SMP
                )
            except ApiException as error:
                if error.status != 404:
                    log.warning("status of %s: %s", self.name, error.body)

    # -- running --
    def run(self) -> None:
        if not self._prepare_until_ready() or not self._pull_until_ready():
            if self.stopping.is_set():
                self.kubelet.finish_deletion(self.pod)
            return
        log.info("starting %s", self.name)
        self.push_status()
        for run in self.init_runs:
            if self.stopping.is_set():
                break
            if not self._start(run):
                break
            self.push_status()
            if run.wait() != 0:
                self.message = f"init container {run.name} exited with {run.exit_code}"
                break
            self.push_status()
        if not self.stopping.is_set() and all(run.exit_code == 0 for run in self.init_runs):
            self.phase = "Running"
            threads = [
                threading.Thread(target=self._supervise, args=(run,), daemon=True) for run in self.runs
            ]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
        else:
            for run in self.runs:
                run.waiting_reason = "PodInitializing"
        failed = any(run.exit_code != 0 for run in [*self.init_runs, *self.runs])
        self.phase = "Failed" if failed else "Succeeded"
        log.info("%s %s (exit codes %s)", self.name, self.phase, [run.exit_code for run in self.runs])
        self.push_status()
        if self.stopping.is_set():
            self.kubelet.finish_deletion(self.pod)

    def _supervise(self, run: ContainerRun) -> None:
        policy = self.pod["spec"].get("restartPolicy", "Always")
        backoff_s = 1.0
        while True:
            if not self._start(run):
                return
            self.push_status()
            code = run.wait()
            self.push_status()
            restart = policy == "Always" or (policy == "OnFailure" and code != 0)
            if not restart or self.stopping.is_set():
                return
            run.backing_off = code != 0
            if run.backing_off:
                self.push_status()
            stopped = self.stopping.wait(backoff_s)
            run.backing_off = False
            if stopped:
                return
            backoff_s = min(backoff_s * 2, 30.0)

    def _start(self, run: ContainerRun) -> bool:
        """Starts the container; one that cannot be created (a runtime config this pod cannot have, a runc
        error) fails the pod with CreateContainerError and the reason, instead of leaving it waiting."""
        try:
            run.start()
            return True
        except Exception as error:
            log.exception("creating container %s of %s", run.name, self.name)
            run.waiting_reason, run.waiting_message = "CreateContainerError", str(error)
            self.message = f"container {run.name}: {error}"
            self.push_status()
            return False

    def stop(self, grace_s: float) -> None:
        """SIGTERM to every container's process group; SIGKILL what is left after the grace period."""
        if self.stopping.is_set():
            return
        log.info("stopping %s (grace %ss)", self.name, grace_s)
        self.stopping.set()

        def terminate():
            for run in [*self.init_runs, *self.runs]:
                run.signal(signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            while time.monotonic() < deadline and any(
                r.process and r.exit_code is None for r in [*self.init_runs, *self.runs]
            ):
                time.sleep(0.1)
            for run in [*self.init_runs, *self.runs]:
                run.signal(signal.SIGKILL)

        threading.Thread(target=terminate, daemon=True).start()

    def log_path(self, container: str) -> pathlib.Path | None:
        for run in [*self.init_runs, *self.runs]:
            if run.name == container:
                return run.log_path
        return None


class Kubelet:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.node_name = args.node_name
        self.state_dir = pathlib.Path(args.state_dir)
        self.api_client = config.new_client_from_config(config_file=args.kubeconfig)
        self.api_port = urllib.parse.urlsplit(self.api_client.configuration.host).port
        self.core = client.CoreV1Api(self.api_client)
        self.coordination = client.CoordinationV1Api(self.api_client)
        self.workers: dict[str, PodWorker] = {}
        self.workers_lock = threading.Lock()
        self.shutting_down = threading.Event()
        self.images = oci.ImageStore(pathlib.Path(args.image_cache))

    # -- node --
    def _capacity(self) -> dict[str, str]:
        return dict(item.split("=", 1) for item in self.args.capacity)

    def register_node(self) -> None:
        labels = {
            "kubernetes.io/hostname": self.node_name,
            "kubernetes.io/os": "linux",
            "kubernetes.io/arch": "amd64",
        }
        labels.update(dict(item.split("=", 1) for item in self.args.label))
        taints = []
        for item in self.args.taint:
            key_value, effect = item.rsplit(":", 1)
            key, _, value = key_value.partition("=")
            taints.append({"key": key, "value": value, "effect": effect})
        node = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": self.node_name, "labels": labels},
            "spec": {"taints": taints},
        }
        try:
            self.core.create_node(node)
        except ApiException as error:
            if error.status != 409:
                raise
        self.update_node_status()

    def update_node_status(self) -> None:
        t = now()
        ready = {
            "type": "Ready",
            "status": "True",
            "reason": "KubeletReady",
            "message": "kembed test kubelet is ready",
            "lastHeartbeatTime": t,
            "lastTransitionTime": t,
        }
        pressure = [
            {
                "type": kind,
                "status": "False",
                "reason": reason,
                "message": "",
                "lastHeartbeatTime": t,
                "lastTransitionTime": t,
            }
            for kind, reason in (
                ("MemoryPressure", "KubeletHasSufficientMemory"),
                ("DiskPressure", "KubeletHasNoDiskPressure"),
                ("PIDPressure", "KubeletHasSufficientPID"),
            )
        ]
        capacity = self._capacity()
        status = {
            "status": {
                "conditions": [ready, *pressure],
                "addresses": [
                    {"type": "InternalIP", "address": "127.0.0.1"},
                    {"type": "Hostname", "address": self.node_name},
                ],
                "daemonEndpoints": {"kubeletEndpoint": {"Port": self.args.port}},
                "capacity": capacity,
                "allocatable": capacity,
                "nodeInfo": {
                    "machineID": "",
                    "systemUUID": "",
                    "bootID": "",
                    "kernelVersion": os.uname().release,
                    "osImage": "kembed test kubelet",
                    "containerRuntimeVersion": "kembed-local://1",
                    "kubeletVersion": "kembed-test",
                    "kubeProxyVersion": "",
                    "operatingSystem": "linux",
                    "architecture": "amd64",
                },
            }
        }
        self.core.patch_node_status(self.node_name, status, _content_type=SMP)

    def renew_lease(self) -> None:
        lease = {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {"name": self.node_name, "namespace": "kube-node-lease"},
            "spec": {
                "holderIdentity": self.node_name,
                "leaseDurationSeconds": LEASE_DURATION_S,
                "renewTime": now_micro(),
            },
        }
        try:
            self.coordination.patch_namespaced_lease(
                self.node_name,
                "kube-node-lease",
                {"spec": lease["spec"]},
                _content_type="application/merge-patch+json",
            )
        except ApiException as error:
            if error.status != 404:
                raise
            self.coordination.create_namespaced_lease("kube-node-lease", lease)

    def heartbeat_forever(self) -> None:
        beats = 0
        while not self.shutting_down.wait(HEARTBEAT_INTERVAL_S):
            try:
                self.renew_lease()
                beats += 1
                if beats % 6 == 0:  # the lease carries health; conditions need only a slow refresh
                    self.update_node_status()
            except Exception:
                log.exception("heartbeat")

    # -- pods --
    def reconcile(self, pod: dict, deleted: bool = False) -> None:
        uid = pod["metadata"]["uid"]
        with self.workers_lock:
            worker = self.workers.get(uid)
            if worker is None:
                if deleted:
                    return
                if pod["metadata"].get("deletionTimestamp"):  # nothing of it runs here (a kubelet restart)
                    self.finish_deletion(pod)
                    return
                if pod.get("status", {}).get("phase") in ("Succeeded", "Failed"):
                    return
                worker = self.workers[uid] = PodWorker(self, pod)
                worker.start()
                return
            worker.pod = pod
            if deleted and not worker.is_alive():
                del self.workers[uid]
                return
        if deleted or pod["metadata"].get("deletionTimestamp"):
            grace = pod["metadata"].get("deletionGracePeriodSeconds")
            worker.stop(30.0 if grace is None else float(grace))
            if not worker.is_alive():
                self.finish_deletion(pod)

    def finish_deletion(self, pod: dict) -> None:
        """The last step of a graceful deletion: the kubelet removes the pod once its processes are gone."""
        if not pod["metadata"].get("deletionTimestamp"):
            return
        metadata = pod["metadata"]
        log.info("removing pod %s/%s", metadata["namespace"], metadata["name"])
        try:
            # With a body, the API server reads DeleteOptions from it alone: the grace period goes there too.
            self.core.delete_namespaced_pod(
                metadata["name"],
                metadata["namespace"],
                body={"gracePeriodSeconds": 0, "preconditions": {"uid": metadata["uid"]}},
            )
        except ApiException as error:
            if error.status not in (404, 409):
                log.warning("deleting %s: %s", metadata["name"], error.body)

    def watch_pods_forever(self) -> None:
        selector = f"spec.nodeName={self.node_name}"
        while not self.shutting_down.is_set():
            try:
                response = self.core.list_pod_for_all_namespaces(
                    field_selector=selector, _preload_content=False
                )
                listing = json.loads(response.data)
                for pod in listing["items"]:
                    self.reconcile(pod)
                stream = watch.Watch().stream(
                    self.core.list_pod_for_all_namespaces,
                    field_selector=selector,
                    deserialize=False,
                    resource_version=listing["metadata"]["resourceVersion"],
                    timeout_seconds=300,
                    allow_watch_bookmarks=True,
                )
                for event in stream:
                    if event["type"] in ("ADDED", "MODIFIED", "DELETED"):
                        self.reconcile(event["object"], deleted=event["type"] == "DELETED")
            except Exception:
                if not self.shutting_down.is_set():
                    log.exception("pod watch; listing again")
                    time.sleep(1)

    def log_file(self, namespace: str, name: str, container: str | None) -> pathlib.Path | None:
        with self.workers_lock:
            candidates = [
                w
                for w in self.workers.values()
                if w.pod["metadata"]["namespace"] == namespace and w.pod["metadata"]["name"] == name
            ]
        for worker in reversed(candidates):
            names = [c["name"] for c in worker.pod["spec"]["containers"]]
            path = worker.log_path(container or names[0])
            if path is not None:
                return path
        return None

    def container_done(self, namespace: str, name: str, container: str) -> bool:
        with self.workers_lock:
            workers = [
                w
                for w in self.workers.values()
                if w.pod["metadata"]["namespace"] == namespace and w.pod["metadata"]["name"] == name
            ]
        return all(not w.is_alive() for w in workers)

    def shutdown(self, *_):
        """On SIGTERM: end every pod's processes quickly, then exit; the API may be going away too."""
        self.shutting_down.set()
        with self.workers_lock:
            workers = list(self.workers.values())
        for worker in workers:
            for run in [*worker.init_runs, *worker.runs]:
                run.signal(signal.SIGTERM)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and any(
            r.process and r.process.poll() is None for w in workers for r in [*w.init_runs, *w.runs]
        ):
            time.sleep(0.1)
        for worker in workers:
            for run in [*worker.init_runs, *worker.runs]:
                run.signal(signal.SIGKILL)
        runs = [r for w in workers for r in [*w.init_runs, *w.runs] if r.process]
        with contextlib.suppress(subprocess.TimeoutExpired):
            for run in runs:  # runc returns once its container is gone; then its root filesystem can go too
                run.process.wait(timeout=2)
        oci.unmount_all(self.state_dir)
        os._exit(0)


class LogHandler(http.server.BaseHTTPRequestHandler):
    """The kubelet API's containerLogs endpoint, which the API server proxies for `kubectl logs`."""

    kubelet: Kubelet
    protocol_version = (
        "HTTP/1.0"  # the body ends when the connection closes: simple streaming for follow=true
    )

    def log_message(self, fmt, *args):
        log.debug(fmt, *args)

    def do_GET(self):
        url = urllib.parse.urlsplit(self.path)
        query = urllib.parse.parse_qs(url.query)
        parts = [urllib.parse.unquote(p) for p in url.path.strip("/").split("/")]
        if parts == ["healthz"]:
            return self._reply(200, b"ok")
        if len(parts) not in (3, 4) or parts[0] != "containerLogs":
            return self._reply(404, b"only /containerLogs/{namespace}/{pod}/{container} is served here")
        namespace, name = parts[1], parts[2]
        container = parts[3] if len(parts) == 4 else None
        path = self.kubelet.log_file(namespace, name, container)
        if path is None or not path.exists():
            return self._reply(404, f"no logs for {namespace}/{name}/{container}".encode())
        data = path.read_bytes()
        if "tailLines" in query:
            lines = data.splitlines(keepends=True)
            count = int(query["tailLines"][0])
            data = b"".join(lines[-count:]) if count else b""
        if "limitBytes" in query:
            data = data[: int(query["limitBytes"][0])]
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.end_headers()
        self.wfile.write(data)
        if query.get("follow", ["false"])[0] == "true" and "limitBytes" not in query:
            offset = path.stat().st_size
            with open(path, "rb") as handle:
                handle.seek(offset)
                while True:
                    chunk = handle.read(65536)
                    if chunk:
                        self.wfile.write(chunk)
                        self.wfile.flush()
                    elif self.kubelet.container_done(namespace, name, container):
                        self.wfile.write(handle.read())
                        return
                    else:
                        time.sleep(0.2)

    def _reply(self, code: int, body: bytes):
        self.send_response(code)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def serve_logs(kubelet: Kubelet, args: argparse.Namespace) -> None:
    handler = type("BoundLogHandler", (LogHandler,), {"kubelet": kubelet})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", args.port), handler)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(args.serving_cert, args.serving_key)
    # Only the API server (a client cert of the cluster CA) may read logs, as with a kubelet's x509 authn.
    context.verify_mode = ssl.CERT_REQUIRED
    context.load_verify_locations(args.client_ca)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="logs", daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.cluster.kubelet", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--kubeconfig", required=True)
    parser.add_argument("--node-name", required=True)
    parser.add_argument(
        "--port", type=int, required=True, help="HTTPS port of the logs endpoint on 127.0.0.1"
    )
    parser.add_argument("--state-dir", required=True, help="pods' logs, volumes and process-group files")
    parser.add_argument("--serving-cert", required=True)
    parser.add_argument("--serving-key", required=True)
    parser.add_argument("--client-ca", required=True)
    parser.add_argument("--image-cache", default=str(DEFAULT_IMAGE_CACHE),
                        help="unpacked image layers, shared by every run (image mode)")
    parser.add_argument("--label", action="append", default=[], help="KEY=VALUE node label")
    parser.add_argument("--taint", action="append", default=[], help="KEY=VALUE:EFFECT node taint")
    parser.add_argument(
        "--capacity", action="append", default=[], help="RESOURCE=QUANTITY, capacity = allocatable"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(threadName)s %(message)s")

    kubelet = Kubelet(args)
    signal.signal(signal.SIGTERM, kubelet.shutdown)
    signal.signal(signal.SIGINT, kubelet.shutdown)
    serve_logs(kubelet, args)
    kubelet.register_node()
    kubelet.renew_lease()
    threading.Thread(target=kubelet.heartbeat_forever, name="heartbeat", daemon=True).start()
    log.info("node %s registered; logs on https://127.0.0.1:%d", args.node_name, args.port)
    kubelet.watch_pods_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
