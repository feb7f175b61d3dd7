"""The API's checkpoint listing and export lookup understand incremental chains: full and delta saves, their
steps and sizes, and only steps whose whole chain is complete."""

from __future__ import annotations

import pathlib

import pytest

from kembed_api.jobs import checkpoints, exports
from kembed_contract import runtime


def write_checkpoint(root: pathlib.Path, step: int, parent: int | None, size: int, *, complete: bool = True) -> None:
    folder = root / runtime.step_dir(step)
    folder.mkdir(parents=True)
    (folder / "data").write_bytes(b"x" * size)
    if complete:
        kind = runtime.CHECKPOINT_FULL if parent is None else runtime.CHECKPOINT_DELTA
        marker = runtime.CheckpointMarker(step, kind, parent, size).to_bytes()
        (folder / runtime.CHECKPOINT_MARKER).write_bytes(marker)


@pytest.fixture
def chains(tmp_path) -> str:
    """10 full <- 20 delta <- 30 delta; 40 full <- 50 delta (partial) <- 60 delta (its parent never completed)."""
    for step, parent, size in ((10, None, 1000), (20, 10, 50), (30, 20, 70), (40, None, 1000), (60, 50, 40)):
        write_checkpoint(tmp_path, step, parent, size)
    write_checkpoint(tmp_path, 50, 40, 30, complete=False)
    return f"file://{tmp_path}"


def test_the_listing_shows_full_and_delta_saves_with_their_chains(chains):
    listed = checkpoints.list_checkpoints(chains)
    rows = [(c.step, c.kind, c.parent_step, c.base_step) for c in listed]
    assert rows == [(10, "full", None, 10), (20, "delta", 10, 10), (30, "delta", 20, 10), (40, "full", None, 40)]
    by_step = {c.step: c for c in listed}
    assert by_step[30].num_bytes < by_step[10].num_bytes  # a delta is the small one
    # A restore of 30 reads the whole chain: 10, 20 and 30.
    assert by_step[30].chain_num_bytes == sum(by_step[s].num_bytes for s in (10, 20, 30))
    assert by_step[40].chain_num_bytes == by_step[40].num_bytes


def test_export_finds_a_delta_only_while_its_chain_is_whole(chains):
    assert exports.find_checkpoint(chains).step == 40
    assert exports.find_checkpoint(chains, 30).kind == "delta"
    with pytest.raises(exports.NoCheckpoint, match="step 60"):
        exports.find_checkpoint(chains, 60)
