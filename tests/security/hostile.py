"""A world for hostile-tenant tests: a real `kembed serve` subprocess and two tenants, `alpha` and `beta`, with a
token of every role each (plus the bootstrap platform admin of the `default` tenant).

Test modules import the `world` fixture from here (`from tests.security.hostile import world`); it is started
once per module. Admission is paused in it: the jobs these tests make only need to exist, not to train.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
import pytest

from tests.e2e.conftest import ServerProcess

ROLES = ("viewer", "member", "tenant-admin", "platform-admin")
TENANTS = ("alpha", "beta")


@dataclass
class World:
    server: ServerProcess
    admin: str  # the bootstrap platform admin (tenant `default`)
    tokens: dict[tuple[str, str], str] = field(default_factory=dict)  # (tenant, role) -> secret
    token_ids: dict[tuple[str, str], int] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return self.server.url

    def as_(self, tenant: str, role: str) -> httpx.Client:
        secret = self.admin if (tenant, role) == ("default", "platform-admin") else self.tokens[tenant, role]
        return httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {secret}"}, timeout=30)

    def admin_client(self) -> httpx.Client:
        return self.as_("default", "platform-admin")


def start_world(data_dir, *, env: dict[str, str] | None = None) -> World:
    server = ServerProcess(data_dir, env={"KEMBED_ADMISSION_PAUSED": "true", **(env or {})}).start()
    world = World(server=server, admin=server.token)
    with world.admin_client() as admin:
        for tenant in TENANTS:
            admin.post("/v1/tenants", json={"name": tenant}).raise_for_status()
            for role in ROLES:
                if role == "platform-admin" and tenant != "alpha":
                    continue  # one platform admin outside `default` is enough to show what they may do
                made = admin.post(f"/v1/tenants/{tenant}/tokens", json={"name": f"{tenant}-{role}", "role": role})
                made.raise_for_status()
                world.tokens[tenant, role] = made.json()["token"]
                world.token_ids[tenant, role] = made.json()["id"]
        for role in ("viewer", "member", "tenant-admin"):
            made = admin.post("/v1/tenants/default/tokens", json={"name": f"default-{role}", "role": role})
            made.raise_for_status()
            world.tokens["default", role] = made.json()["token"]
            world.token_ids["default", role] = made.json()["id"]
    return world


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Iterator[World]:
    instance = start_world(tmp_path_factory.mktemp("hostile") / "kembed")
    yield instance
    instance.server.stop()
