"""The CRDs are generated from the pydantic models; the committed chart files must be exactly what they generate."""

from __future__ import annotations

import pathlib

import pytest

from kembed_contract import crds, resources
from tests.builders import make_spec

CHART = pathlib.Path(__file__).resolve().parents[2] / "helm" / "kembed"


@pytest.mark.parametrize("name", sorted(crds.chart_crd_templates()))
def test_committed_crd_templates_match_the_models(name: str):
    generated = crds.chart_crd_templates()[name]
    committed = (CHART / "templates" / "crds" / name).read_text()
    assert committed == generated, (
        f"helm/kembed/templates/crds/{name} drifted from contract/kembed_contract/resources.py: run `make manifests`")


def test_the_job_schema_has_every_spec_field_and_no_unions():
    job_crd = {crd["spec"]["names"]["kind"]: crd for crd in crds.render_crds()}["EmbeddingJob"]
    schema = job_crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    spec = schema["properties"]["spec"]["properties"]
    assert set(resources.EmbeddingJobSpec.model_fields) <= set(spec)
    assert spec["trainer"]["properties"]["model"]["properties"]["kind"]["enum"] == ["dlrm", "two_tower", "word2vec"]
    assert not _keys(schema) & {"$ref", "anyOf", "oneOf", "allOf", "const", "discriminator"}


def _keys(node) -> set[str]:
    """Every schema keyword used anywhere below `node` (property names included, which is harmless here)."""
    if isinstance(node, dict):
        return set(node).union(*(_keys(v) for v in node.values()))
    if isinstance(node, list):
        return set().union(*(_keys(v) for v in node))
    return set()


def test_the_manifest_the_api_creates_round_trips_through_the_models():
    from kembed_contract.spec import JobSpec

    spec = JobSpec.model_validate(make_spec("demo").with_nodes(2).with_gpus(8).build())
    manifest = resources.embedding_job_manifest("demo-x1y2z", "acme", spec, report_url="http://api:8080",
                                                report_token_secret="demo-x1y2z-token")
    assert manifest["metadata"]["namespace"] == "kembed-acme"
    back = resources.EmbeddingJobSpec.model_validate(manifest["spec"])
    assert back.job_spec() == spec and back.report_token_secret == "demo-x1y2z-token" and not back.cancel
    with pytest.raises(ValueError, match="DNS label"):
        resources.embedding_job_manifest("Demo_1", "acme", spec)
