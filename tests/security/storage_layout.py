"""A hostile tenant's view of one machine: a server data dir with its database and token, two tenants'
checkpoint folders, a shared datasets folder, and secrets elsewhere; shared by the storage tests."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from kembed_contract.storage_policy import StoragePolicy

SECRET = "kembed_s3cr3t_admin_token_do_not_echo"


@dataclass
class Layout:
    root: Path
    data_dir: Path
    checkpoints: Path
    datasets: Path
    outside: Path

    def folder(self, tenant: str) -> Path:
        return self.checkpoints / tenant

    def policy(self, tenant: str) -> StoragePolicy:
        """What the API hands tenant `tenant`'s trainers: its folder, the datasets, never the data dir."""
        return StoragePolicy(own=(self.folder(tenant).as_uri(),), read=(self.datasets.as_uri(),),
                             deny=(self.data_dir.as_uri(), self.checkpoints.as_uri()))


def make_layout(root: Path) -> Layout:
    root = root.resolve()
    data_dir = root / "kembed"
    checkpoints = data_dir / "checkpoints"
    for tenant in ("a", "b"):
        (checkpoints / tenant).mkdir(parents=True)
    (data_dir / "admin-token").write_text(SECRET + "\n")
    (data_dir / "kembed.db").write_text(f"SQLite format 3 {SECRET}\n")
    # Tenant a's finished job: two complete checkpoints.
    for step in (10, 20):
        step_dir = checkpoints / "a" / "job-a" / f"step-{step}"
        step_dir.mkdir(parents=True)
        (step_dir / "COMPLETE").write_text(json.dumps({"step": step}))
        (step_dir / ".metadata").write_text(SECRET)
    datasets = root / "datasets"
    datasets.mkdir()
    outside = root / "outside"
    outside.mkdir()
    (outside / "secret.csv").write_text(f"{SECRET},label\n1,0\n")
    return Layout(root, data_dir, checkpoints, datasets, outside)


def tenant_a_files(layout: Layout) -> dict[str, str]:
    """Everything under tenant a's folder with its contents, to show nothing was touched."""
    return {str(p.relative_to(layout.folder("a"))): p.read_text() for p in sorted(layout.folder("a").rglob("*"))
            if p.is_file()}
