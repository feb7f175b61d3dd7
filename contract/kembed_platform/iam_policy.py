"""A tenant's storage policy as an IAM policy document: what the identity minted for its trainers may do on S3.

Platform-only (the API's local backend and the operator mint keys with it; a trainer never needs it). What a
policy allows is defined once, in kembed_contract.storage_policy; this only says it in IAM's words.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from kembed_contract.storage_policy import StoragePolicy, is_under

__all__ = ["s3_policy_document"]

# ----------------------------------------------------------------------------------------------- as an IAM policy
# What a trainer does with objects under a prefix it may write (checkpoints are written, resumed from and pruned),
# and under one it may only read. Listing is s3:ListBucket on the bucket, narrowed by the s3:prefix condition.
_S3_WRITE_ACTIONS = ("s3:GetObject", "s3:PutObject", "s3:DeleteObject", "s3:AbortMultipartUpload",
                     "s3:ListMultipartUploadParts")
_S3_READ_ACTIONS = ("s3:GetObject",)
# '*' and '?' are wildcards in ARNs and StringLike, '${' starts a policy variable: a key holding one would grant
# more than the policy says, so such a prefix cannot become an IAM policy at all.
_IAM_SPECIAL = re.compile(r"[*?]|\$\{")


def _bucket_key(prefix: str) -> tuple[str, str]:
    bucket, _, key = prefix[len("s3://"):].partition("/")
    if _IAM_SPECIAL.search(key):
        raise ValueError(f"{prefix}: '*', '?' and '${{' in an S3 prefix cannot be expressed in an IAM policy")
    return bucket, key


def _object_arn(bucket: str, key: str) -> str:
    return f"arn:aws:s3:::{bucket}/{key}/*" if key else f"arn:aws:s3:::{bucket}/*"


def _listing(effect: str, bucket: str, key: str) -> dict[str, Any]:
    statement: dict[str, Any] = {"Effect": effect, "Action": "s3:ListBucket", "Resource": f"arn:aws:s3:::{bucket}"}
    if key:
        statement["Condition"] = {"StringLike": {"s3:prefix": [key, f"{key}/*"]}}
    return statement


def s3_policy_document(policy: StoragePolicy) -> dict[str, Any]:
    """The IAM policy document that lets an S3 identity reach exactly what `policy` allows on S3, nothing else.

    The policy's own and write prefixes become GetObject/PutObject/DeleteObject on their keys, its read prefixes
    GetObject, each with s3:ListBucket on its bucket limited by an s3:prefix condition. A denied place that lies
    inside a granted prefix becomes an explicit Deny (IAM's deny wins, as `deny` does here). file:// prefixes have
    no part in it. Raises ValueError where IAM cannot say what the policy says: a denied place that holds the
    tenant's own folder inside a granted prefix (IAM cannot deny a folder but one of its subfolders), or a key
    with IAM wildcards.
    """
    def s3_only(values: Iterable[str]) -> list[str]:
        return [v for v in values if v.startswith("s3://")]

    writable, readable = s3_only((*policy.own, *policy.write)), s3_only(policy.read)
    statements: list[dict[str, Any]] = []
    for prefixes_, actions in ((writable, _S3_WRITE_ACTIONS), (readable, _S3_READ_ACTIONS)):
        for prefix in prefixes_:
            bucket, key = _bucket_key(prefix)
            statements.append({"Effect": "Allow", "Action": list(actions), "Resource": _object_arn(bucket, key)})
            statements.append(_listing("Allow", bucket, key))
    granted = s3_only((*policy.write, *policy.read))
    for place in s3_only(policy.deny):
        if not any(is_under(place, p) and place != p for p in granted) and place not in granted:
            continue  # nothing granted reaches it: IAM's default deny already keeps it out
        if any(is_under(own, place) for own in policy.own):
            raise ValueError(f"{place} is denied but holds the tenant's own folder inside a granted prefix; "
                             "grant prefixes beside it, not around it")
        bucket, key = _bucket_key(place)
        statements.append({"Effect": "Deny", "Action": "s3:*", "Resource": _object_arn(bucket, key)})
        statements.append(_listing("Deny", bucket, key))
    buckets = sorted({_bucket_key(p)[0] for p in (*writable, *readable)})
    if buckets:
        # A bucket's region, nothing in it: what s3fs probes before it writes (HeadBucket needs an unconditioned
        # s3:ListBucket, which would list every tenant's keys).
        statements.append({"Effect": "Allow", "Action": "s3:GetBucketLocation",
                           "Resource": [f"arn:aws:s3:::{b}" for b in buckets]})
    if not statements:  # IAM refuses an empty statement list; this one allows nothing
        statements.append({"Effect": "Deny", "Action": "s3:*", "Resource": "*"})
    return {"Version": "2012-10-17", "Statement": statements}
