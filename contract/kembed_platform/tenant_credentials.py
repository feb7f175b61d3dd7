"""Per-tenant S3 credentials, minted by kembed with the platform's IAM credentials (docs/security.md).

Each tenant gets one IAM user whose only permissions are its storage policy turned into an IAM policy
(`kembed_contract.storage_policy.s3_policy_document`, the one place that says what a policy allows), and an access
key that only that tenant's trainers receive. The platform's own keys, which can do this minting, never reach a
trainer: `trainer_environ` takes every way an AWS SDK finds credentials out of a trainer's environment before it
puts the tenant's key in.

Keys rotate two at a time (IAM allows two per user): a rotation creates a new key and keeps the one before it, so
trainers started with the previous key finish their job; the rotation after that deletes it. Removing a tenant
deletes its keys, its policy and its user.

The secret half of a key is held only by `S3Credentials`, whose repr leaves it out, and is never logged; boto3's
errors name the user and the operation, never a secret.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, Field

from kembed_contract.storage_policy import StoragePolicy
from kembed_platform.iam_policy import s3_policy_document

__all__ = ["ACCESS_KEY_ID", "PLATFORM_CREDENTIAL_VARS", "SECRET_ACCESS_KEY", "MintingSettings", "S3Credentials",
           "TenantCredentials", "trainer_environ"]

log = logging.getLogger(__name__)

ACCESS_KEY_ID, SECRET_ACCESS_KEY = "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"
# Every variable through which botocore (boto3, s3fs) finds credentials other than the two above: a profile, a
# credentials or config file (which may run a credential_process), a session token, a web identity, the container
# credentials endpoint. None of the platform's may reach a trainer that holds its tenant's own key.
PLATFORM_CREDENTIAL_VARS = (
    ACCESS_KEY_ID, SECRET_ACCESS_KEY, "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AWS_PROFILE", "AWS_DEFAULT_PROFILE",
    "AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE", "AWS_ROLE_ARN", "AWS_ROLE_SESSION_NAME",
    "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_CONTAINER_CREDENTIALS_FULL_URI",
    "AWS_CONTAINER_AUTHORIZATION_TOKEN", "AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE",
)
# The name of the inline policy that carries the tenant's storage policy; the only policy kembed's users have.
POLICY_NAME = "kembed-storage"
_MAX_USER_NAME = 64  # IAM's limit


class MintingSettings(BaseModel):
    """Where minted users live: settings of whichever component mints (the API's local backend, the operator)."""

    s3_iam_endpoint_url: str | None = Field(
        None, description="IAM endpoint for minting (an S3-compatible store's IAM, a test server); unset = AWS IAM."
    )
    s3_iam_user_prefix: str = Field(
        "kembed-", description="Minted IAM users are named <prefix><tenant>: one prefix per installation sharing an "
        "AWS account."
    )


@dataclass(frozen=True)
class S3Credentials:
    """One access key of a tenant's IAM user."""

    access_key_id: str
    secret_access_key: str = field(repr=False)

    def environ(self) -> dict[str, str]:
        return {ACCESS_KEY_ID: self.access_key_id, SECRET_ACCESS_KEY: self.secret_access_key}


def trainer_environ(environ: Mapping[str, str], credentials: S3Credentials) -> dict[str, str]:
    """`environ` with the platform's credentials taken out and the tenant's key put in.

    The instance metadata service is switched off too: on a cloud machine botocore would otherwise fall back to
    the machine's own role, which is the platform's."""
    kept = {k: v for k, v in environ.items() if k not in PLATFORM_CREDENTIAL_VARS}
    return {**kept, **credentials.environ(), "AWS_EC2_METADATA_DISABLED": "true"}


class TenantCredentials:
    """Mints, updates, rotates and deletes the tenants' IAM users through boto3's IAM client.

    `iam` is `boto3.client("iam", ...)` with the platform's credentials; `user_prefix` keeps one installation's
    users apart from another's in the same account (`<user_prefix><tenant>`); users live under IAM path `path`.
    """

    def __init__(self, iam: Any, *, user_prefix: str = "kembed-", path: str = "/kembed/") -> None:
        self.iam = iam
        self.user_prefix = user_prefix
        self.path = path

    @classmethod
    def connect(cls, *, endpoint_url: str | None = None, region: str | None = None, **kwargs: Any) -> TenantCredentials:
        """An IAM client from the environment's (the platform's) credentials; `endpoint_url` None = AWS IAM."""
        import boto3  # only installations that mint credentials need it at all

        return cls(boto3.client("iam", endpoint_url=endpoint_url, region_name=region or "us-east-1"), **kwargs)

    def user_name(self, tenant: str) -> str:
        name = f"{self.user_prefix}{tenant}"
        if len(name) > _MAX_USER_NAME:
            raise ValueError(f"IAM user name {name!r} is longer than {_MAX_USER_NAME} characters: shorten the "
                             "tenant's name or the installation's user prefix")
        return name

    # ------------------------------------------------------------------------------------------- the policy
    def apply_policy(self, tenant: str, policy: StoragePolicy) -> None:
        """Create the tenant's user if it has none, and make its only permissions `policy` (replacing any before).

        Raises ValueError (before touching IAM) for a policy IAM cannot express."""
        document = json.dumps(s3_policy_document(policy))
        user = self.user_name(tenant)
        try:
            self.iam.create_user(UserName=user, Path=self.path,
                                 Tags=[{"Key": "kembed.io/tenant", "Value": tenant}])
            log.info("created IAM user %s for tenant %s", user, tenant)
        except self.iam.exceptions.EntityAlreadyExistsException:
            pass
        self.iam.put_user_policy(UserName=user, PolicyName=POLICY_NAME, PolicyDocument=document)

    # ------------------------------------------------------------------------------------------- keys
    def _key_ids(self, user: str) -> list[str]:
        """The user's key ids, oldest first."""
        keys = self.iam.list_access_keys(UserName=user)["AccessKeyMetadata"]
        return [k["AccessKeyId"] for k in sorted(keys, key=lambda k: k["CreateDate"])]

    def _delete_key(self, user: str, key_id: str) -> None:
        with contextlib.suppress(self.iam.exceptions.NoSuchEntityException):
            self.iam.delete_access_key(UserName=user, AccessKeyId=key_id)
        log.info("deleted access key %s of IAM user %s", key_id, user)

    def _new_key(self, user: str, *, keep: str | None) -> S3Credentials:
        """A new key; every other key but `keep` is deleted first (IAM allows two)."""
        for key_id in self._key_ids(user):
            if key_id != keep:
                self._delete_key(user, key_id)
        created = self.iam.create_access_key(UserName=user)["AccessKey"]
        log.info("created access key %s of IAM user %s", created["AccessKeyId"], user)
        return S3Credentials(created["AccessKeyId"], created["SecretAccessKey"])

    def ensure(self, tenant: str, policy: StoragePolicy, *, current: str | None) -> S3Credentials | None:
        """Bring the tenant's user and policy up to date; a new key if `current` (the key id the tenant's trainers
        hold now) is not one of the user's keys any more, else None (keep using it)."""
        self.apply_policy(tenant, policy)
        user = self.user_name(tenant)
        if current is not None and current in self._key_ids(user):
            return None
        return self._new_key(user, keep=None)

    def rotate(self, tenant: str, *, current: str | None) -> S3Credentials:
        """A new key for the tenant; `current` stays valid (trainers started with it finish), every older one goes."""
        user = self.user_name(tenant)
        return self._new_key(user, keep=current)

    def remove(self, tenant: str) -> None:
        """Delete the tenant's keys, its policy and its user (nothing left to do is not an error)."""
        user = self.user_name(tenant)
        missing = self.iam.exceptions.NoSuchEntityException
        try:
            key_ids = self._key_ids(user)
        except missing:
            return
        for key_id in key_ids:
            self._delete_key(user, key_id)
        with contextlib.suppress(missing):
            self.iam.delete_user_policy(UserName=user, PolicyName=POLICY_NAME)
        with contextlib.suppress(missing):
            self.iam.delete_user(UserName=user)
        log.info("deleted IAM user %s of tenant %s", user, tenant)
