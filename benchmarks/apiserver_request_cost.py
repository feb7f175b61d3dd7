"""What one API request of each kind an EmbeddingJob's life makes costs kube-apiserver and etcd (not a timed test).

    .venv/bin/python -m benchmarks.apiserver_request_cost [--count 300 --threads 8]

One control plane (tests/cluster) with the CRDs installed. The controllers, the scheduler and kwok are paused
(SIGSTOP) while each kind is measured, so the CPU that kube-apiserver and etcd spend is the requests' own (and
the watches' that every real cluster has open), not the Job controller's reaction to them. For each kind, `count`
requests from `threads` client threads through the same raw client call; printed: requests/s, kube-apiserver and
etcd CPU ms per request (from /proc), and the body's size.

Kinds: a batch Job (the floor's one create per job), an EmbeddingJob (kembed's), the same EmbeddingJob under a CRD
whose spec and status are schemaless (`x-kubernetes-preserve-unknown-fields`: what the schema's validation and
pruning cost), an EmbeddingJob status merge-patch (RUNNING with its conditions), an Event (what each of the
operator's Normal events costs), and a ConfigMap of the trainer files' size.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import yaml

from benchmarks.operator_scale import _load, _post, _proc_cpu_s
from kembed_contract import crds, resources
from kembed_operator import job_manifests
from kembed_operator.settings import OperatorSettings
from tests.builders import operator_job
from tests.cluster import controlplane
from tests.cluster.fixture import Cluster, wait_for
from tests.operator import harness

LOOSE_GROUP = "bench.kembed.io"
PAUSED = ("kube-controller-manager", "kube-scheduler", "kwok")


def _loose_crd() -> dict[str, Any]:
    """The EmbeddingJob CRD under another group, spec and status without a schema (only the status subresource)."""
    crd = copy.deepcopy(next(c for c in crds.render_crds() if c["spec"]["names"]["kind"] == resources.EMBEDDING_JOB_KIND))
    crd["metadata"]["name"] = f"{resources.EMBEDDING_JOB_PLURAL}.{LOOSE_GROUP}"
    crd["spec"]["group"] = LOOSE_GROUP
    for version in crd["spec"]["versions"]:
        props = version["schema"]["openAPIV3Schema"]["properties"]
        for part in ("spec", "status"):
            props[part] = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
    return crd


@contextlib.contextmanager
def _paused(plane: controlplane.ControlPlane) -> Iterator[None]:
    pids = [plane.pgids[name] for name in PAUSED]
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)


def _measure(plane: controlplane.ControlPlane, cluster: Cluster, name: str, calls: list[Callable[[Any], None]],
             threads: int, size: int) -> dict[str, Any]:
    clients = [cluster.api_client() for _ in range(threads)]
    chunks = [calls[i::threads] for i in range(threads)]
    api_pid, etcd_pid = plane.pgids["kube-apiserver"], plane.pgids["etcd"]
    with _paused(plane):
        time.sleep(0.5)
        before = _proc_cpu_s(api_pid), _proc_cpu_s(etcd_pid)
        started = time.monotonic()
        with ThreadPoolExecutor(max_workers=threads) as pool:
            list(pool.map(lambda pair: [call(pair[0]) for call in pair[1]], zip(clients, chunks, strict=True)))
        elapsed = time.monotonic() - started
        time.sleep(0.5)  # watch fan-out of the last objects
        after = _proc_cpu_s(api_pid), _proc_cpu_s(etcd_pid)
    n = len(calls)
    return {"kind": name, "requests": n, "per_s": n / elapsed, "apiserver_ms": 1000 * (after[0] - before[0]) / n,
            "etcd_ms": 1000 * (after[1] - before[1]) / n, "body_bytes": size}


def _patch(path: str, body: dict[str, Any]) -> Callable[[Any], None]:
    def call(api: Any) -> None:
        api.call_api(path, "PATCH", body=body, header_params={"Content-Type": "application/merge-patch+json"},
                     auth_settings=["BearerToken"], _preload_content=False, _request_timeout=60)
    return call


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--count", type=int, default=300)
    parser.add_argument("--threads", type=int, default=8)
    args = parser.parse_args()
    print(f"start: {_load()}", flush=True)
    plane = controlplane.ControlPlane(controlplane.runs_root() / f"bench-request-cost-{int(time.time())}",
                                      controlplane.ClusterConfig(num_gpu_nodes=1), owner_pid=os.getpid())
    plane.start()
    cluster = Cluster(plane)
    try:
        wait_for(lambda: cluster.core().list_namespaced_service_account("default").items, timeout_s=60)
        harness.install_platform(cluster)
        subprocess.run([str(cluster.kubectl_path), "apply", "--server-side", "-f", "-"],
                       input=yaml.safe_dump(_loose_crd()), text=True, env=cluster.env, check=True,
                       capture_output=True)
        wait_for(lambda: cluster.kubectl("get", f"{resources.EMBEDDING_JOB_PLURAL}.{LOOSE_GROUP}", "-A",
                                         check=False).returncode == 0, timeout_s=30, what="loose CRD served")
        tenant = harness.tenant_name()
        namespace = resources.tenant_namespace(tenant)
        cluster.create_namespace(namespace)  # no operator runs here: a bare namespace, no quota
        settings = OperatorSettings()
        n = args.count
        manifests = []
        for i in range(n):
            builder = operator_job(f"j{i}")
            builder.spec["labels"] = {}
            manifests.append(builder.manifest(tenant))
        spec = resources.EmbeddingJobSpec.model_validate(manifests[0]["spec"])
        files = job_manifests.trainer_files(spec, default_checkpoint_uri="s3://kembed-test/x")

        def batch_job(i: int) -> dict[str, Any]:
            body = job_manifests.batch_job(f"b{i}", namespace, "0", tenant, spec, attempt=0, settings=settings,
                                           files=files)
            del body["metadata"]["ownerReferences"]
            body["spec"]["suspend"] = True
            return body

        ej_path = f"/apis/{resources.GROUP}/{resources.VERSION}/namespaces/{namespace}/{resources.EMBEDDING_JOB_PLURAL}"
        loose_path = f"/apis/{LOOSE_GROUP}/{resources.VERSION}/namespaces/{namespace}/{resources.EMBEDDING_JOB_PLURAL}"
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        status = {"status": {"phase": "RUNNING", "reason": "GangRunning", "message": "all 1 pods are running",
                             "observedGeneration": 1, "attempt": 0, "restartCount": 0, "attemptStartTime": now,
                             "startTime": now, "conditions": [
                                 {"type": "PodsReady", "status": "True", "reason": "GangRunning", "message": "1/1",
                                  "lastTransitionTime": now, "observedGeneration": 1}]}}

        def minimal(m: dict[str, Any]) -> dict[str, Any]:
            """The same job with its defaults left out of the spec (what the schema's defaults would fill in)."""
            spec = resources.EmbeddingJobSpec.model_validate(m["spec"])
            return {**m, "metadata": {**m["metadata"], "name": "m" + m["metadata"]["name"]},
                    "spec": spec.model_dump(mode="json", exclude_defaults=True)}

        def loose(m: dict[str, Any]) -> dict[str, Any]:
            return {**m, "apiVersion": f"{LOOSE_GROUP}/{resources.VERSION}"}

        def event(i: int) -> dict[str, Any]:
            return {"apiVersion": "v1", "kind": "Event", "metadata": {"name": f"e{i}", "namespace": namespace},
                    "involvedObject": {"apiVersion": f"{resources.GROUP}/{resources.VERSION}",
                                       "kind": resources.EMBEDDING_JOB_KIND, "name": f"j{i}", "namespace": namespace},
                    "reason": "GangRunning", "message": "RUNNING: all 1 pods are running", "type": "Normal",
                    "source": {"component": "kopf"}, "firstTimestamp": now, "lastTimestamp": now, "count": 1}

        def configmap(i: int) -> dict[str, Any]:
            body = job_manifests.config_map(f"c{i}", namespace, "0", tenant, files)
            del body["metadata"]["ownerReferences"]
            return body

        def size(body: dict[str, Any]) -> int:
            return len(json.dumps(body))

        jobs_path = f"/apis/batch/v1/namespaces/{namespace}/jobs"
        kinds = [
            ("POST batch Job (suspended)", [lambda api, b=batch_job(i): _post(api, jobs_path, b) for i in range(n)],
             size(batch_job(0))),
            ("POST EmbeddingJob", [lambda api, m=m: _post(api, ej_path, m) for m in manifests], size(manifests[0])),
            ("POST EmbeddingJob, schemaless CRD", [lambda api, m=loose(m): _post(api, loose_path, m)
                                                   for m in manifests], size(manifests[0])),
            ("PATCH EmbeddingJob status (RUNNING)", [_patch(f"{ej_path}/{m['metadata']['name']}/status", status)
                                                     for m in manifests], size(status)),
            ("POST EmbeddingJob, defaults left out of the spec", [lambda api, m=minimal(m): _post(api, ej_path, m)
                                                                  for m in manifests], size(minimal(manifests[0]))),
            ("PATCH status of such an EmbeddingJob", [_patch(f"{ej_path}/m{m['metadata']['name']}/status", status)
                                                      for m in manifests], size(status)),
            ("PATCH schemaless EmbeddingJob status", [_patch(f"{loose_path}/{m['metadata']['name']}/status", status)
                                                      for m in manifests], size(status)),
            ("POST Event", [lambda api, i=i: _post(api, f"/api/v1/namespaces/{namespace}/events", event(i))
                            for i in range(n)], size(event(0))),
            ("POST ConfigMap (trainer files)", [lambda api, i=i: _post(
                api, f"/api/v1/namespaces/{namespace}/configmaps", configmap(i)) for i in range(n)],
             size(configmap(0))),
        ]
        rows = [_measure(plane, cluster, name, calls, args.threads, body_size) for name, calls, body_size in kinds]
        print(f"end: {_load()}")
        print("\n| request | requests/s | kube-apiserver CPU ms / request | etcd CPU ms / request | body bytes |")
        print("| --- | ---: | ---: | ---: | ---: |")
        for row in rows:
            print(f"| {row['kind']} | {row['per_s']:.0f} | {row['apiserver_ms']:.1f} | {row['etcd_ms']:.1f} | "
                  f"{row['body_bytes']} |")
    finally:
        plane.stop(remove=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
