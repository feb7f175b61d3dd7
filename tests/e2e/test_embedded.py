"""What `make demo` does, through HTTP and the CLI, with a tiny model: real trainers, real checkpoints."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml

from kembed_api.cli.client import ApiError
from tests.builders import make_spec
from tests.e2e.conftest import file_uri_path

pytestmark = pytest.mark.slow


def test_a_job_submitted_over_http_trains_to_succeeded(server):
    job = server.client.submit(make_spec("http").with_nodes(1, 2).build())
    assert job["state"] == "QUEUED"
    done = server.wait_terminal(job["id"])

    assert done["state"] == "SUCCEEDED", done["message"]
    assert [e["reason"] for e in done["events"]] == ["Submitted", "Admitted", "Started", "Completed"]
    started = done["events"][2]["message"]  # which layers hold the trainers (docs/security.md#trainers)
    assert "limits per node: memory 2.00 GiB" in started and "network:" in started, started
    assert done["progress"]["step"] == done["progress"]["total_steps"] == 60
    assert done["result"]["auc"] > 0.6  # the planted signal is learnt
    checkpoint = file_uri_path(done["latest_checkpoint_uri"])
    assert checkpoint.name == "step-60" and checkpoint.is_dir()
    assert str(checkpoint).startswith(str(server.data_dir / "checkpoints" / "default" / job["id"]))

    logs = server.client.logs(job["id"])
    assert '"event": "done"' in logs
    progress = server.client._call("GET", f"/v1/jobs/{job['id']}/metrics", params={"event": "progress"}).json()
    assert [p["step"] for p in progress][-1] == 60


def test_the_cli_submits_follows_and_reports_the_outcome(server, tmp_path):
    spec_file = tmp_path / "job.yaml"
    spec_file.write_text(yaml.safe_dump(make_spec("cli").build()))

    def kembed(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "kembed_api.cli", *args, "--server", server.url],
                              capture_output=True, text=True, timeout=300,
                              env={**os.environ, "KEMBED_TOKEN": server.token})

    followed = kembed("submit", str(spec_file), "--follow")
    assert followed.returncode == 0, followed.stdout + followed.stderr
    assert "final state: SUCCEEDED" in followed.stdout
    assert "eval auc:" in followed.stdout and "latest checkpoint: file://" in followed.stdout

    job_id = followed.stdout.split("submitted ")[1].split()[0]
    assert job_id in kembed("jobs").stdout
    status = kembed("status", job_id)
    assert "SUCCEEDED" in status.stdout and "Completed" in status.stdout
    logs = kembed("logs", job_id, "--tail", "3")
    assert json.loads(logs.stdout.strip().splitlines()[-1])["event"] == "done"
    missing = kembed("status", "nope-00000")
    assert missing.returncode == 1 and "404" in missing.stdout


def test_bad_input_is_refused_and_nothing_is_half_created(server):
    before = server.client.jobs(limit=500)["items"]
    spec = make_spec().build()
    spec["trainer"]["training"]["batch_size"] = 0
    with pytest.raises(ApiError) as caught:
        server.client.submit(spec)
    assert caught.value.status_code == 422 and "trainer.training.batch_size" in str(caught.value)
    with pytest.raises(ApiError) as too_big:
        server.client.submit(make_spec().with_nodes(3, 1).build())
    assert too_big.value.status_code == 422 and "local slots" in str(too_big.value)
    assert server.client.jobs(limit=500)["items"] == before
    with pytest.raises(ApiError) as missing:
        server.client.cancel("nope-00000")
    assert missing.value.status_code == 404


def test_cancelling_a_running_job_checkpoints_and_ends_cancelled(server):
    job = server.client.submit(make_spec("long").with_steps(5000, checkpoint_every=0).build())
    server.wait_for(job["id"], lambda j: j["state"] == "RUNNING" and j["progress"]["step"] >= 20)
    server.client.cancel(job["id"])
    done = server.wait_terminal(job["id"], timeout=90)
    assert done["state"] == "CANCELLED"
    assert 20 <= done["checkpoint_step"] < 5000  # the SIGTERM checkpoint
    assert file_uri_path(done["latest_checkpoint_uri"]).is_dir()
    assert [e["reason"] for e in done["events"]][-2:] == ["CancelRequested", "Cancelled"]


def test_platform_admins_manage_tenants_and_tokens_from_the_cli(server):
    def kembed(*args: str, token: str = server.token) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "kembed_api.cli", *args, "--server", server.url],
                              capture_output=True, text=True, timeout=60, env={**os.environ, "KEMBED_TOKEN": token})

    created = kembed("tenants", "create", "ads", "--gpus", "16", "--max-running-jobs", "2")
    assert created.returncode == 0 and "gpus=16" in created.stdout, created.stdout
    changed = kembed("tenants", "set-quota", "ads", "--limit", "storage=2Ti", "--limit", "max_run_seconds=3600")
    assert changed.returncode == 0, changed.stdout
    quota = server.client.tenant("ads")["quota"]
    assert (quota["storage"], quota["max_run_seconds"], quota["gpus"]) == ("2048Gi", 3600, 16)  # the rest kept
    refused = kembed("tenants", "set-quota", "ads", "--limit", "disk=1")
    assert refused.returncode == 1 and "quota.disk" in refused.stdout
    minted = kembed("tokens", "create", "ads", "--name", "ci", "--role", "viewer")
    secret = minted.stdout.strip().splitlines()[-1]
    assert secret.startswith("kmb_")
    usage = kembed("tenants", "usage", token=secret)
    assert usage.returncode == 0 and "ads" in usage.stdout and "0 queued" in usage.stdout
    refused = kembed("tenants", "create", "other", token=secret)
    assert refused.returncode == 1 and "403" in refused.stdout  # a viewer manages nothing
    assert "ads" in kembed("tenants", "list").stdout
    assert "viewer" in kembed("tokens", "list", "ads").stdout and secret not in kembed("tokens", "list", "ads").stdout
    token_id = server.client.tokens("ads")["items"][0]["id"]
    assert kembed("tokens", "revoke", "ads", str(token_id)).returncode == 0
    assert "401" in kembed("tenants", "usage", token=secret).stdout
