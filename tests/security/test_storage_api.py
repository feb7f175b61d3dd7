"""A hostile member of tenant b against a real `kembed serve`: every URI of a job spec outside b's storage policy
is refused at submission with 422 naming the field and the allowed prefixes, and nothing is stored; what is
accepted is stored canonical; a platform admin sets the policy, and cannot grant what no tenant may reach."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from kembed_api.cli.client import ApiError, Client
from tests.builders import make_spec
from tests.e2e.conftest import ServerProcess
from tests.security.storage_layout import SECRET


@pytest.fixture(scope="module")
def platform(tmp_path_factory):
    """A server with tenants a and b, b's member token, a datasets folder b may read, and a's checkpoints."""
    root = tmp_path_factory.mktemp("storage").resolve()
    server = ServerProcess(root / "kembed", slots=2).start()
    datasets, outside = root / "datasets", root / "outside"
    datasets.mkdir()
    outside.mkdir()
    (datasets / "train.csv").write_text("c,label\n" + "".join(f"{i % 7},{i % 2}\n" for i in range(64)))
    (outside / "secret.csv").write_text(f"{SECRET},label\n")
    admin = server.client
    admin.create_tenant("a", {})
    admin.create_tenant("b", {}, storage={"read": [str(datasets)], "write": []})
    member = Client(server.url, token=admin.create_token("b", name="hostile", role="member")["token"])
    checkpoints = root / "kembed" / "checkpoints"
    (checkpoints / "a" / "job-a" / "step-10").mkdir(parents=True)
    (checkpoints / "a" / "job-a" / "step-10" / "COMPLETE").write_text("{}")
    (checkpoints / "b").mkdir(parents=True, exist_ok=True)
    (checkpoints / "b" / "link-to-a").symlink_to(checkpoints / "a")
    yield {"server": server, "admin": admin, "member": member, "root": root, "datasets": datasets,
           "outside": outside, "checkpoints": checkpoints, "data_dir": root / "kembed"}
    server.stop()


def _table_job(datasets, **data) -> dict:
    spec = make_spec("hostile").build()
    spec["trainer"]["data"] = {"kind": "table", "uri": str(datasets / "train.csv"), "label": "label",
                               "sparse": {f"c{i}": "c" for i in range(8)}, "eval_fraction": 0.0, **data}
    spec["trainer"]["model"]["bottom_mlp"] = [16, 8]
    return spec


HOSTILE = [
    # (field, URI template): {a}/{b} tenants' folders, {root} the checkpoint root, {data} the data dir
    ("checkpoint.uri", "{a}/job-a"),
    ("checkpoint.uri", "{b}/../a/job-a"),
    ("checkpoint.uri", "{b}//..//a"),
    ("checkpoint.uri", "file://{b}/%2e%2e/a"),
    ("checkpoint.uri", "file://{b}/%2E%2E%2Fa"),
    ("checkpoint.uri", "file://localhost{a}"),
    ("checkpoint.uri", "file:{a}"),
    ("checkpoint.uri", "{b}/link-to-a/job-a"),
    ("checkpoint.uri", "{root}"),
    ("checkpoint.uri", "{root}/"),
    ("checkpoint.uri", "{b}/.."),
    ("checkpoint.uri", "{data}"),
    ("checkpoint.uri", "{data}/logs"),
    ("checkpoint.uri", "{b}x"),
    ("checkpoint.uri", "{b}./x"),
    ("checkpoint.uri", "{datasets}/out"),  # readable, not writable
    ("checkpoint.uri", "s3://other-bucket/b"),
    ("checkpoint.uri", "s3://Other-Bucket/b"),
    ("checkpoint.uri", "relative/path"),
    ("checkpoint.uri", "file://otherhost/x"),
    ("data.uri", "{data}/admin-token"),
    ("data.uri", "file://{data}/kembed.db"),
    ("data.uri", "/proc/self/environ"),
    ("data.uri", "file:///proc/self/%65nviron"),
    ("data.uri", "/etc/passwd"),
    ("data.uri", "{outside}/secret.csv"),
    ("data.uri", "{datasets}/../outside/secret.csv"),
    ("data.uri", "{datasets}/x%00.csv"),
    ("data.uri", "{a}/job-a/step-10/COMPLETE"),
    ("data.uri", "{b}/link-to-a/job-a/step-10/COMPLETE"),
    ("data.uri", "s3://bucket/a::file:///etc/passwd"),
    ("data.eval_uri", "file://{data}/admin-token"),
    ("data.eval_uri", "{root}/a"),
]


@pytest.mark.parametrize(("field", "template"), [pytest.param(f, t, id=f"{f}:{t}") for f, t in HOSTILE])
def test_a_uri_outside_the_policy_is_refused_naming_the_field(platform, field, template):
    c = platform["checkpoints"]
    uri = template.format(a=c / "a", b=c / "b", root=c, data=platform["data_dir"], datasets=platform["datasets"],
                          outside=platform["outside"])
    spec = _table_job(platform["datasets"])
    section, key = field.split(".")
    spec["trainer"].setdefault(section, {})[key] = uri
    before = platform["member"].jobs(limit=500)["items"]
    with pytest.raises(ApiError) as refused:
        platform["member"].submit(spec)
    assert refused.value.status_code == 422
    detail = str(refused.value.detail)
    assert _names(refused.value.detail, f"trainer.{field}") and SECRET not in detail
    if "outside the tenant's storage policy" in detail:  # a URI with a canonical form: where it may go instead
        assert str(c / "b") in detail
    assert platform["member"].jobs(limit=500)["items"] == before  # nothing stored


def _names(detail: str, field: str) -> bool:
    """Whether an error names `field` (a validation error's location also names the data union's tag)."""
    return field in detail or field.replace("data.", "data.table.") in detail


def test_the_admin_token_incident_is_refused_at_the_door(platform):
    """A member's table job with eval_uri = the server's admin token: refused, never run, never echoed."""
    spec = _table_job(platform["datasets"], eval_uri=f"file://{platform['data_dir']}/admin-token")
    with pytest.raises(ApiError) as refused:
        platform["member"].submit(spec)
    assert refused.value.status_code == 422 and "trainer.data.eval_uri" in str(refused.value.detail)
    token = (platform["data_dir"] / "admin-token").read_text().strip()
    assert token not in str(refused.value.detail)


def test_accepted_uris_are_stored_canonical_and_the_job_runs_inside_the_policy(platform):
    own = platform["checkpoints"] / "b"
    spec = _table_job(platform["datasets"], uri=f"file://localhost{platform['datasets']}/./x/../train.csv")
    spec["trainer"]["checkpoint"] = {"uri": f"file://{own}//runs/%2e/one/", "keep": 1, "every_steps": 20}
    job = platform["member"].submit(spec)
    trainer = job["spec"]["trainer"]
    assert trainer["data"]["uri"] == (platform["datasets"] / "train.csv").as_uri()
    assert trainer["checkpoint"]["uri"] == f"{own.as_uri()}/runs/one"
    done = _wait_terminal(platform["member"], job["id"])
    assert done["state"] == "SUCCEEDED", done
    assert done["latest_checkpoint_uri"] == f"{own.as_uri()}/runs/one/step-60"
    assert [p.name for p in (own / "runs" / "one").iterdir()] == ["step-60"]


def _wait_terminal(client: Client, job_id: str, timeout: float = 300) -> dict:
    deadline = time.monotonic() + timeout
    while (job := client.job(job_id))["state"] not in ("SUCCEEDED", "FAILED", "CANCELLED"):
        assert time.monotonic() < deadline, job
        time.sleep(0.3)
    return job


def test_a_platform_admin_sets_the_policy_and_cannot_grant_what_no_tenant_may_reach(platform):
    admin, data_dir, checkpoints = platform["admin"], platform["data_dir"], platform["checkpoints"]
    for prefix in (str(data_dir), f"file://{data_dir}/logs", str(checkpoints), str(checkpoints / "a"), "/proc",
                   "/", f"file://{checkpoints}/b/%2e%2e/a"):
        with pytest.raises(ApiError) as refused:
            admin.set_storage("b", {"read": [prefix], "write": []})
        assert refused.value.status_code == 422 and "storage.read.0" in str(refused.value.detail), prefix
    read = admin.tenant("b")["storage"]
    assert read == {"read": [platform["datasets"].as_uri()], "write": [], "own": (checkpoints / "b").as_uri()}
    # A prefix that contains the data dir is granted, and the data dir stays out of reach inside it.
    admin.set_storage("b", {"read": [str(platform["root"])], "write": []})
    try:
        spec = _table_job(platform["datasets"], uri=str(platform["outside"] / "secret.csv"))
        spec["trainer"]["training"]["steps"] = 1
        platform["member"].cancel(platform["member"].submit(spec)["id"])  # now readable: accepted
        spec = _table_job(platform["datasets"], uri=str(data_dir / "admin-token"))
        with pytest.raises(ApiError) as refused:
            platform["member"].submit(spec)
        assert refused.value.status_code == 422
    finally:
        admin.set_storage("b", {"read": [str(platform["datasets"])], "write": []})


def test_a_tenant_sees_its_own_policy_and_not_another(platform):
    mine = platform["member"].tenant("b")
    assert mine["storage"]["own"] == (platform["checkpoints"] / "b").as_uri()
    with pytest.raises(ApiError) as hidden:
        platform["member"].tenant("a")
    assert hidden.value.status_code == 404


def test_the_cli_sets_and_shows_a_policy(platform):
    server = platform["server"]
    cli = [sys.executable, "-m", "kembed_api.cli", "tenants"]
    env = {**os.environ, "KEMBED_TOKEN": server.token}
    shown = subprocess.run([*cli, "set-storage", "a", "--read-prefix", str(platform["datasets"]),
                            "--server", server.url], capture_output=True, text=True, timeout=60,
                           env=env)
    assert shown.returncode == 0, shown.stderr
    assert platform["admin"].tenant("a")["storage"]["read"] == [platform["datasets"].as_uri()]
    shown = subprocess.run([*cli, "show", "a", "--server", server.url], capture_output=True, text=True,
                           timeout=60, env=env)
    assert shown.returncode == 0 and "own folder" in shown.stdout, shown.stderr
