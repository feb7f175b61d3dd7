"""The trainer's one door to storage: every open, listing and deletion goes through a `Guard`.

The guard holds the tenant's storage policy (from the launcher, `storage_policy.POLICY_ENV`) and checks each URI
at the moment it is used, after making it canonical again: a file a folder or a glob turned up, a checkpoint step
folder about to be loaded or deleted. A symlink planted after the job was accepted therefore resolves to where it
really points, and is refused if that is outside the policy. Without a policy (a trainer run by hand) URIs are
still made canonical, and nothing is refused.

Files are opened through the filesystem object of the canonical URI with the bare path, so fsspec never parses a
URL (no chaining, no second percent-decoding) and opens exactly what was checked.
"""

from __future__ import annotations

import os
from typing import Any

import fsspec

from kembed_contract.storage_policy import Access, StoragePolicy, UriError, canonical_uri

__all__ = ["Guard"]


class Guard:
    def __init__(self, policy: StoragePolicy | None, *, cwd: str | None = None) -> None:
        self.policy = policy
        self.cwd = cwd or os.getcwd()

    @classmethod
    def from_env(cls) -> Guard:
        return cls(StoragePolicy.from_env())

    def check(self, uri: str, access: Access, *, where: str) -> str:
        """The canonical form of `uri`, if the policy allows `access`; raises StorageDenied or UriError."""
        if self.policy is None:
            try:
                return canonical_uri(uri, cwd=self.cwd)
            except UriError as error:
                raise UriError(f"{where}: {error}") from None
        return self.policy.check(uri, access, where=where, cwd=self.cwd)

    def readable(self, uri: str, *, where: str) -> str:
        return self.check(uri, Access.READ, where=where)

    def writable(self, uri: str, *, where: str) -> str:
        return self.check(uri, Access.WRITE, where=where)

    @staticmethod
    def fs(canonical: str) -> tuple[Any, str]:
        """(filesystem, bare path) of a canonical URI."""
        scheme, _, path = canonical.partition("://")
        if scheme == "file":
            return fsspec.filesystem("file"), path
        return fsspec.filesystem(scheme), path

    @staticmethod
    def uri_of(fs: Any, path: str) -> str:
        protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
        if protocol in ("file", "local"):
            return "file://" + path
        return f"{protocol}://{path}"

    def open(self, uri: str, mode: str = "rb", *, where: str, **kwargs: Any) -> Any:
        """Open `uri` (checked for reading, or writing for a write mode)."""
        access = Access.READ if mode.startswith("r") else Access.WRITE
        canonical = self.check(uri, access, where=where)
        fs, path = self.fs(canonical)
        return fs.open(path, mode, **kwargs)

    def list_files(self, uri: str, *, where: str) -> list[str]:
        """The files a URI names (itself, every file of a folder, or a glob's matches), sorted, each checked."""
        canonical = self.readable(uri, where=where)
        fs, path = self.fs(canonical)
        if any(c in path for c in "*?["):
            paths = fs.glob(path)
        elif fs.isdir(path):
            paths = [p for p in fs.find(path) if not p.rsplit("/", 1)[-1].startswith((".", "_"))]
        else:
            paths = [path]
        if not paths:
            raise FileNotFoundError(f"{where}: no files at {uri}")
        # Each found file again: a symlink inside an allowed folder may point anywhere.
        return [self.readable(self.uri_of(fs, p), where=where) for p in sorted(paths)]

    def check_tree(self, uri: str, *, where: str) -> None:
        """Every entry under folder `uri`, hidden ones and folders included, readable where it really is (a
        symlink is judged by its target); raises StorageDenied or UriError. For a reader with more rights than
        the writer, such as the API reading a checkpoint a trainer wrote."""
        canonical = self.readable(uri, where=where)
        fs, path = self.fs(canonical)
        for found in fs.find(path, withdirs=True):
            self.readable(self.uri_of(fs, found), where=where)

