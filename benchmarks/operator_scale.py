"""Operator at scale, against the control plane's own floor (not a timed test).

    .venv/bin/python -m benchmarks.operator_scale [--jobs 500 --tenants 10 --nodes 100 --threads 8]

One control plane (tests/cluster) with 100 fake 8-GPU nodes, the CRDs and the chart's operator RBAC, 10 tenants.
Two phases on it, one after the other, each the same 500 single-pod jobs (1 GPU, 1 s of fake run time) created as
fast as 8 client threads can, spread over the tenants' namespaces:

- floor: the very batch Jobs the operator would make for those jobs (job_manifests.batch_job, without the owner),
  created directly; no operator runs. This is what the control plane itself costs per job.
- kembed: the EmbeddingJobs, with one operator replica (under the chart's RBAC) making the batch Jobs.

Both phases create through the same raw client call (POST, the response not decoded into models), so the client
costs the same per object. For each phase: jobs/s from the first object created to the last job's pod scheduled
(bound to a node), p50/p99 of each job's time from created to pod scheduled, how long the creates took, the CPU
seconds of every process (kube-apiserver, etcd, kube-controller-manager, kube-scheduler, kwok, the operator and
this client process with its watches) from the first create until every job has finished, and the API requests
per job by verb and resource (the API server's own apiserver_request_total). Then kembed's figures as ratios to
the floor's. Target (issue 19): kembed >= 0.8x the floor's jobs/s with p99 <= 1.5x the floor's.

`--profile out.txt` samples the operator with py-spy (raw format, GIL-holding samples) during its phase.
`--pprof DIR` runs kube-apiserver with profiling on and keeps a CPU profile of it for each phase
(DIR/apiserver-<phase>.pprof, the first `--pprof-seconds` of the phase; read with `go tool pprof -top`).
`--audit FILE` runs kube-apiserver with an audit log (metadata only) and prints each phase's requests per job by
client (user agent and user), verb and resource: who asks what. Auditing costs the API server CPU of its own, so
the CPU figures of such a run are not comparable with one without.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import pathlib
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kubernetes import client as k8s
from kubernetes import watch
from prometheus_client.parser import text_string_to_metric_families

from kembed_contract import resources, runtime
from kembed_operator import job_manifests
from kembed_operator.settings import OperatorSettings
from kembed_operator.views import ATTEMPT_LABEL, JOB_LABEL
from tests.builders import operator_job
from tests.cluster import controlplane
from tests.cluster.fixture import Cluster, wait_for
from tests.operator import harness

# The floor's objects carry this label instead of the operator's, so no kembed code ever sees them.
FLOOR_LABEL = "bench.kembed.io/floor-job"
PROCESSES = ("kube-apiserver", "etcd", "kube-controller-manager", "kube-scheduler", "kwok", "operator", "client")


def _proc_cpu_s(pid: int) -> float:
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = int(fields[11]) + int(fields[12]) + int(fields[13]) + int(fields[14])  # utime stime cutime cstime
    return ticks / os.sysconf("SC_CLK_TCK")


def _own_cpu_s() -> float:
    times = os.times()
    return times.user + times.system


def _peak_rss_mib(pid: int) -> float:
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def _load() -> str:
    return "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg())


def _start_profiler(pid: int, out: str) -> subprocess.Popen:
    py_spy = pathlib.Path(sys.executable).with_name("py-spy")
    return subprocess.Popen([str(py_spy), "record", "-p", str(pid), "-f", "raw", "-o", out, "--gil", "--nonblocking"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)


def _body(response: Any) -> bytes:
    return (response[0] if isinstance(response, tuple) else response).data


def _requests(api: k8s.ApiClient) -> collections.Counter:
    """apiserver_request_total summed by (verb, resource[/subresource]): what every client asked so far."""
    text = _body(api.call_api("/metrics", "GET", auth_settings=["BearerToken"], _preload_content=False)).decode()
    counts: collections.Counter = collections.Counter()
    for family in text_string_to_metric_families(text):
        if family.name != "apiserver_request":
            continue
        for sample in family.samples:
            if sample.name != "apiserver_request_total":
                continue
            labels = sample.labels
            resource = labels.get("resource", "") + (f"/{labels['subresource']}" if labels.get("subresource") else "")
            counts[(labels.get("verb", ""), resource)] += sample.value
    return counts


AUDIT_POLICY = {"apiVersion": "audit.k8s.io/v1", "kind": "Policy", "omitStages": ["RequestReceived"],
                "rules": [{"level": "Metadata"}]}


def _audit_flags(log: pathlib.Path) -> tuple[str, ...]:
    policy = log.with_suffix(".policy.json")
    policy.write_text(json.dumps(AUDIT_POLICY))
    # Blocking mode: every request is in the file when its response has gone out, so a phase's part is exact.
    return (f"--audit-policy-file={policy}", f"--audit-log-path={log}", "--audit-log-format=json",
            "--audit-log-mode=blocking", "--audit-log-maxsize=0")


def _client_of(event: dict[str, Any]) -> str:
    user = event.get("user", {}).get("username", "")
    agent = event.get("userAgent", "").split(" ")[0].split("/")[0]
    user = user.removeprefix("system:serviceaccount:").removeprefix("system:")
    return f"{agent} ({user})" if agent and agent not in user else user


def _audit_counts(log: pathlib.Path, offset: int) -> collections.Counter:
    """(client, verb, resource[/subresource]) -> requests in the audit log past `offset` (ResponseComplete only)."""
    counts: collections.Counter = collections.Counter()
    with log.open("rb") as f:
        f.seek(offset)
        for line in f:
            event = json.loads(line)
            if event.get("stage") != "ResponseComplete":
                continue
            ref = event.get("objectRef") or {}
            resource = ref.get("resource", event.get("requestURI", "").split("?")[0]) + (
                f"/{ref['subresource']}" if ref.get("subresource") else "")
            counts[(_client_of(event), event.get("verb", ""), resource)] += 1
    return counts


def _apiserver_profile(api: k8s.ApiClient, out: pathlib.Path, seconds: int) -> None:
    """kube-apiserver's own CPU profile (Go pprof) over the next `seconds`."""
    out.write_bytes(_body(api.call_api(f"/debug/pprof/profile?seconds={seconds}", "GET", auth_settings=["BearerToken"],
                                       _preload_content=False, _request_timeout=seconds + 60)))


RETRIES: collections.Counter = collections.Counter()  # phase name -> creates the API server refused for a while


def _post(api: k8s.ApiClient, path: str, body: dict[str, Any], *, phase: str = "") -> None:
    """One create, the response left undecoded: the floor and kembed pay the same client cost per object.

    A busy API server answers 429 or a 5xx ("resource quota evaluation timed out"): the create is tried again after
    a pause, as every Kubernetes client does, and counted; a name already taken by the first try is a success."""
    for delay_s in (0.5, 1, 2, 4, 8, None):
        try:
            api.call_api(path, "POST", body=body, header_params={"Content-Type": "application/json"},
                         auth_settings=["BearerToken"], _preload_content=False, _request_timeout=60)
            return
        except k8s.ApiException as error:
            if error.status == 409 and RETRIES[phase]:
                return
            if delay_s is None or not (error.status == 429 or error.status >= 500):
                raise
            RETRIES[phase] += 1
            time.sleep(delay_s)


@dataclasses.dataclass
class PhaseResult:
    name: str
    num_jobs: int
    creation_s: float
    jobs_per_s: float
    p50_s: float
    p99_s: float
    cpu_s: dict[str, float]
    until_done_s: float
    requests: collections.Counter
    missing: int
    audit: collections.Counter = dataclasses.field(default_factory=collections.Counter)


class Phase:
    """Creates `bodies` (path, body, job name) with `threads` clients and follows them to scheduled and done."""

    def __init__(self, name: str, cluster: Cluster, pids: dict[str, int], *, pod_label: str,
                 done_watch: Callable[[k8s.ApiClient], tuple[Callable[..., Any], Callable[[dict], str | None]]],
                 threads: int, audit_log: pathlib.Path | None = None) -> None:
        self.name, self.cluster, self.pids, self.pod_label = name, cluster, pids, pod_label
        self.audit_log = audit_log
        self.done_watch, self.threads = done_watch, threads
        self.created_at: dict[str, float] = {}
        self.scheduled_at: dict[str, float] = {}
        self.done: set[str] = set()
        self.all_done = threading.Event()
        self.num_jobs = 0

    @staticmethod
    def _watch(list_fn: Callable[..., Any], ready: threading.Event, on_object: Callable[[dict], bool],
               **kwargs: Any) -> None:
        """Calls `on_object` with every object list_fn's watch sees until it returns True. A watch the API server
        ends (its time limit, a busy server dropping the stream) is opened again: its list brings back what changed
        meanwhile, and the followers keep only the first time they see a job scheduled or done."""
        ready.set()
        while True:
            stream = watch.Watch()
            try:
                for event in stream.stream(list_fn, timeout_seconds=900, **kwargs):
                    if on_object(event["raw_object"]):
                        stream.stop()
                        return
            except Exception as error:  # noqa: BLE001 - any broken stream is reopened; the phase has its own limit
                print(f"watch reopened after: {type(error).__name__}: {error}", flush=True)
                time.sleep(0.5)

    def _follow_pods(self, ready: threading.Event) -> None:
        core = k8s.CoreV1Api(self.cluster.api_client())

        def on_pod(pod: dict) -> bool:
            job = pod["metadata"]["labels"][self.pod_label]
            if pod["spec"].get("nodeName") and job not in self.scheduled_at:
                self.scheduled_at[job] = time.monotonic()
            return len(self.scheduled_at) >= self.num_jobs

        self._watch(core.list_pod_for_all_namespaces, ready, on_pod, label_selector=self.pod_label)

    def _follow_done(self, ready: threading.Event) -> None:
        list_fn, finished = self.done_watch(self.cluster.api_client())

        def on_job(job: dict) -> bool:
            name = finished(job)
            if name:
                self.done.add(name)
            if len(self.done) >= self.num_jobs:
                self.all_done.set()
                return True
            return False

        self._watch(list_fn, ready, on_job)

    def run(self, bodies: list[tuple[str, dict[str, Any], str]], *, on_started: Callable[[], None] | None = None,
            pprof: tuple[pathlib.Path, int] | None = None) -> PhaseResult:
        self.num_jobs = len(bodies)
        admin = self.cluster.api_client()
        followers = []
        for target in (self._follow_pods, self._follow_done):
            ready = threading.Event()
            thread = threading.Thread(target=target, args=(ready,), daemon=True)
            thread.start()
            ready.wait()
            followers.append(thread)
        time.sleep(1)  # the watches are open
        requests_before = _requests(admin)
        audit_offset = self.audit_log.stat().st_size if self.audit_log else 0
        cpu_before = {name: _proc_cpu_s(pid) for name, pid in self.pids.items()} | {"client": _own_cpu_s()}
        clients = [self.cluster.api_client() for _ in range(self.threads)]
        local = threading.local()
        counter = iter(range(len(clients)))
        lock = threading.Lock()

        def create(item: tuple[str, dict[str, Any], str]) -> None:
            if not hasattr(local, "api"):
                with lock:
                    local.api = clients[next(counter)]
            path, body, job = item
            self.created_at[job] = time.monotonic()
            _post(local.api, path, body, phase=self.name)

        if on_started is not None:
            on_started()
        profiler = None
        if pprof is not None:
            profiler = threading.Thread(target=_apiserver_profile, args=(admin, *pprof), daemon=True)
            profiler.start()
        started = time.monotonic()
        with ThreadPoolExecutor(max_workers=self.threads) as pool:
            list(pool.map(create, bodies))
        creation_s = time.monotonic() - started
        followers[0].join(timeout=600)
        self.all_done.wait(timeout=600)
        until_done_s = time.monotonic() - started
        if profiler is not None:
            profiler.join(timeout=120)
        cpu = {name: _proc_cpu_s(pid) - cpu_before[name] for name, pid in self.pids.items()}
        cpu["client"] = _own_cpu_s() - cpu_before["client"]
        requests = _requests(admin) - requests_before
        audit = _audit_counts(self.audit_log, audit_offset) if self.audit_log else collections.Counter()
        latencies = [self.scheduled_at[j] - self.created_at[j] for j in self.created_at if j in self.scheduled_at]
        elapsed = max(self.scheduled_at.values()) - started
        return PhaseResult(
            name=self.name, num_jobs=len(bodies), creation_s=creation_s, jobs_per_s=len(latencies) / elapsed,
            p50_s=statistics.median(latencies), p99_s=_pct(latencies, 0.99), cpu_s=cpu, until_done_s=until_done_s,
            requests=requests, missing=len(bodies) - len(latencies), audit=audit,
        )


def _floor_bodies(specs: list[tuple[str, str, resources.EmbeddingJobSpec]], settings: OperatorSettings,
                  ) -> list[tuple[str, dict[str, Any], str]]:
    """The batch Jobs the operator would make for these jobs, relabelled and without an owner."""
    bodies = []
    for namespace, name, spec in specs:
        tenant = namespace.removeprefix(resources.NAMESPACE_PREFIX)
        folder = runtime.job_checkpoint_folder(f"s3://kembed-test/{tenant}", name)  # as the operator's
        files = job_manifests.trainer_files(spec, default_checkpoint_uri=folder)
        body = job_manifests.batch_job(name, namespace, "0", tenant, spec, attempt=0, settings=settings, files=files)
        for meta in (body["metadata"], body["spec"]["template"]["metadata"]):
            labels = meta["labels"]
            labels[FLOOR_LABEL] = labels.pop(JOB_LABEL)
            labels.pop(ATTEMPT_LABEL, None)
        del body["metadata"]["ownerReferences"]
        bodies.append((f"/apis/batch/v1/namespaces/{namespace}/jobs", body, name))
    return bodies


def _floor_done(api: k8s.ApiClient):
    batch = k8s.BatchV1Api(api)

    def finished(job: dict) -> str | None:
        conditions = (job.get("status") or {}).get("conditions") or []
        if any(c["type"] in ("Complete", "Failed") and c["status"] == "True" for c in conditions):
            return job["metadata"]["name"]
        return None

    return (lambda **kw: batch.list_job_for_all_namespaces(label_selector=FLOOR_LABEL, **kw)), finished


def _kembed_done(api: k8s.ApiClient):
    custom = k8s.CustomObjectsApi(api)
    terminal = harness.TERMINAL

    def finished(job: dict) -> str | None:
        return job["metadata"]["name"] if (job.get("status") or {}).get("phase") in terminal else None

    return (lambda **kw: custom.list_cluster_custom_object(resources.GROUP, resources.VERSION,
                                                           resources.EMBEDDING_JOB_PLURAL, **kw)), finished


def _print_results(floor: PhaseResult, kembed: PhaseResult, operator_rss: float) -> None:
    print("\n| phase | jobs | creates took | jobs/s (created -> pod scheduled) | p50 | p99 | until all finished | "
          + " | ".join(f"CPU s {p}" for p in PROCESSES) + " | CPU ms per job, all processes |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | " + " | ".join("---:" for _ in PROCESSES) + " | ---: |")
    for r in (floor, kembed):
        total = sum(r.cpu_s.values())
        print(f"| {r.name} | {r.num_jobs} | {r.creation_s:.1f} s | {r.jobs_per_s:.1f} | {r.p50_s:.2f} s | "
              f"{r.p99_s:.2f} s | {r.until_done_s:.1f} s | "
              + " | ".join(f"{r.cpu_s.get(p, 0.0):.1f}" for p in PROCESSES)
              + f" | {1000 * total / r.num_jobs:.0f} |")
    ratio = kembed.jobs_per_s / floor.jobs_per_s
    p99_ratio = kembed.p99_s / floor.p99_s
    cpu_ratio = sum(kembed.cpu_s.values()) / sum(floor.cpu_s.values())
    api_ratio = kembed.cpu_s["kube-apiserver"] / floor.cpu_s["kube-apiserver"]
    print(f"\nkembed / floor: jobs/s {ratio:.2f}x (target >= 0.8x), p99 {p99_ratio:.2f}x (target <= 1.5x), "
          f"CPU of all processes {cpu_ratio:.2f}x, kube-apiserver CPU {api_ratio:.2f}x; "
          f"operator peak RSS {operator_rss:.0f} MiB")
    for r in (floor, kembed):
        if r.missing:
            print(f"{r.name}: {r.missing} jobs never got their pod scheduled")
        if RETRIES[r.name]:
            print(f"{r.name}: {RETRIES[r.name]} creates refused by the busy API server (429/5xx) and tried again")
    print("\nAPI requests per job (apiserver_request_total over each phase; WATCH = watches opened):")
    keys = sorted(set(floor.requests) | set(kembed.requests),
                  key=lambda k: (-(kembed.requests[k] + floor.requests[k]), k))
    print("| verb | resource | floor | kembed |")
    print("| --- | --- | ---: | ---: |")
    for key in keys:
        f, k = floor.requests[key] / floor.num_jobs, kembed.requests[key] / kembed.num_jobs
        if f >= 0.005 or k >= 0.005:
            print(f"| {key[0]} | {key[1]} | {f:.2f} | {k:.2f} |")
    print(f"| all | | {sum(floor.requests.values()) / floor.num_jobs:.1f} | "
          f"{sum(kembed.requests.values()) / kembed.num_jobs:.1f} |")
    if floor.audit or kembed.audit:
        print("\nAPI requests per job by client (audit log over each phase):")
        print("| client | verb | resource | floor | kembed |")
        print("| --- | --- | --- | ---: | ---: |")
        keys = sorted(set(floor.audit) | set(kembed.audit), key=lambda k: (-(kembed.audit[k] + floor.audit[k]), k))
        for key in keys:
            f, k = floor.audit[key] / floor.num_jobs, kembed.audit[key] / kembed.num_jobs
            if f >= 0.005 or k >= 0.005:
                print(f"| {key[0]} | {key[1]} | {key[2]} | {f:.2f} | {k:.2f} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--jobs", type=int, default=500)
    parser.add_argument("--tenants", type=int, default=10)
    parser.add_argument("--nodes", type=int, default=100)
    parser.add_argument("--threads", type=int, default=8, help="client threads creating the objects")
    parser.add_argument("--profile", metavar="OUT", help="py-spy raw profile of the operator during its phase")
    parser.add_argument("--json", metavar="OUT", help="also write both phases' figures as JSON")
    parser.add_argument("--pprof", metavar="DIR", type=pathlib.Path, help="kube-apiserver CPU profile per phase")
    parser.add_argument("--pprof-seconds", type=int, default=15)
    parser.add_argument("--audit", metavar="FILE", type=pathlib.Path, help="kube-apiserver audit log, by client")
    args = parser.parse_args()
    print(f"start: {_load()}", flush=True)

    run_dir = controlplane.runs_root() / f"bench-operator-{int(time.time())}"
    flags = (("--profiling=true",) if args.pprof else ()) + (_audit_flags(args.audit.resolve()) if args.audit else ())
    config = controlplane.ClusterConfig(num_gpu_nodes=args.nodes, apiserver_flags=flags)
    plane = controlplane.ControlPlane(run_dir, config, owner_pid=os.getpid())
    pprof = None
    if args.pprof:
        args.pprof.mkdir(parents=True, exist_ok=True)
        pprof = lambda phase: (args.pprof / f"apiserver-{phase}.pprof", args.pprof_seconds)  # noqa: E731
    audit_log = args.audit.resolve() if args.audit else None
    plane.start()
    cluster = Cluster(plane)
    operator = None
    try:
        wait_for(lambda: cluster.core().list_namespaced_service_account("default").items, timeout_s=60)
        harness.install_platform(cluster)
        work = pathlib.Path(tempfile.mkdtemp(prefix="kembed-bench-"))
        operator = harness.OperatorProcess(cluster, work, name="bench", peering_name="kembed-bench",
                                           rendezvous_timeout_s=600, resync_interval_s=30,
                                           progress_interval_s=300).start()
        tenants = [harness.tenant_name() for _ in range(args.tenants)]
        for tenant in tenants:
            harness.create_tenant(cluster, tenant, gpus=8 * args.nodes)
        settings = OperatorSettings(**{k: v for k, v in operator.settings.items()})
        pids = {name: pid for name, pid in plane.pgids.items() if name != "kubelet"}

        def job_specs(prefix: str) -> list[tuple[str, str, resources.EmbeddingJobSpec, dict[str, Any]]]:
            out = []
            for i in range(args.jobs):
                builder = operator_job(f"{prefix}{i}")
                builder.spec["labels"] = {}
                tenant = tenants[i % len(tenants)]
                manifest = builder.manifest(tenant)
                spec = resources.EmbeddingJobSpec.model_validate(manifest["spec"])
                out.append((resources.tenant_namespace(tenant), builder.job_id, spec, manifest))
            return out

        # The operator is stopped while the floor runs: the floor is the control plane alone.
        operator.stop()
        floor_jobs = job_specs("f")
        floor = Phase("floor (plain batch Jobs)", cluster, pids, pod_label=FLOOR_LABEL, done_watch=_floor_done,
                      threads=args.threads, audit_log=audit_log).run(
            _floor_bodies([(n, j, s) for n, j, s, _ in floor_jobs], settings), pprof=pprof("floor") if pprof else None)
        # Printed now, so a run cut short in the kembed phase still leaves the floor's figures.
        print(f"floor done: {_load()}; {floor.jobs_per_s:.1f} jobs/s, p50 {floor.p50_s:.2f} s, p99 {floor.p99_s:.2f} s, "
              "CPU s " + ", ".join(f"{p} {floor.cpu_s.get(p, 0.0):.1f}" for p in PROCESSES), flush=True)

        operator.start()
        wait_for(lambda: "kembed operator configured" in operator.log(), timeout_s=60, what="operator started")
        time.sleep(5)  # its watches listed what exists (the floor's objects among them)
        kembed_jobs = job_specs("k")
        kembed_bodies = [(f"/apis/{resources.GROUP}/{resources.VERSION}/namespaces/{n}/"
                          f"{resources.EMBEDDING_JOB_PLURAL}", m, j) for n, j, _, m in kembed_jobs]
        profiler = None

        def start_profiler() -> None:
            nonlocal profiler
            if args.profile:
                profiler = _start_profiler(operator.process.pid, args.profile)

        kembed_phase = Phase("kembed (EmbeddingJobs + operator)", cluster, pids | {"operator": operator.process.pid},
                             pod_label=JOB_LABEL, done_watch=_kembed_done, threads=args.threads,
                             audit_log=audit_log)
        kembed = kembed_phase.run(kembed_bodies, on_started=start_profiler, pprof=pprof("kembed") if pprof else None)
        if profiler is not None:
            profiler.send_signal(signal.SIGINT)  # py-spy writes its file on Ctrl-C, not on SIGTERM
            profiler.wait(timeout=60)
        print(f"end: {_load()}")
        _print_results(floor, kembed, _peak_rss_mib(operator.process.pid))
        if args.json:
            pathlib.Path(args.json).write_text(json.dumps(
                [dict(dataclasses.asdict(r), requests={f"{v} {res}": n for (v, res), n in r.requests.items()})
                 for r in (floor, kembed)], indent=2))
        forbidden = operator.forbidden_lines()
        if forbidden:
            print("RBAC refusals:", *forbidden[:5], sep="\n")
    finally:
        if operator is not None:
            operator.stop()
        plane.stop(remove=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
