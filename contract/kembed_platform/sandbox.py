"""A kernel sandbox for trainers on a shared machine (the embedded default): Landlock, through ctypes.

`python -m kembed_platform.sandbox --read DIR... --write DIR... -- COMMAND...` restricts itself, then execs
COMMAND; everything COMMAND starts (torchrun, its ranks) inherits the restriction and cannot undo it. Inside,
a file can be opened only beneath a granted path: readable beneath `--read`, also writable, creatable and
removable beneath `--write`. So a trainer cannot open the server's database, its tokens or another tenant's
folder even if every check of the storage policy were bypassed, and Landlock also keeps it from inspecting
processes outside the sandbox (`/proc/<server>/environ`, ptrace).

Why Landlock (docs/security.md): it needs no privileges (a laptop, CI and root alike), restricts per job to
exactly the tenant's folders, and the kernel enforces it whatever the trainer's code does. A separate uid would
need root, and would put every tenant's trainers under one identity.

Landlock grants, it cannot carve out: `rules` expands a granted folder that contains a place no trainer may
reach (the data dir) into the folder's other entries, as they are at launch. Standard library only.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
from collections.abc import Iterable, Sequence

__all__ = ["SYSTEM_READ", "SYSTEM_WRITE", "abi_version", "python_paths", "restrict", "rules"]

_SYS_CREATE_RULESET, _SYS_ADD_RULE, _SYS_RESTRICT_SELF = 444, 445, 446  # the same on x86_64 and arm64
_PR_SET_NO_NEW_PRIVS = 38
_CREATE_RULESET_VERSION = 1
_RULE_PATH_BENEATH = 1

_EXECUTE, _WRITE_FILE, _READ_FILE, _READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
_REFER, _TRUNCATE, _IOCTL_DEV = 1 << 13, 1 << 14, 1 << 15
_ABI1_ALL = (1 << 13) - 1  # execute .. make_sym
_FILE_RIGHTS = _EXECUTE | _WRITE_FILE | _READ_FILE | _TRUNCATE | _IOCTL_DEV  # what a rule on a file may grant

# What every Python process needs to start and run: the system's programs, libraries and settings, the hardware
# description torch reads (cpuinfo). Not /proc as a whole: Landlock does not keep a sandboxed process from
# reading other processes' /proc/<pid>/environ (measured on Linux 6.18), so only these machine-wide files.
SYSTEM_READ = ("/usr", "/lib", "/lib32", "/lib64", "/bin", "/sbin", "/etc", "/opt", "/sys", "/dev",
               "/proc/cpuinfo", "/proc/meminfo", "/proc/stat")
SYSTEM_WRITE = ("/dev/null",)


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64)]


class _PathBeneathAttr(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


_libc = ctypes.CDLL(None, use_errno=True)


def abi_version() -> int:
    """The kernel's Landlock ABI version; 0 when it has none (or a seccomp filter hides it)."""
    if not sys.platform.startswith("linux"):
        return 0
    version = _libc.syscall(_SYS_CREATE_RULESET, None, ctypes.c_size_t(0), ctypes.c_uint32(_CREATE_RULESET_VERSION))
    return max(0, version)


def _handled(abi: int) -> int:
    rights = _ABI1_ALL
    if abi >= 2:
        rights |= _REFER
    if abi >= 3:
        rights |= _TRUNCATE
    if abi >= 5:
        rights |= _IOCTL_DEV
    return rights


def restrict(read: Iterable[str], write: Iterable[str]) -> None:
    """Restrict this process (and what it starts) to reading beneath `read` and writing beneath `write`.

    Paths that do not exist are skipped. Raises OSError when the kernel has no Landlock."""
    abi = abi_version()
    if abi < 1:
        raise OSError("this kernel has no Landlock (Linux 5.13+ with landlock in its LSM list)")
    handled = _handled(abi)
    attr = _RulesetAttr(handled)
    ruleset = _libc.syscall(_SYS_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(ctypes.sizeof(attr)),
                            ctypes.c_uint32(0))
    if ruleset < 0:
        raise OSError(ctypes.get_errno(), "landlock_create_ruleset failed")
    try:
        read_rights = (_EXECUTE | _READ_FILE | _READ_DIR | (_IOCTL_DEV if abi >= 5 else 0)) & handled
        for path, rights in [*((p, read_rights) for p in read), *((p, handled) for p in write)]:
            _add_rule(ruleset, path, rights)
        if _libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS) failed")
        if _libc.syscall(_SYS_RESTRICT_SELF, ctypes.c_int(ruleset), ctypes.c_uint32(0)) != 0:
            raise OSError(ctypes.get_errno(), "landlock_restrict_self failed")
    finally:
        os.close(ruleset)


def _add_rule(ruleset: int, path: str, rights: int) -> None:
    try:
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    except FileNotFoundError:
        return
    try:
        if not os.path.isdir(path):
            rights &= _FILE_RIGHTS
        attr = _PathBeneathAttr(rights, fd)
        if _libc.syscall(_SYS_ADD_RULE, ctypes.c_int(ruleset), ctypes.c_int(_RULE_PATH_BENEATH),
                         ctypes.byref(attr), ctypes.c_uint32(0)) != 0:
            raise OSError(ctypes.get_errno(), f"landlock_add_rule failed for {path}")
    finally:
        os.close(fd)


def python_paths() -> list[str]:
    """Where this interpreter and its packages live (the trainer runs the same interpreter): read-only."""
    import importlib.util

    paths = [sys.prefix, sys.base_prefix, sys.exec_prefix, *(p for p in sys.path if p and os.path.isdir(p))]
    for package in ("kembed_trainer", "kembed_contract"):  # what a trainer imports of ours
        spec = importlib.util.find_spec(package)  # an editable install finds it outside sys.path
        if spec and spec.submodule_search_locations:
            paths += list(spec.submodule_search_locations)
    return list(dict.fromkeys(os.path.realpath(p) for p in paths))


def _is_under(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip("/") + "/")


def _without(path: str, denied: Sequence[str], seen: set[str] | None = None) -> list[str]:
    """`path`, or, if it contains a denied place, its entries except the ones leading there (recursively)."""
    seen = set() if seen is None else seen
    if path in seen:  # a symlink back up the tree: granted already, or being expanded
        return []
    seen.add(path)
    inside = [d for d in denied if _is_under(d, path)]
    if not inside:
        return [] if any(_is_under(path, d) for d in denied) else [path]
    if any(d == path for d in inside):
        return []
    kept = []
    try:
        entries = sorted(os.listdir(path))
    except OSError:
        return []
    for entry in entries:
        # As the kernel sees it: a symlink is granted as its target, which may be a denied place or inside one.
        kept += _without(os.path.realpath(os.path.join(path, entry)), denied, seen)
    return kept


def rules(*, read: Iterable[str], write: Iterable[str], denied: Sequence[str],
          granted_inside_denied: Iterable[str] = ()) -> tuple[list[str], list[str]]:
    """(read, write) paths for `restrict`: real paths, each place in `denied` left out even where a granted
    folder contains it; `granted_inside_denied` (the job's own folders) are writable all the same."""
    denied = [os.path.realpath(d) for d in denied]
    out_read, out_write = [], []
    for path in read:
        out_read += _without(os.path.realpath(path), denied)
    for path in write:
        out_write += _without(os.path.realpath(path), denied)
    out_write += [os.path.realpath(p) for p in granted_inside_denied]
    return list(dict.fromkeys(out_read)), list(dict.fromkeys(out_write))


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        print("usage: python -m kembed_platform.sandbox [--read P]... [--write P]... -- COMMAND...", file=sys.stderr)
        return 2
    split = argv.index("--")
    parser = argparse.ArgumentParser(prog="python -m kembed_platform.sandbox")
    parser.add_argument("--read", action="append", default=[])
    parser.add_argument("--write", action="append", default=[])
    args = parser.parse_args(argv[:split])
    command = argv[split + 1:]
    restrict(args.read, args.write)
    os.execvp(command[0], command)
    return 127  # not reached


if __name__ == "__main__":
    sys.exit(main())
