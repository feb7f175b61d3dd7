"""Canonical storage URIs and the storage policy that decides which of them a tenant's job may read or write.

One function (`canonical_uri`) turns every spelling a user can write into one form before any decision: the
scheme and host forms of `file:` (`file:/x`, `file:///x`, `file://localhost/x`, a plain absolute path), repeated
slashes, `.` and `..`, percent-encoding, and, for local files, symlinks (the real path is what is checked and then
opened). S3 keys are normalised the same way (but have no symlinks). The API checks a job's URIs with it at
submission, and the trainer checks them again, with the same policy, whenever it opens, lists or deletes anything.

A canonical URI is either `file://<absolute real path>` or `s3://<bucket>[/<key>]`, with no trailing slash, no empty,
`.` or `..` segments and no `%`: so it means the same thing to every reader (fsspec opens it literally) and
canonicalising it again changes nothing. `::` (fsspec's URL chaining), control characters (NUL, newlines) and
backslashes are refused outright.

Prefixes match whole segments: `file:///data/a` covers `file:///data/a/x`, never `file:///data/ab`.

Torch-free and fsspec-free: the API imports it (through kembed_contract.trainer_config) to validate specs.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any
from urllib.parse import unquote

from kembed_contract.runtime import ENV_STORAGE_POLICY

__all__ = [
    "ALWAYS_DENIED",
    "POLICY_ENV",
    "Access",
    "StorageDenied",
    "StoragePolicy",
    "UriError",
    "canonical_uri",
    "canonicalize_fields",
    "check_uri_syntax",
    "is_under",
    "prefixes",
    "uri_fields",
]

# Where the launcher (the API's local backend, the operator's pods) puts the tenant's effective policy as JSON
# (`StoragePolicy.to_json`): the runtime contract's name, re-exported for the policy's readers.
POLICY_ENV = ENV_STORAGE_POLICY

# Never data, whatever a policy says: kernel views of processes (environment variables, memory) and devices.
ALWAYS_DENIED = ("file:///proc", "file:///sys", "file:///dev")

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):")
# S3's rules for bucket names (lower case only: an upper-case spelling is refused, not folded).
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_MAX_URI = 4096


class UriError(ValueError):
    """A URI that has no canonical form (the message says why, without echoing the URI)."""


class Access(StrEnum):
    """What a job does with a URI. Writing includes reading (a checkpoint folder is also resumed from)."""

    READ = "read"
    WRITE = "write"


class StorageDenied(PermissionError):
    """A URI outside the storage policy (the message names the field and the allowed prefixes)."""

    def __init__(self, message: str, access: Access | None = None) -> None:
        super().__init__(message)
        self.access = access  # what was refused, so the API can say how to grant it


# ----------------------------------------------------------------------------------------------- canonical form
def _refuse_characters(text: str) -> None:
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in text):
        raise UriError("control characters (NUL, newline, ...) are not allowed in a URI")
    if "\\" in text:
        raise UriError("backslashes are not allowed in a URI")
    if "::" in text:
        raise UriError("'::' (URL chaining) is not allowed in a URI")


def _decode(text: str) -> str:
    """Percent-decoding, once. What is left with a `%` (double encoding) is refused, so no reader decodes again."""
    try:
        decoded = unquote(text, errors="strict")
    except UnicodeDecodeError:
        raise UriError("percent-encoding that is not UTF-8") from None
    if "%" in decoded:
        raise UriError("'%' is not allowed in a path (after percent-decoding)")
    _refuse_characters(decoded)
    return decoded


def _local_path(path: str, *, resolve: bool) -> str:
    path = "/" + path.lstrip("/")  # POSIX keeps a leading "//" as special: one slash is the same file here
    return os.path.realpath(path) if resolve else os.path.normpath(path)


def _s3(rest: str) -> str:
    if not rest.startswith("//"):
        raise UriError("an s3 URI is s3://<bucket>/<key>")
    bucket, _, key = rest[2:].partition("/")
    if not _BUCKET.match(bucket) or ".." in bucket:
        raise UriError("not a valid S3 bucket name (3-63 lower-case letters, digits, '.' and '-')")
    segments: list[str] = []
    for segment in _decode(key).split("/"):
        if segment in ("", "."):
            continue
        if segment == "..":
            if not segments:
                raise UriError("'..' leads out of the bucket")
            segments.pop()
        else:
            segments.append(segment)
    return f"s3://{bucket}" + "".join(f"/{s}" for s in segments)


def canonical_uri(uri: str, *, cwd: str | None = None, resolve: bool = True) -> str:
    """The one canonical spelling of `uri` (see the module's docstring); raises UriError.

    A relative path is relative to `cwd`, and refused without one. `resolve=False` leaves symlinks alone (a syntax
    check, for validating a spec where its files are not visible).
    """
    if not isinstance(uri, str) or not uri:
        raise UriError("empty URI")
    if len(uri) > _MAX_URI:
        raise UriError(f"longer than {_MAX_URI} characters")
    _refuse_characters(uri)
    match = _SCHEME.match(uri)
    if match:
        scheme, rest = match.group(1).lower(), uri[match.end():]
        if scheme == "s3":
            return _s3(rest)
        if scheme != "file":
            raise UriError(f"only file:// and s3:// URIs (or absolute paths) are supported, not {scheme}:")
        if rest.startswith("//"):
            host, slash, path = rest[2:].partition("/")
            if host.lower() not in ("", "localhost"):
                raise UriError("a file:// URI may name no host but localhost")
            path = slash + path
        else:
            path = rest
        if not path.startswith("/"):
            raise UriError("a file: URI needs an absolute path")
        path = _decode(path)
    else:
        if "%" in uri:
            raise UriError("'%' is not allowed in a path")
        path = uri
        if not path.startswith("/"):
            if cwd is None:
                raise UriError("a path must be absolute (or a file:// or s3:// URI)")
            path = os.path.join(cwd, path)
    return "file://" + _local_path(path, resolve=resolve)


def check_uri_syntax(uri: str) -> str:
    """`uri` unchanged, if it has a canonical form (relative paths allowed, symlinks not followed); for validators."""
    canonical_uri(uri, cwd="/", resolve=False)
    return uri


def is_under(canonical: str, prefix: str) -> bool:
    """Whether canonical URI `canonical` is `prefix` or inside it, segment by segment."""
    return canonical == prefix or canonical.startswith(prefix.rstrip("/") + "/")


# ----------------------------------------------------------------------------------------------- the policy
@dataclass(frozen=True)
class StoragePolicy:
    """What one tenant's jobs may touch, as canonical URI prefixes.

    own:   always readable and writable (the tenant's checkpoint folder), whatever `deny` says;
    deny:  never (the server's data dir, the checkpoint root with the other tenants' folders), plus ALWAYS_DENIED;
    write: writable and readable (checkpoints, exports);
    read:  readable (datasets).
    """

    own: tuple[str, ...] = ()
    read: tuple[str, ...] = ()
    write: tuple[str, ...] = ()
    deny: tuple[str, ...] = field(default=())

    def allows(self, canonical: str, access: Access) -> bool:
        if any(is_under(canonical, p) for p in self.own):
            return True
        if any(is_under(canonical, p) for p in (*self.deny, *ALWAYS_DENIED)):
            return False
        prefixes = self.write if access is Access.WRITE else (*self.read, *self.write)
        return any(is_under(canonical, p) for p in prefixes)

    def allowed(self, access: Access) -> list[str]:
        """The prefixes `access` may use (for messages)."""
        return [*self.own, *(self.write if access is Access.WRITE else (*self.read, *self.write))]

    def check(self, uri: str, access: Access, *, where: str, cwd: str | None = None) -> str:
        """The canonical form of `uri` if the policy allows `access` to it; raises StorageDenied or UriError."""
        try:
            canonical = canonical_uri(uri, cwd=cwd)
        except UriError as error:
            raise UriError(f"{where}: {error}") from None
        if not self.allows(canonical, access):
            # The URI itself is not repeated: what the caller sent is theirs, where a symlink led is not.
            verb = "write" if access is Access.WRITE else "read"
            allowed = ", ".join(self.allowed(access)) or "(nothing)"
            raise StorageDenied(f"{where}: outside the tenant's storage policy; jobs may {verb} under: {allowed}",
                                access)
        return canonical

    def to_json(self) -> str:
        return json.dumps({"own": self.own, "read": self.read, "write": self.write, "deny": self.deny})

    @classmethod
    def from_json(cls, text: str) -> StoragePolicy:
        raw = json.loads(text)
        if not isinstance(raw, dict) or set(raw) - {"own", "read", "write", "deny"}:
            raise ValueError(f"{POLICY_ENV}: expected an object with own, read, write and deny lists")
        # Stored prefixes are canonical already; once more costs nothing and keeps a hand-written policy honest.
        return cls(**{k: tuple(canonical_uri(p) for p in v) for k, v in raw.items()})

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> StoragePolicy | None:
        text = (os.environ if environ is None else environ).get(POLICY_ENV)
        return None if text is None else cls.from_json(text)


# ----------------------------------------------------------------------------------------------- URI fields
def uri_fields(model: Any, where: str = "") -> Iterator[tuple[str, Any, str, Access]]:
    """Every URI a (nested) pydantic model holds: (its field path, the model holding it, field name, access).

    A field is a URI when its annotation carries an `Access` (`Annotated[str | None, Access.READ]`), so a field
    added later is checked by every check without anyone remembering to list it.
    """
    for name, info in type(model).model_fields.items():
        value = getattr(model, name)
        loc = f"{where}{name}"
        access = next((m for m in info.metadata if isinstance(m, Access)), None)
        if access is not None:
            if value is not None:
                yield loc, model, name, access
            continue
        yield from _nested(value, loc)


def _nested(value: Any, loc: str) -> Iterator[tuple[str, Any, str, Access]]:
    if hasattr(type(value), "model_fields"):
        yield from uri_fields(value, f"{loc}.")
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            yield from _nested(item, f"{loc}.{i}")
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _nested(item, f"{loc}.{key}")


def canonicalize_fields(model: Any, policy: StoragePolicy | None, *, where: str = "",
                        cwd: str | None = None) -> list[tuple[str, str, Access]]:
    """Check every URI of `model` against `policy` (None: no limit) and store its canonical form in place.

    Returns (field path, canonical URI, access) of each; raises StorageDenied or UriError naming the first field
    at fault (nothing is changed then).
    """
    checked = []
    for loc, holder, name, access in list(uri_fields(model, where)):
        value = getattr(holder, name)
        if policy is None:
            try:
                canonical = canonical_uri(value, cwd=cwd)
            except UriError as error:
                raise UriError(f"{loc}: {error}") from None
        else:
            canonical = policy.check(value, access, where=loc, cwd=cwd)
        checked.append((holder, name, loc, canonical, access))
    for holder, name, _, canonical, _ in checked:
        object.__setattr__(holder, name, canonical)  # no re-validation: the canonical form is the checked one
    return [(loc, canonical, access) for _, _, loc, canonical, access in checked]


def prefixes(values: Iterable[str]) -> tuple[str, ...]:
    """Canonical, deduplicated prefixes in their given order."""
    seen: dict[str, None] = {}
    for value in values:
        seen[canonical_uri(value)] = None
    return tuple(seen)
