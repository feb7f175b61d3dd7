"""Roles and what each may do. One table, so a reviewer sees the whole policy at once."""

from __future__ import annotations

from enum import StrEnum

__all__ = ["Action", "Role", "allowed"]


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
