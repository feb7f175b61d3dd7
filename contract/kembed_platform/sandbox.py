"""A kernel sandbox for trainers on a shared machine (the embedded default): Landlock, through ctypes.

`python -m kembed_platform.sandbox --read DIR... --write DIR... --connect PORT... --bind PORT... -- COMMAND...`
restricts itself, then execs COMMAND; everything COMMAND starts (torchrun, its ranks) inherits the restriction
and cannot undo it. Inside, a file can be opened only beneath a granted path: readable beneath `--read`, also
writable, creatable and removable beneath `--write`. So a trainer cannot open the server's database, its tokens
or another tenant's folder even if every check of the storage policy were bypassed, and Landlock also keeps it
from inspecting processes outside the sandbox (`/proc/<server>/environ`, ptrace). Where the kernel has
Landlock's network rules (ABI 4, Linux 6.7), `--connect` and `--bind` (a port, a range `LO-HI`, or `none`) are
the only TCP ports it may connect to and bind; without `--connect`/`--bind` the network is not restricted.

The same command sets resource limits before it execs, for the platform, which cannot do it between fork and
exec in a threaded server: `--join FILE` writes its pid to FILE (a cgroup's `cgroup.procs`), `--rlimit
NAME=N` sets RLIMIT_NAME (soft and hard) to N, `--cpus N,N...` the cores it and everything it starts may run on
(its CPU affinity: kembed_api.backends.cores places each node). `--files=off` skips Landlock's file rules (then Landlock is used
for the network only, or not at all).

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

__all__ = ["NET_ABI", "SYSTEM_READ", "SYSTEM_WRITE", "abi_version", "parse_ports", "python_paths", "restrict",
           "rules"]

_SYS_CREATE_RULESET, _SYS_ADD_RULE, _SYS_RESTRICT_SELF = 444, 445, 446  # the same on x86_64 and arm64
_PR_SET_NO_NEW_PRIVS = 38
_CREATE_RULESET_VERSION = 1
_RULE_PATH_BENEATH, _RULE_NET_PORT = 1, 2
NET_ABI = 4  # the first ABI with TCP rules
_NET_BIND_TCP, _NET_CONNECT_TCP = 1 << 0, 1 << 1

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
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64)]


class _NetPortAttr(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("port", ctypes.c_uint64)]


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


def restrict(read: Iterable[str] | None, write: Iterable[str] = (), *, connect: Iterable[int] | None = None,
             bind: Iterable[int] | None = None) -> bool:
    """Restrict this process (and what it starts) to reading beneath `read` and writing beneath `write`, and,
    where the kernel can (ABI 4), to connecting to the TCP ports `connect` and binding the ports `bind` (0: an
    ephemeral port the kernel picks). `read` None leaves files alone; `connect` and `bind` None leave the network
    alone. Returns whether the network rules were applied (False on a kernel older than ABI 4).

    Paths that do not exist are skipped. Raises OSError when the kernel has no Landlock."""
    abi = abi_version()
    if abi < 1:
        raise OSError("this kernel has no Landlock (Linux 5.13+ with landlock in its LSM list)")
    net = abi >= NET_ABI and (connect is not None or bind is not None)
    handled_fs = _handled(abi) if read is not None else 0
    handled_net = (_NET_CONNECT_TCP if connect is not None else 0) | (_NET_BIND_TCP if bind is not None else 0)
    if not handled_fs and not net:
        return False
    attr = _RulesetAttr(handled_fs, handled_net if net else 0)
    # An older kernel refuses a struct it does not know the end of unless the rest is zero: give it only what it has.
    size = ctypes.sizeof(attr) if net else ctypes.sizeof(ctypes.c_uint64)
    ruleset = _libc.syscall(_SYS_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(size), ctypes.c_uint32(0))
    if ruleset < 0:
        raise OSError(ctypes.get_errno(), "landlock_create_ruleset failed")
    try:
        if handled_fs:
            read_rights = (_EXECUTE | _READ_FILE | _READ_DIR | (_IOCTL_DEV if abi >= 5 else 0)) & handled_fs
            for path, rights in [*((p, read_rights) for p in read), *((p, handled_fs) for p in write)]:
                _add_rule(ruleset, path, rights)
        if net:
            rights_by_port: dict[int, int] = {}
            for port in connect or ():
                rights_by_port[port] = rights_by_port.get(port, 0) | _NET_CONNECT_TCP
            for port in bind or ():
                rights_by_port[port] = rights_by_port.get(port, 0) | _NET_BIND_TCP
            for port, rights in rights_by_port.items():
                _add_port_rule(ruleset, port, rights)
        if _libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS) failed")
        if _libc.syscall(_SYS_RESTRICT_SELF, ctypes.c_int(ruleset), ctypes.c_uint32(0)) != 0:
            raise OSError(ctypes.get_errno(), "landlock_restrict_self failed")
    finally:
        os.close(ruleset)
    return net


def _add_port_rule(ruleset: int, port: int, rights: int) -> None:
    attr = _NetPortAttr(rights, port)
    if _libc.syscall(_SYS_ADD_RULE, ctypes.c_int(ruleset), ctypes.c_int(_RULE_NET_PORT), ctypes.byref(attr),
                     ctypes.c_uint32(0)) != 0:
        raise OSError(ctypes.get_errno(), f"landlock_add_rule failed for port {port}")


def parse_ports(text: str) -> range:
    """`"8080"` or `"32768-60999"` (both ends included) as a range of ports; `"none"` for none at all."""
    if text == "none":
        return range(0)
    low, _, high = text.partition("-")
    first, last = int(low), int(high or low)
    if not 0 <= first <= last <= 65535:
        raise ValueError(f"not a port or a range of ports: {text!r}")
    return range(first, last + 1)


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


def _set_rlimit(setting: str) -> None:
    import resource

    name, _, value = setting.partition("=")
    limit = getattr(resource, f"RLIMIT_{name.upper()}")
    wanted = int(value)
    _, hard = resource.getrlimit(limit)
    if hard != resource.RLIM_INFINITY:
        wanted = min(wanted, hard)  # never above what this process may have: lowering needs no privilege
    resource.setrlimit(limit, (wanted, wanted))


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        print("usage: python -m kembed_platform.sandbox [--read P]... [--write P]... [--connect PORT[-PORT]]... "
              "[--bind PORT]... [--files=off] [--join FILE]... [--rlimit NAME=N]... [--cpus N,N...] -- COMMAND...",
              file=sys.stderr)
        return 2
    split = argv.index("--")
    parser = argparse.ArgumentParser(prog="python -m kembed_platform.sandbox")
    parser.add_argument("--read", action="append", default=[])
    parser.add_argument("--write", action="append", default=[])
    parser.add_argument("--connect", action="append", default=None)
    parser.add_argument("--bind", action="append", default=None)
    parser.add_argument("--files", choices=("on", "off"), default="on")
    parser.add_argument("--join", action="append", default=[])
    parser.add_argument("--rlimit", action="append", default=[])
    parser.add_argument("--cpus", default=None, help="comma-separated cores the command may run on")
    args = parser.parse_args(argv[:split])
    command = argv[split + 1:]
    # Limits first: joining a cgroup needs its files, which Landlock may not grant.
    for procs in args.join:
        with open(procs, "w") as f:
            f.write(str(os.getpid()))
    for setting in args.rlimit:
        _set_rlimit(setting)
    if args.cpus is not None:
        # Before the exec: every process and thread the node starts inherits it (kembed_api.backends.cores).
        os.sched_setaffinity(0, {int(core) for core in args.cpus.split(",")})
    connect = None if args.connect is None else [p for text in args.connect for p in parse_ports(text)]
    bind = None if args.bind is None else [p for text in args.bind for p in parse_ports(text)]
    if args.files == "on" or connect is not None or bind is not None:
        restrict(args.read if args.files == "on" else None, args.write, connect=connect, bind=bind)
    os.execvp(command[0], command)
    return 127  # not reached


if __name__ == "__main__":
    sys.exit(main())
