"""Every spelling of a URI a hostile tenant can think of comes down to one canonical form, and the storage
policy decides on that form: its own folder yes, the data dir, another tenant's folder or /proc never."""

from __future__ import annotations

import os

import pytest
from pydantic import BaseModel

from kembed_api.platform.storage import PlatformStorage
from kembed_contract import trainer_config as config
from kembed_contract.spec import JobSpec
from kembed_contract.storage_policy import Access, StorageDenied, UriError, canonical_uri, uri_fields
from tests.builders import make_spec
from tests.security.storage_layout import make_layout


@pytest.mark.parametrize(("uri", "canonical"), [
    pytest.param("/data/x", "file:///data/x", id="plain-path"),
    pytest.param("file:///data/x", "file:///data/x", id="file-uri"),
    pytest.param("file:/data/x", "file:///data/x", id="file-no-authority"),
    pytest.param("file://localhost/data/x", "file:///data/x", id="file-localhost"),
    pytest.param("file://LocalHost/data/x", "file:///data/x", id="file-localhost-case"),
    pytest.param("FILE:///data/x", "file:///data/x", id="scheme-case"),
    pytest.param("file:////data//x///", "file:///data/x", id="repeated-slashes"),
    pytest.param("//data/x", "file:///data/x", id="posix-double-slash"),
    pytest.param("/data/./x/.", "file:///data/x", id="dots"),
    pytest.param("/data/y/../x", "file:///data/x", id="dot-dot"),
    pytest.param("/../../data/x", "file:///data/x", id="dot-dot-above-root"),
    pytest.param("file:///data/%78", "file:///data/x", id="percent-encoded-letter"),
    pytest.param("file:///data/y/%2e%2e/x", "file:///data/x", id="percent-encoded-dot-dot"),
    pytest.param("file:///data/y/%2E%2E%2Fx", "file:///data/x", id="percent-encoded-slash"),
    pytest.param("s3://bucket/a/./b//c/", "s3://bucket/a/b/c", id="s3-dots-slashes"),
    pytest.param("s3://bucket/other/../mine/x", "s3://bucket/mine/x", id="s3-dot-dot"),
    pytest.param("s3://bucket/mine/%2e%2e/x", "s3://bucket/x", id="s3-percent-dot-dot"),
    pytest.param("S3://bucket/x", "s3://bucket/x", id="s3-scheme-case"),
    pytest.param("s3://bucket", "s3://bucket", id="s3-bucket-only"),
    pytest.param("/data/tenant./x", "file:///data/tenant./x", id="trailing-dot-is-a-name"),
])
def test_spellings_have_one_canonical_form(uri, canonical):
    assert canonical_uri(uri, resolve=False) == canonical
    assert canonical_uri(canonical, resolve=False) == canonical  # canonical again: unchanged


@pytest.mark.parametrize("uri", [
    pytest.param("", id="empty"),
    pytest.param("data/x", id="relative"),
    pytest.param("file:data/x", id="file-relative"),
    pytest.param("file://otherhost/data/x", id="file-remote-host"),
    pytest.param("file://localhost:80/data/x", id="file-host-port"),
    pytest.param("/data/x\x00.csv", id="nul"),
    pytest.param("file:///data/x%00.csv", id="percent-nul"),
    pytest.param("/data/x\n", id="newline"),
    pytest.param("/data/%2e%2e/x", id="percent-in-plain-path"),
    pytest.param("file:///data/%252e%252e/x", id="double-percent-encoding"),
    pytest.param("file:///data/%ff", id="percent-not-utf8"),
    pytest.param("C:\\data\\x", id="backslashes"),
    pytest.param("s3://bucket/a::file:///etc/passwd", id="fsspec-chaining"),
    pytest.param("simplecache::s3://bucket/x", id="fsspec-cache-chain"),
    pytest.param("http://example.com/x.csv", id="http"),
    pytest.param("gs://bucket/x", id="other-scheme"),
    pytest.param("s3://Bucket/x", id="s3-upper-case-bucket"),
    pytest.param("s3://bucket/../other/x", id="s3-out-of-bucket"),
    pytest.param("s3:bucket/x", id="s3-no-slashes"),
    pytest.param("s3://b/x", id="s3-bucket-too-short"),
    pytest.param("/" + "a" * 5000, id="too-long"),
])
def test_spellings_without_a_canonical_form_are_refused(uri):
    with pytest.raises(UriError):
        canonical_uri(uri, resolve=False)


def test_symlinks_resolve_to_where_they_point(tmp_path):
    layout = make_layout(tmp_path)
    link = layout.folder("b") / "to-a"
    link.symlink_to(layout.folder("a"))
    assert canonical_uri(f"{link}/job-a") == f"{layout.folder('a').as_uri()}/job-a"
    # A link in a folder that does not exist yet resolves as far as it exists.
    assert canonical_uri(f"{link}/new/../job-a") == f"{layout.folder('a').as_uri()}/job-a"


HOSTILE_TARGETS = {
    "other-tenant-folder": "{a}/job-a",
    "other-tenant-dot-dot": "{b}/../a/job-a",
    "other-tenant-percent": "file://{b}/%2e%2e/a/job-a",
    "other-tenant-localhost": "file://localhost{b}/../a",
    "other-tenant-slashes": "//{b}//..//a",
    "other-tenant-symlink": "{b}/link-to-a/job-a",
    "checkpoint-root": "{root}",
    "checkpoint-root-slash": "{root}/",
    "checkpoint-root-dot": "{b}/..",
    "data-dir": "{data}",
    "sqlite-db": "{data}/kembed.db",
    "admin-token": "file://{data}/admin-token",
    "admin-token-via-symlink": "{b}/link-to-token",
    "proc-self-environ": "/proc/self/environ",
    "proc-environ-percent": "file:///proc/self/%65nviron",
    "sys": "/sys/kernel",
    "dev": "/dev/mem",
    "etc-passwd": "/etc/passwd",
    "outside": "{outside}/secret.csv",
    "prefix-sibling": "{b}x/file",
    "trailing-dot": "{b}./file",
    "s3-other-bucket": "s3://other-bucket/x",
}


@pytest.mark.parametrize("access", list(Access))
@pytest.mark.parametrize("name", list(HOSTILE_TARGETS))
def test_tenant_b_reaches_none_of_the_hostile_targets(tmp_path, name, access):
    layout = make_layout(tmp_path)
    (layout.folder("b") / "link-to-a").symlink_to(layout.folder("a"))
    (layout.folder("b") / "link-to-token").symlink_to(layout.data_dir / "admin-token")
    uri = HOSTILE_TARGETS[name].format(a=layout.folder("a"), b=layout.folder("b"), root=layout.checkpoints,
                                       data=layout.data_dir, outside=layout.outside)
    policy = layout.policy("b")
    with pytest.raises((StorageDenied, UriError)) as refused:
        policy.check(uri, access, where="trainer.checkpoint.uri")
    assert "trainer.checkpoint.uri" in str(refused.value)
    if isinstance(refused.value, StorageDenied):  # it says where jobs may go instead
        assert layout.folder("b").as_uri() in str(refused.value)


@pytest.mark.parametrize(("uri", "access"), [
    pytest.param("{b}/job-1", Access.WRITE, id="own-folder"),
    pytest.param("file://localhost{b}/x/../job-1", Access.WRITE, id="own-folder-spelled-oddly"),
    pytest.param("{datasets}/train.csv", Access.READ, id="dataset"),
    pytest.param("{datasets}/*.csv", Access.READ, id="dataset-glob"),
])
def test_tenant_b_reaches_its_own_places(tmp_path, uri, access):
    layout = make_layout(tmp_path)
    uri = uri.format(b=layout.folder("b"), datasets=layout.datasets)
    assert layout.policy("b").check(uri, access, where="x").startswith("file:///")


def test_datasets_are_read_only(tmp_path):
    layout = make_layout(tmp_path)
    with pytest.raises(StorageDenied, match="may write under"):
        layout.policy("b").check(f"{layout.datasets}/out", Access.WRITE, where="trainer.checkpoint.uri")


def test_an_admin_prefix_that_contains_the_data_dir_leaves_it_out_of_reach(tmp_path):
    layout = make_layout(tmp_path)
    storage = PlatformStorage.of(checkpoint_root=layout.checkpoints.as_uri(), data_dir=layout.data_dir)
    granted = storage.validate([str(tmp_path)], field="storage.read")  # the data dir is inside it
    policy = storage.policy("b", read=granted, write=[])
    assert policy.allows(canonical_uri(f"{layout.outside}/secret.csv"), Access.READ)  # what was granted
    for target in (layout.data_dir / "kembed.db", layout.folder("a") / "job-a", layout.checkpoints):
        assert not policy.allows(canonical_uri(str(target)), Access.READ), target


@pytest.mark.parametrize("prefix", [
    pytest.param("{data}", id="data-dir"),
    pytest.param("{data}/logs", id="inside-data-dir"),
    pytest.param("{root}/a", id="other-tenant-folder"),
    pytest.param("{root}", id="checkpoint-root"),
    pytest.param("/proc", id="proc"),
    pytest.param("/", id="whole-file-system"),
    pytest.param("file:///x%00", id="nul"),
])
def test_an_admin_cannot_grant_what_no_tenant_may_reach(tmp_path, prefix):
    layout = make_layout(tmp_path)
    storage = PlatformStorage.of(checkpoint_root=layout.checkpoints.as_uri(), data_dir=layout.data_dir)
    with pytest.raises(ValueError, match=r"storage\.read\.0"):
        storage.validate([prefix.format(data=layout.data_dir, root=layout.checkpoints)], field="storage.read")


def test_every_uri_of_a_job_spec_is_found():
    """Fields whose name says URI carry an Access marker, so every check sees them (and ones added later)."""
    def named_uris(model: type[BaseModel], where: str = "") -> set[str]:
        found = set()
        for name, info in model.model_fields.items():
            if "uri" in name.lower():
                assert any(isinstance(m, Access) for m in info.metadata), f"{where}{name} has no Access marker"
                found.add(f"{where}{name}")
            for sub in _models_in(info.annotation):
                found |= named_uris(sub, f"{where}{name}.")
        return found

    assert named_uris(JobSpec) >= {"trainer.data.uri", "trainer.data.eval_uri", "trainer.checkpoint.uri"}
    raw = make_spec().with_trainer(checkpoint={"uri": "s3://bucket/x"}).build()
    raw["trainer"]["data"] = {"kind": "table", "uri": "/d/train.csv", "eval_uri": "/d/eval.csv", "label": "y",
                              "sparse": {f"c{i}": f"c{i}" for i in range(8)}}
    spec = JobSpec.model_validate(raw)
    assert {loc for loc, *_ in uri_fields(spec)} == {"trainer.data.uri", "trainer.data.eval_uri",
                                                      "trainer.checkpoint.uri"}


def _models_in(annotation) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in getattr(annotation, "__args__", ()) for m in _models_in(arg)]


def test_a_spec_with_a_uri_that_has_no_canonical_form_is_invalid():
    with pytest.raises(config.ValidationError, match="checkpoint.uri"):
        config.TrainerConfig.model_validate(
            {**make_spec().build()["trainer"], "checkpoint": {"uri": "file:///c/x\x00"}})


def test_canonical_forms_are_what_the_filesystem_opens(tmp_path):
    """Checked and opened are the same file: the canonical path names the file the original spelling names."""
    layout = make_layout(tmp_path)
    spelled = f"file://localhost{layout.folder('b')}/%2e%2e/a/job-a/step-10/COMPLETE"
    canonical = canonical_uri(spelled)
    assert os.path.samefile(canonical.removeprefix("file://"), layout.folder("a") / "job-a/step-10/COMPLETE")
