"""A job with tiered tables survives a kill -9 of a rank: it resumes from its last checkpoint, at the same or at
another number of ranks, to the state of a run that was never killed, bit for bit (tables, their optimizer
state, the dense model and its optimizer), and the killed rank leaves no tier file behind."""

from __future__ import annotations

import pathlib
import shutil

import pytest
import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from kembed_contract import runtime
from kembed_trainer import dcp_read
from tests.trainer.conftest import run_trainer, write_config
from tests.trainer.test_streamed_data import run_recorded
from tests.trainer.test_tiered import losses, tiered_config

pytestmark = pytest.mark.slow

STEPS = 20  # saves (every 5, a full checkpoint every 3rd): full 5, delta 10, delta 15, full 20
# Killed from step 13 on, once the save of step 10 (a delta) has landed (saves run in the background): the job
# resumes from the chain 5 <- 10, or 5 <- 10 <- 15 where that save too landed before the kill.
KILL_FROM, KILL_ONCE_SAVED = 13, 10
RUN_TIMEOUT_S = 600  # seconds on a quiet machine; the limit only stops a hung run


def saved_state(step_uri: str) -> dict[str, torch.Tensor]:
    """Every tensor of a full checkpoint: the tables and their optimizer state, the dense model and its
    optimizer's, the trainer's counters."""
    saved = dcp_read.SafeReader(step_uri).read_metadata().state_dict_metadata
    state = {key: torch.empty(tuple(entry.size), dtype=entry.properties.dtype) for key, entry in saved.items()
             if isinstance(entry, TensorStorageMetadata)}
    dcp_read.quiet_load(state, storage_reader=dcp_read.SafeReader(step_uri), planner=dcp_read.SafeLoadPlanner())
    return state


def run(tmp_path: pathlib.Path, name: str, uri: str, nproc: int) -> list[dict]:
    """A run to STEPS with its tier files in a folder of its own, which it must leave empty."""
    local = tmp_path / f"{name}-local"
    local.mkdir(exist_ok=True)
    code, recs, stderr = run_trainer(write_config(tmp_path / f"{name}.yaml", tiered_config(uri, STEPS)),
                                     nproc=nproc, timeout=RUN_TIMEOUT_S, KEMBED_LOCAL_DIR=str(local))
    assert code == 0, stderr
    assert list(local.iterdir()) == []
    return recs


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """{ranks: (checkpoint folder, records)} of runs never killed, made when first asked for."""
    runs: dict[int, tuple[str, list[dict]]] = {}

    def at(nproc: int) -> tuple[str, list[dict]]:
        if nproc not in runs:
            tmp = tmp_path_factory.mktemp(f"uninterrupted-{nproc}")
            uri = f"file://{tmp}/ckpt"
            runs[nproc] = uri, run(tmp, "run", uri, nproc)
        return runs[nproc]

    return at


@pytest.mark.parametrize(("first", "then"), [
    pytest.param(1, 1, id="1-to-1"), pytest.param(2, 2, id="2-to-2"),
    pytest.param(2, 1, id="2-to-1"), pytest.param(1, 2, id="1-to-2"),
])
def test_a_tiered_job_killed_mid_run_resumes_to_the_uninterrupted_state(tmp_path, uninterrupted, first, then):
    straight_uri, straight = uninterrupted(first)
    uri = f"file://{tmp_path}/ckpt"
    local = tmp_path / "killed-local"
    local.mkdir()
    config = write_config(tmp_path / "killed.yaml", tiered_config(uri, STEPS))
    marker = tmp_path / "ckpt" / f"step-{KILL_ONCE_SAVED}" / runtime.CHECKPOINT_MARKER
    code, _, stderr = run_recorded(config, first, tmp_path / "killed-rows", timeout=RUN_TIMEOUT_S,
                                   KEMBED_LOCAL_DIR=str(local), KEMBED_TEST_KILL_AT=str(KILL_FROM),
                                   KEMBED_TEST_KILL_WHEN=str(marker), KEMBED_TEST_KILL_RANK=str(first - 1))
    # The last rank killed itself with SIGKILL, mid-run (the launcher exits with the killed rank's code).
    assert code == (-9 if first == 1 else 128 + 9), stderr
    # Its stores were open and written (steps 11-12 trained on them), yet nothing is left: each store's file is
    # unlinked as soon as it is opened, so neither the killed rank nor those stopped after it leave one.
    assert list(local.iterdir()) == []

    resumed = run(tmp_path, "resumed", uri, then)
    assert resumed[0]["resumed_from"] in (f"{uri}/step-10", f"{uri}/step-15") and resumed[0]["world_size"] == then
    resumed_at = int(resumed[0]["resumed_from"].rsplit("-", 1)[1])
    assert [(r["step"], r["kind"]) for r in resumed if r["event"] == "checkpoint"][-1] == (STEPS, "full")
    if first == then:
        reference = straight_uri
        assert list(losses(resumed)) == list(range(resumed_at + 1, STEPS + 1))
        assert losses(resumed) == {s: losses(straight)[s] for s in losses(resumed)}  # bit for bit
    else:
        # At another number of ranks each rank trains on other batches, so no run at one size equals a run at
        # another: the reference is the uninterrupted run's own chain of that step resumed at `then` ranks (what a
        # planned resize does), which the killed job must equal.
        resized = tmp_path / "resized"
        for step in range(5, resumed_at + 1, 5):
            shutil.copytree(straight_uri.removeprefix("file://") + f"/step-{step}", resized / f"step-{step}")
        reference = f"file://{resized}"
        assert run(tmp_path, "reference", reference, then)[0]["resumed_from"] == f"{reference}/step-{resumed_at}"
    want, got = saved_state(f"{reference}/step-{STEPS}"), saved_state(f"{uri}/step-{STEPS}")
    assert sorted(got) == sorted(want) and any(key.endswith(".exp_avg_sq") for key in got)
    for key in want:
        assert torch.equal(got[key], want[key]), key
