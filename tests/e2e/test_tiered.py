"""Tiered tables on the embedded backend: a real `kembed serve` keeps a job's tier under the job's folder in its
data dir (KEMBED_LOCAL_DIR), sizes an unsized cache from the job's memory, and refuses a tier its disk cannot hold.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from kembed_api.cli.client import ApiError
from tests.builders import make_spec
from tests.e2e.conftest import frozen, trainer_pids

pytestmark = pytest.mark.slow


def _held_files(pids: list[int]) -> set[str]:
    """What the processes hold open, as /proc names it (an unlinked file ends in ' (deleted)')."""
    held = set()
    for pid in pids:
        fds = Path(f"/proc/{pid}/fd")
        for fd in os.listdir(fds):
            try:
                held.add(os.readlink(fds / fd))
            except OSError:  # closed meanwhile
                continue
    return held


def test_a_tiered_job_keeps_its_tier_in_its_folder_of_the_data_dir_and_trains_to_succeeded(server):
    spec = (make_spec("tier").with_nodes(1, 2).with_steps(300, checkpoint_every=100)
            .with_trainer(training={"log_every": 10}).with_table("t0", tier={}).build())  # cache from memory
    job = server.client.submit(spec)
    assert job["estimates"]["tier_cache_rows_per_rank"] == {"t0": 1000}  # memory enough for its 1000 rows a rank
    folder = server.data_dir / "jobs" / job["id"] / "local"
    # The ranks load the tiered kernels from the server's compiled kernels, but the server builds those at its
    # start (after an edit of the trainer's source): on a loaded machine that first build alone takes minutes.
    with frozen(job["id"], lambda: server.client.logs(job["id"]), after_step=10, timeout_s=600):
        tiers = {f for f in _held_files(trainer_pids(job["id"])) if "kembed-tier-" in f}
        assert len(tiers) == 2, tiers  # t0's rows of each of the two ranks
        assert all(f.startswith(f"{folder}/") and f.endswith(" (deleted)") for f in tiers), tiers
        assert list(folder.iterdir()) == []  # unlinked at open: a killed trainer leaves nothing behind
    done = server.wait_terminal(job["id"], timeout=600)
    assert done["state"] == "SUCCEEDED", done["message"]
    assert done["metrics"]["tier_hit_rate"] > 0


def test_a_tier_larger_than_the_data_dirs_free_disk_is_refused_at_submission(server):
    """A table whose rows need twice the disk free under the data dir: refused before it queues, naming the
    field, and nothing is stored."""
    before = server.client.jobs(limit=500)["items"]
    width = 1024  # wide rows: much disk for the 7 bytes of memory a tiered row costs
    rows = 2 * shutil.disk_usage(server.data_dir).free // (4 * (width + 1)) + 1
    builder = make_spec("huge").with_trainer(model={"bottom_mlp": [16, width]})
    for i in range(8):
        builder.with_table(f"t{i}", embedding_dim=width)
    builder.with_table("t0", num_embeddings=rows, tier={"cache_rows": 1024})
    builder.spec["trainer"]["data"] = {  # files: synthetic data would keep ids of every row in memory
        "kind": "table", "uri": f"file://{server.data_dir}/checkpoints/default/clicks/", "label": "label",
        "dense": ["d0", "d1", "d2", "d3"], "sparse": {f"c{i}": f"c{i}" for i in range(8)}}
    with pytest.raises(ApiError) as refused:
        server.client.submit(builder.with_resources(memory_per_node="4Gi").build())
    assert refused.value.status_code == 422
    assert "resources.local_disk_per_node: the job asks for " in str(refused.value)
    assert "but the disk of this server's data dir has " in str(refused.value)
    assert server.client.jobs(limit=500)["items"] == before
