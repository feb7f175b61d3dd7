"""The IAM policy a tenant's minted S3 key carries is its storage policy, said in IAM's words: its own folder and
grants, listing narrowed to them, denied places inside a grant denied, nothing IAM would read more widely."""

from __future__ import annotations

import pytest

from kembed_api.platform.storage import PlatformStorage
from kembed_contract.storage_policy import StoragePolicy
from kembed_platform.iam_policy import s3_policy_document

PLATFORM = PlatformStorage(checkpoint_root="s3://ckpt/kembed")


def _statements(policy: StoragePolicy, effect: str = "Allow") -> list[dict]:
    return [s for s in s3_policy_document(policy)["Statement"] if s["Effect"] == effect]


def test_own_folder_and_grants_become_object_and_listing_rights_and_nothing_else():
    policy = PLATFORM.policy("b", read=["s3://datasets/ctr", "file:///data/local"], write=["s3://exports/b"])
    allowed = _statements(policy)
    objects = {s["Resource"]: s["Action"] for s in allowed if s["Action"] not in ("s3:ListBucket",
                                                                                    "s3:GetBucketLocation")}
    assert objects == {
        "arn:aws:s3:::ckpt/kembed/b/*": ["s3:GetObject", "s3:PutObject", "s3:DeleteObject",
                                        "s3:AbortMultipartUpload", "s3:ListMultipartUploadParts"],
        "arn:aws:s3:::exports/b/*": ["s3:GetObject", "s3:PutObject", "s3:DeleteObject",
                                     "s3:AbortMultipartUpload", "s3:ListMultipartUploadParts"],
        "arn:aws:s3:::datasets/ctr/*": ["s3:GetObject"],
    }
    listing = {s["Resource"]: s["Condition"]["StringLike"]["s3:prefix"] for s in allowed
               if s["Action"] == "s3:ListBucket"}
    assert listing == {"arn:aws:s3:::ckpt": ["kembed/b", "kembed/b/*"], "arn:aws:s3:::exports": ["b", "b/*"],
                       "arn:aws:s3:::datasets": ["ctr", "ctr/*"]}
    # The checkpoint root is denied, but nothing granted reaches it: IAM's default deny keeps it out.
    assert _statements(policy, "Deny") == []


def test_a_denied_place_inside_a_grant_is_denied_explicitly():
    policy = StoragePolicy(own=("s3://ckpt/kembed/b",), read=("s3://shared",), deny=("s3://shared/secrets",))
    denied = _statements(policy, "Deny")
    assert {"Effect": "Deny", "Action": "s3:*", "Resource": "arn:aws:s3:::shared/secrets/*"} in denied
    assert any(s["Action"] == "s3:ListBucket" and s["Condition"]["StringLike"]["s3:prefix"] == [
        "secrets", "secrets/*"] for s in denied)


@pytest.mark.parametrize(("policy", "why"), [
    pytest.param(StoragePolicy(own=("s3://ckpt/kembed/b",), read=("s3://ckpt",), deny=("s3://ckpt/kembed",)),
                 "holds the tenant's own folder", id="grant-around-the-checkpoint-root"),
    pytest.param(StoragePolicy(own=("s3://ckpt/kembed/b",), read=("s3://datasets/ctr*",)), "cannot be expressed",
                 id="wildcard-star"),
    pytest.param(StoragePolicy(own=("s3://ckpt/kembed/b?",)), "cannot be expressed", id="wildcard-question"),
    pytest.param(StoragePolicy(own=("s3://ckpt/${aws:username}",)), "cannot be expressed", id="policy-variable"),
])
def test_what_iam_cannot_say_is_refused_not_widened(policy, why):
    with pytest.raises(ValueError, match="cannot be expressed|holds the tenant's own folder") as error:
        s3_policy_document(policy)
    assert why in str(error.value)


def test_a_policy_without_s3_prefixes_allows_nothing():
    assert s3_policy_document(StoragePolicy(own=("file:///srv/ckpt/b",))) == {
        "Version": "2012-10-17", "Statement": [{"Effect": "Deny", "Action": "s3:*", "Resource": "*"}]}
