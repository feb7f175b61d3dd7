"""The one builder of job specs for every test folder (Kueue's wrappers):
`make_spec().with_nodes(2).with_steps(40).build()` for the API, `operator_job("demo").with_gpus(1).create(cluster,
tenant)` for an EmbeddingJob made straight in a cluster (the same spec, with the operator tests' defaults)."""

from __future__ import annotations

import copy
import uuid
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parent.parent
TINY_TRAINER = yaml.safe_load((REPO / "trainer_image/examples/dlrm-tiny.yaml").read_text())


class SpecBuilder:
    def __init__(self, name: str = "tiny") -> None:
        self.spec: dict[str, Any] = {
            "name": name,
            "resources": {"nodes": 1, "procs_per_node": 1},
            "trainer": copy.deepcopy(TINY_TRAINER),
        }
        self.job_id = f"{name}-{uuid.uuid4().hex[:5]}"  # the id an EmbeddingJob made by `manifest` gets

    def with_name(self, name: str) -> SpecBuilder:
        self.spec["name"] = name
        return self

    def with_nodes(self, nodes: int, procs_per_node: int = 1) -> SpecBuilder:
        self.spec["resources"].update(nodes=nodes, procs_per_node=procs_per_node)
        return self

    def with_gpus(self, per_node: int) -> SpecBuilder:
        self.spec["resources"]["gpus_per_node"] = per_node
        self.spec["resources"].pop("procs_per_node", None)  # a GPU node runs one rank per GPU
        return self

    def with_cpu_only(self, procs_per_node: int = 1, cpu: float = 1.0, memory: str = "1Gi") -> SpecBuilder:
        self.spec["resources"].update(gpus_per_node=0, procs_per_node=procs_per_node, cpu_per_node=cpu,
                                      memory_per_node=memory)
        return self

    def with_resources(self, **resources: Any) -> SpecBuilder:
        """Any `resources` field (memory_per_node, local_disk_per_node, ...)."""
        self.spec["resources"].update(resources)
        return self

    def with_table(self, name: str = "t0", **fields: Any) -> SpecBuilder:
        """Fields of one of the tiny DLRM's tables (t0..t7), e.g. `num_embeddings`, or `tier={}`: tiered, its
        cache sized from the job's memory."""
        next(t for t in self.spec["trainer"]["embeddings"]["tables"] if t["name"] == name).update(fields)
        return self

    def with_labels(self, **labels: str) -> SpecBuilder:
        """Pod labels, `kembed__io_test_x` for `kembed.io/test-x` (the fake nodes' test stages read them)."""
        self.spec["labels"] = {k.replace("__", "/").replace("_", "-"): v for k, v in labels.items()}
        return self

    def with_image(self, image: str) -> SpecBuilder:
        self.spec["image"] = image
        return self

    def with_priority(self, priority: int) -> SpecBuilder:
        self.spec["priority"] = priority
        return self

    def with_priority_class(self, name: str) -> SpecBuilder:
        self.spec["priority_class"] = name
        return self

    def with_steps(self, steps: int, *, checkpoint_every: int | None = None) -> SpecBuilder:
        self.spec["trainer"]["training"]["steps"] = steps
        if checkpoint_every is not None:
            self.spec["trainer"]["checkpoint"]["every_steps"] = checkpoint_every
        return self

    def with_max_restarts(self, max_restarts: int) -> SpecBuilder:
        self.spec["max_restarts"] = max_restarts
        return self

    def with_trainer(self, **sections: Any) -> SpecBuilder:
        for section, values in sections.items():
            self.spec["trainer"].setdefault(section, {}).update(values)
        return self

    def build(self) -> dict[str, Any]:
        return copy.deepcopy(self.spec)

    def manifest(self, tenant: str) -> dict[str, Any]:
        """The EmbeddingJob the API would create for this spec in `tenant`'s namespace."""
        from kembed_contract import resources
        from kembed_contract.spec import JobSpec

        return resources.embedding_job_manifest(self.job_id, tenant, JobSpec.model_validate(self.spec))

    def create(self, cluster: Any, tenant: str) -> str:
        """Create the EmbeddingJob in a test cluster (tests/cluster), as the API would; returns its id."""
        from kembed_contract import resources
        from tests.operator.harness import custom

        manifest = self.manifest(tenant)
        custom(cluster).create_namespaced_custom_object(
            resources.GROUP, resources.VERSION, manifest["metadata"]["namespace"], resources.EMBEDDING_JOB_PLURAL,
            manifest)
        return self.job_id


def make_spec(name: str = "tiny") -> SpecBuilder:
    return SpecBuilder(name)


def operator_job(name: str = "job") -> SpecBuilder:
    """The operator tests' default job: one node with one GPU (a kwok node runs it), two restarts."""
    return make_spec(name).with_gpus(1).with_max_restarts(2)
