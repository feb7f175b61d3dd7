"""Operator at scale: 500 EmbeddingJobs across 10 tenants on 100 fake 8-GPU nodes (not a timed test).

    .venv/bin/python -m benchmarks.operator_scale [--jobs 500 --tenants 10 --nodes 100]

Starts its own control plane (tests/cluster), installs the CRDs and the chart's operator RBAC, runs one operator
replica under that identity, then creates the jobs as fast as 8 client threads can. Each job is 1 pod with
1 GPU that runs 1 s on a fake node (kwok's default stage). Reported: jobs/s from the first CR created to the last
job's pods all scheduled (bound to a node), the same for the operator's own part (CR created to its batch Job
created), the p50/p99 latency of each job from its CR created to its pods scheduled, and the operator's CPU
seconds and peak RSS (from /proc) over the run. Also where each job's time goes after the operator (batch Job ->
pod created by the Job controller -> pod bound by the scheduler), how long creating the CRs took, the CPU seconds
of every control-plane process, and the load average (the machine is shared). Targets (issue 5): >= 50 jobs/s, p99 < 5 s.

`--profile out.txt` samples the operator with py-spy (raw format, GIL-holding samples) during the run.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from kubernetes import client as k8s
from kubernetes import watch

from tests.cluster import controlplane
from tests.cluster.fixture import Cluster, wait_for
from tests.operator import harness


def _proc_cpu_s(pid: int) -> float:
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = int(fields[11]) + int(fields[12]) + int(fields[13]) + int(fields[14])  # utime stime cutime cstime
    return ticks / os.sysconf("SC_CLK_TCK")


def _peak_rss_mib(pid: int) -> float:
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _percentiles(values: list[float]) -> str:
    if not values:
        return "n/a"
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
    return f"p50 {statistics.median(ordered):.2f} s, p99 {p99:.2f} s"


def _load() -> str:
    return "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg())


def _start_profiler(pid: int, out: str) -> subprocess.Popen:
    py_spy = pathlib.Path(sys.executable).with_name("py-spy")
    return subprocess.Popen([str(py_spy), "record", "-p", str(pid), "-f", "raw", "-o", out, "--gil", "--nonblocking"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--jobs", type=int, default=500)
    parser.add_argument("--tenants", type=int, default=10)
    parser.add_argument("--nodes", type=int, default=100)
    parser.add_argument("--profile", metavar="OUT", help="py-spy raw profile of the operator during the run")
    args = parser.parse_args()
    print(f"start: {_load()}", flush=True)

    run_dir = controlplane.runs_root() / f"bench-operator-{int(time.time())}"
    plane = controlplane.ControlPlane(run_dir, controlplane.ClusterConfig(num_gpu_nodes=args.nodes),
                                      owner_pid=os.getpid())
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
        builders = [harness.JobBuilder(f"b{i}").gpus(1) for i in range(args.jobs)]
        for builder in builders:
            builder.spec["labels"] = {}
        created_at: dict[str, float] = {}
        scheduled_at: dict[str, float] = {}
        pod_seen_at: dict[str, float] = {}  # the Job controller created the job's (first) pod
        done = threading.Event()

        def follow_pods():
            core = k8s.CoreV1Api(cluster.api_client())
            stream = watch.Watch()
            for event in stream.stream(core.list_pod_for_all_namespaces, label_selector="kembed.io/job",
                                       timeout_seconds=600):
                pod = event["object"]
                job = pod.metadata.labels.get("kembed.io/job")
                pod_seen_at.setdefault(job, time.monotonic())
                if pod.spec.node_name and job not in scheduled_at:
                    scheduled_at[job] = time.monotonic()
                if done.is_set() or len(scheduled_at) >= args.jobs:
                    stream.stop()

        def follow_batch_jobs():
            batch = k8s.BatchV1Api(cluster.api_client())
            stream = watch.Watch()
            for event in stream.stream(batch.list_job_for_all_namespaces, label_selector="kembed.io/job",
                                       timeout_seconds=600):
                job_created_at.setdefault(event["object"].metadata.name, time.monotonic())
                if done.is_set() or len(job_created_at) >= args.jobs:
                    stream.stop()

        job_created_at: dict[str, float] = {}
        follower = threading.Thread(target=follow_pods, daemon=True)
        follower.start()
        threading.Thread(target=follow_batch_jobs, daemon=True).start()
        time.sleep(1)
        cpu_before = _proc_cpu_s(operator.process.pid)
        components = dict(plane.pgids) | {"operator": operator.process.pid}
        components_before = {name: _proc_cpu_s(pid) for name, pid in components.items()}
        profiler = _start_profiler(operator.process.pid, args.profile) if args.profile else None

        def create(i: int) -> None:
            builder = builders[i]
            created_at[builder.job_id] = time.monotonic()
            builder.create(cluster, tenants[i % len(tenants)])

        started = time.monotonic()
        with ThreadPoolExecutor(max_workers=8) as pool:
            list(pool.map(create, range(args.jobs)))
        creation_s = time.monotonic() - started
        follower.join(timeout=600)
        done.set()
        cpu = _proc_cpu_s(operator.process.pid) - cpu_before
        components_cpu = {name: _proc_cpu_s(pid) - components_before[name] for name, pid in components.items()}
        if profiler is not None:
            profiler.send_signal(signal.SIGINT)  # py-spy writes its file on Ctrl-C, not on SIGTERM
            profiler.wait(timeout=60)
        rss = _peak_rss_mib(operator.process.pid)
        missing = [j for j in created_at if j not in scheduled_at]
        latencies = sorted(scheduled_at[j] - created_at[j] for j in created_at if j in scheduled_at)
        elapsed = max(scheduled_at.values()) - started
        operator_latencies = sorted(job_created_at[j] - created_at[j] for j in created_at if j in job_created_at)
        operator_elapsed = max(job_created_at.values()) - started
        p99 = latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))]
        print("| jobs | tenants | fake nodes | jobs/s (created -> all pods scheduled) | p50 | p99 | operator CPU | "
              "operator peak RSS |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- |")
        print(f"| {args.jobs} | {args.tenants} | {args.nodes} | {len(latencies) / elapsed:.1f} | "
              f"{statistics.median(latencies):.2f} s | {p99:.2f} s | {cpu:.1f} s | {rss:.0f} MiB |")
        op_p99 = operator_latencies[min(len(operator_latencies) - 1, int(0.99 * len(operator_latencies)))]
        print(f"\noperator alone (CR created -> its batch Job created): {len(operator_latencies) / operator_elapsed:.1f} "
              f"jobs/s, p50 {statistics.median(operator_latencies):.2f} s, p99 {op_p99:.2f} s")
        print(f"the {args.jobs} CRs were created in {creation_s:.1f} s ({args.jobs / creation_s:.1f}/s): "
              "no figure above can beat that rate")
        print("after the operator: batch Job created -> pod created (Job controller): "
              + _percentiles([pod_seen_at[j] - job_created_at[j] for j in job_created_at if j in pod_seen_at])
              + "; pod created -> bound (scheduler): "
              + _percentiles([scheduled_at[j] - pod_seen_at[j] for j in pod_seen_at if j in scheduled_at]))
        print(f"CPU seconds over {elapsed:.1f} s: "
              + ", ".join(f"{name} {seconds:.1f}" for name, seconds in sorted(components_cpu.items())))
        print(f"end: {_load()}")
        if missing:
            print(f"{len(missing)} jobs never got their pods scheduled")
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
