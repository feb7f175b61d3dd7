"""On the real control plane, the operator mints each tenant's own S3 key against an S3 server that enforces per-user
IAM policies (moto's IAM mode): tenant b's Secret holds b's key, which S3 refuses on tenant a's prefix, also to a
pod of b that bypasses every kembed check; trainer pods carry no trace of the platform's keys; a storage change
reaches the IAM policy, a rotation keeps the previous key, and deleting a tenant deletes its IAM user."""

from __future__ import annotations

import base64
import json
import uuid
from collections.abc import Iterator

import botocore.exceptions
import pytest

from kembed_contract import resources
from tests.builders import operator_job
from tests.cluster.fixture import Cluster, wait_for
from tests.fixtures.iam_s3 import IamS3Server, run_iam_s3
from tests.operator import harness

pytestmark = pytest.mark.cluster

BUCKET = "kembed-test"  # the harness's tenants live under s3://kembed-test/<tenant>


@pytest.fixture(scope="module")
def iam_s3() -> Iterator[IamS3Server]:
    with run_iam_s3() as server:
        server.client("s3").create_bucket(Bucket=BUCKET)
        yield server


@pytest.fixture(scope="module")
def minting_operator(platform: Cluster, iam_s3, tmp_path_factory) -> Iterator[harness.OperatorProcess]:
    """An operator that mints, holding the platform's keys in its own environment only."""
    process = harness.OperatorProcess(
        platform, tmp_path_factory.mktemp("minting"), s3_mint_credentials=True,
        s3_iam_endpoint_url=iam_s3.endpoint_url, s3_endpoint_url=iam_s3.endpoint_url,
        s3_iam_user_prefix=f"t{uuid.uuid4().hex[:6]}-")
    with pytest.MonkeyPatch.context() as env:
        for name, value in iam_s3.platform_env.items():
            env.setenv(name, value)
        process.start()
    yield process
    process.stop()
    assert not process.forbidden_lines()


def _secret_env(platform: Cluster, namespace: str) -> dict[str, str]:
    def read():
        try:
            secret = platform.core().read_namespaced_secret("kembed-s3", namespace)
        except Exception:  # noqa: BLE001 - not there yet
            return None
        return {k: base64.b64decode(v).decode() for k, v in (secret.data or {}).items()}

    return wait_for(read, timeout_s=30, what=f"Secret kembed-s3 in {namespace}")


def _user(operator: harness.OperatorProcess, tenant: str) -> str:
    return f"{operator.settings['s3_iam_user_prefix']}{tenant}"


def _patch_tenant(platform: Cluster, name: str, spec: dict) -> None:
    harness.custom(platform).patch_cluster_custom_object(
        resources.GROUP, resources.VERSION, resources.TENANT_PLURAL, name, {"spec": spec},
        _content_type="application/merge-patch+json")


def test_each_tenant_holds_its_own_key_and_s3_refuses_it_on_another_tenants_prefix(
        platform, minting_operator, iam_s3, make_tenant):
    a, namespace_a = make_tenant()
    b, namespace_b = make_tenant()
    key_a, key_b = _secret_env(platform, namespace_a), _secret_env(platform, namespace_b)
    iam = iam_s3.client("iam")
    for tenant, key in ((a, key_a), (b, key_b)):
        listed = iam.list_access_keys(UserName=_user(minting_operator, tenant))["AccessKeyMetadata"]
        assert [k["AccessKeyId"] for k in listed] == [key["AWS_ACCESS_KEY_ID"]]
        assert key["AWS_SECRET_ACCESS_KEY"] != iam_s3.platform_env["AWS_SECRET_ACCESS_KEY"]

    s3_a, s3_b = iam_s3.client("s3", key_a), iam_s3.client("s3", key_b)
    s3_a.put_object(Bucket=BUCKET, Key=f"{a}/job/step-1/data", Body=b"a's model")
    for attempt in (lambda: s3_b.get_object(Bucket=BUCKET, Key=f"{a}/job/step-1/data"),
                    lambda: s3_b.list_objects_v2(Bucket=BUCKET, Prefix=f"{a}/"),
                    lambda: s3_b.put_object(Bucket=BUCKET, Key=f"{a}/job/step-1/data", Body=b"poison"),
                    lambda: s3_b.delete_object(Bucket=BUCKET, Key=f"{a}/job/step-1/data")):
        with pytest.raises(botocore.exceptions.ClientError, match="AccessDenied"):
            attempt()
    assert s3_a.get_object(Bucket=BUCKET, Key=f"{a}/job/step-1/data")["Body"].read() == b"a's model"
    s3_b.put_object(Bucket=BUCKET, Key=f"{b}/job/x", Body=b"b's own")  # b's key works on b's prefix

    # A trainer pod of b: its credentials come from b's Secret only; the platform's keys are nowhere in its spec.
    job = operator_job("keys").create(platform, b)
    template = wait_for(lambda: next(iter(platform.batch().list_namespaced_job(
        namespace_b, label_selector=f"kembed.io/job={job}").items), None), timeout_s=30, what="the batch Job")
    pod_spec = platform.batch().api_client.sanitize_for_serialization(template.spec.template.spec)
    container = pod_spec["containers"][0]
    assert container["envFrom"] == [{"secretRef": {"name": "kembed-s3", "optional": True}}]
    assert not {e["name"] for e in container["env"]} & {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                                                        "AWS_SESSION_TOKEN", "AWS_PROFILE"}
    rendered = json.dumps(pod_spec)
    assert iam_s3.platform_env["AWS_ACCESS_KEY_ID"] not in rendered
    assert iam_s3.platform_env["AWS_SECRET_ACCESS_KEY"] not in rendered
    secrets = platform.core().list_namespaced_secret(namespace_b).items
    for secret in secrets:
        values = {base64.b64decode(v).decode(errors="replace") for v in (secret.data or {}).values()}
        assert iam_s3.platform_env["AWS_SECRET_ACCESS_KEY"] not in values, secret.metadata.name
    assert iam_s3.platform_env["AWS_SECRET_ACCESS_KEY"] not in minting_operator.log()


# What b's pod tries on a's checkpoints with the credentials b's Secret gives it, through s3fs as the trainer
# does; it prints each outcome and passes only when S3 refuses all of them.
_THIEF = """
import os, s3fs
fs, uri = s3fs.S3FileSystem(), os.environ["VICTIM"]
attempts = {"read": lambda: fs.cat_file(uri + "/step-1/data"), "list": lambda: fs.ls(uri, refresh=True),
            "write": lambda: fs.pipe_file(uri + "/step-1/data", b"poison"),
            "delete": lambda: fs.rm_file(uri + "/step-1/data")}
refused = []
for name, attempt in attempts.items():
    try:
        attempt()
        print(name, "ALLOWED")
    except PermissionError:
        print(name, "AccessDenied")
        refused.append(name)
raise SystemExit(0 if len(refused) == len(attempts) else 1)
"""


def test_a_pod_of_b_with_bs_credentials_gets_access_denied_on_as_prefix(platform, minting_operator, iam_s3,
                                                                       make_tenant):
    """Every kembed check bypassed: a pod in b's namespace, given b's Secret as trainer pods are, goes straight to
    S3 for a's checkpoints; the IAM policy minted for b refuses it."""
    a, namespace_a = make_tenant()
    b, namespace_b = make_tenant()
    s3_a = iam_s3.client("s3", _secret_env(platform, namespace_a))
    s3_a.put_object(Bucket=BUCKET, Key=f"{a}/job/step-1/data", Body=b"a's model")
    _secret_env(platform, namespace_b)
    pod = platform.local_pod("thief", ["python", "-c", _THIEF], env={
        "VICTIM": f"s3://{BUCKET}/{a}/job", "AWS_ENDPOINT_URL": iam_s3.endpoint_url,
        "AWS_DEFAULT_REGION": "us-east-1"})
    pod["spec"]["securityContext"] = {"runAsNonRoot": True, "runAsUser": 1000,
                                      "seccompProfile": {"type": "RuntimeDefault"}}  # the namespace's restricted PSS
    pod["spec"]["containers"][0].update(envFrom=[{"secretRef": {"name": "kembed-s3"}}], securityContext={
        "allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}})
    platform.core().create_namespaced_pod(namespace_b, pod)
    ended = platform.wait_pod_phase(namespace_b, "thief", timeout_s=120)
    log = platform.pod_log(namespace_b, "thief")
    assert ended.status.phase == "Succeeded", log
    assert log.split() == ["read", "AccessDenied", "list", "AccessDenied", "write", "AccessDenied",
                           "delete", "AccessDenied"], log
    assert s3_a.get_object(Bucket=BUCKET, Key=f"{a}/job/step-1/data")["Body"].read() == b"a's model"


def test_storage_changes_rotation_and_removal_reach_iam(platform, minting_operator, iam_s3, make_tenant):
    name, namespace = make_tenant()
    user = _user(minting_operator, name)
    iam = iam_s3.client("iam")
    first = _secret_env(platform, namespace)["AWS_ACCESS_KEY_ID"]

    _patch_tenant(platform, name, {"storage": {"read": ["s3://datasets/ctr"]}})
    wait_for(lambda: "datasets/ctr/*" in json.dumps(iam.get_user_policy(UserName=user, PolicyName="kembed-storage")[
        "PolicyDocument"]), timeout_s=30, what="the grant in the IAM policy")

    _patch_tenant(platform, name, {"s3": {"prefix": f"s3://{BUCKET}/{name}", "credentials_rotation": "2026-12"}})
    second = wait_for(lambda: (k := _secret_env(platform, namespace)["AWS_ACCESS_KEY_ID"]) != first and k,
                      timeout_s=30, what="a rotated key")
    keys = {k["AccessKeyId"] for k in iam.list_access_keys(UserName=user)["AccessKeyMetadata"]}
    assert keys == {first, second}  # the previous key lives on until the next rotation: running trainers finish

    _patch_tenant(platform, name, {"s3": {"prefix": f"s3://{BUCKET}/{name}", "credentials_rotation": "2027-01"}})
    third = wait_for(lambda: (k := _secret_env(platform, namespace)["AWS_ACCESS_KEY_ID"]) not in (first, second)
                     and k, timeout_s=30, what="a second rotation")
    assert {k["AccessKeyId"] for k in iam.list_access_keys(UserName=user)["AccessKeyMetadata"]} == {second, third}

    harness.custom(platform).delete_cluster_custom_object(resources.GROUP, resources.VERSION,
                                                          resources.TENANT_PLURAL, name)

    def user_gone() -> bool:
        try:
            iam.get_user(UserName=user)
        except iam.exceptions.NoSuchEntityException:
            return True
        return False

    wait_for(user_gone, timeout_s=60, what="the tenant's IAM user deleted")
