"""Jobs with tiered tables over HTTP: what the API estimates and shows, what it refuses and why, and the local disk
a job asks for counted against its tenant's quota (real dispatcher, SQLite and PostgreSQL; a fake backend).

The tiny DLRM's tables are 8 wide with row-wise Adagrad: a row is 9 floats (36 bytes) in the cache and on disk. Its
data are files (`tiered`): synthetic data keeps 36 bytes of generator state per id in memory, which would hide
what the tables take.
"""

from __future__ import annotations

import time

import pytest

from kembed_contract import sizing
from tests.api.conftest import bearer
from tests.api.test_tenancy_http import new_tenant
from tests.builders import SpecBuilder, make_spec

ROW_BYTES = 4 * (8 + 1)
MiB = 2**20


@pytest.fixture
def client(api_client, backend):
    backend.slots = 4
    return api_client


@pytest.fixture
def tiered(tmp_path):
    """tiered(name, rows, **tier): the tiny DLRM reading click logs from files in its tenant's folder (by default,
    the default tenant's), its table t0 of `rows` rows tiered (`tier`: {} sizes the cache from the job's memory)."""
    def build(name: str, rows: int, *, tenant: str = "default", **tier) -> SpecBuilder:
        return _tiered(name, rows, uri=f"file://{tmp_path}/checkpoints/{tenant}/clicks/", **tier)
    return build


def _tiered(name: str, rows: int, *, uri: str, **tier) -> SpecBuilder:
    data = {"kind": "table", "uri": uri, "label": "label", "dense": ["d0", "d1", "d2", "d3"],
            "sparse": {f"c{i}": f"c{i}" for i in range(8)}}
    builder = make_spec(name).with_table("t0", num_embeddings=rows, tier=tier)
    builder.spec["trainer"]["data"] = data
    return builder


def _submit(client, spec: dict, **headers) -> dict:
    response = client.post("/v1/jobs", json=spec, **headers)
    assert response.status_code == 201, response.text
    return response.json()


def test_a_tier_without_a_cache_size_gets_what_memory_per_node_leaves_per_rank(client, tiered):
    """The estimate shows the cache the trainers will make: 90 % of what a rank's memory leaves after the rest of
    the job, so another GiB per rank is 0.9 GiB more of rows."""
    def cache_rows(memory: str) -> tuple[int, dict]:
        job = _submit(client, tiered("auto", 50_000_000)
                      .with_resources(memory_per_node=memory).build())
        return job["estimates"]["tier_cache_rows_per_rank"]["t0"], job["estimates"]

    small, estimate = cache_rows("2Gi")
    large, _ = cache_rows("2560Mi")
    assert 1_000_000 < small < large < 50_000_000
    assert large - small == pytest.approx(0.9 * 512 * MiB / ROW_BYTES, abs=2)
    # All of the rank's memory is spoken for, within the estimate's margin; the rows themselves are on disk.
    assert 0.9 * 2 * 2**30 < estimate["memory_bytes_per_rank"] <= 2 * 2**30
    assert estimate["table_memory_bytes_per_rank"] < 50_000_000 * ROW_BYTES


def test_two_ranks_on_a_node_share_its_memory_and_each_caches_its_half_of_the_rows(client, tiered):
    one = _submit(client, tiered("one", 50_000_000)
                  .with_resources(memory_per_node="4Gi").build())
    two = _submit(client, tiered("two", 50_000_000)
                  .with_resources(memory_per_node="4Gi", procs_per_node=2).build())
    assert two["estimates"]["memory_bytes_per_rank"] <= 2 * 2**30 < one["estimates"]["memory_bytes_per_rank"]
    assert two["estimates"]["tier_cache_rows_per_rank"]["t0"] < one["estimates"]["tier_cache_rows_per_rank"]["t0"]


def test_a_table_too_big_for_memory_is_refused_naming_tiering_as_the_way_out(client, tiered):
    response = client.post("/v1/jobs", json=tiered("big", 100_000_000).with_table("t0", tier=None).build())
    assert response.status_code == 422
    detail = response.json()["detail"]
    assert detail.startswith("resources.memory_per_node: the job needs about")
    assert "largest table, t0 (3.35 GiB per rank)" in detail and "`tier:`" in detail
    # Tiered, the same table fits the same 2Gi.
    _submit(client, tiered("big", 100_000_000).build())


def test_a_job_whose_memory_leaves_its_cache_less_than_two_steps_of_rows_is_refused(client, tiered):
    """Each step of the tiny DLRM looks up 256 ids in t0: its cache must hold 512 rows. The 7 bytes of
    bookkeeping each of 300M rows takes in memory leave nothing of 2Gi."""
    spec = tiered("tight", 300_000_000).build()
    response = client.post("/v1/jobs", json=spec)
    assert response.status_code == 422
    assert response.json()["detail"] == (
        "resources.memory_per_node: a tiered table's cache of 1 rows cannot hold two steps' rows (256 this step): "
        "table t0's tier gives no cache size, and what 2.00 GiB per rank leaves after the rest of the job "
        "(2.31 GiB) holds 1 of its rows; give the job more memory_per_node (or a smaller training.batch_size)")
    spec["resources"]["memory_per_node"] = "3Gi"
    assert _submit(client, spec)["estimates"]["tier_cache_rows_per_rank"]["t0"] > 512


def test_the_local_disk_a_tier_needs_is_requested_and_shown(client, tiered):
    job = _submit(client, tiered("disk", 1_000_000, cache_rows=10_000)
                  .with_resources(procs_per_node=2, memory_per_node="4Gi").build())
    # Each of the node's 2 ranks keeps its 500k rows (in 4 KiB blocks), and the node its headroom.
    rank = -(-500_000 * ROW_BYTES // 4096) * 4096
    needed = 2 * rank + sizing.LOCAL_DISK_HEADROOM_BYTES
    assert job["estimates"]["local_disk_bytes_per_node"] == needed
    assert job["spec"]["resources"]["local_disk_per_node"] == f"{-(-needed // MiB)}Mi"
    plain = _submit(client, make_spec("plain").build())
    assert plain["spec"]["resources"]["local_disk_per_node"] is None
    assert plain["estimates"]["local_disk_bytes_per_node"] == 0


def test_a_local_disk_smaller_than_the_tiers_need_is_refused_naming_the_field(client, tiered):
    spec = tiered("small", 10_000_000, cache_rows=10_000).with_resources(
        local_disk_per_node="100Mi").build()
    response = client.post("/v1/jobs", json=spec)
    assert response.status_code == 422
    messages = " ".join(error["msg"] for error in response.json()["errors"])
    assert "resources.local_disk_per_node: the job's tiered tables need 599.3 MiB of local disk per node" in messages
    assert "give at least 600Mi" in messages
    spec["resources"]["local_disk_per_node"] = "1Gi"  # more is the user's to give (scratch beside the tier)
    assert _submit(client, spec)["spec"]["resources"]["local_disk_per_node"] == "1Gi"


def test_the_tenants_local_disk_quota_admits_tiered_jobs_one_at_a_time_and_refuses_one_too_big(client, tiered):
    token = new_tenant(client, "disks", local_disk="1Gi")
    job = tiered("tier", 10_000_000, tenant="disks", cache_rows=10_000)  # 600Mi
    too_big = client.post("/v1/jobs", json=job.with_resources(local_disk_per_node="2Gi").build(),
                          headers=bearer(token))
    assert too_big.status_code == 422
    assert too_big.json()["detail"] == ("resources: the job needs 2.00 GiB of local disk but the tenant's quota "
                                        "(quota.local_disk) is 1.00 GiB")
    first = _submit(client, job.with_resources(local_disk_per_node=None).build(), headers=bearer(token))
    second = _submit(client, job.build(), headers=bearer(token))
    deadline = time.monotonic() + 10
    while "quota.local_disk" not in (waiting := client.get(f"/v1/jobs/{second['id']}", headers=bearer(token))
                                     .json())["message"]:
        assert time.monotonic() < deadline, waiting["message"]
        time.sleep(0.05)
    assert waiting["state"] == "QUEUED"
    assert client.get(f"/v1/jobs/{first['id']}", headers=bearer(token)).json()["state"] == "RUNNING"
    usage = client.get("/v1/usage", headers=bearer(token)).json()
    assert usage["used"]["local_disk_bytes"] == 600 * MiB and usage["quota"]["local_disk"] == "1Gi"
