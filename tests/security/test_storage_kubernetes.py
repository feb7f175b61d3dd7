"""On Kubernetes the trainers get their tenant's storage policy from its Tenant resource (not from the job):
their own prefix, what the platform admin granted, never another tenant's prefix, and nothing without a Tenant.
These are the manifests alone; per-tenant S3 credentials against a real cluster are not tested yet (issue #15)."""

from __future__ import annotations

import json

from kembed_contract import resources
from kembed_contract.quota import QuotaSpec
from kembed_contract.storage_policy import POLICY_ENV, Access, StoragePolicy, canonical_uri
from kembed_operator import job_manifests
from kembed_operator.embeddingjob import storage_policy
from kembed_operator.settings import OperatorSettings
from tests.builders import make_spec


def _tenant(prefix: str, **storage) -> dict:
    return {"quota": {"gpus": 0, "cpu": 4, "memory": "8Gi", "max_running_jobs": 2}, "s3": {"prefix": prefix},
            **({"storage": storage} if storage else {})}


SPECS = {"a": [_tenant("s3://ckpt/a")],
         "b": [_tenant("s3://ckpt/b", read=["s3://datasets/ctr"], deny=["s3://ckpt"])]}
PREFIXES = {"a": ["s3://ckpt/a"], "b": ["s3://ckpt/b"]}


def _policy(tenant: str) -> StoragePolicy:
    return StoragePolicy.from_json(storage_policy(tenant, SPECS, PREFIXES))


def test_a_tenants_trainers_reach_their_prefix_and_grants_only():
    b = _policy("b")
    assert b.allows(canonical_uri("s3://ckpt/b/job/step-1"), Access.WRITE)
    assert b.allows(canonical_uri("s3://datasets/ctr/day-1.parquet"), Access.READ)
    for uri in ("s3://ckpt/a/job", "s3://ckpt/b/../a/job", "s3://ckpt", "s3://datasets/ctr-x", "s3://other/x"):
        assert not b.allows(canonical_uri(uri), Access.READ), uri
    # Tenant a names no deny list: b's prefix is denied to it all the same, because it is another tenant's.
    assert not _policy("a").allows(canonical_uri("s3://ckpt/b/job"), Access.READ)


def test_a_job_in_a_namespace_without_a_valid_tenant_reaches_nothing():
    for tenant, specs in (("ghost", SPECS), ("a", {"a": [{"quota": "not a quota"}]})):
        policy = StoragePolicy.from_json(storage_policy(tenant, specs, PREFIXES))
        assert not policy.allows(canonical_uri("s3://ckpt/a/x"), Access.READ)


def test_the_trainer_pods_carry_the_policy():
    spec = resources.EmbeddingJobSpec.model_validate(make_spec().build())
    files = job_manifests.trainer_files(spec, default_checkpoint_uri="s3://ckpt/b/job-1")
    manifest = job_manifests.batch_job("job-1", "kembed-b", "uid", "b", spec, attempt=1, settings=OperatorSettings(),
                                       files=files, storage_policy=_policy("b").to_json())
    env = {e["name"]: e.get("value") for e in manifest["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert json.loads(env[POLICY_ENV])["own"] == ["s3://ckpt/b"]


def test_the_api_writes_the_policy_into_the_tenant_resource():
    """What the API's Kubernetes backend sends is what the operator reads back (the CRD's schema included)."""
    from kembed_api.platform.storage import PlatformStorage

    platform = PlatformStorage(checkpoint_root="s3://ckpt")
    policy = platform.policy("b", read=["s3://datasets/ctr"], write=[])
    spec = resources.TenantSpec(quota=QuotaSpec(gpus=0, cpu=1, memory="1Gi", max_running_jobs=1),
                                s3=resources.TenantS3(prefix=policy.own[0]),
                                storage=resources.TenantStorage(read=list(policy.read), write=list(policy.write),
                                                                deny=list(policy.deny)))
    manifest = resources.tenant_manifest("b", spec)
    read_back = StoragePolicy.from_json(storage_policy("b", {"b": [manifest["spec"]]}, {"b": ["s3://ckpt/b"]}))
    assert read_back.own == ("s3://ckpt/b",) and read_back.read == ("s3://datasets/ctr",)
    assert not read_back.allows("s3://ckpt/a/x", Access.READ)
