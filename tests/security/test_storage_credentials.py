"""Per-tenant S3 credentials, against an S3 server that enforces per-user IAM policies (moto's IAM mode).

kembed mints an IAM user and key for tenants a and b from the platform's keys. Tenant b's trainer, holding b's
key and started with every storage check of its own bypassed (no policy in its environment, a config aimed at
a's checkpoints), is refused by S3 itself; a's job checkpoints and resumes with a's key through the local backend;
the platform's keys never reach a trainer.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator

import botocore.exceptions
import pytest
import yaml

from kembed_api.backends.base import Launch
from kembed_api.backends.local import LocalBackend
from kembed_api.platform.storage import PlatformStorage
from kembed_contract.quota import QuotaSpec, SharingSpec
from kembed_contract.spec import JobSpec
from kembed_contract.storage_policy import POLICY_ENV, StoragePolicy
from kembed_platform.tenant_credentials import PLATFORM_CREDENTIAL_VARS, TenantCredentials, trainer_environ
from tests.builders import make_spec
from tests.fixtures.iam_s3 import IamS3Server, run_iam_s3
from tests.fixtures.report_sink import report_sink
from tests.trainer.conftest import records

BUCKET = "ckpt"
PLATFORM = PlatformStorage(checkpoint_root=f"s3://{BUCKET}/kembed")


@pytest.fixture(scope="module")
def iam_s3() -> Iterator[IamS3Server]:
    with run_iam_s3() as server:
        server.client("s3").create_bucket(Bucket=BUCKET)
        yield server


@pytest.fixture
def minter(iam_s3) -> Iterator[TenantCredentials]:
    """The platform's minter; users are named per test, so tests share the server and not their tenants."""
    minter = TenantCredentials(iam_s3.client("iam"), user_prefix=f"t{uuid.uuid4().hex[:8]}-")
    yield minter
    for tenant in ("a", "b"):
        minter.remove(tenant)


@pytest.fixture
def platform_env(iam_s3, monkeypatch) -> dict[str, str]:
    """This server's environment: the platform's keys, which local trainers would inherit without minting."""
    for name in PLATFORM_CREDENTIAL_VARS:
        monkeypatch.delenv(name, raising=False)
    for name, value in iam_s3.platform_env.items():
        monkeypatch.setenv(name, value)
    return iam_s3.platform_env


@pytest.fixture(scope="module", name="report_sink")
def report_sink_url() -> Iterator[str]:
    with report_sink() as url:
        yield url


def _policy(tenant: str) -> StoragePolicy:
    return PLATFORM.policy(tenant, read=[], write=[])


def _keys(iam_s3: IamS3Server, prefix: str) -> dict[str, str]:
    s3 = iam_s3.client("s3")
    listed = s3.list_objects_v2(Bucket=BUCKET, Prefix=prefix).get("Contents", [])
    return {o["Key"]: o["ETag"] for o in listed}


def _denied(call) -> bool:
    try:
        call()
    except botocore.exceptions.ClientError as error:
        return error.response["Error"]["Code"] in ("AccessDenied", "403")
    return False


def test_tenant_b_key_is_refused_everywhere_under_tenant_a_prefix(iam_s3, minter):
    key_a = minter.ensure("a", _policy("a"), current=None)
    key_b = minter.ensure("b", _policy("b"), current=None)
    a, b = iam_s3.client("s3", key_a.environ()), iam_s3.client("s3", key_b.environ())
    a.put_object(Bucket=BUCKET, Key="kembed/a/job/step-1/data", Body=b"a's model")
    assert a.list_objects_v2(Bucket=BUCKET, Prefix="kembed/a/job/")["KeyCount"] == 1

    attempts = {
        "read": lambda: b.get_object(Bucket=BUCKET, Key="kembed/a/job/step-1/data"),
        "head": lambda: b.head_object(Bucket=BUCKET, Key="kembed/a/job/step-1/data"),
        "list-a": lambda: b.list_objects_v2(Bucket=BUCKET, Prefix="kembed/a/"),
        "list-root": lambda: b.list_objects_v2(Bucket=BUCKET, Prefix="kembed/"),
        "list-bucket": lambda: b.list_objects_v2(Bucket=BUCKET),
        "list-a-no-slash": lambda: b.list_objects_v2(Bucket=BUCKET, Prefix="kembed/a"),
        "write": lambda: b.put_object(Bucket=BUCKET, Key="kembed/a/job/step-1/data", Body=b"b's poison"),
        "delete": lambda: b.delete_object(Bucket=BUCKET, Key="kembed/a/job/step-1/data"),
        "other-bucket": lambda: b.create_bucket(Bucket="b-owns-this"),
    }
    allowed = [name for name, call in attempts.items() if not _denied(call)]
    assert allowed == []
    # A batch delete answers per key, as AWS does.
    batch = b.delete_objects(Bucket=BUCKET, Delete={"Objects": [{"Key": "kembed/a/job/step-1/data"}]})
    assert [e["Code"] for e in batch.get("Errors", [])] == ["AccessDenied"] and not batch.get("Deleted")
    # S3 keys are literal: '..' in a prefix lists keys that really start with b's folder, none of a's.
    assert b.list_objects_v2(Bucket=BUCKET, Prefix="kembed/b/../a/")["KeyCount"] == 0
    assert a.get_object(Bucket=BUCKET, Key="kembed/a/job/step-1/data")["Body"].read() == b"a's model"
    # b's own folder is b's: the key works, it is not simply a broken one.
    b.put_object(Bucket=BUCKET, Key="kembed/b/job/x", Body=b"b")
    assert b.list_objects_v2(Bucket=BUCKET, Prefix="kembed/b/")["KeyCount"] == 1
    b.delete_object(Bucket=BUCKET, Key="kembed/b/job/x")


def test_tenant_b_trainer_with_its_own_checks_bypassed_is_refused_by_s3(iam_s3, minter, platform_env, tmp_path):
    """b's trainer process, with b's key as the local backend gives it, no storage policy in its environment
    (as if every check of kembed's own were bypassed), told to resume from a's checkpoints and prune them."""
    minter.ensure("a", _policy("a"), current=None)
    key_b = minter.ensure("b", _policy("b"), current=None)
    platform = iam_s3.client("s3")
    platform.put_object(Bucket=BUCKET, Key="kembed/a/job-a/step-20/.metadata", Body=b"a's checkpoint")
    platform.put_object(Bucket=BUCKET, Key="kembed/a/job-a/step-20/COMPLETE", Body=b"")
    before = _keys(iam_s3, "kembed/a/")

    trainer = make_spec().build()["trainer"]
    trainer["training"]["steps"] = 4
    trainer["checkpoint"] = {"uri": f"s3://{BUCKET}/kembed/a/job-a", "every_steps": 2, "keep": 1}
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(trainer))
    server_env = {k: v for k, v in os.environ.items() if not k.startswith("KEMBED_")}  # as the backend passes it
    env = trainer_environ({**server_env, "KEMBED_JOB_ID": "b-hostile"}, key_b)
    assert POLICY_ENV not in env
    proc = subprocess.run([sys.executable, "-m", "kembed_trainer", "--config", str(config)], capture_output=True,
                          text=True, timeout=180, env=env, cwd=tmp_path, check=False)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output[-3000:]
    assert "AccessDenied" in output or "Access Denied" in output or "Forbidden" in output, output[-3000:]
    assert not any(r["event"] == "checkpoint" for r in records(proc.stdout))
    assert _keys(iam_s3, "kembed/a/") == before
    assert platform_env["AWS_SECRET_ACCESS_KEY"] not in output and key_b.secret_access_key not in output


def _run(backend: LocalBackend, launch: Launch) -> tuple[bool, str]:
    backend.start(launch)
    deadline = time.monotonic() + 300
    while (ended := backend.poll(launch.job_id)) is None:
        assert time.monotonic() < deadline, "the trainer did not end"
        time.sleep(0.3)
    return ended.succeeded, backend.read_logs(launch.job_id)


def test_tenant_a_job_checkpoints_and_resumes_with_its_minted_key(iam_s3, minter, platform_env, report_sink,
                                                                   tmp_path):
    backend = LocalBackend(data_dir=tmp_path / "data", slots=1, stop_grace_s=10, credentials=minter)
    policy = _policy("a")
    backend.sync_tenant("a", QuotaSpec(), SharingSpec(), policy)
    spec = make_spec("resume").with_steps(40, checkpoint_every=20).build()
    spec["trainer"]["checkpoint"]["uri"] = f"s3://{BUCKET}/kembed/a/job-r"

    def launch(steps: int, attempt: int) -> Launch:
        spec["trainer"]["training"]["steps"] = steps
        return Launch(job_id="resume-a1b2c", tenant="a", spec=JobSpec.model_validate(spec), attempt=attempt,
                      report_url=report_sink, report_token="t", storage_policy=policy)

    ok, logs = _run(backend, launch(40, 1))
    assert ok, logs[-3000:]
    assert any(k.startswith("kembed/a/job-r/step-40/") for k in _keys(iam_s3, "kembed/a/job-r/"))
    ok, logs = _run(backend, launch(60, 2))
    assert ok, logs[-3000:]
    started = [r for r in records(logs) if r["event"] == "started"]
    assert started[-1]["resumed_from"] == f"s3://{BUCKET}/kembed/a/job-r/step-40", logs[-3000:]
    assert any(k.startswith("kembed/a/job-r/step-60/") for k in _keys(iam_s3, "kembed/a/job-r/"))
    assert platform_env["AWS_SECRET_ACCESS_KEY"] not in logs


def test_the_platform_keys_never_reach_a_local_trainer(iam_s3, minter, platform_env, report_sink, tmp_path):
    """What the trainer process really holds: its /proc/<pid>/environ, read while it runs."""
    backend = LocalBackend(data_dir=tmp_path / "data", slots=1, stop_grace_s=10, credentials=minter, sandbox="off")
    spec = make_spec("environ").with_steps(100000).build()
    spec["trainer"]["checkpoint"] = {"uri": f"s3://{BUCKET}/kembed/b/job-e", "every_steps": 100000}
    launched = backend.start(Launch(job_id="environ-d3e4f", tenant="b", spec=JobSpec.model_validate(spec), attempt=1,
                                    report_url=report_sink, report_token="t", storage_policy=_policy("b")))
    try:
        environ = {}
        deadline = time.monotonic() + 30
        while "AWS_ACCESS_KEY_ID" not in environ:
            assert time.monotonic() < deadline
            raw = open(f"/proc/{launched['pids'][0]}/environ", "rb").read().decode()  # noqa: SIM115
            environ = dict(item.split("=", 1) for item in raw.split("\0") if "=" in item)
            time.sleep(0.05)
    finally:
        backend.stop("environ-d3e4f")
        backend.shutdown()
    minted = {k["AccessKeyId"] for k in minter.iam.list_access_keys(UserName=minter.user_name("b"))[
        "AccessKeyMetadata"]}
    assert environ["AWS_ACCESS_KEY_ID"] in minted
    assert environ["AWS_ACCESS_KEY_ID"] != platform_env["AWS_ACCESS_KEY_ID"]
    assert platform_env["AWS_SECRET_ACCESS_KEY"] not in raw
    assert not (set(PLATFORM_CREDENTIAL_VARS) - {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"}) & set(environ)
