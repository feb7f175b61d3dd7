"""Real trainers on the test kubelet's local node. The gang runs in the real trainer image (`make images`, pulled
from the local registry and run with runc): it trains, checkpoints to S3 (moto), loses a pod, resumes, succeeds; an
image that cannot be pulled and a trainer that crashes at start fail their jobs with the reason. The one-node job
tests the operator's manifests, not the image: its trainer runs as local processes (the kubelet's fast mode)."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Callable

import pytest

from kembed_api.platform.confinement import node_processes
from kembed_api.platform.ports import free_port
from kembed_operator import job_manifests
from kembed_operator.settings import OperatorSettings
from tests.builders import operator_job
from tests.cluster import controlplane
from tests.cluster.fixture import Cluster, wait_for
from tests.images.registry import prepull
from tests.operator import harness
from tests.operator.harness import job_pods, wait_phase

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

# Long enough that the pod is killed well before the end (the kill follows the first checkpoint, at step 50, within
# a second or two; the tiny gang trains tens of steps a second), short enough that the resumed attempt is not
# most of the suite's time: 4000 steps took 8 minutes here on a loaded machine.
STEPS = 1000



def _local_operator(platform: Cluster, s3_server, tmp_path, **settings):
    """An operator whose trainers run on the local node."""
    return harness.OperatorProcess(
        platform, tmp_path, name="e2e-operator",
        trainer_node_selector={controlplane.LOCAL_NODE_LABEL: "true"},
        trainer_tolerations=[{"key": controlplane.LOCAL_NODE_TAINT_KEY, "operator": "Exists",
                              "effect": "NoSchedule"}],
        s3_endpoint_url=s3_server.endpoint_url, rendezvous_port=free_port(), rendezvous_timeout_s=120, **settings,
    ).start()


@pytest.fixture
def local_operator(platform: Cluster, s3_server, tmp_path):
    """Trainers as local processes (no image)."""
    process = _local_operator(platform, s3_server, tmp_path)
    yield process
    process.stop()
    assert not process.forbidden_lines(), process.forbidden_lines()


@pytest.fixture
def image_operator(platform: Cluster, s3_server, images, tmp_path):
    """Trainers in this tree's trainer image (pre-pulled onto the node, as a platform team does with big images),
    with the product's own image pull time-out."""
    prepull(platform, images.trainer)
    process = _local_operator(platform, s3_server, tmp_path, trainer_image=images.trainer,
                              image_pull_timeout_s=OperatorSettings().image_pull_timeout_s)
    yield process
    process.stop()
    assert not process.forbidden_lines(), process.forbidden_lines()


def _kill_pod_processes(cluster: Cluster, pod) -> None:
    """What a node failure or an OOM kill does: every process of the pod gets SIGKILL (exit 137). The kubelet
    records a process group per container (process mode) or the container's init process (image mode: killing it
    ends the container's pid namespace)."""
    pod_dir = cluster.run_dir / "kubelet" / "pods" / pod.metadata.uid
    pgid_files, pid_files = list(pod_dir.glob("*.pgid")), list(pod_dir.glob("*.pid"))
    assert pgid_files or pid_files, f"no running process recorded for pod {pod.metadata.name}"
    for pgid_file in pgid_files:
        os.killpg(int(pgid_file.read_text()), signal.SIGKILL)
    for pid_file in pid_files:
        os.kill(int(pid_file.read_text()), signal.SIGKILL)


def _gang_survives_a_killed_pod(platform: Cluster, s3_server, make_tenant, builder,
                                on_running: Callable[[list], None] = lambda gang: None) -> None:
    """The 2-node job `builder` makes trains to a first checkpoint in S3, loses a pod (SIGKILL), restarts from that
    checkpoint and succeeds. `on_running(gang)` looks at each attempt's running pods."""
    s3_server.create_bucket("kembed-test")
    tenant, namespace = make_tenant()
    job = builder.create(platform, tenant)

    wait_phase(platform, namespace, job, "RUNNING", timeout_s=120)
    checkpointed = wait_for(lambda: (harness.job_status(platform, namespace, job).get("latestCheckpoint") or {}).get(
        "step", 0) >= 50, timeout_s=300, interval_s=0.5, what="a first checkpoint in S3")
    assert checkpointed
    first_checkpoint = harness.job_status(platform, namespace, job)["latestCheckpoint"]
    assert first_checkpoint["uri"].startswith(f"s3://kembed-test/{tenant}/{job}/step-")

    gang = sorted(job_pods(platform, namespace, job), key=lambda p: p.metadata.name)
    assert len(gang) == 2, (harness.job_status(platform, namespace, job),
                            [(p.metadata.name, p.status.phase) for p in gang])
    on_running(gang)
    victim = gang[1]
    _kill_pod_processes(platform, victim)

    restarting = wait_phase(platform, namespace, job, "RESTARTING", "FAILED", timeout_s=60)
    assert restarting["phase"] == "RESTARTING", [
        (e.last_timestamp, e.reason, e.message) for e in harness.events_of(platform, namespace, job)]
    assert "137 (SIGKILL)" in restarting["message"]
    wait_phase(platform, namespace, job, "RUNNING", timeout_s=180)
    resumed = sorted((p for p in job_pods(platform, namespace, job) if p.metadata.labels["kembed.io/attempt"] == "1"),
                     key=lambda p: p.metadata.name)
    rank0 = next(p for p in resumed if p.metadata.name.startswith(f"{job}-0-"))

    def started_record():
        for line in platform.pod_log(namespace, rank0.metadata.name).splitlines():
            if line.startswith('{"event": "started"'):
                return json.loads(line)
        return None

    try:
        started = wait_for(started_record, timeout_s=120, interval_s=1, what="the resumed trainer's started record")
    except TimeoutError:  # what the resumed rank 0 said instead
        raise AssertionError(platform.pod_log(namespace, rank0.metadata.name)[-3000:]) from None
    assert started["resumed_from"] and started["step"] >= first_checkpoint["step"], started
    on_running(resumed)

    done = wait_phase(platform, namespace, job, "SUCCEEDED", "FAILED", timeout_s=600)
    assert done["phase"] == "SUCCEEDED", done
    assert done["restartCount"] == 1 and done["progress"]["percent"] == 100
    assert done["latestCheckpoint"]["uri"].endswith(f"/step-{STEPS}")


def _gang(name: str):
    return (operator_job(name).with_nodes(2).with_cpu_only(procs_per_node=1, cpu=1, memory="2Gi").with_max_restarts(2)
            .with_trainer(training={"steps": STEPS, "log_every": 50, "threads": 1}, checkpoint={"every_steps": 50}))


@pytest.mark.images
def test_a_two_node_cpu_gang_in_the_trainer_image_survives_a_killed_pod_and_resumes_from_its_s3_checkpoint(
        platform: Cluster, s3_server, image_operator, make_tenant):
    _gang_survives_a_killed_pod(platform, s3_server, make_tenant, _gang("e2e"))


def _tier_files_of(platform: Cluster, pod) -> list[tuple[str, str]]:
    """(the file as the trainer names it, where its folder is mounted from) for each tier file the pod's trainers
    hold open: /proc of the container's processes, as the host sees them (the files are unlinked at open, so no
    listing of the volume shows them), and the mount that holds the file, from the same process's mountinfo."""
    pod_dir = platform.run_dir / "kubelet" / "pods" / pod.metadata.uid
    init = int(next(pod_dir.glob("*.pid")).read_text())
    found = []
    for pid in node_processes(init):
        try:
            held = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
            with open(f"/proc/{pid}/mountinfo") as table:
                mounts = {line.split()[4]: line.split()[3] for line in table}  # mount point: its root
        except OSError:  # ended meanwhile
            continue
        for path in held:
            if "/kembed-tier-" in path:
                folder = os.path.dirname(path)
                found.append((path, mounts.get(folder, "")))
    return found


@pytest.mark.images
def test_a_tiered_gang_keeps_its_rows_on_each_pods_volume_and_resumes_after_a_killed_pod(
        platform: Cluster, s3_server, image_operator, make_tenant):
    """Table t0 tiered, its cache sized from the pod's memory: each trainer's tier file is on its pod's own
    volume (the emptyDir the kubelet keeps under the pod's folder), never the container's root file system, before
    and after a pod is killed and the gang resumes from S3."""
    def tiers_on_the_pods_volumes(gang: list) -> None:
        for pod in gang:
            volume = platform.run_dir / "kubelet" / "pods" / pod.metadata.uid / "volumes" / job_manifests.LOCAL_VOLUME
            files = wait_for(lambda pod=pod: _tier_files_of(platform, pod), timeout_s=60, interval_s=0.5,
                             what=f"the tier file of {pod.metadata.name}")
            for path, source in files:
                assert path.startswith(f"{job_manifests.LOCAL_MOUNT}/kembed-tier-") and path.endswith(" (deleted)")
                # The bind mount's root is the volume's folder (a path within its file system: a suffix of it).
                assert source and str(volume).endswith(source) and source.endswith(
                    f"/{pod.metadata.uid}/volumes/{job_manifests.LOCAL_VOLUME}"), (source, volume)

    _gang_survives_a_killed_pod(platform, s3_server, make_tenant, _gang("tier").with_table("t0", tier={}),
                                on_running=tiers_on_the_pods_volumes)


def test_a_one_node_job_trains_from_the_files_in_its_pod_annotations(platform: Cluster, s3_server, local_operator,
                                                                    make_tenant):
    """No Service and no ConfigMap: the launcher and config come through a downward-API volume, rank 0 is local."""
    s3_server.create_bucket("kembed-test")
    tenant, namespace = make_tenant()
    job = (operator_job("single").with_cpu_only(procs_per_node=1, cpu=1, memory="2Gi")
           .with_trainer(training={"steps": 20, "log_every": 10, "threads": 1}, checkpoint={"every_steps": 10})
           .create(platform, tenant))

    done = wait_phase(platform, namespace, job, "SUCCEEDED", "FAILED", timeout_s=300)
    assert done["phase"] == "SUCCEEDED", done
    assert done["latestCheckpoint"]["uri"] == f"s3://kembed-test/{tenant}/{job}/step-20"
    assert not platform.core().list_namespaced_service(namespace).items
    assert not platform.core().list_namespaced_config_map(namespace, label_selector=f"kembed.io/job={job}").items


@pytest.mark.images
def test_an_image_that_cannot_be_pulled_fails_the_job_with_the_reason_within_a_minute(platform: Cluster, images,
                                                                                      image_operator, make_tenant):
    tenant, namespace = make_tenant()
    job = (operator_job("nopull").with_cpu_only(procs_per_node=1, cpu=1, memory="1Gi").with_image(images.missing("trainer"))
           .with_trainer(training={"steps": 10}).create(platform, tenant))

    def pull_error_reported():
        conditions = harness.job_status(platform, namespace, job).get("conditions") or []
        ready = next((c for c in conditions if c["type"] == "PodsReady"), {})
        return ready if ready.get("reason") in ("ErrImagePull", "ImagePullBackOff") else None

    ready = wait_for(pull_error_reported, timeout_s=30, interval_s=0.5, what="the pull error on the job")
    assert "manifest unknown" in ready["message"], ready
    done = wait_phase(platform, namespace, job, "FAILED", "SUCCEEDED", timeout_s=60)
    assert done["reason"] == "ImagePullFailed" and "manifest unknown" in done["message"], done


@pytest.mark.images
def test_a_trainer_that_crashes_at_start_fails_the_job_with_its_exit_code(platform: Cluster, images, image_operator,
                                                                          make_tenant):
    """The platform image has no torch: the trainer's launcher dies at its first import."""
    tenant, namespace = make_tenant()
    job = (operator_job("crash").with_cpu_only(procs_per_node=1, cpu=1, memory="1Gi").with_image(images.platform)
           .with_max_restarts(0).with_trainer(training={"steps": 10}).create(platform, tenant))
    done = wait_phase(platform, namespace, job, "FAILED", "SUCCEEDED", timeout_s=60)
    assert done["phase"] == "FAILED" and "exit code 1" in done["message"], done
