"""What confines the local backend's trainers (docs/security.md#trainers): the environment they get, the files and
ports they may reach (Landlock), and the memory, CPU, processes and open files they may take.

Platform code: the trainer's side is `kembed_platform.sandbox`, the small command every node starts under
(`python -m kembed_platform.sandbox ... -- <node command>`), which joins the node's cgroups, sets its rlimits and
restricts itself before it execs the node; what goes on its command line is decided here.

Limits are enforced by the strongest layer this machine lets an unprivileged server use, detected once:
- cgroup v2: a delegated cgroup whose `cgroup.subtree_control` enables memory (cpu, pids), writable by us, either
  our own cgroup or its parent (the server in a leaf `.../server` of it); each node gets a child with
  `memory.max` (and no swap), `cpu.max`, `pids.max`;
- cgroup v1: writable memory (cpu, pids) hierarchies, each node a child of ours with `memory.limit_in_bytes`,
  `cpu.cfs_quota_us`, `pids.max`;
- rlimits and a watchdog: RLIMIT_DATA per process (its memory limit plus the headroom torch reserves without
  using it), and the backend's poll sums each node's anonymous memory and SIGKILLs the node over its limit.
Every layer sets RLIMIT_NOFILE and RLIMIT_CORE. A node killed for memory is reported as such (`NodeLimit.oom`),
and the lifecycle fails the job `OOMKilled`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from kembed_contract.spec import Resources
from kembed_contract.storage_policy import StoragePolicy
from kembed_platform import sandbox as landlock
from kembed_platform.tenant_credentials import PLATFORM_CREDENTIAL_VARS

__all__ = ["TRAINER_ENV_NAMES", "Limiter", "NodeLimit", "NodeLimits", "detect_limiter", "ephemeral_ports",
           "landlock_file_rules", "network_rules", "node_limits", "node_processes", "sandbox_command",
           "trainer_environ"]

log = logging.getLogger(__name__)

# ---- environment ------------------------------------------------------------------------------------------------
# The only variables of the server's environment a trainer inherits: what the interpreter and its libraries need
# to start and to find things, thread counts, and where S3 is. Never the server's own settings (KEMBED_*: the
# database URL, tokens), its database's (PG*, DATABASE_*), nor any cloud credentials (those only as
# `trainer_environ` says). What the trainer reads of ours (kembed_contract.runtime's ENV_*, the storage policy) the
# backend sets itself, per job.
TRAINER_ENV_NAMES = frozenset({
    "PATH", "LANG", "LANGUAGE", "TZ", "LD_LIBRARY_PATH",
    # the interpreter's own (a PYTHONPATH is how an uninstalled checkout finds kembed_trainer)
    "PYTHONPATH", "PYTHONHOME", "PYTHONNOUSERSITE", "PYTHONSAFEPATH", "PYTHONHASHSEED", "PYTHONUTF8",
    "PYTHONIOENCODING", "PYTHONWARNINGS", "PYTHONFAULTHANDLER",
    "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS",
    "GLOO_SOCKET_IFNAME",  # the interface gloo uses, where the machine's name does not resolve to it
    # Where S3 is, not who may use it: s3fs/botocore read these.
    "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_DEFAULT_REGION", "AWS_REGION",
})
_ENV_PREFIXES = ("LC_",)
_S3_ENDPOINT_VARS = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")  # botocore: the service's own first


def trainer_environ(server: Mapping[str, str], *, scratch: Path, server_s3_credentials: bool) -> dict[str, str]:
    """A trainer's base environment from the server's `server`: the allowlist, and its own scratch folder as HOME
    and TMPDIR (numba's cache too).

    `server_s3_credentials`: also pass the server's AWS credentials (Settings.trainer_server_s3_credentials: a
    single-team installation on S3 without minting, where every trainer may reach everything the server can).
    Otherwise a trainer has no credentials but the ones the backend adds (a tenant's minted key), and never the
    machine's role: the instance metadata service is off for it."""
    environ = {k: v for k, v in server.items() if k in TRAINER_ENV_NAMES or k.startswith(_ENV_PREFIXES)}
    if server_s3_credentials:
        environ.update({k: v for k, v in server.items() if k in PLATFORM_CREDENTIAL_VARS})
    return {**environ, "HOME": str(scratch), "TMPDIR": str(scratch), "NUMBA_CACHE_DIR": str(scratch),
            "AWS_EC2_METADATA_DISABLED": "true", "PYTHONDONTWRITEBYTECODE": "1"}


# ---- files and network (Landlock) -------------------------------------------------------------------------------
def landlock_file_rules(*, data_dir: Path, job_dir: Path, policy: StoragePolicy | None,
                        kernel_cache: Path | None = None) -> tuple[list[str], list[str]]:
    """(read, write) for the node's Landlock: readable the system, this interpreter and its packages, the
    platform's compiled kernels (`kernel_cache`: never writable, every tenant's jobs load them), the job's
    folder, the policy's local prefixes; writable the job's folder, the tenant's own checkpoint folder, the
    policy's local write prefixes. The data dir (the database, tokens, logs, other jobs) and the checkpoint root
    (other tenants) stay out, also where a granted folder contains them."""
    def local(uris: Iterable[str]) -> list[str]:
        return [u.removeprefix("file://") for u in uris if u.startswith("file://")]

    policy = policy or StoragePolicy()
    own = local(policy.own)
    for folder in own:
        Path(folder).mkdir(parents=True, exist_ok=True)  # Landlock grants only what exists
    return landlock.rules(
        read=[*landlock.SYSTEM_READ, *landlock.python_paths(), *([str(kernel_cache)] if kernel_cache else []),
              *local(policy.read), *local(policy.write)],
        write=[*landlock.SYSTEM_WRITE, *local(policy.write)],
        denied=[str(data_dir), *local(policy.deny)],
        granted_inside_denied=[str(job_dir), *own],
    )


def ephemeral_ports() -> range:
    """The ports the kernel hands out for port 0 (`net.ipv4.ip_local_port_range`)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return range(int(low), int(high) + 1)
    except (OSError, ValueError):
        return range(32768, 61000)  # Linux's default


def _port(url: str) -> int | None:
    try:
        parts = urlsplit(url)
        return parts.port or {"http": 80, "https": 443}.get(parts.scheme)
    except ValueError:
        return None


def network_rules(*, report_url: str, rendezvous_port: int, environ: Mapping[str, str],
                  policy: StoragePolicy | None) -> tuple[list[str], list[str]]:
    """(connect, bind) for `kembed_platform.sandbox`: ports and ranges a node may connect to and bind.

    Connect: the report URL's port, the S3 endpoint's (AWS_ENDPOINT_URL[_S3], else AWS's 443 when the policy
    names any s3:// prefix), the gang's rendezvous port, and the ephemeral range: gloo's ranks listen on port 0
    and connect to each other's ephemeral ports, which cannot be known before they start (measured: torch 2.13).
    Bind: the rendezvous port (node 0's store) and port 0 (gloo's listeners). So fixed-port services (PostgreSQL
    on 5432, the API's other ports, anything below the range) are out of reach, and whatever listens in the
    ephemeral range is not (docs/security.md)."""
    connect = {rendezvous_port, _port(report_url)}
    endpoints = [environ[v] for v in _S3_ENDPOINT_VARS if v in environ]
    connect.update(_port(url) for url in endpoints)
    if not endpoints and policy is not None and any(
            u.startswith("s3://") for u in (*policy.own, *policy.read, *policy.write)):
        connect.add(443)  # AWS S3 itself (HTTPS)
    ports = ephemeral_ports()
    fixed = sorted(p for p in connect if p is not None and p not in ports)
    return [*map(str, fixed), f"{ports.start}-{ports.stop - 1}"], [str(rendezvous_port), "0"]


def sandbox_command(*, files: tuple[list[str], list[str]] | None, network: tuple[list[str], list[str]] | None,
                    joins: Iterable[str] = (), rlimits: Mapping[str, int] | None = None,
                    cpus: Iterable[int] | None = None) -> list[str]:
    """`python -m kembed_platform.sandbox ... --`: what one node starts under (None: no Landlock for that part;
    `cpus`: the cores it runs on, None: any)."""
    args = [f"--join={path}" for path in joins]
    if cpus is not None:
        args.append("--cpus=" + ",".join(str(core) for core in cpus))
    args += [f"--rlimit={name}={value}" for name, value in (rlimits or {}).items()]
    if files is None:
        args.append("--files=off")
    else:
        args += [*(f"--read={p}" for p in files[0]), *(f"--write={p}" for p in files[1])]
    if network is not None:
        args += [*(f"--connect={p}" for p in network[0] or ["none"]), *(f"--bind={p}" for p in network[1] or ["none"])]
    return [sys.executable, "-m", "kembed_platform.sandbox", *args, "--"]


# ---- resource limits --------------------------------------------------------------------------------------------
# Tasks (processes and threads) per trainer process of a node: a rank measured 5-6 threads and the launcher 2
# (torch 2.13, CPU), but torch's inter-op pool grows with the cores; enough for that, nowhere near a fork bomb.
_TASKS_PER_PROCESS = 512
# Open files per process: datasets are read a few files at a time and a checkpoint writes one file per rank at a
# time; a leak or a flood stops here instead of at the machine's limit.
_OPEN_FILES = 8192
# RLIMIT_DATA counts what a process maps writable, used or not: the launcher and a rank each held about 0.5 GiB
# more than they used (VmData - RssAnon: 466 and 509 MiB, the tests' tiny CTR job, torch 2.13), so each process
# may map its node's memory limit plus this before an allocation fails.
DATA_HEADROOM_BYTES = 1 << 30
_CPU_PERIOD_US = 100_000


@dataclass(frozen=True)
class NodeLimits:
    memory_bytes: int
    cpus: float
    tasks: int
    open_files: int


def node_limits(resources: Resources) -> NodeLimits:
    """What one node of a job may take: its `resources` per node."""
    procs = (resources.procs_per_node or 1) + 1  # its ranks and the launcher
    return NodeLimits(memory_bytes=resources.memory_bytes_per_node, cpus=resources.cpu_per_node,
                      tasks=max(_TASKS_PER_PROCESS, 2 * (os.cpu_count() or 1)) * procs, open_files=_OPEN_FILES)


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / 2**30:.2f} GiB"


@dataclass
class NodeLimit:
    """One node's limits as enforced: what its sandbox command joins and sets, and what happened to it."""

    limits: NodeLimits
    layer: str
    joins: list[str] = field(default_factory=list)
    rlimits: dict[str, int] = field(default_factory=dict)
    dirs: list[Path] = field(default_factory=list)  # its cgroups (memory's first)
    watched: bool = False  # the rlimit layer: poll measures and kills
    peak_bytes: int = 0
    killed_for_memory: bool = False

    def watch(self, pid: int) -> None:
        """The rlimit layer's watchdog, at every poll: the node's anonymous memory (all its processes, as a cgroup
        would count it: shared libraries once, not per process); over the limit, the whole node is SIGKILLed."""
        if not self.watched or self.killed_for_memory:
            return
        pids = node_processes(pid)
        used = sum(_anonymous_bytes(p) for p in pids)
        self.peak_bytes = max(self.peak_bytes, used)
        if used > self.limits.memory_bytes:
            self.killed_for_memory = True
            log.warning("node process %d used %s of its %s memory limit: killed", pid, _gib(used),
                        _gib(self.limits.memory_bytes))
            for p in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p, signal.SIGKILL)

    def oom(self, *, refused: bool = False) -> str | None:
        """Why the node was killed for memory ("used X of its Y limit"), or None if it was not. `refused`: the
        trainer said an allocation failed (exit code 4, runtime.EXIT_OUT_OF_MEMORY): under RLIMIT_DATA that is the limit speaking too."""
        if self.watched:
            killed, peak = self.killed_for_memory, self.peak_bytes
        elif self.dirs:
            killed, peak = _cgroup_oom(self.dirs[0])
        else:
            return None
        if not (killed or refused):
            return None
        used = f"used {_gib(peak)}" if peak else "reached"
        return (f"{used} of its {_gib(self.limits.memory_bytes)} memory limit (resources.memory_per_node, "
                f"enforced by {self.layer}); ask for more memory or make the job smaller")

    def release(self) -> None:
        """Remove the node's cgroups once its processes are gone (anything left in them is killed first)."""
        for folder in self.dirs:
            with contextlib.suppress(OSError):
                for pid in (folder / "cgroup.procs").read_text().split():
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(int(pid), signal.SIGKILL)
            with contextlib.suppress(OSError):
                folder.rmdir()


def _cgroup_oom(memory_dir: Path) -> tuple[bool, int]:
    """(whether the kernel's OOM killer killed in this memory cgroup, its peak usage in bytes)."""
    killed = False
    for events in ("memory.events", "memory.oom_control"):  # v2, v1 (oom_kill counted since Linux 4.13)
        with contextlib.suppress(OSError, ValueError):
            for line in (memory_dir / events).read_text().splitlines():
                name, _, value = line.partition(" ")
                killed = killed or (name == "oom_kill" and int(value) > 0)
    peak = 0
    for name in ("memory.peak", "memory.max_usage_in_bytes"):
        with contextlib.suppress(OSError, ValueError):
            peak = max(peak, int((memory_dir / name).read_text()))
    return killed, peak


def node_processes(pid: int) -> list[int]:
    """`pid` and its descendants (torchrun starts each rank in a session of its own: not its process group, so
    a signal to the node's group reaches the launcher alone)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        todo += children.get(current, [])
    return found


def _anonymous_bytes(pid: int) -> int:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    total = 0
    for line in status.splitlines():
        if line.startswith(("RssAnon:", "RssShmem:")):
            total += int(line.split()[1]) * 1024
    return total


class Limiter:
    """The layer that enforces limits here, and each node's cgroups or rlimits under it."""

    def __init__(self, layer: str, cgroups: Mapping[str, Path] | None = None, *, version: int = 0) -> None:
        self.layer, self.version = layer, version
        self.cgroups = dict(cgroups or {})  # controller -> the folder nodes' cgroups are made in

    def describe(self, limits: NodeLimits) -> str:
        """What holds a node here, in a line for its job's events."""
        memory = f"memory {_gib(limits.memory_bytes)}"
        files = f"{limits.open_files} open files per process"
        if not self.cgroups:
            return (f"limits per node: {memory} (RLIMIT_DATA and a watchdog), {files}; CPU and processes not "
                    "limited (no writable cgroup)")
        held = [memory if "memory" in self.cgroups else "",
                f"{limits.cpus:g} CPU" if "cpu" in self.cgroups else "",
                f"{limits.tasks} tasks" if "pids" in self.cgroups else ""]
        return f"limits per node: {', '.join(h for h in held if h)}, {files}, by {self.layer}"

    def release_all(self, prefix: str) -> None:
        """Remove the cgroups named `prefix`* (an earlier server's nodes of one job, found after a restart)."""
        for parent in self.cgroups.values():
            for folder in parent.glob(f"{prefix}*"):
                NodeLimit(NodeLimits(0, 0, 0, 0), self.layer, dirs=[folder]).release()

    def node(self, name: str, limits: NodeLimits) -> NodeLimit:
        rlimits = {"nofile": limits.open_files, "core": 0}  # no core dumps of many-GiB processes in the job folder
        if not self.cgroups:
            rlimits["data"] = limits.memory_bytes + DATA_HEADROOM_BYTES
            return NodeLimit(limits, self.layer, rlimits=rlimits, watched=True)
        node = NodeLimit(limits, self.layer, rlimits=rlimits)
        for controller, parent in self.cgroups.items():
            folder = parent / name
            folder.mkdir(exist_ok=True)
            for file, value in _cgroup_settings(self.version, controller, limits):
                # Missing: no swap accounting (memory.swap.max, memory.memsw.*), so no swap to limit.
                with contextlib.suppress(FileNotFoundError):
                    (folder / file).write_text(value)
            node.dirs.append(folder)
            node.joins.append(str(folder / "cgroup.procs"))
        return node


def _cgroup_settings(version: int, controller: str, limits: NodeLimits) -> list[tuple[str, str]]:
    quota = max(1000, int(limits.cpus * _CPU_PERIOD_US))  # the kernel's least quota is 1 ms
    memory = str(limits.memory_bytes)
    if version == 2:
        return {"memory": [("memory.max", memory), ("memory.swap.max", "0")],
                "cpu": [("cpu.max", f"{quota} {_CPU_PERIOD_US}")],
                "pids": [("pids.max", str(limits.tasks))]}[controller]
    return {"memory": [("memory.limit_in_bytes", memory), ("memory.memsw.limit_in_bytes", memory)],
            "cpu": [("cpu.cfs_period_us", str(_CPU_PERIOD_US)), ("cpu.cfs_quota_us", str(quota))],
            "pids": [("pids.max", str(limits.tasks))]}[controller]


_CONTROLLERS = ("memory", "cpu", "pids")


def _cgroup_mounts() -> list[tuple[Path, str, str, set[str]]]:
    """(mount point, root within the hierarchy, type, options) of the cgroup file systems mounted here."""
    mounts = []
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/mountinfo").read_text().splitlines():
            left, _, right = line.partition(" - ")
            fields, (fstype, _source, options) = left.split(), right.split()[:3]
            if fstype in ("cgroup", "cgroup2"):
                point = fields[4].encode().decode("unicode_escape")  # mountinfo escapes spaces as \040
                mounts.append((Path(point), fields[3], fstype, set(options.split(","))))
    return mounts


def _own_cgroups() -> dict[str, str]:
    """Our cgroup per v1 controller, and "" -> our v2 cgroup (/proc/self/cgroup)."""
    own = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            for controller in controllers.split(",") if controllers else [""]:
                own[controller] = path
    return own


def _inside(mount: Path, root: str, path: str) -> Path | None:
    if not (path == root or path.startswith(root.rstrip("/") + "/")):
        return None
    return mount / path[len(root.rstrip("/")):].lstrip("/")


def _writable(folder: Path) -> bool:
    """Whether we may make cgroups in `folder` (tried: permissions alone do not say it on every system)."""
    probe = folder / f"kembed-probe-{os.getpid()}"
    try:
        probe.mkdir()
    except OSError:
        return False
    with contextlib.suppress(OSError):
        probe.rmdir()
    return True


def _v2_limiter(mounts, own) -> Limiter | None:
    if "" not in own:
        return None
    for mount, root, fstype, _ in mounts:
        if fstype != "cgroup2" or (ours := _inside(mount, root, own[""])) is None:
            continue
        # Our own cgroup holds processes (us), so only the root may enable controllers for children; otherwise
        # the parent of our leaf, delegated to us (docs/security.md shows how to start the server so).
        for folder in (ours, ours.parent):
            try:
                enabled = set((folder / "cgroup.subtree_control").read_text().split())
            except OSError:
                continue
            if "memory" in enabled and _writable(folder):
                controllers = [c for c in _CONTROLLERS if c in enabled]
                return Limiter(f"cgroup v2 ({', '.join(controllers)})", {c: folder for c in controllers}, version=2)
    return None


def _v1_limiter(mounts, own) -> Limiter | None:
    folders = {}
    for controller in _CONTROLLERS:
        for mount, root, fstype, options in mounts:
            if fstype == "cgroup" and controller in options and controller in own:
                folder = _inside(mount, root, own[controller])
                if folder is not None and _writable(folder):
                    folders[controller] = folder
                    break
    if "memory" not in folders:
        return None
    return Limiter(f"cgroup v1 ({', '.join(folders)})", folders, version=1)


def detect_limiter(mode: str = "auto") -> Limiter:
    """The strongest layer available (module docstring); `mode` rlimit skips cgroups, cgroup refuses to go without
    (Settings.trainer_limits). Raises RuntimeError for cgroup where none is writable."""
    if mode != "rlimit" and sys.platform.startswith("linux"):
        mounts, own = _cgroup_mounts(), _own_cgroups()
        limiter = _v2_limiter(mounts, own) or _v1_limiter(mounts, own)
        if limiter is not None:
            return limiter
        if mode == "cgroup":
            raise RuntimeError("KEMBED_TRAINER_LIMITS=cgroup, but no cgroup with a memory controller is writable "
                               "by this server (docs/security.md#limits)")
    return Limiter("rlimits and a memory watchdog")
