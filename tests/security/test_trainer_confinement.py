"""Local trainers are confined (docs/security.md#trainers): a job that allocates past its memory is killed as
`OOMKilled` while another job on the same server trains on; a trainer holds none of the server's secrets; a
sandboxed trainer reaches only the ports it needs."""

from __future__ import annotations

import os
import random
import socket
import sys
import time
from pathlib import Path

import pytest

from kembed_api.backends import local
from kembed_api.backends.base import Exit, Launch
from kembed_api.backends.local import LocalBackend
from kembed_api.platform import confinement
from kembed_contract.lifecycle import OOM_KILLED
from kembed_contract.spec import JobSpec
from kembed_platform import sandbox
from tests.builders import make_spec
from tests.fixtures.report_sink import report_sink


def _fixed_port_listener() -> socket.socket:
    """A listening socket on a free port below the ephemeral range: where fixed-port services live (PostgreSQL,
    the API's other ports)."""
    below = confinement.ephemeral_ports().start
    for _ in range(200):
        listener = socket.socket()
        try:
            listener.bind(("127.0.0.1", random.randrange(10_000, below)))
        except OSError:
            listener.close()
            continue
        listener.listen()
        return listener
    raise RuntimeError("no free port below the ephemeral range")


def _launch(backend: LocalBackend, job_id: str, spec: dict, report_url: str) -> dict:
    return backend.start(Launch(job_id=job_id, tenant="t", spec=JobSpec.model_validate(spec), attempt=1,
                                report_url=report_url, report_token="t"))


def _wait(backend: LocalBackend, job_id: str, timeout_s: float = 400) -> Exit:
    deadline = time.monotonic() + timeout_s
    while (ended := backend.poll(job_id)) is None:
        assert time.monotonic() < deadline, f"{job_id} did not end"
        time.sleep(0.5)
    return ended


def _layers() -> list:
    params = [pytest.param("rlimit", id="rlimits-and-watchdog")]
    try:
        layer = confinement.detect_limiter("cgroup").layer
        params.insert(0, pytest.param("cgroup", id=layer.split(" (")[0].replace(" ", "-")))
    except RuntimeError:
        params.insert(0, pytest.param("cgroup", id="cgroup", marks=pytest.mark.skip("no writable cgroup here")))
    return params


@pytest.mark.slow
@pytest.mark.parametrize("limits", _layers())
def test_a_job_past_its_memory_is_oom_killed_while_another_job_trains_on(limits, tmp_path):
    """A real table too big for the job's memory_per_node (the submission's estimate would refuse it: this is
    the layer under that one), beside a small job on the same backend."""
    hog = make_spec("hog").with_steps(200).build()
    hog["resources"]["memory_per_node"] = "1Gi"
    # 40 million rows x 8 floats: 1.2 GiB of weights alone, written as it is initialised.
    hog["trainer"]["embeddings"]["tables"][0]["num_embeddings"] = 40_000_000
    small = make_spec("small").with_steps(3000, checkpoint_every=0).build()
    backend = LocalBackend(data_dir=tmp_path / "data", slots=2, sandbox="off", stop_grace_s=10, limits=limits)
    with report_sink() as url:
        _launch(backend, "small-a1b2c", small, url)
        try:
            deadline = time.monotonic() + 300
            while '"event": "progress"' not in backend.read_logs("small-a1b2c", tail_lines=5):
                assert time.monotonic() < deadline, "the small job never trained"
                time.sleep(0.5)
            _launch(backend, "hog-d3e4f", hog, url)  # while the small job trains
            hogged = _wait(backend, "hog-d3e4f")
            trained = _wait(backend, "small-a1b2c")
        finally:
            backend.shutdown()
    assert (hogged.succeeded, hogged.retryable, hogged.reason) == (False, False, OOM_KILLED), hogged
    assert "out of memory" in hogged.message and "of its 1.00 GiB memory limit" in hogged.message, hogged.message
    assert trained.succeeded, trained.message
    assert '"step": 3000' in backend.read_logs("small-a1b2c")


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")
    return dict(item.split("=", 1) for item in raw.split("\0") if "=" in item)


SERVER_SECRETS = {
    "DATABASE_PASSWORD": "db-p4ssw0rd-of-the-server",
    "PGPASSWORD": "pg-p4ssw0rd-of-the-server",
    "AWS_SECRET_ACCESS_KEY": "aws-s3cr3t-of-the-server",
    "AWS_ACCESS_KEY_ID": "AKIASERVERKEY",
    "AWS_SESSION_TOKEN": "aws-session-of-the-server",
    "GOOGLE_APPLICATION_CREDENTIALS": "/etc/server-gcp.json",
    "KEMBED_DATABASE_URL": "postgresql+psycopg://kembed:db-p4ssw0rd-of-the-server@db/kembed",
    "KEMBED_BOOTSTRAP_ADMIN_TOKEN": "kmb_server_admin_token",
}


@pytest.mark.parametrize("sandbox_mode", ["off", "auto"])
def test_a_trainer_holds_none_of_the_servers_secrets(sandbox_mode, monkeypatch, tmp_path):
    """What every process of a running trainer really holds: its /proc/<pid>/environ, read from outside."""
    for name, value in SERVER_SECRETS.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9000")  # where S3 is: a trainer needs it
    backend = LocalBackend(data_dir=tmp_path / "data", slots=2, sandbox=sandbox_mode, stop_grace_s=10)
    spec = make_spec("environ").with_nodes(1, 2).with_steps(1_000_000).build()
    with report_sink() as url:
        started = _launch(backend, "environ-g5h6i", spec, url)
        try:
            deadline = time.monotonic() + 120
            while len(pids := confinement.node_processes(started["pids"][0])) < 3:  # the launcher and its two ranks
                assert time.monotonic() < deadline, "the ranks did not start"
                time.sleep(0.2)
            environs = [_environ(pid) for pid in pids]
        finally:
            backend.shutdown()
    for environ in environs:
        raw = "\0".join(f"{k}={v}" for k, v in environ.items())
        assert not set(SERVER_SECRETS) & set(environ), sorted(environ)
        for secret in SERVER_SECRETS.values():
            assert secret not in raw
        assert environ["AWS_ENDPOINT_URL"] == "http://127.0.0.1:9000"
        assert environ["HOME"] == environ["TMPDIR"] == str(tmp_path / "data" / "jobs" / "environ-g5h6i" / "tmp")
        assert environ["KEMBED_JOB_ID"] == "environ-g5h6i" and environ["PATH"] == os.environ["PATH"]


def test_the_servers_s3_credentials_reach_trainers_only_when_the_settings_say_so(tmp_path):
    server = {**SERVER_SECRETS, "PATH": "/usr/bin", "LC_ALL": "C.UTF-8", "AWS_REGION": "eu-west-1"}
    kept = confinement.trainer_environ(server, scratch=tmp_path, server_s3_credentials=False)
    assert {k for k in kept if k.startswith("AWS_")} == {"AWS_REGION", "AWS_EC2_METADATA_DISABLED"}
    shared = confinement.trainer_environ(server, scratch=tmp_path, server_s3_credentials=True)
    assert shared["AWS_SECRET_ACCESS_KEY"] == SERVER_SECRETS["AWS_SECRET_ACCESS_KEY"]
    assert not {"DATABASE_PASSWORD", "PGPASSWORD", "KEMBED_DATABASE_URL"} & set(shared)


_PROBE = """
import socket, sys
for port in sys.argv[1:3]:
    s = socket.socket()
    try:
        s.connect(("127.0.0.1", int(port)))
        print("probe connect", port, "allowed", flush=True)
    except OSError as error:
        print("probe connect", port, "denied", error.errno, flush=True)
    finally:
        s.close()
"""


@pytest.mark.skipif(sandbox.abi_version() < sandbox.NET_ABI, reason="the kernel has no Landlock network rules")
def test_a_sandboxed_trainer_connects_to_its_report_port_and_not_to_another_local_port(monkeypatch, tmp_path):
    """Launched exactly as the backend launches a node (its sandbox, its limits, its environment), with a probe in
    the launcher's place: a local service on a fixed port (a database's) is refused, the report URL's is not."""
    service, report = _fixed_port_listener(), _fixed_port_listener()
    service_port, report_port = service.getsockname()[1], report.getsockname()[1]
    # The probe reads the two ports from its first arguments; the node's torchrun arguments follow, unread.
    monkeypatch.setattr(local, "_LAUNCHER", (sys.executable, "-c", _PROBE, str(service_port), str(report_port)))
    backend = LocalBackend(data_dir=tmp_path / "data", slots=1, sandbox="landlock", stop_grace_s=10)
    try:
        _launch(backend, "probe-j7k8l", make_spec("probe").build(),
                f"http://127.0.0.1:{report_port}/v1/jobs/probe-j7k8l/reports")
        ended = _wait(backend, "probe-j7k8l", timeout_s=60)
    finally:
        service.close()
        report.close()
    logs = backend.read_logs("probe-j7k8l")
    assert ended.succeeded, logs
    assert f"probe connect {service_port} denied 13" in logs, logs  # EACCES: Landlock refused it
    assert f"probe connect {report_port} allowed" in logs, logs


@pytest.mark.parametrize(("version", "written", "oom_file", "oom_text", "peak_file"), [
    pytest.param(2, {"memory/n/memory.max": "1073741824", "memory/n/memory.swap.max": "0",
                     "cpu/n/cpu.max": "150000 100000", "pids/n/pids.max": "1536"},
                 "memory.events", "low 0\nhigh 0\nmax 7\noom 1\noom_kill 1\n", "memory.peak", id="cgroup-v2"),
    pytest.param(1, {"memory/n/memory.limit_in_bytes": "1073741824", "cpu/n/cpu.cfs_quota_us": "150000",
                     "cpu/n/cpu.cfs_period_us": "100000", "pids/n/pids.max": "1536"},
                 "memory.oom_control", "oom_kill_disable 0\nunder_oom 0\noom_kill 1\n", "memory.max_usage_in_bytes",
                 id="cgroup-v1"),
])
def test_a_nodes_cgroups_get_its_resources_in_each_versions_words(tmp_path, version, written, oom_file, oom_text,
                                                                  peak_file):
    """The files each cgroup version reads, as a folder (this machine cannot make a cgroup v2 with controllers:
    the real v1 layer is the OOM test's), and the OOM count and peak read back in each version's format."""
    parents = {}
    for controller in ("memory", "cpu", "pids"):
        parents[controller] = tmp_path / controller
        parents[controller].mkdir()
    limiter = confinement.Limiter(f"cgroup v{version}", parents, version=version)
    node = limiter.node("n", confinement.NodeLimits(memory_bytes=2**30, cpus=1.5, tasks=1536, open_files=8192))
    assert {path: (tmp_path / path).read_text() for path in written} == written
    assert node.joins == [str(tmp_path / c / "n" / "cgroup.procs") for c in ("memory", "cpu", "pids")]
    assert node.rlimits == {"nofile": 8192, "core": 0} and node.oom() is None
    (tmp_path / "memory" / "n" / oom_file).write_text(oom_text)
    (tmp_path / "memory" / "n" / peak_file).write_text(str(2**30 + 2**20))
    assert node.oom().startswith(f"used 1.00 GiB of its 1.00 GiB memory limit (resources.memory_per_node, "
                                 f"enforced by cgroup v{version})")
