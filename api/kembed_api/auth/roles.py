"""Roles and what each may do. One table, so a reviewer sees the whole policy at once."""

from __future__ import annotations

from enum import StrEnum

__all__ = ["Action", "Role", "allowed", "may_hold"]


class Role(StrEnum):
    PLATFORM_ADMIN = "platform-admin"  # manages tenants and quotas; acts in its own tenant like a tenant-admin
    TENANT_ADMIN = "tenant-admin"  # manages its tenant's tokens; submits and cancels
    MEMBER = "member"  # submits and cancels
    VIEWER = "viewer"  # reads


class Action(StrEnum):
    READ = "read"
    SUBMIT = "submit"  # also cancel
    MANAGE_TOKENS = "manage-tokens"
    MANAGE_TENANTS = "manage-tenants"


_POLICY: dict[Role, frozenset[Action]] = {
    Role.PLATFORM_ADMIN: frozenset(Action),
    Role.TENANT_ADMIN: frozenset({Action.READ, Action.SUBMIT, Action.MANAGE_TOKENS}),
    Role.MEMBER: frozenset({Action.READ, Action.SUBMIT}),
    Role.VIEWER: frozenset({Action.READ}),
}


def allowed(role: Role, action: Action) -> bool:
    return action in _POLICY[role]


def may_hold(caller: Role, token_role: Role) -> bool:
    """Whether a caller may see, mint or revoke a token of `token_role`: only a token that can do no more than the
    caller can. A tenant-admin manages its tenant's tenant-admins, members and viewers; a platform-admin token is
    seen and touched by platform admins only, whichever tenant it belongs to (a tenant-admin of the tenant the
    bootstrap token lives in could otherwise revoke, and so lock out, the platform's administrators)."""
    return _POLICY[token_role] <= _POLICY[caller]
