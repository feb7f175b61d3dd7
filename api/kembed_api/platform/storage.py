"""Tenants' storage policies as the platform sees them: what each tenant's jobs may read and write.

A platform admin sets a tenant's read prefixes (datasets) and write prefixes (checkpoints, exports); new tenants
start from the platform's defaults (settings `storage_read_prefixes` / `storage_write_prefixes`). On top of what
is stored, always:

- the tenant's own checkpoint folder `<checkpoint_root>/<tenant>` is readable and writable;
- the server's data dir, the checkpoint root and so every other tenant's folder, and the kernel's /proc, /sys
  and /dev are never reachable, even under a prefix an admin granted that contains them.

The canonical form and the check itself are `kembed_contract.storage_policy`'s, the same code the trainer runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kembed_contract.storage_policy import (
    ALWAYS_DENIED,
    Access,
    StoragePolicy,
    UriError,
    canonical_uri,
    is_under,
)

__all__ = ["PlatformStorage", "how_to_grant"]


def how_to_grant(tenant: str, access: Access | None) -> str:
    """The commands that would allow a refused URI: said with the refusal, so a newcomer is not stuck on it."""
    flag = "--write-prefix" if access is Access.WRITE else "--read-prefix"
    embedded = " or, on the embedded server, restart it with `kembed serve --read-prefix FOLDER`" if flag == "--read-prefix" else ""
    return (f"a platform admin allows a prefix with `kembed tenants set-storage {tenant} {flag} PREFIX` (it replaces "
            f"the tenant's prefixes: repeat those to keep){embedded}")


@dataclass(frozen=True)
class PlatformStorage:
    """The platform's side of every tenant's policy (canonical URIs)."""

    checkpoint_root: str
    data_dir: str | None = None
    default_read: tuple[str, ...] = ()
    default_write: tuple[str, ...] = ()

    @classmethod
    def of(cls, *, checkpoint_root: str, data_dir: Path | None = None, default_read: Sequence[str] = (),
           default_write: Sequence[str] = ()) -> PlatformStorage:
        """From settings: everything made canonical once (symlinks of file:// resolved), defaults validated."""
        storage = cls(checkpoint_root=canonical_uri(checkpoint_root),
                      data_dir=canonical_uri(str(data_dir)) if data_dir is not None else None)
        return cls(checkpoint_root=storage.checkpoint_root, data_dir=storage.data_dir,
                   default_read=storage.validate(default_read, field="storage_read_prefixes"),
                   default_write=storage.validate(default_write, field="storage_write_prefixes"))

    def own_folder(self, tenant: str) -> str:
        return f"{self.checkpoint_root}/{tenant}"

    @property
    def denied(self) -> tuple[str, ...]:
        return (self.checkpoint_root,) if self.data_dir is None else (self.data_dir, self.checkpoint_root)

    def validate(self, values: Sequence[str], *, field: str) -> tuple[str, ...]:
        """Prefixes an admin may grant, canonical and deduplicated; raises ValueError naming the item at fault.

        A prefix inside a place no tenant may reach (the data dir, the checkpoint root, another tenant's folder,
        /proc) could never take effect, so it is refused instead of stored. A prefix that contains such a place
        is accepted: the place stays out of reach inside it.
        """
        found: dict[str, None] = {}
        for i, value in enumerate(values):
            try:
                prefix = canonical_uri(value)
            except UriError as error:
                raise ValueError(f"{field}.{i}: {error}") from None
            if prefix == "file:///":
                raise ValueError(f"{field}.{i}: the whole file system is not a prefix; name the folders")
            for place in (*self.denied, *ALWAYS_DENIED):
                if is_under(prefix, place):
                    raise ValueError(f"{field}.{i}: {value!r} lies in {place}, which no tenant's jobs may reach "
                                     "(a tenant's own checkpoint folder is always allowed without being listed)")
            found[prefix] = None
        return tuple(found)

    def policy(self, tenant: str, *, read: Sequence[str] | None, write: Sequence[str] | None) -> StoragePolicy:
        """The effective policy of `tenant` given its stored prefixes (None: not set yet, the defaults)."""
        return StoragePolicy(
            own=(self.own_folder(tenant),),
            read=tuple(self.default_read if read is None else read),
            write=tuple(self.default_write if write is None else write),
            deny=self.denied,
        )
