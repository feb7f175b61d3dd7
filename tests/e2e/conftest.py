"""A real `kembed serve` process on 127.0.0.1 (API + SQLite + local torchrun backend)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import pytest

from kembed_api.cli.client import Client
from kembed_api.platform.ports import free_port


class ServerProcess:
    def __init__(self, data_dir: Path, *, slots: int = 2, workers: int = 1, env: dict[str, str] | None = None,
                 args: tuple[str, ...] = ()) -> None:
        self.data_dir, self.slots, self.workers, self.env, self.args = data_dir, slots, workers, env or {}, args
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None
        self.client = Client(self.url)

    def start(self) -> ServerProcess:
        log = open(self.data_dir.parent / f"server-{self.port}.log", "ab")  # noqa: SIM115
        self.process = subprocess.Popen(
            [sys.executable, "-m", "kembed_api.cli", "serve", "--port", str(self.port),
             "--data-dir", str(self.data_dir), "--slots", str(self.slots), "--workers", str(self.workers), *self.args],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, "KEMBED_STOP_GRACE_S": "60", **self.env},
        )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert self.process.poll() is None, f"server exited with {self.process.returncode}"
            try:
                self.client.health()
                token = (self.data_dir / "admin-token").read_text().strip()
                self.client = Client(self.url, token=token)
                self.token = token
                return self
            except Exception:  # noqa: BLE001 (not listening yet)
                time.sleep(0.2)
        raise TimeoutError("kembed serve did not become healthy")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 120) -> int:
        assert self.process is not None
        self.process.send_signal(sig)
        return self.process.wait(timeout=timeout)

    def wait_for(self, job_id: str, predicate: Callable[[dict], bool], *, timeout: float = 180) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            job = self.client.job(job_id)
            if predicate(job):
                return job
            if time.monotonic() > deadline:
                raise TimeoutError(f"{job_id}: condition not met; last seen {job['state']} {job['reason']}: "
                                   f"{job['message']} at step {job['progress']['step']}")
            time.sleep(0.3)

    def wait_terminal(self, job_id: str, *, timeout: float = 180) -> dict:
        return self.wait_for(job_id, lambda j: j["state"] in ("SUCCEEDED", "FAILED", "CANCELLED"), timeout=timeout)


@pytest.fixture
def start_server(tmp_path):
    servers: list[ServerProcess] = []

    def start(data_dir: Path | None = None, *, slots: int = 2, workers: int = 1) -> ServerProcess:
        server = ServerProcess(data_dir or tmp_path / "kembed", slots=slots, workers=workers).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        if server.process and server.process.poll() is None:
            server.stop()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """One server shared by the read-mostly tests of a module."""
    instance = ServerProcess(tmp_path_factory.mktemp("server") / "kembed", slots=2).start()
    yield instance
    instance.stop()


def file_uri_path(uri: str) -> Path:
    assert uri.startswith("file://"), uri
    return Path(uri.removeprefix("file://"))


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"  # a zombie has ended
    except OSError:
        return False


def trainer_pids(job_id: str) -> list[int]:
    """The processes a job's trainers run in (found by the job id in their environment)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                environ = Path(f"/proc/{entry}/environ").read_bytes()
            except OSError:
                continue
            if f"KEMBED_JOB_ID={job_id}".encode() in environ:
                pids.append(int(entry))
    return pids


def _pending_signals(pid: int) -> int:
    """The signals waiting for the process (its own and its threads'), as a bit mask (bit n-1 is signal n)."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return 0
    return sum(int(line.split()[1], 16) for line in lines if line.startswith(("SigPnd:", "ShdPnd:")))


def last_logged_step(logs: str) -> int:
    """The step of the newest progress record in a trainer's log (-1 before the first). The log is what the
    trainer printed, at once; the API's progress comes later (its reports queue behind one another)."""
    steps = re.findall(r'\{"event": "progress", "step": (\d+)', logs)
    return int(steps[-1]) if steps else -1


def _continue(pids: list[int]) -> None:
    for pid in pids:
        with suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


@contextmanager
def frozen(job_id: str, logs: Callable[[], str], *, after_step: int,
           timeout_s: float = 120) -> Iterator[tuple[int, Callable[[], bool]]]:
    """Stops every process of a job's trainers (SIGSTOP) once its log (`logs()`) shows `after_step` trained, and
    continues them on leaving, so that the platform acts on a job that cannot move meanwhile: a preemption then
    always finds it mid-run, however slow the machine. Stopped first and read after, so the step it holds at is
    exact. Yields that step and `asked_to_stop()`: whether a SIGTERM waits for any of them (a stopped process
    keeps it pending)."""
    deadline = time.monotonic() + timeout_s
    while True:
        pids = trainer_pids(job_id)
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        try:
            step = last_logged_step(logs())
        except BaseException:
            _continue(pids)  # never leave a trainer stopped behind a failed read
            raise
        if pids and step >= after_step and sorted(trainer_pids(job_id)) == sorted(pids):
            break
        _continue(pids)
        assert time.monotonic() < deadline, f"{job_id} never logged step {after_step} (last: {step})"
        time.sleep(0.1)
    sigterm = 1 << (signal.SIGTERM - 1)
    try:
        yield step, lambda: any(_pending_signals(pid) & sigterm for pid in pids)
    finally:
        _continue(pids)
