"""Every resource a job can take is bounded, against a real `kembed serve` running real trainers: a tenant's stored
bytes (quota.storage), a job's time running (max_run_seconds), and what a quota and a spec may say at all.

A tenant over its storage quota gets a failed save with the reason, its earlier checkpoints intact, and nothing of
another tenant's is touched; an endless job is stopped at its time limit with the reason; a quota PATCH changes
only what it names; a CPU request Kubernetes could not represent is refused naming the field."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from kembed_api.cli.client import ApiError, Client
from tests.builders import make_spec
from tests.e2e.conftest import ServerProcess


@pytest.fixture(scope="module")
def platform(tmp_path_factory):
    root = tmp_path_factory.mktemp("quota").resolve()
    server = ServerProcess(root / "kembed", slots=2).start()
    admin = server.client
    members = {}
    for tenant in ("alpha", "beta"):
        admin.create_tenant(tenant, {"max_running_jobs": 2})
        members[tenant] = Client(server.url, token=admin.create_token(tenant, name="m", role="member")["token"])
    yield {"server": server, "admin": admin, "members": members,
           "checkpoints": root / "kembed" / "checkpoints", "logs": root / "kembed" / "logs"}
    server.stop()


def _wait(client: Client, job_id: str, states=("SUCCEEDED", "FAILED", "CANCELLED"), timeout: float = 300) -> dict:
    deadline = time.monotonic() + timeout
    while (job := client.job(job_id))["state"] not in states:
        assert time.monotonic() < deadline, job
        time.sleep(0.3)
    return job


def _files(folder: Path) -> dict[str, tuple[int, int]]:
    """Every file under `folder`: (size, modification time in ns)."""
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in folder.rglob("*") if p.is_file()}


def _saving_every_step(name: str, steps: int) -> dict:
    return make_spec(name).with_steps(steps).with_trainer(
        checkpoint={"every_steps": 1, "keep": 10_000}, evaluation={"keep_best": False}).build()


def test_a_tenant_over_its_storage_quota_fails_at_save_with_the_reason_and_no_one_else_is_touched(platform):
    admin, alpha, beta = platform["admin"], platform["members"]["alpha"], platform["members"]["beta"]
    # beta's finished job: its files must stay exactly as they are.
    done = _wait(beta, beta.submit(_saving_every_step("other-team", 3))["id"])
    assert done["state"] == "SUCCEEDED", done
    beta_files = _files(platform["checkpoints"] / "beta")
    one_checkpoint = sum(size for name, (size, _) in beta_files.items()
                         if name.split("/")[1] == "step-1" and not name.endswith("COMPLETE"))
    beta_usage = beta.usage()
    # What it keeps: its checkpoints (the markers aside) and its logs on this server, to the byte. Every job of
    # beta's counts: the tests share the server and run in random order (the endless job may have run first).
    checkpoint_bytes = sum(size for name, (size, _) in beta_files.items() if not name.endswith("COMPLETE"))
    log_bytes = sum(p.stat().st_size for job in beta.jobs(limit=100)["items"]
                    for p in (platform["logs"] / job["id"]).glob("node-*.log"))
    assert beta_usage["stored_bytes"] == checkpoint_bytes + log_bytes and log_bytes > 0

    # alpha may keep two and a half checkpoints; its job saves one every step, and keeps them all.
    quota = int(2.5 * one_checkpoint)
    admin.set_quota("alpha", {"storage": str(quota)})
    failed = _wait(alpha, alpha.submit(_saving_every_step("greedy", 100_000))["id"])
    assert (failed["state"], failed["reason"]) == ("FAILED", "StorageQuotaExceeded"), failed
    assert "checkpoint step 3 not saved" in failed["message"] and f"over the {quota} bytes" in failed["message"]
    assert "quota.storage" in failed["message"]

    job_folder = platform["checkpoints"] / "alpha" / failed["id"]
    assert sorted(p.name for p in job_folder.iterdir()) == ["step-1", "step-2"]  # the dropped save is gone
    assert all((job_folder / f"step-{s}" / "COMPLETE").exists() for s in (1, 2))  # the earlier ones intact
    usage = alpha.usage()
    assert usage["quota"]["storage"] == str(quota) and usage["stored_bytes"] >= 2 * one_checkpoint
    assert usage["quota"]["max_running_jobs"] == 2  # the PATCH changed only the storage

    # Another tenant's files and use are untouched.
    assert _files(platform["checkpoints"] / "beta") == beta_files
    assert beta.usage()["stored_bytes"] == beta_usage["stored_bytes"]

    # At or over its quota, alpha cannot submit at all until space is freed (or the quota raised).
    admin.set_quota("alpha", {"storage": "1Ki"})
    with pytest.raises(ApiError) as refused:
        alpha.submit(_saving_every_step("more", 10))
    assert refused.value.status_code == 422 and "quota.storage" in str(refused.value)
    admin.set_quota("alpha", {"storage": None})  # an explicit null clears it: unlimited again
    assert alpha.usage()["quota"]["storage"] is None


def test_an_endless_job_is_stopped_at_its_time_limit_with_the_reason(platform):
    admin, beta = platform["admin"], platform["members"]["beta"]
    admin.set_quota("beta", {"max_run_seconds": 600})
    spec = make_spec("endless").with_steps(10_000_000, checkpoint_every=1_000_000).build()
    spec["max_run_seconds"] = 601
    with pytest.raises(ApiError) as refused:  # above the tenant's limit
        beta.submit(spec)
    assert refused.value.status_code == 422 and "max_run_seconds" in str(refused.value)

    spec["max_run_seconds"] = 15
    job = beta.submit(spec)
    _wait(beta, job["id"], states=("RUNNING",))
    ended = _wait(beta, job["id"], timeout=120)
    assert (ended["state"], ended["reason"]) == ("FAILED", "DeadlineExceeded"), ended
    assert "past its time limit of 15 s (max_run_seconds)" in ended["message"]
    assert ended["progress"]["step"] < 10_000_000
    admin.set_quota("beta", {"max_run_seconds": None})


def test_a_quota_patch_changes_only_the_fields_it_names(platform):
    admin = platform["admin"]
    admin.create_tenant("gamma", {"gpus": 4, "memory": "64Gi", "max_running_jobs": 3})
    after = admin.set_quota("gamma", {"gpus": 32})["quota"]  # docs/api.md's own example
    assert after["gpus"] == 32 and after["memory"] == "64Gi" and after["max_running_jobs"] == 3
    assert after["max_queued_jobs"] == 1000  # the platform's default for a new tenant, never unlimited
    cleared = admin.set_quota("gamma", {"memory": None})["quota"]
    assert cleared["memory"] is None and cleared["gpus"] == 32 and cleared["max_running_jobs"] == 3


@pytest.mark.parametrize(("where", "body"), [
    pytest.param("resources.cpu_per_node", {"resources": {"cpu_per_node": 1e-300}}, id="spec-cpu"),
    pytest.param("resources.memory_per_node", {"resources": {"memory_per_node": "1"}}, id="spec-memory"),
])
def test_a_resource_request_below_the_minimum_is_refused_naming_the_field(platform, where, body):
    spec = make_spec("tiny").build()
    spec["resources"].update(body["resources"])
    with pytest.raises(ApiError) as refused:
        platform["members"]["alpha"].submit(spec)
    assert refused.value.status_code == 422 and where in str(refused.value)


def test_a_quota_cpu_below_a_millicore_is_refused_naming_the_field(platform):
    with pytest.raises(ApiError) as refused:
        platform["admin"].set_quota("alpha", {"cpu": 1e-300})
    assert refused.value.status_code == 422 and "quota.cpu" in str(refused.value)
