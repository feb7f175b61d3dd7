"""The local backend's admission checks and its trainers' logs (its process handling is tested for real in
tests/e2e, its confinement in tests/security/test_trainer_confinement.py)."""

import json
import shutil
import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from kembed_api.app import create_app
from kembed_api.backends import node_logs
from kembed_api.backends.base import Launch
from kembed_api.backends.local import LocalBackend
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
