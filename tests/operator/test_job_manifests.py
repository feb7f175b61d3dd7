"""What the operator writes for a job (pure, no cluster): the batch Job, and only the side objects it needs."""

from __future__ import annotations

import json

import pytest

from kembed_contract import resources, runtime, sizing, threads
from kembed_operator import job_manifests
from kembed_operator.settings import OperatorSettings
from tests.builders import SpecBuilder, operator_job

ARGS = ("demo", "kembed-acme", "uid-1", "acme")
CHECKPOINTS = "s3://kembed-test/acme/demo"


def _spec(builder: SpecBuilder) -> resources.EmbeddingJobSpec:
    return resources.EmbeddingJobSpec.model_validate(builder.manifest("acme")["spec"])


def _children(builder: SpecBuilder, **settings) -> tuple[dict, list[dict]]:
    spec, settings = _spec(builder), OperatorSettings(**settings)
    files = job_manifests.trainer_files(spec, default_checkpoint_uri=CHECKPOINTS)
    return (job_manifests.batch_job(*ARGS, spec, attempt=0, settings=settings, files=files),
            job_manifests.side_children(*ARGS, spec, files, settings))


def _volume(job: dict, name: str) -> dict:
    return next(v for v in job["spec"]["template"]["spec"]["volumes"] if v["name"] == name)


def _file_from_annotation(job: dict, path: str) -> str:
    """What the kubelet writes at CONFIG_MOUNT/<path>: the annotation the downward-API item names."""
    item = next(i for i in _volume(job, "config")["downwardAPI"]["items"] if i["path"] == path)
    key = item["fieldRef"]["fieldPath"].removeprefix("metadata.annotations['").removesuffix("']")
    return job["spec"]["template"]["metadata"]["annotations"][key]


def test_a_one_node_job_is_only_its_batch_job():
    job, side = _children(operator_job("one").with_gpus(1))
    assert side == []
    pod = job["spec"]["template"]["spec"]
    args = pod["containers"][0]["args"]
    assert "--nnodes=1" in args and "--master-addr=127.0.0.1" in args  # rank 0 is in the pod itself
    assert "subdomain" not in pod
    config = json.loads(_file_from_annotation(job, job_manifests.CONFIG_FILE))
    assert config["checkpoint"]["uri"] == CHECKPOINTS
    assert config["model"] == _spec(operator_job("one")).trainer.model.model_dump(mode="json")
    mounts = {m["name"]: m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}
    assert mounts["config"] == job_manifests.CONFIG_MOUNT
    # The image's own launcher; the pod carries only the config (annotations are copied into every pod).
    assert args[:2] == ["-m", "kembed_trainer.launch"] and f"{job_manifests.CONFIG_MOUNT}/{job_manifests.CONFIG_FILE}" in args
    assert list(job["spec"]["template"]["metadata"]["annotations"]) == [job_manifests.CONFIG_ANNOTATION]


def test_a_gang_gets_the_headless_service_its_ranks_find_rank_0_through():
    job, side = _children(operator_job("gang").with_nodes(3).with_gpus(2))
    assert [(c["kind"], c["metadata"]["name"]) for c in side] == [("Service", "demo")]
    service = side[0]
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"]
    assert service["spec"]["selector"] == {"kembed.io/job": "demo"}
    assert service["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    pod = job["spec"]["template"]["spec"]
    assert pod["subdomain"] == "demo" and "--master-addr=demo-0.demo" in pod["containers"][0]["args"]
    assert "downwardAPI" in _volume(job, "config")


def test_a_config_too_large_for_annotations_goes_into_a_config_map():
    # As large as the spec's bounds let a config be in tables and features (names of 100 characters).
    tables = [{"name": f"t{i}", "num_embeddings": 10, "embedding_dim": 8,
               "features": [f"feature_{i:04d}_{j}_".ljust(100, "x") for j in range(4)]} for i in range(256)]
    builder = operator_job("big").with_gpus(1).with_trainer(embeddings={"tables": tables})
    job, side = _children(builder)
    assert [(c["kind"], c["metadata"]["name"]) for c in side] == [("ConfigMap", "demo")]
    config_map = side[0]
    assert len(config_map["data"][job_manifests.CONFIG_FILE].encode()) > job_manifests.MAX_INLINE_CONFIG_BYTES
    assert json.loads(config_map["data"][job_manifests.CONFIG_FILE])["checkpoint"]["uri"] == CHECKPOINTS
    assert _volume(job, "config")["configMap"] == {"name": "demo"}
    assert "annotations" not in job["spec"]["template"]["metadata"]


def test_the_trainers_are_told_their_storage_budget_when_the_api_gives_one():
    def env_of(manifest: dict) -> dict:
        spec = resources.EmbeddingJobSpec.model_validate(manifest["spec"])
        files = job_manifests.trainer_files(spec, default_checkpoint_uri=CHECKPOINTS)
        job = job_manifests.batch_job(*ARGS, spec, attempt=0, settings=OperatorSettings(), files=files)
        return {e["name"]: e.get("value") for e in job["spec"]["template"]["spec"]["containers"][0]["env"]}

    spec = _spec(operator_job("one")).job_spec()
    budgeted = resources.embedding_job_manifest("demo", "acme", spec, storage_budget_bytes=5 * 2**30)
    assert env_of(budgeted)[runtime.ENV_STORAGE_BUDGET] == str(5 * 2**30)
    assert runtime.ENV_STORAGE_BUDGET not in env_of(resources.embedding_job_manifest("demo", "acme", spec))


def _env(job: dict) -> dict[str, str | None]:
    return {e["name"]: e.get("value") for e in job["spec"]["template"]["spec"]["containers"][0]["env"]}


def tiered_job(name: str) -> SpecBuilder:
    """Two nodes of two ranks each, table t0 (2M rows of 8 floats and row-wise Adagrad's 1: 36 bytes) tiered."""
    return (operator_job(name).with_nodes(2).with_cpu_only(procs_per_node=2, memory="4Gi")
            .with_table("t0", num_embeddings=2_000_000, tier={"cache_rows": 10_000}))


def test_a_tiered_job_gets_a_volume_of_its_local_disk_named_to_the_trainer_and_requested():
    job, _ = _children(tiered_job("tiered"))
    pod = job["spec"]["template"]["spec"]
    # Each of a node's 2 ranks keeps its quarter of the rows; the node its headroom.
    needed = 2 * -(-500_000 * 36 // 4096) * 4096 + sizing.LOCAL_DISK_HEADROOM_BYTES
    size = f"{-(-needed // 2**20)}Mi"
    assert _volume(job, job_manifests.LOCAL_VOLUME) == {"name": "local", "emptyDir": {"sizeLimit": size}}
    container = pod["containers"][0]
    assert {"name": "local", "mountPath": job_manifests.LOCAL_MOUNT} in container["volumeMounts"]
    assert _env(job)[runtime.ENV_LOCAL_DIR] == job_manifests.LOCAL_MOUNT  # never the container's root file system
    # The emptyDir, the container's writable layer and its logs all count in ephemeral-storage.
    assert container["resources"]["requests"]["ephemeral-storage"] == size
    assert container["resources"]["limits"]["ephemeral-storage"] == size
    assert _env(job)[runtime.ENV_MEMORY_PER_RANK] == str(2 * 2**30)  # 4Gi over the node's 2 ranks


@pytest.mark.parametrize("given", ["20Gi", None], ids=["given", "from-the-tier"])
def test_a_storage_class_for_local_disks_makes_a_generic_ephemeral_volume_of_the_jobs_size(given):
    builder = tiered_job("nvme").with_resources(local_disk_per_node=given)
    job, _ = _children(builder, local_disk_storage_class="local-nvme")
    size = _spec(builder).resources.local_disk_per_node
    assert size == given or given is None
    claim = _volume(job, job_manifests.LOCAL_VOLUME)["ephemeral"]["volumeClaimTemplate"]["spec"]
    assert claim["storageClassName"] == "local-nvme" and claim["resources"]["requests"]["storage"] == size
    assert claim["accessModes"] == ["ReadWriteOnce"]
    # The claim is the disk: the pod's own ephemeral storage is not asked for it.
    container = job["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"]["requests"]["ephemeral-storage"] == "0"
    assert "ephemeral-storage" not in container["resources"]["limits"]
    assert _env(job)[runtime.ENV_LOCAL_DIR] == job_manifests.LOCAL_MOUNT


def test_a_job_without_tiers_gets_no_local_volume_and_requests_no_disk():
    job, _ = _children(operator_job("plain"))
    pod = job["spec"]["template"]["spec"]
    assert job_manifests.LOCAL_VOLUME not in {v["name"] for v in pod["volumes"]}
    assert runtime.ENV_LOCAL_DIR not in _env(job)
    # Zero, not nothing: a namespace whose quota limits local disk admits only pods that say what they take.
    assert pod["containers"][0]["resources"]["requests"]["ephemeral-storage"] == "0"


@pytest.mark.parametrize("cpu, procs, per_rank", [(4.0, 2, "2"), (1.0, 1, "1"), (0.5, 1, "1")])
def test_each_pod_s_ranks_run_their_share_of_the_cpu_request_not_the_node_s_cores(cpu, procs, per_rank):
    builder = operator_job("threads").with_resources(cpu_per_node=cpu, procs_per_node=procs, gpus_per_node=procs)
    job, _ = _children(builder)
    env = _env(job)
    assert env[threads.ENV_THREADS_PER_RANK] == env["OMP_NUM_THREADS"] == env["NUMBA_NUM_THREADS"] == per_rank
    assert all(env[name] == value for name, value in threads.WAIT_POLICY.items())
