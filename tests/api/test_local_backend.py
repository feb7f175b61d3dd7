"""The local backend's admission checks and its trainers' logs (its process handling is tested for real in
tests/e2e, its confinement in tests/security/test_trainer_confinement.py)."""

import json
import shutil
import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from kembed_api.app import create_app
from kembed_api.backends import local_disk, node_logs
from kembed_api.backends.base import CannotStart, Launch, NotReady
from kembed_api.backends.local import LocalBackend
from kembed_api.platform.confinement import node_processes
from kembed_api.platform.settings import Settings
from kembed_api.quota.admission import Quota
from kembed_contract.spec import JobSpec
from tests.builders import make_spec
from tests.fixtures.report_sink import report_sink


@pytest.fixture
def local(tmp_path):
    return LocalBackend(data_dir=tmp_path, slots=4)


def test_a_job_larger_than_the_slots_is_refused_with_the_numbers(local):
    with pytest.raises(ValueError, match=r"needs 6 trainer processes .* 4 local slots \(KEMBED_LOCAL_SLOTS\)"):
        local.check_fits(JobSpec.model_validate(make_spec().with_nodes(3, 2).build()))


def test_gpus_are_refused_on_the_cpu_only_local_backend(local):
    spec = make_spec().build()
    spec["resources"]["gpus_per_node"] = 1
    with pytest.raises(ValueError, match="resources.gpus_per_node"):
        local.check_fits(JobSpec.model_validate(spec))


def test_capacity_is_the_slots_in_trainer_processes(local):
    assert local.capacity() == Quota(max_processes=4)


# ---- logs: bounded on disk, read from the end, streamed ------------------------------------------------------
@pytest.mark.slow
def test_a_log_flood_stays_under_the_cap_and_keeps_its_newest_output(tmp_path):
    """A real trainer logging every step: its log on disk never grows past the cap, the newest records stay, and
    the log says what was dropped."""
    cap = 64 * 1024
    backend = LocalBackend(data_dir=tmp_path, slots=1, stop_grace_s=10, log_bytes_per_node=cap)
    spec = make_spec("flood").with_steps(1500, checkpoint_every=0).with_trainer(training={"log_every": 1}).build()
    with report_sink() as url:
        backend.start(Launch(job_id="flood-m9n0p", tenant="t", spec=JobSpec.model_validate(spec), attempt=1,
                             report_url=url, report_token="t"))
        deadline = time.monotonic() + 300
        largest = 0
        while (ended := backend.poll("flood-m9n0p")) is None:
            assert time.monotonic() < deadline, "the job did not end"
            largest = max(largest, sum(f.stat().st_size for f in (tmp_path / "logs" / "flood-m9n0p").glob("*.log*")
                                       if f.exists()))
            time.sleep(0.2)
    assert ended.succeeded, ended.message
    files = list((tmp_path / "logs" / "flood-m9n0p").glob("node-0.log*"))
    on_disk = sum(f.stat().st_size for f in files if not f.name.endswith(".dropped"))
    assert max(largest, on_disk) <= cap
    logs = backend.read_logs("flood-m9n0p")
    dropped = int(logs.split("[kembed: ", 1)[1].split(" bytes", 1)[0])
    assert dropped > 3 * cap  # 1,500 progress records of ~200 bytes: most of them gone
    assert '"event": "done"' in logs and '"step": 1500' in logs
    assert json.loads(backend.read_logs("flood-m9n0p", tail_lines=1))["event"] == "done"


def test_tail_reads_the_end_of_each_node_across_its_rotated_file(tmp_path):
    backend = LocalBackend(data_dir=tmp_path, slots=2)
    log_dir = _mkdir(tmp_path / "logs" / "j-1")
    for node in (0, 1):
        pump = node_logs.LogPump(node_logs.node_log(log_dir, node), 4096)
        for i in range(1000):
            pump.write(f"node {node} line {i}\n".encode())
        pump.close()
    assert backend.read_logs("j-1", tail_lines=2) == ("node 0 line 998\nnode 0 line 999\n"
                                                     "node 1 line 998\nnode 1 line 999\n")
    # Lines from the rotated file (node-<i>.log.1) too, when the newest file holds fewer.
    tail = backend.read_logs("j-1", tail_lines=150).splitlines()
    assert tail[:150] == [f"node 0 line {i}" for i in range(850, 1000)]
    whole = backend.read_logs("j-1")
    assert whole.startswith("[kembed: ") and whole.endswith("node 1 line 999\n")
    assert len(whole.encode()) < 2 * 4096 + 400


def _mkdir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def test_logs_without_tail_are_streamed_never_read_whole(tmp_path, sqlite_at_head):
    """GET /v1/jobs/{id}/logs without `tail` answers in chunks from the files (no Content-Length: nothing held
    whole); with `tail`, the last lines of each node."""
    shutil.copyfile(sqlite_at_head, tmp_path / "kembed.db")
    settings = Settings(data_dir=tmp_path, admission_paused=True, dispatch_interval_s=0.05)
    with TestClient(create_app(settings, backend=LocalBackend(data_dir=tmp_path, slots=2))) as client:
        client.headers["Authorization"] = f"Bearer {(tmp_path / 'admin-token').read_text().strip()}"
        job_id = client.post("/v1/jobs", json=make_spec("logs").build()).json()["id"]
        log_dir = _mkdir(tmp_path / "logs" / job_id)
        line = b"x" * 99 + b"\n"
        (log_dir / "node-0.log").write_bytes(line * 30_000)  # 3 MB
        (log_dir / "node-1.log").write_bytes(b"last of node 1\n")
        with client.stream("GET", f"/v1/jobs/{job_id}/logs") as response:
            assert response.status_code == 200
            assert "content-length" not in response.headers
            assert response.headers["content-type"].startswith("text/plain")
            chunks = list(response.iter_raw())
        assert b"".join(chunks) == line * 30_000 + b"last of node 1\n"
        tail = client.get(f"/v1/jobs/{job_id}/logs", params={"tail": 1})
        assert tail.text == "x" * 99 + "\nlast of node 1\n"


def test_a_file_the_server_writes_into_a_job_folder_never_follows_a_planted_link(tmp_path):
    """The job folder is the trainers' to write: a link an earlier attempt left where the next attempt's config goes
    (to the database, the admin token) is replaced, and its target is untouched."""
    from kembed_api.backends import local

    secret = tmp_path / "admin-token"
    secret.write_text("the platform's secret")
    planted = tmp_path / "trainer.yaml"
    planted.symlink_to(secret)
    local._write_anew(planted, "model: {}\n")
    assert secret.read_text() == "the platform's secret"
    assert not planted.is_symlink() and planted.read_text() == "model: {}\n"


# ---- local disk: tiered tables' rows under the job's folder ---------------------------------------------------
def _tiered_spec(name: str = "tier", *, nodes: int = 1) -> JobSpec:
    """The tiny DLRM with t0 (1M rows, 36 bytes each) tiered: its rows and 256 MiB of headroom per node."""
    return JobSpec.model_validate(make_spec(name).with_nodes(nodes).with_table(
        "t0", num_embeddings=1_000_000, tier={"cache_rows": 10_000}).build())


def test_a_tier_larger_than_the_data_dirs_free_disk_is_refused_naming_the_field(tmp_path):
    spec = _tiered_spec(nodes=2)
    needed = 2 * spec.resources.local_disk_bytes_per_node
    LocalBackend(data_dir=tmp_path, slots=4, free_disk=lambda path: needed).check_fits(spec)  # just enough
    small = LocalBackend(data_dir=tmp_path, slots=4, free_disk=lambda path: needed - 1)
    with pytest.raises(ValueError, match=r"^resources.local_disk_per_node: the job asks for 548.0 MiB of local "
                                         r"disk in all \(2 node\(s\) x 274Mi, its tiered tables' rows\) but the "
                                         r"disk of this server's data dir has 548.0 MiB free$"):
        small.check_fits(spec)


def test_a_start_after_the_disk_filled_is_refused_and_leaves_nothing_running(tmp_path):
    """Accepted while the disk had room, the job finds it full at dispatch: it cannot start, and no trainer runs."""
    free = {"bytes": 2**40}
    backend = LocalBackend(data_dir=tmp_path, slots=4, free_disk=lambda path: free["bytes"])
    spec = _tiered_spec()
    backend.check_fits(spec)
    free["bytes"] = 2**20
    with pytest.raises(CannotStart, match="the job's tiered tables need .* of local disk .* 1.0 MiB free, even once "
                                          "this server's other jobs end") as refused:
        backend.start(Launch(job_id="tier-a1b2c", tenant="t", spec=spec, attempt=1, report_url="http://127.0.0.1:9",
                             report_token="t"))
    assert refused.value.reason == "LocalDiskFull"
    assert backend.poll("tier-a1b2c").reason == "Lost"  # no gang was started


@pytest.mark.slow
def test_a_tiered_job_waits_for_disk_promised_to_a_running_one_and_counts_what_that_one_wrote(tmp_path):
    """Room for one and a half tiered jobs: the second waits (NotReady) for the first, before and after the
    first has written its tier; it is not refused as if the disk had filled, because the first's files, unlinked,
    still show through its open descriptors and will be freed when it ends."""
    rows = 10_000_000  # 343 MiB of rows, 600 MiB asked with the headroom
    first = JobSpec.model_validate(make_spec("first").with_steps(100_000, checkpoint_every=0).with_table(
        "t0", num_embeddings=rows, tier={"cache_rows": 10_000}).build())
    need = first.resources.local_disk_bytes_per_node
    free = {"bytes": need * 3 // 2}
    backend = LocalBackend(data_dir=tmp_path, slots=4, stop_grace_s=10, free_disk=lambda path: free["bytes"])
    with report_sink() as url:
        backend.start(Launch(job_id="first-a1b2c", tenant="t", spec=first, attempt=1, report_url=url,
                             report_token="t"))
        try:
            second = Launch(job_id="second-d3e4f", tenant="t", spec=first, attempt=1, report_url=url,
                            report_token="t")
            with pytest.raises(NotReady, match="promised to running jobs' tiers"):
                backend.start(second)
            folder = tmp_path / "jobs" / "first-a1b2c" / "local"
            gang = backend._gangs["first-a1b2c"]
            deadline = time.monotonic() + 180
            while (written := local_disk.written_bytes(
                    [p for proc in gang.processes for p in node_processes(proc.pid)], folder)) < rows * 36:
                assert time.monotonic() < deadline, backend.read_logs("first-a1b2c", tail_lines=20)
                time.sleep(0.2)
            free["bytes"] -= written  # what the first's tier took of the disk
            with pytest.raises(NotReady, match="promised to running jobs' tiers"):
                backend.start(second)
        finally:
            backend.shutdown()
