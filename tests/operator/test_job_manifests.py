"""What the operator writes for a job (pure, no cluster): the batch Job, and only the side objects it needs."""

from __future__ import annotations

import json

from kembed_contract import resources
from kembed_operator import job_manifests
from kembed_operator.settings import OperatorSettings
from tests.builders import SpecBuilder, operator_job

ARGS = ("demo", "kembed-acme", "uid-1", "acme")
CHECKPOINTS = "s3://kembed-test/acme/demo"


def _spec(builder: SpecBuilder) -> resources.EmbeddingJobSpec:
    return resources.EmbeddingJobSpec.model_validate(builder.manifest("acme")["spec"])


def _children(builder: SpecBuilder) -> tuple[dict, list[dict]]:
    spec, settings = _spec(builder), OperatorSettings()
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
    from kembed_contract import runtime

    def env_of(manifest: dict) -> dict:
        spec = resources.EmbeddingJobSpec.model_validate(manifest["spec"])
        files = job_manifests.trainer_files(spec, default_checkpoint_uri=CHECKPOINTS)
        job = job_manifests.batch_job(*ARGS, spec, attempt=0, settings=OperatorSettings(), files=files)
        return {e["name"]: e.get("value") for e in job["spec"]["template"]["spec"]["containers"][0]["env"]}

    spec = _spec(operator_job("one")).job_spec()
    budgeted = resources.embedding_job_manifest("demo", "acme", spec, storage_budget_bytes=5 * 2**30)
    assert env_of(budgeted)[runtime.ENV_STORAGE_BUDGET] == str(5 * 2**30)
    assert runtime.ENV_STORAGE_BUDGET not in env_of(resources.embedding_job_manifest("demo", "acme", spec))
