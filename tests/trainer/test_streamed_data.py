"""Streamed table data: every epoch visits each training row once across ranks, also across a resume mid-epoch at
the same or another world size; shuffling; bad data named where it is; the Criteo layout."""

from __future__ import annotations

import collections
import json
import pathlib
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from kembed_contract import runtime
from kembed_contract import trainer_config as config
from kembed_trainer.data import plan
from kembed_trainer.data.table import TableData
from kembed_trainer.storage import Guard
from tests.trainer.conftest import (
    REPO,
    records,
    run_trainer_to_its_reason,
    tiny_config,
    trainer_env,
    write_config,
)

RECORDER = REPO / "tests" / "trainer" / "rows_recorder.py"


# ----------------------------------------------------------------------------------------------- the plan
def visits(segment: plan.Segment, until: int | None = None) -> list[int]:
    """The positions every rank takes from `segment`'s start to `until` (default: its end)."""
    out = []
    for step in range(segment.start_step, segment.end_step if until is None else until):
        for rank in range(segment.world_size):
            lo, hi = segment.step_offsets(rank, step)
            out += [p for a, b in plan.slice_of(segment.share(rank), lo, hi) for p in range(a, b)]
    return out


@pytest.mark.parametrize(
    ("num_rows", "batch_size", "sizes"),
    [
        pytest.param(1000, 32, [2], id="one-size"),
        pytest.param(1000, 32, [2, 3], id="2-to-3"),
        pytest.param(1001, 7, [4, 1, 3], id="4-to-1-to-3"),
        pytest.param(97, 20, [1, 2], id="last-steps-longer-than-a-batch"),
    ],
)
def test_an_epoch_visits_each_position_once_across_world_size_changes(num_rows, batch_size, sizes):
    segment = plan.first_segment(num_rows, sizes[0], batch_size)
    seen: list[int] = []
    for new_size in sizes[1:]:
        step = (segment.start_step + segment.end_step) // 2  # mid-segment
        seen += visits(segment, step)
        restored = plan.Segment.from_state(segment.to_state(), batch_size)
        segment = plan.segment_at(restored, step, world_size=new_size, num_rows=num_rows)
        assert segment.epoch == 0 and segment.start_step == step
    seen += visits(segment)
    assert sorted(seen) == list(range(num_rows))
    nxt = plan.segment_at(segment, segment.end_step, world_size=sizes[-1], num_rows=num_rows)
    assert nxt.epoch == 1 and nxt.remaining == [(0, num_rows)]


def test_ranks_shares_differ_by_at_most_one_row_and_every_rank_takes_the_same_steps():
    segment = plan.first_segment(1003, 4, 10)
    sizes = [plan.total_length(segment.share(r)) for r in range(4)]
    assert max(sizes) - min(sizes) <= 1 and sum(sizes) == 1003
    assert segment.num_steps == 25  # 250 rows per rank in batches of 10, the last step taking the rest
    assert [segment.step_offsets(r, 24)[1] - segment.step_offsets(r, 24)[0] for r in range(4)] == [
        s - 240 for s in sizes
    ]


# ----------------------------------------------------------------------------------------------- the reader
def write_rows(folder: pathlib.Path, num_rows: int, *, files: int = 3, row_group: int = 150, sort_by_label=False):
    """Parquet files whose `rid` column is each row's number; `label` depends on `feat`."""
    rng = np.random.default_rng(0)
    feat = rng.integers(0, 50, num_rows)
    label = (rng.random(num_rows) < np.where(feat < 25, 0.8, 0.2)).astype(np.int64)
    rows = pa.table({"rid": np.arange(num_rows), "feat": feat, "price": rng.normal(size=num_rows), "label": label})
    if sort_by_label:
        rows = rows.sort_by("label")
    folder.mkdir(parents=True, exist_ok=True)
    per_file = -(-num_rows // files)
    for i in range(files):
        pq.write_table(rows.slice(i * per_file, per_file), folder / f"part-{i}.parquet", row_group_size=row_group)
    return rows


def row_data(folder, rank, world_size, *, batch_size=50, **data) -> TableData:
    cfg = config.TableDataConfig.model_validate(
        {"kind": "table", "uri": str(folder), "label": "label", "sparse": {"rid": "rid"}, "shuffle_buffer": 400,
         **data})
    tables = [config.TableConfig(name="rows", num_embeddings=1 << 20, embedding_dim=4, features=["rid"])]
    return TableData(cfg, tables=tables, seed=0, batch_size=batch_size, rank=rank, world_size=world_size,
                     guard=Guard(None))


def test_streamed_epochs_visit_each_training_row_once_in_a_new_order(tmp_path):
    write_rows(tmp_path / "rows", 2000)
    ranks = [row_data(tmp_path / "rows", r, 2) for r in range(2)]
    epochs = []
    step = 0
    for _ in range(2):
        seen = []
        for _ in range(ranks[0].steps_per_epoch):
            for data in ranks:
                seen += data.train_batch(step).values.tolist()
            step += 1
        epochs.append(seen)
    held_out = [i for data in ranks for b in data.eval_batches() for i in b.values.tolist()]
    for seen in epochs:
        assert len(seen) == len(set(seen)) and not set(seen) & set(held_out)
        assert len(seen) + len(held_out) == 2000
    assert epochs[0] != epochs[1] and sorted(epochs[0]) == sorted(epochs[1])
    # Rows that are neighbours in the files are scattered: a batch spans more than one row group.
    first_batch = epochs[0][:50]
    assert len({i // 150 for i in first_batch}) > 1
    for data in ranks:
        data.close()


# ----------------------------------------------------------------------------------------------- the trainer
def recorded(folder: pathlib.Path) -> dict[int, dict[int, list[int]]]:
    """{pid-file: {step: ids}}, per file, so runs can be told apart."""
    out: dict[str, dict[int, tuple[int, list[int]]]] = {}
    for file in sorted(folder.glob("*.jsonl")):
        out[file.name] = {(r := json.loads(line))["step"]: (r["epoch"], r["ids"]) for line in file.read_text().splitlines()}
    return out


def run_recorded(cfg_path: pathlib.Path, nproc: int, rows_dir: pathlib.Path, timeout: float = 240, **env: str):
    rows_dir.mkdir(parents=True, exist_ok=True)
    script = [str(RECORDER), "--config", str(cfg_path)]
    command = ([sys.executable, *script] if nproc == 1 else
               [sys.executable, "-m", "kembed_trainer.launch", "--standalone", "--nnodes", "1",
                "--nproc-per-node", str(nproc), *script])
    proc = subprocess.run(command, env=trainer_env(KEMBED_TEST_ROWS_DIR=str(rows_dir), **env),  # noqa: PLW1510
                          capture_output=True, text=True, timeout=timeout, cwd=REPO)
    return proc.returncode, records(proc.stdout), proc.stderr


def rows_config(folder: pathlib.Path, ckpt_uri: str) -> dict:
    return tiny_config(
        model={"kind": "dlrm", "bottom_mlp": [8], "top_mlp": [8]},
        embeddings={"tables": [{"name": "rows", "num_embeddings": 2000, "embedding_dim": 8, "features": ["rid"]}]},
        data={"kind": "table", "uri": str(folder), "label": "label", "dense": ["price"], "sparse": {"rid": "rid"},
              "shuffle_buffer": 400},
        training={"steps": None, "epochs": 3, "batch_size": 50, "log_every": 1},
        checkpoint={"uri": ckpt_uri, "every_steps": 4, "keep": 10},
    )


def epochs_of(runs: list[dict[int, tuple[int, list[int]]]]) -> dict[int, list[int]]:
    by_epoch: dict[int, list[int]] = collections.defaultdict(list)
    for steps in runs:
        for epoch, ids in steps.values():
            by_epoch[epoch] += ids
    return by_epoch


@pytest.mark.parametrize(("first", "then"), [pytest.param(2, 2, id="2-to-2"), pytest.param(2, 1, id="2-to-1")])
def test_a_rank_killed_mid_epoch_resumes_the_epoch_with_each_row_once(tmp_path, first, then):
    write_rows(tmp_path / "rows", 2000)
    straight_cfg = write_config(tmp_path / "straight.yaml", rows_config(tmp_path / "rows", f"file://{tmp_path}/a"))
    code, straight_recs, stderr = run_recorded(straight_cfg, first, tmp_path / "straight")
    assert code == 0, stderr
    straight = epochs_of(list(recorded(tmp_path / "straight").values()))
    train_rows = straight_recs[0]["dataset"]["train_rows"]
    assert sorted(straight) == [0, 1, 2]
    assert all(sorted(ids) == sorted(straight[0]) and len(ids) == train_rows for ids in straight.values())

    cfg = write_config(tmp_path / "killed.yaml", rows_config(tmp_path / "rows", f"file://{tmp_path}/b"))
    per_epoch = straight_recs[0]["total_steps"] // 3
    kill_at = per_epoch + per_epoch // 2 + 1  # mid-way through the second epoch
    code, _, stderr = run_recorded(cfg, first, tmp_path / "killed", KEMBED_TEST_KILL_AT=str(kill_at))
    assert code == 128 + 9, stderr
    code, resumed_recs, stderr = run_recorded(cfg, then, tmp_path / "resumed")
    assert code == 0, stderr
    resumed_at = resumed_recs[0]["step"]
    assert per_epoch < resumed_at < kill_at  # resumed mid-epoch, from a checkpoint before the kill
    # What the killed run trained after its checkpoint is lost with it: the resumed run retrains from there.
    killed = [{s: v for s, v in steps.items() if s < resumed_at} for steps in recorded(tmp_path / "killed").values()]
    resumed = list(recorded(tmp_path / "resumed").values())
    together = epochs_of(killed + resumed)
    assert sorted(together) == [0, 1, 2]
    for epoch, ids in together.items():
        assert len(ids) == train_rows and sorted(ids) == sorted(straight[0]), f"epoch {epoch}"
    if first == then:  # the same batches, step by step, as the uninterrupted run
        by_step = lambda runs: {s: sorted(v[1]) for steps in runs for s, v in steps.items()}  # noqa: E731
        straight_steps = by_step(recorded(tmp_path / "straight").values())
        assert by_step(killed + resumed) == straight_steps
        assert resumed_recs[-1]["step"] == straight_recs[-1]["step"]


def test_bad_data_fails_naming_the_file_the_row_group_and_the_column(tmp_path):
    rows = write_rows(tmp_path / "rows", 600, files=1)
    bad = rows.set_column(rows.column_names.index("price"), "price", pa.array(["x"] * 600))
    pq.write_table(bad, tmp_path / "rows" / "part-1.parquet", row_group_size=150)
    cfg = rows_config(tmp_path / "rows", f"file://{tmp_path}/ckpt")
    code, reason, stderr = run_trainer_to_its_reason(write_config(tmp_path / "c.yaml", cfg))
    assert code == runtime.EXIT_BAD_CONFIG, stderr
    assert "data.dense.0: column 'price' holds values that are not numbers in file://" in reason
    assert "part-1.parquet row group " in reason and "x" not in reason.split("not numbers")[1].replace("row", "")


def test_ids_out_of_range_name_the_line_of_a_csv_file(tmp_path):
    (tmp_path / "rows.csv").write_text("label,rid\n1,3\n0,5\n1,2500\n")
    cfg = config.TableDataConfig.model_validate(
        {"kind": "table", "uri": str(tmp_path / "rows.csv"), "label": "label", "sparse": {"rid": "rid"},
         "eval_fraction": 0})
    tables = [config.TableConfig(name="rows", num_embeddings=2000, embedding_dim=4, features=["rid"])]
    data = TableData(cfg, tables=tables, seed=0, batch_size=2, rank=0, world_size=1, guard=Guard(None))
    with pytest.raises(ValueError, match=r"feature 'rid': ids 3\.\.2500 outside \[0, 2000\); .*rows\.csv line 4\)"):
        data.train_batch(0)
    data.close()


CRITEO_COLUMNS = ["label", *(f"i{i}" for i in range(1, 14)), *(f"c{i}" for i in range(1, 27))]


def write_criteo(path: pathlib.Path, num_rows: int) -> None:
    """Criteo's layout: TSV, no header, label, 13 integers, 26 hexadecimal ids, empty fields for missing values."""
    rng = np.random.default_rng(0)
    lines = []
    for _ in range(num_rows):
        ints = ["" if rng.random() < 0.2 else str(int(rng.integers(0, 100))) for _ in range(13)]
        cats = ["" if rng.random() < 0.2 else f"{int(rng.integers(0, 40)):08x}" for _ in range(26)]
        label = int(cats[0] != "" and int(cats[0], 16) < 20)
        lines.append("\t".join([str(label), *ints, *cats]))
    path.write_text("\n".join(lines) + "\n")


@pytest.mark.parametrize(("missing", "fails"), [pytest.param("fill", False, id="fill"),
                                                pytest.param("error", True, id="error")])
def test_the_criteo_layout_reads_with_a_column_mapping(tmp_path, missing, fails):
    write_criteo(tmp_path / "day_0", 300)
    cfg = config.TableDataConfig.model_validate(
        {"kind": "table", "uri": str(tmp_path / "day_0"), "format": "tsv", "columns": CRITEO_COLUMNS,
         "label": "label", "dense": CRITEO_COLUMNS[1:14], "sparse": {c: c for c in CRITEO_COLUMNS[14:]},
         "missing": missing, "eval_fraction": 0})
    tables = [config.TableConfig(name="cats", num_embeddings=1000, embedding_dim=4, features=CRITEO_COLUMNS[14:],
                                 hash_ids=True)]
    data = TableData(cfg, tables=tables, seed=0, batch_size=100, rank=0, world_size=1, guard=Guard(None))
    if fails:
        with pytest.raises(ValueError, match=r"data\.dense\.\d+: column 'i\d+' is empty at .*day_0 line \d+"):
            data.train_batch(0)
        data.close()
        return
    batch = data.train_batch(0)
    data.close()
    assert batch.dense.shape == (100, 13) and not batch.dense.isnan().any()
    assert (batch.lengths == 1).all()  # a missing categorical is its feature's missing id, not an empty bag
    raw = data.raw_ids()
    assert "" in raw["c1"][0] and raw["c1"][1][raw["c1"][0].index("")] != raw["c2"][1][raw["c2"][0].index("")]


def test_the_id_index_keeps_the_ids_read_before_a_resume(tmp_path):
    from tests.trainer.conftest import run_trainer

    write_rows(tmp_path / "rows", 2000)
    cfg = rows_config(tmp_path / "rows", f"file://{tmp_path}/ckpt")
    cfg["embeddings"]["tables"][0]["hash_ids"] = True
    cfg["data"]["shuffle_buffer"] = 50  # a window per step: the resumed run reads none of the first run's rows
    cfg["training"] = {**cfg["training"], "epochs": None, "steps": 5}
    cfg["checkpoint"]["every_steps"] = 0
    assert run_trainer(write_config(tmp_path / "first.yaml", cfg))[0] == 0
    cfg["training"]["steps"] = 10
    code, recs, stderr = run_trainer(write_config(tmp_path / "second.yaml", cfg))
    assert code == 0, stderr
    assert recs[0]["resumed_from"].endswith("step-5")
    ids = {step: set(pq.read_table(tmp_path / "ckpt" / f"step-{step}" / "ids" / "rows.rank-0.parquet")["id"]
                     .to_pylist()) for step in (5, 10)}
    assert len(ids[5]) >= 5 * 50 and ids[5] < ids[10]
