"""Fixtures of the hostile-tenant suite (tests/security/hostile.py: a real server with two tenants)."""

from tests.security.hostile import world  # noqa: F401 (a fixture, used by name)
