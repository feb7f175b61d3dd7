"""The embedded default: each job is `nodes` torchrun processes on this machine (gloo on CPU).

Every node of the gang is its own torchrun in its own process group (so SIGTERM reaches every rank at once),
confined (kembed_api.platform.confinement: its environment, Landlock, its resource limits) and logging through a pipe to
<data_dir>/logs/<job>/node-<i>.log, bounded (backends.node_logs). Child processes never outlive the server: a
graceful stop SIGTERMs them (they checkpoint), and a server that died is cleaned up by `reclaim` on its next start.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kembed_api.backends import cores, kernels, local_disk, node_logs
from kembed_api.backends.base import CannotStart, Exit, Launch, NotReady
from kembed_api.platform import confinement
from kembed_api.platform.ports import free_port
from kembed_api.quota.admission import Quota
from kembed_contract import lifecycle, runtime, sizing, threads
from kembed_contract.quota import QuotaSpec, SharingSpec
from kembed_contract.resources import TenantUsage
from kembed_contract.spec import JobSpec
from kembed_contract.storage_policy import POLICY_ENV, StoragePolicy
from kembed_platform import sandbox as landlock
from kembed_platform.tenant_credentials import S3Credentials, TenantCredentials, trainer_environ

log = logging.getLogger(__name__)

__all__ = ["LocalBackend"]

# Each node runs under the trainer's launcher, which exits with the first failed rank's own code (torchrun
# alone exits 1 whatever happened), so failures are judged by the lifecycle's one exit-code policy.
_LAUNCHER = (sys.executable, "-m", runtime.LAUNCHER_MODULE)


# How long poll waits for a node's last output to reach its log after the node exited (the log writer ends when
# the last holder of the pipe does: ranks the node started go with it).
_LOG_DRAIN_S = 5.0
DEFAULT_LOG_BYTES_PER_NODE = 16 * 2**20


@dataclass
class _Gang:
    processes: list[subprocess.Popen]
    pumps: list[subprocess.Popen]  # each node's log writer (backends.node_logs)
    limits: list[confinement.NodeLimit]
    local_dir: Path  # runtime.ENV_LOCAL_DIR of its trainers: their tiers' files
    local_disk_bytes: int  # what its nodes asked for there together (resources.local_disk_per_node x nodes)
    stop_requested_at: float | None = None
    collateral: set[int] = field(default_factory=set)  # nodes stopped by us: their exits do not decide


def _exit_code(process: subprocess.Popen) -> int | None:
    """The node's exit code as a shell reports it (128 + N when signal N ended it); None while it runs."""
    code = process.poll()
    return None if code is None else runtime.exit_code(code)


def _is_our_process(pid: int, job_id: str) -> bool:
    """A pid from an earlier server is ours only if it still runs this job (pids get reused)."""
    try:
        return job_id.encode() in Path(f"/proc/{pid}/cmdline").read_bytes() or job_id.encode() in Path(
            f"/proc/{pid}/environ"
        ).read_bytes()
    except OSError:
        return False


def machine_memory_bytes() -> int:
    """Physical memory of this machine (what all local trainers share)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def machine_cpus() -> int:
    """Cores this process may run on (its affinity: a container's or taskset's share, not the host's)."""
    return len(os.sched_getaffinity(0))


def _write_anew(path: Path, text: str) -> None:
    """Write a file into a folder the trainers of an earlier attempt could write: whatever they left at `path`
    (a symlink to the database, say) is removed, never followed, and the file is created afresh."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def _core_list(node_cores: list[int]) -> str:
    return ",".join(str(core) for core in node_cores)


def _signal_group(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, sig)


class LocalBackend:
    def __init__(self, *, data_dir: Path, slots: int, stop_grace_s: float = 60.0,
                 memory_bytes: int | None = None, cpus: int | None = None, sandbox: str = "auto",
                 credentials: TenantCredentials | None = None, server_s3_credentials: bool = False,
                 limits: str = "auto", log_bytes_per_node: int = DEFAULT_LOG_BYTES_PER_NODE,
                 free_disk: Callable[[Path], int] = local_disk.free_bytes,
                 kernel_cache_root: Path | None = None) -> None:
        """`memory_bytes`, `cpus`: what this machine offers its trainers (measured when not given). `sandbox`:
        auto, landlock or off (Settings.trainer_sandbox); raises RuntimeError for landlock without a kernel that
        has it. `credentials`: mint each tenant's own S3 key for its trainers (Settings.s3_mint_credentials).
        `server_s3_credentials`: give trainers this server's AWS credentials instead (a single-team installation,
        Settings.trainer_server_s3_credentials); with neither, trainers hold no credentials. `limits`: auto,
        cgroup or rlimit (Settings.trainer_limits); raises RuntimeError for cgroup where none is writable.
        `log_bytes_per_node`: what each node's log keeps on disk (Settings.trainer_log_bytes_per_node).
        `free_disk`: bytes free on the file system of a path (the data dir's, where jobs' tiers live).
        `kernel_cache_root`: where the platform keeps the trainer's compiled kernels, which every job reads and none
        writes (Settings.kernel_cache_dir; None: each job compiles its own)."""
        abi = landlock.abi_version()
        self.landlock = sandbox != "off" and abi > 0
        self.landlock_network = self.landlock and abi >= landlock.NET_ABI
        if sandbox == "landlock" and not self.landlock:
            raise RuntimeError("KEMBED_TRAINER_SANDBOX=landlock, but this kernel has no Landlock (Linux 5.13+)")
        if sandbox == "auto" and not self.landlock:
            log.warning("this kernel has no Landlock: trainers run without a sandbox (the storage policy is still "
                        "enforced by the API and the trainers); see docs/security.md")
        elif self.landlock and not self.landlock_network:
            log.warning("this kernel's Landlock (ABI %d) has no network rules (ABI 4, Linux 6.7): trainers may "
                        "connect to any port; see docs/security.md", abi)
        self.limiter = confinement.detect_limiter(limits)
        log.info("local trainers are limited by %s; their network by %s", self.limiter.layer,
                 "Landlock" if self.landlock_network else "nothing")
        self.server_s3_credentials = server_s3_credentials
        self.log_bytes_per_node = log_bytes_per_node
        self.data_dir = data_dir
        self.slots = slots
        self.memory_bytes = memory_bytes or machine_memory_bytes()
        self.cpus = cpus or machine_cpus()
        self.core_allocator = cores.CoreAllocator(sorted(os.sched_getaffinity(0)))
        self.stop_grace_s = stop_grace_s
        self.free_disk = free_disk
        self._gangs: dict[str, _Gang] = {}
        self._lock = threading.Lock()
        self.credentials = credentials
        # Each tenant's minted key, in memory only (never on disk, where a bug could let a trainer read another
        # tenant's): after a restart the next launch mints a fresh one, and the old key is deleted in IAM.
        self._keys: dict[str, S3Credentials] = {}
        self.kernel_cache = kernels.PlatformKernels(kernel_cache_root) if kernel_cache_root else None
        self._wake: Callable[[], None] | None = None

    # ------------------------------------------------------------------------------------------- admission
    def check_fits(self, spec: JobSpec) -> None:
        if spec.resources.gpus_per_node:
            raise ValueError(
                "resources.gpus_per_node: the local backend runs on CPU only; "
                "set it to 0 or submit to a Kubernetes installation"
            )
        if spec.resources.num_processes > self.slots:
            raise ValueError(
                f"resources: the job needs {spec.resources.num_processes} trainer processes "
                f"(nodes x procs_per_node) but this server has {self.slots} local slots (KEMBED_LOCAL_SLOTS)"
            )
        # Every node of a gang runs on this one machine, at once.
        resources = spec.resources
        memory, cpus = resources.nodes * resources.memory_bytes_per_node, resources.nodes * resources.cpu_per_node
        if memory > self.memory_bytes:
            raise ValueError(
                f"resources.memory_per_node: the job asks for {memory / 2**30:.2f} GiB in all ({resources.nodes} "
                f"node(s) x {resources.memory_per_node}) but this machine has {self.memory_bytes / 2**30:.2f} GiB"
            )
        if cpus > self.cpus:
            raise ValueError(
                f"resources.cpu_per_node: the job asks for {cpus:g} CPU cores in all ({resources.nodes} node(s) x "
                f"{resources.cpu_per_node:g}) but this machine has {self.cpus}"
            )
        disk = resources.nodes * resources.local_disk_bytes_per_node
        if disk and disk > (free := self.free_disk(self.data_dir)):
            raise ValueError(
                f"resources.local_disk_per_node: the job asks for {sizing.in_units(disk)} of local disk in all "
                f"({resources.nodes} node(s) x {resources.local_disk_per_node}, its tiered tables' rows) but the "
                f"disk of this server's data dir has {sizing.in_units(free)} free"
            )

    def _check_disk(self, job_id: str, needed: int) -> None:
        """Before a start: the job's local disk must fit what is free under the data dir now, less what the other
        running gangs asked for and have not written yet. Raises NotReady while their ending would make room,
        CannotStart when even that would not (the disk filled since the job was accepted)."""
        free = self.free_disk(self.data_dir)
        with self._lock:
            others = [g for other, g in self._gangs.items() if other != job_id and g.local_disk_bytes]
        written = [local_disk.written_bytes([pid for p in g.processes for pid in confinement.node_processes(p.pid)],
                                            g.local_dir) for g in others]
        pending = sum(max(0, g.local_disk_bytes - done) for g, done in zip(others, written, strict=True))
        needs = (f"the job's tiered tables need {sizing.in_units(needed)} of local disk "
                 f"(resources.local_disk_per_node x nodes) and the disk of this server's data dir has "
                 f"{sizing.in_units(free)} free")
        if needed > free + sum(written):
            raise CannotStart(f"{needs}, even once this server's other jobs end", reason="LocalDiskFull")
        if needed > free - pending:
            raise NotReady(f"{needs}, {sizing.in_units(pending)} of it promised to running jobs' tiers")

    def capacity(self) -> Quota:
        return Quota(max_processes=self.slots)

    shows_tenant_usage = False  # the API's usage endpoint and dashboard show it; nothing else here would

    def sync_tenant(self, name: str, quota: QuotaSpec, sharing: SharingSpec,
                    policy: StoragePolicy | None = None) -> None:
        """Only with minted credentials: the tenant's IAM policy follows its storage policy."""
        if self.credentials is not None and policy is not None:
            self._tenant_key(name, policy)

    def _tenant_key(self, tenant: str, policy: StoragePolicy) -> S3Credentials:
        with self._lock:
            held = self._keys.get(tenant)
        new = self.credentials.ensure(tenant, policy, current=held.access_key_id if held else None)
        with self._lock:
            if new is not None:
                self._keys[tenant] = new
            return self._keys[tenant]

    def show_usage(self, name: str, usage: TenantUsage) -> None:
        pass

    # ------------------------------------------------------------------------------------------- lifecycle
    def _job_dir(self, job_id: str) -> Path:
        return self.data_dir / "jobs" / job_id

    def _log_dir(self, job_id: str) -> Path:
        return self.data_dir / "logs" / job_id

    @staticmethod
    def _cgroup_name(job_id: str, node_rank: int | str) -> str:
        return f"kembed-{job_id}-{node_rank}"

    def _termination_log(self, job_id: str, node_rank: int) -> Path:
        """Where node `node_rank`'s first failing rank writes why (runtime.ENV_TERMINATION_LOG)."""
        return self._job_dir(job_id) / f"node-{node_rank}.termination-log"

    def start(self, launch: Launch) -> dict[str, Any]:
        job_dir, log_dir = self._job_dir(launch.job_id), self._log_dir(launch.job_id)
        job_dir.mkdir(parents=True, exist_ok=True)
        log_dir.mkdir(parents=True, exist_ok=True)
        config_path = job_dir / "trainer.yaml"
        _write_anew(config_path, yaml.safe_dump(launch.spec.trainer.model_dump(mode="json"), sort_keys=False))
        scratch = job_dir / "tmp"  # the trainers' home, temporary files and numba's cache: their own, per job
        scratch.mkdir(exist_ok=True)
        local_dir = job_dir / "local"  # their tiered tables' rows (runtime.ENV_LOCAL_DIR)
        local_dir.mkdir(exist_ok=True)

        resources = launch.spec.resources
        local_disk_bytes = resources.nodes * resources.local_disk_bytes_per_node
        if local_disk_bytes:
            self._check_disk(launch.job_id, local_disk_bytes)
        port = free_port()
        kernel_cache = self.kernel_cache.folder() if self.kernel_cache else None
        base_env = confinement.trainer_environ(os.environ, scratch=scratch, server_s3_credentials=False)
        env = {
            **confinement.trainer_environ(os.environ, scratch=scratch,
                                          server_s3_credentials=self.server_s3_credentials),
            runtime.ENV_JOB_ID: launch.job_id,
            runtime.ENV_REPORT_URL: launch.report_url,
            runtime.ENV_REPORT_TOKEN: launch.report_token,
            runtime.ENV_LOCAL_DIR: str(local_dir),
            runtime.ENV_MEMORY_PER_RANK: str(resources.memory_bytes_per_rank),
            **({runtime.ENV_KERNEL_CACHE: str(kernel_cache)} if kernel_cache else {}),
            "PYTHONUNBUFFERED": "1",
            # Each rank runs its share of the cores the job was admitted with, never the machine's.
            **threads.thread_environ(resources.cpu_per_node, resources.procs_per_node or 1),
        }
        if launch.storage_policy is not None:
            env[POLICY_ENV] = launch.storage_policy.to_json()
        if launch.storage_budget_bytes is not None:
            env[runtime.ENV_STORAGE_BUDGET] = str(launch.storage_budget_bytes)
        if self.credentials is not None:
            # Fail closed: with minting on, a job without a policy would get no key, never the platform's.
            policy = launch.storage_policy or StoragePolicy()
            env = trainer_environ(env, self._tenant_key(launch.tenant, policy))
        files = network = None
        if self.landlock:
            files = confinement.landlock_file_rules(data_dir=self.data_dir, job_dir=job_dir,
                                                    policy=launch.storage_policy, kernel_cache=kernel_cache)
        if self.landlock_network:
            network = confinement.network_rules(report_url=launch.report_url, rendezvous_port=port, environ=env,
                                                policy=launch.storage_policy)
        limits = confinement.node_limits(resources)
        placement = self.core_allocator.take(launch.job_id, nodes=resources.nodes,
                                             cpu_per_node=resources.cpu_per_node)
        processes, pumps, node_limits = [], [], []
        try:
            for node_rank in range(resources.nodes):
                termination_log = self._termination_log(launch.job_id, node_rank)
                termination_log.unlink(missing_ok=True)  # an earlier attempt's reason
                limit = self.limiter.node(self._cgroup_name(launch.job_id, node_rank), limits)
                node_limits.append(limit)
                command = runtime.node_command(
                    _LAUNCHER, nnodes=resources.nodes, node_rank=node_rank, nproc_per_node=resources.procs_per_node,
                    master_addr="127.0.0.1", master_port=port, rdzv_id=launch.job_id, config=str(config_path),
                )
                sandboxed = confinement.sandbox_command(files=files, network=network, joins=limit.joins,
                                                        rlimits=limit.rlimits, cpus=placement[node_rank])
                log_path = node_logs.node_log(log_dir, node_rank)
                header = node_logs.LogPump(log_path, self.log_bytes_per_node)
                header.write(f"=== attempt {launch.attempt} of job {launch.job_id}, node {node_rank} ===\n".encode())
                header.close()
                node_env = {**env, runtime.ENV_TERMINATION_LOG: str(termination_log)}
                read_end, write_end = os.pipe()
                try:
                    # Its own session, like the node's: a Ctrl-C meant for the server must not end the logs
                    # while the trainers write their SIGTERM checkpoint.
                    pumps.append(subprocess.Popen(
                        node_logs.pump_command(log_path, self.log_bytes_per_node), stdin=read_end,
                        stdout=subprocess.DEVNULL, env=base_env, start_new_session=True))
                    processes.append(subprocess.Popen(
                        [*sandboxed, *command], env=node_env, stdout=write_end, stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL, cwd=job_dir, start_new_session=True))
                finally:
                    os.close(read_end)
                    os.close(write_end)
        except BaseException:
            for process in processes:  # a half-started gang would wait for its missing nodes forever
                _signal_group(process.pid, signal.SIGKILL)
            for limit in node_limits:
                limit.release()
            for pump in pumps:
                pump.kill()
            self.core_allocator.release(launch.job_id)
            raise
        with self._lock:
            self._gangs[launch.job_id] = _Gang(processes=processes, pumps=pumps, limits=node_limits,
                                               local_dir=local_dir, local_disk_bytes=local_disk_bytes)
        for process in processes:
            threading.Thread(target=self._wake_on_exit, args=(process,), name=f"kembed-exit-{process.pid}",
                             daemon=True).start()
        described = f"{self._describe(limits)}; cores: {'; '.join(_core_list(c) for c in placement)}"
        log.info("job %s attempt %d: %s", launch.job_id, launch.attempt, described)
        return {"pids": [p.pid for p in processes], "attempt": launch.attempt, "confinement": described}

    def watch_exits(self, wake: Callable[[], None]) -> None:
        self._wake = wake

    def _wake_on_exit(self, process: subprocess.Popen) -> None:
        """Wait for a node's process (in a thread of its own; Popen's lock makes poll from the dispatcher safe
        meanwhile) and wake the dispatcher, whose pass then finds the node ended."""
        process.wait()
        if self._wake is not None:
            self._wake()

    def _describe(self, limits: confinement.NodeLimits) -> str:
        network = ("network: Landlock (report, storage and rendezvous ports, the ephemeral range)"
                   if self.landlock_network else "network: unrestricted")
        return (f"{self.limiter.describe(limits)}; files: {'Landlock' if self.landlock else 'unrestricted'}; "
                f"{network}")

    def poll(self, job_id: str) -> Exit | None:
        with self._lock:
            gang = self._gangs.get(job_id)
        if gang is None:
            return Exit(succeeded=False, retryable=True, reason="Lost",
                        message="the trainer processes are gone (the server restarted while they ran)")
        for process, limit in zip(gang.processes, gang.limits, strict=True):
            if process.poll() is None:
                limit.watch(process.pid)
        codes = [_exit_code(p) for p in gang.processes]
        failed = [i for i, code in enumerate(codes) if code not in (None, 0)]
        if failed and any(c is None for c in codes):
            # One node failed: the gang cannot go on without it, so the rest is stopped too (gang semantics).
            self.stop(job_id)
            return None
        if any(c is None for c in codes):
            return None
        for pump in gang.pumps:
            with contextlib.suppress(subprocess.TimeoutExpired):
                pump.wait(_LOG_DRAIN_S)
        if not failed:
            self._forget(job_id)
            return Exit(succeeded=True, retryable=False, reason="Completed", message="all trainers exited 0")
        failures = []
        for i in failed:
            out_of_memory = gang.limits[i].oom(refused=codes[i] == runtime.EXIT_OUT_OF_MEMORY)
            said = runtime.read_termination_message(self._termination_log(job_id, i))
            if out_of_memory and said:
                out_of_memory = f"{out_of_memory}; the trainer said: {said}"
            failures.append(lifecycle.Failure(
                name=f"node {i}", index=i, exit_code=codes[i], collateral=i in gang.collateral,
                message=out_of_memory or said, out_of_memory=out_of_memory is not None))
        self._forget(job_id)
        verdict = lifecycle.judge(failures)
        if any(f.message for f in failures):
            # The trainer (or its limit) said why (the verdict carries it): that is the message, not log lines.
            return Exit(succeeded=False, retryable=verdict.retryable, reason=verdict.reason, message=verdict.message)
        tail = self.read_logs(job_id, tail_lines=12)
        return Exit(succeeded=False, retryable=verdict.retryable, reason=verdict.reason,
                    message=f"{verdict.message}; trainer exit codes {codes}; last log lines:\n{tail}")

    def _forget(self, job_id: str) -> None:
        with self._lock:
            gang = self._gangs.pop(job_id, None)
        if gang:
            for limit in gang.limits:
                limit.release()
            self.core_allocator.release(job_id)

    def stop(self, job_id: str) -> None:
        with self._lock:
            gang = self._gangs.get(job_id)
        if gang is None or gang.stop_requested_at is not None:
            return
        gang.stop_requested_at = time.monotonic()
        for index, process in enumerate(gang.processes):
            if process.poll() is None:
                gang.collateral.add(index)
                _signal_group(process.pid, signal.SIGTERM)

    def preempt(self, job_id: str) -> None:
        self.stop(job_id)  # the same SIGTERM: the trainers save; the dispatcher queues the job again

    def kill_overdue(self) -> None:
        """SIGKILL gangs that ignored SIGTERM for longer than the grace period."""
        with self._lock:
            gangs = list(self._gangs.values())
        for gang in gangs:
            if gang.stop_requested_at is not None and time.monotonic() - gang.stop_requested_at > self.stop_grace_s:
                for process in gang.processes:
                    if process.poll() is None:
                        for pid in confinement.node_processes(process.pid):  # its ranks too: their own sessions
                            with contextlib.suppress(ProcessLookupError):
                                os.kill(pid, signal.SIGKILL)

    def reclaim(self, job_id: str, backend_state: dict[str, Any]) -> bool:
        # Trainers never outlive the server that started them: end what is left (SIGTERM: they checkpoint).
        pids = [pid for pid in backend_state.get("pids", []) if _is_our_process(pid, job_id)]
        for pid in pids:
            _signal_group(pid, signal.SIGTERM)
        deadline = time.monotonic() + self.stop_grace_s
        while pids and time.monotonic() < deadline:
            pids = [pid for pid in pids if _is_our_process(pid, job_id)]
            time.sleep(0.2)
        for pid in pids:
            _signal_group(pid, signal.SIGKILL)
        self.limiter.release_all(self._cgroup_name(job_id, ""))
        return True

    def _node_logs(self, job_id: str) -> list[Path]:
        found = self._log_dir(job_id).glob("node-*.log")
        return sorted(found, key=lambda p: int(p.stem.removeprefix("node-")) if p.stem[5:].isdigit() else -1)

    def read_logs(self, job_id: str, *, tail_lines: int | None = None) -> str:
        if tail_lines is None:
            return b"".join(self.stream_logs(job_id)).decode(errors="replace")
        return b"".join(node_logs.read_tail(p, tail_lines) for p in self._node_logs(job_id)).decode(errors="replace")

    def stream_logs(self, job_id: str) -> Iterator[bytes]:
        for path in self._node_logs(job_id):
            yield from node_logs.stream(path)

    def log_bytes(self, job_id: str) -> int:
        """The job's log files' sizes (a stat each): its tenant's storage counts them."""
        return sum(path.stat().st_size for path in self._log_dir(job_id).glob("node-*.log*"))  # rotated ones too

    def shutdown(self) -> None:
        with self._lock:
            job_ids = list(self._gangs)
        for job_id in job_ids:
            self.stop(job_id)
        deadline = time.monotonic() + self.stop_grace_s
        for job_id in job_ids:
            gang = self._gangs.get(job_id)
            for process in gang.processes if gang else []:
                try:
                    process.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    _signal_group(process.pid, signal.SIGKILL)
                    process.wait()
            self._forget(job_id)
