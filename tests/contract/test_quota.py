"""One quota model: the API's schema, the database's columns and the Tenant resource all follow from
kembed_contract.quota.QuotaSpec, with one set of bounds."""

from __future__ import annotations

import pydantic
import pytest
from sqlalchemy import BigInteger, Float, Integer

from kembed_api.jobs.models import Job
from kembed_api.tenants import schemas
from kembed_api.tenants.models import Tenant
from kembed_contract import crds, resources
from kembed_contract.quota import MAX_JOBS, QuotaSpec, SharingSpec, Stored
from kembed_operator import tenant_manifests


def test_every_dimension_of_the_model_is_a_column_of_the_type_it_is_stored_as():
    types = {Stored.COUNT: Integer, Stored.CORES: Float, Stored.BYTES: BigInteger}
    stored = QuotaSpec.stored()
    assert set(stored) == {"gpus", "cpu", "memory_bytes", "local_disk_bytes", "max_running_jobs", "max_queued_jobs", "storage_bytes",
                           "max_run_seconds"}
    quota_columns = {c.name: c for c in Tenant.__table__.columns if c.name.startswith("quota_")}
    assert set(quota_columns) == {f"quota_{amount}" for amount in stored}
    for amount, kind in stored.items():
        column = quota_columns[f"quota_{amount}"]
        assert isinstance(column.type, types[kind]) and column.nullable, amount


def test_what_each_job_holds_is_a_column_per_dimension_running_jobs_hold():
    types = {Stored.COUNT: Integer, Stored.CORES: Float, Stored.BYTES: BigInteger}
    held = {d.used: d for d in QuotaSpec.held()}
    assert set(held) == {"gpus", "cpu", "memory_bytes", "local_disk_bytes", "running_jobs"}
    columns = Job.__table__.columns
    for name, dimension in held.items():
        if dimension.counts_jobs:  # each job holds one: no column
            assert name not in columns, name
        else:
            assert isinstance(columns[name].type, types[dimension.stored]) and not columns[name].nullable, name


def test_the_api_and_the_tenant_resource_use_the_model_itself():
    assert schemas.QuotaSpec is QuotaSpec and schemas.SharingSpec is SharingSpec
    assert resources.TenantSpec.model_fields["quota"].annotation is QuotaSpec
    tenant_crd = next(c for c in crds.render_crds() if c["spec"]["names"]["kind"] == "Tenant")
    quota_schema = tenant_crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"][
        "properties"]["quota"]["properties"]
    assert set(quota_schema) == set(QuotaSpec.model_fields)
    assert quota_schema["max_queued_jobs"]["maximum"] == MAX_JOBS  # one set of bounds, in the CRD too


@pytest.mark.parametrize("bad", [
    pytest.param({"max_running_jobs": MAX_JOBS + 1}, id="jobs-above-the-bound"),
    pytest.param({"gpus": -1}, id="negative"),
    pytest.param({"gpus": "8"}, id="text-for-a-count"),
    pytest.param({"memory": "5Ei"}, id="memory-above-4Ei"),
    pytest.param({"cpu": float("inf")}, id="infinite-cpu"),
    pytest.param({"disk": 1}, id="unknown-dimension"),
    pytest.param({"storage": "lots"}, id="storage-not-a-quantity"),
    pytest.param({"storage": "5Ei"}, id="storage-above-4Ei"),
    pytest.param({"cpu": 1e-300}, id="cpu-below-a-millicore"),
    pytest.param({"max_run_seconds": 0}, id="no-run-time"),
    pytest.param({"max_run_seconds": 10**9}, id="run-time-above-a-year"),
])
def test_the_api_and_the_tenant_resource_refuse_the_same_quotas(bad):
    with pytest.raises(pydantic.ValidationError):
        schemas.TenantCreate.model_validate({"name": "team", "quota": bad})
    with pytest.raises(pydantic.ValidationError):
        resources.TenantSpec.model_validate({"quota": bad})


def test_amounts_round_trip_through_the_columns():
    quota = QuotaSpec(gpus=8, cpu=12.5, memory="96Gi", local_disk="1024Gi", max_running_jobs=3, max_queued_jobs=50,
                      storage="2Gi", max_run_seconds=3600)
    assert quota.amounts() == {"gpus": 8, "cpu": 12.5, "memory_bytes": 96 * 2**30, "local_disk_bytes": 2**40,
                               "max_running_jobs": 3, "max_queued_jobs": 50, "storage_bytes": 2 * 2**30,
                               "max_run_seconds": 3600}
    assert QuotaSpec.from_amounts(quota.amounts()) == quota
    assert QuotaSpec.from_amounts({}) == QuotaSpec()  # nothing set: unlimited


def test_in_a_cohort_the_namespace_quota_is_the_nominal_quota_plus_the_borrowing_limit():
    rigid = resources.TenantSpec(quota=QuotaSpec(gpus=8, cpu=16, memory="64Gi"))
    shared = rigid.model_copy(update={"sharing": SharingSpec(cohort="research",
                                                             borrowing_limit=QuotaSpec(gpus=4, cpu=0.5))})
    assert tenant_manifests.quota("a", rigid)["spec"]["hard"] == {
        "requests.nvidia.com/gpu": "8", "requests.cpu": "16", "limits.cpu": "16",
        "requests.memory": "64Gi", "limits.memory": "64Gi"}
    # Memory has no borrowing limit: as much as the cohort leaves idle, so the cluster does not cap it.
    assert tenant_manifests.quota("a", shared)["spec"]["hard"] == {
        "requests.nvidia.com/gpu": "12", "requests.cpu": "16.5", "limits.cpu": "16.5"}
    assert tenant_manifests.quota("a", resources.TenantSpec())["spec"]["hard"] == {}  # unlimited


def test_local_disk_is_the_namespaces_quota_of_ephemeral_storage_requests():
    """What trainer pods request for their tiers' volumes (job_manifests) is what the cluster counts."""
    disks = resources.TenantSpec(quota=QuotaSpec(local_disk="2Ti"))
    assert tenant_manifests.quota("a", disks)["spec"]["hard"] == {"requests.ephemeral-storage": "2Ti"}


def test_a_patch_changes_only_the_fields_it_gives_and_an_explicit_null_clears_one():
    quota = QuotaSpec(gpus=8, cpu=16, memory="64Gi", storage="1Ti", max_queued_jobs=100)
    patched = quota.merged(QuotaSpec.model_validate({"gpus": 32}))
    assert patched == QuotaSpec(gpus=32, cpu=16, memory="64Gi", storage="1Ti", max_queued_jobs=100)
    cleared = quota.merged(QuotaSpec.model_validate({"storage": None, "cpu": 4}))
    assert cleared == QuotaSpec(gpus=8, cpu=4, memory="64Gi", max_queued_jobs=100)
    assert quota.merged(QuotaSpec()) == quota  # an empty patch changes nothing


def test_every_dimension_has_a_bound_for_sums():
    """plus() caps each sum at its dimension's bound: a new dimension without one would fail there."""
    big = QuotaSpec.from_amounts({name: 2**61 if name.endswith("_bytes") else 10**6 for name in QuotaSpec.stored()})
    assert big.plus(big).amounts()["storage_bytes"] == 2**62
