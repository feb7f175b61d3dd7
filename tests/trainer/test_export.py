"""Embeddings out of a checkpoint: the formats other tools load, gathered from any world size a range of rows at a
time, in bounded memory."""

from __future__ import annotations

import io
import json
import os
import pathlib
import subprocess
import sys
import warnings

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import torch.distributed.checkpoint as dcp
from gensim.models import KeyedVectors

from kembed_contract import runtime
from kembed_trainer import dcp_read, delta, export, row_index, saved_table, step_writer
from tests.trainer.conftest import run_trainer, tiny_config, write_config
from tests.trainer.test_models_and_data import synthetic_rows, table_config, write_corpus

pytestmark = pytest.mark.slow


def latest_step(ckpt_uri: str) -> str:
    root = pathlib.Path(ckpt_uri.removeprefix("file://"))
    steps = sorted((p for p in root.glob("step-*") if (p / "COMPLETE").exists()), key=lambda p: int(p.name[5:]))
    return f"file://{steps[-1]}"


def exported(rows: export.TableRows, fmt: str, path: pathlib.Path) -> pathlib.Path:
    with open(path, "wb") as out:
        export.write(rows, fmt, out)
    return path


def test_word2vec_vectors_load_in_gensim_and_match_parquet_and_numpy(tmp_path, ckpt_uri, monkeypatch):
    write_corpus(tmp_path / "corpus.txt")
    cfg = tiny_config(
        model={"kind": "word2vec"},
        embeddings={"tables": [
            {"name": "words_in", "num_embeddings": 200, "embedding_dim": 16, "features": ["center"]},
            {"name": "words_out", "num_embeddings": 200, "embedding_dim": 16, "features": ["context"]},
        ]},
        data={"kind": "text", "uri": str(tmp_path / "corpus.txt"), "window": 3, "negatives": 3},
        training={"steps": 80, "batch_size": 2000, "log_every": 40},
        checkpoint={"uri": ckpt_uri},
    )
    del cfg["optimizer"]  # word2vec's own (SGD, as gensim)
    code, recs, stderr = run_trainer(write_config(tmp_path / "c.yaml", cfg))
    assert code == 0, stderr
    rows = export.read_table(latest_step(ckpt_uri))
    assert rows.name == "words_in" and len(rows.keys) == recs[0]["dataset"]["vocab_size"]

    text = KeyedVectors.load_word2vec_format(exported(rows, "word2vec-text", tmp_path / "v.txt"))
    binary = KeyedVectors.load_word2vec_format(exported(rows, "word2vec-binary", tmp_path / "v.bin"), binary=True)
    table = pq.read_table(exported(rows, "parquet", tmp_path / "v.parquet"))
    matrix = np.load(exported(rows, "numpy", tmp_path / "v.npy"))
    assert table.column_names == ["token", "vector"] and table.num_rows == len(rows.keys) == matrix.shape[0]
    parquet_vectors = np.stack(table.column("vector").to_numpy(zero_copy_only=False))
    for i, word in enumerate(table.column("token").to_pylist()):
        assert np.array_equal(text[word], parquet_vectors[i]) and np.array_equal(binary[word], matrix[i])
    assert np.array_equal(parquet_vectors, matrix)

    # Words co-occur only within their topic (w0..w39 and w40..w79): neighbours come from the same topic.
    near = export.neighbours(rows, "w3", k=5)
    assert len(near) == 5 and all(int(w[1:]) < 40 for w, _ in near if w.startswith("w")), near
    assert near == sorted(near, key=lambda n: -n[1]) and "w3" not in [w for w, _ in near]
    assert [w for w, _ in near] == [w for w, _ in text.most_similar("w3", topn=5)]
    assert_exported_as_whole(latest_step(ckpt_uri), "words_in", monkeypatch)


def test_a_row_sharded_hashed_table_is_gathered_whole_with_its_raw_ids(tmp_path, ckpt_uri, monkeypatch):
    rows_table = synthetic_rows(4000)
    (tmp_path / "clicks").mkdir()
    for i in range(2):  # one file per rank: each rank sees its own countries
        pq.write_table(rows_table.slice(i * 2000, 2000), tmp_path / "clicks" / f"part-{i}.parquet")
    cfg = table_config(str(tmp_path / "clicks"), ckpt_uri)
    for table in cfg["embeddings"]["tables"]:
        table["sharding"] = "row_wise"
    cfg["training"]["steps"] = 30
    code, _, stderr = run_trainer(write_config(tmp_path / "c.yaml", cfg), nproc=2)
    assert code == 0, stderr

    step = latest_step(ckpt_uri)
    country = export.read_table(step, "country")
    assert country.meaning == "hashed_ids"
    assert sorted(country.keys) == sorted(set(rows_table.column("country").to_pylist()))
    assert country.vectors.shape == (64, 8)  # both ranks' halves of the rows
    table = pq.read_table(io.BytesIO(exported_bytes(country, "parquet")))
    assert table.column_names == ["feature", "id", "row", "vector"]
    for key, row, vector in zip(table.column("id").to_pylist(), table.column("row").to_pylist(),
                                table.column("vector").to_pylist(), strict=True):
        assert np.array_equal(np.asarray(vector, np.float32), country.vectors.read()[row]), key
        assert export.neighbours(country, key, k=1)  # a raw id is found by its text
    items = export.read_table(step, "item")
    assert items.meaning == "ids" and items.vectors.shape == (1000, 8)
    item_table = pq.read_table(io.BytesIO(exported_bytes(items, "parquet")))
    assert item_table.column("id").type == pa.int64() and item_table.num_rows == 1000
    for table in ("country", "item"):
        assert_exported_as_whole(step, table, monkeypatch)


def exported_bytes(rows: export.TableRows, fmt: str) -> bytes:
    out = io.BytesIO()
    export.write(rows, fmt, out)
    return out.getvalue()


def test_a_resumed_job_exports_the_same_vectors_as_an_uninterrupted_one(tmp_path):
    pq.write_table(synthetic_rows(3000), tmp_path / "rows.parquet")

    def train(name: str, steps: int) -> str:
        uri = f"file://{tmp_path}/{name}"
        cfg = table_config(str(tmp_path / "rows.parquet"), uri)
        cfg["training"]["steps"] = steps
        cfg["checkpoint"]["every_steps"] = 0
        code, _, stderr = run_trainer(write_config(tmp_path / f"{name}-{steps}.yaml", cfg))
        assert code == 0, stderr
        return latest_step(uri)

    whole = train("whole", 40)
    train("resumed", 20)
    resumed = train("resumed", 40)
    for table in ("country", "tags", "item"):
        assert exported_bytes(export.read_table(whole, table), "parquet") == exported_bytes(
            export.read_table(resumed, table), "parquet"), table


def test_unknown_table_and_word_are_clear_errors(tmp_path, ckpt_uri):
    pq.write_table(synthetic_rows(500), tmp_path / "rows.parquet")
    cfg = table_config(str(tmp_path / "rows.parquet"), ckpt_uri)
    cfg["training"]["steps"] = 2
    code, _, stderr = run_trainer(write_config(tmp_path / "c.yaml", cfg))
    assert code == 0, stderr
    step = latest_step(ckpt_uri)
    with pytest.raises(export.ExportError, match=r"table: not in this checkpoint \(its tables: \['country'"):
        export.read_table(step, "nope")
    with pytest.raises(export.ExportError, match=r"word: an id of table .item. is in \[0, 1000\)"):
        export.neighbours(export.read_table(step, "item"), "5000")
    with pytest.raises(export.ExportError, match="format 'csv'"):
        export.write(export.read_table(step, "item"), "csv", io.BytesIO())


# ------------------------------------------------------------------------------------ streamed, bounded memory
def whole_table(step_uri: str, table: str) -> np.ndarray:
    """The table as the export read it before it streamed: loaded whole, each delta of its chain applied on it.
    What the streamed export must give, row for row."""
    chain = export.chain_uris(step_uri)
    key = saved_table.weight_key(table)
    state = {key: torch.empty(dcp_read.RowRanges(chain[0]).shape(key))}
    dcp_read.quiet_load(state, storage_reader=dcp_read.SafeReader(chain[0]), planner=dcp_read.SafeLoadPlanner())
    for uri in chain[1:]:
        saved = dcp_read.SafeReader(uri).read_metadata().state_dict_metadata
        entries = {k: v for k, v in delta.entries_of(saved).items()
                   if k.startswith(f"{table}.") and k.endswith((".rows", ".weight"))}
        if entries:
            dcp_read.quiet_load({delta.DELTA_KEY: entries}, storage_reader=dcp_read.SafeReader(uri),
                                planner=dcp_read.SafeLoadPlanner())
            delta.apply({f"{table}.weight": state[key]}, entries)
    return state[key].numpy()


def assert_exported_as_whole(step_uri: str, table: str, monkeypatch) -> None:
    """The streamed export, cut into many small ranges, writes what the whole table gives: numpy byte for byte
    (`np.save` of the matrix), parquet the same table; neighbours the same as a search of the whole matrix."""
    monkeypatch.setattr(saved_table, "CHUNK_BYTES", 200)  # a few rows a range: many ranges, even here
    with export.read_table(step_uri, table) as rows:
        assert rows.vectors.chunk_rows < rows.vectors.num_rows / 4
        whole = whole_table(step_uri, table)[: rows.vectors.num_rows]
        expected = io.BytesIO()
        np.save(expected, whole)
        assert exported_bytes(rows, "numpy") == expected.getvalue()

        entry_rows = np.asarray(rows.rows, dtype=np.int64)
        vectors = pa.FixedSizeListArray.from_arrays(pa.array(whole[entry_rows].reshape(-1)), whole.shape[1])
        keys = {"words": lambda: {"token": pa.array(list(rows.keys), pa.string())},
                "ids": lambda: {"id": pa.array(entry_rows)},
                "hashed_ids": lambda: {"feature": pa.array(rows.features, pa.string()),
                                       "id": pa.array(list(rows.keys), pa.string()), "row": pa.array(entry_rows)},
                }[rows.meaning]()
        streamed = pq.read_table(io.BytesIO(exported_bytes(rows, "parquet")))
        assert streamed.equals(pa.table({**keys, "vector": vectors}))

        query = rows.keys[len(rows.keys) // 2]
        target = entry_rows[len(rows.keys) // 2]
        unit = torch.nn.functional.normalize(torch.from_numpy(whole[:, :-1] if rows.bias_column else whole), dim=1)
        scores = (unit @ unit[target])[torch.from_numpy(entry_rows)]
        scores[torch.from_numpy(entry_rows == target)] = -float("inf")
        top = torch.topk(scores, 5)
        near = export.neighbours(rows, query, k=5)
        assert [key for key, _ in near] == [rows.keys[i] for i in top.indices.tolist()]
        assert [s for _, s in near] == pytest.approx(top.values.tolist(), rel=1e-5)


def _save(folder: pathlib.Path, state: dict, marker: runtime.CheckpointMarker, num_rows: int, dim: int) -> str:
    """A checkpoint folder as the trainer writes one (`step_writer`: tensors in chunks of ITEM_BYTES), of table
    `big` (plain ids)."""
    with warnings.catch_warnings():  # one process, no process group: intended
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state, storage_writer=step_writer.StepWriter(str(folder)), planner=step_writer.RowRangePlanner())
    manifest = {"format": row_index.FORMAT_VERSION, "model": "dlrm", "tables": [
        {"name": "big", "num_embeddings": num_rows, "embedding_dim": dim, "features": ["f"], "rows": "ids"}]}
    (folder / row_index.TABLES_FILE).write_text(json.dumps(manifest))
    (folder / runtime.CHECKPOINT_MARKER).write_bytes(marker.to_bytes())
    return f"file://{folder}"


def saved_chain(root: pathlib.Path, num_rows: int, dim: int = 32) -> tuple[str, str]:
    """(a full checkpoint of a table of `num_rows` x `dim`, a delta on it that changed a quarter of the rows)."""
    gen = torch.Generator().manual_seed(0)
    full = _save(root / runtime.step_dir(1), {"embeddings": {"big.weight": torch.rand(num_rows, dim, generator=gen)}},
                 runtime.CheckpointMarker(1), num_rows, dim)
    changed = torch.randperm(num_rows, generator=gen)[: num_rows // 4]
    changes = {"big.rank0.rows": changed, "big.rank0.weight": torch.rand(changed.numel(), dim, generator=gen)}
    chained = _save(root / runtime.step_dir(2), {delta.DELTA_KEY: changes},
                    runtime.CheckpointMarker(2, runtime.CHECKPOINT_DELTA, parent=1), num_rows, dim)
    return full, chained


# A launcher that imports nothing large, so that the worker's peak RSS is its own (a child's maxrss counts what
# it inherited before exec, and the test process holds torch and the table): argv[1] gets "<exit code> <bytes>".
_PEAK_RSS = ("import os, subprocess, sys; p = subprocess.Popen(sys.argv[2:]); _, status, usage = os.wait4(p.pid, 0);"
             "p.returncode = os.waitstatus_to_exitcode(status);"
             "open(sys.argv[1], 'w').write(f'{p.returncode} {usage.ru_maxrss * 1024}')")


def export_peak_rss(step_uri: str, fmt: str, tmp_path: pathlib.Path) -> tuple[int, int]:
    """(bytes exported, peak RSS in bytes) of `python -m kembed_trainer.export_worker` writing `fmt`."""
    out_path, peak_path = tmp_path / "exported", tmp_path / "peak"
    with open(out_path, "wb") as out:
        subprocess.run([sys.executable, "-c", _PEAK_RSS, str(peak_path), sys.executable, "-m",
                        "kembed_trainer.export_worker", step_uri, "--format", fmt], stdout=out, check=True,
                       env={**os.environ, "TMPDIR": str(tmp_path)}, timeout=600)
    code, peak = map(int, peak_path.read_text().split())
    with open(out_path, "rb") as exported:
        head = json.loads(exported.readline())
    assert code == 0 and "num_bytes" in head, head
    return head["num_bytes"], peak


def test_an_export_streams_a_table_larger_than_its_memory_bound(tmp_path):
    """A table of 366 MiB (45 ranges) exports with a peak RSS within 128 MiB of the same export of a table of
    1000 rows: a range at a time, from the full checkpoint (parquet) and through a delta chain (numpy, by the
    scratch copy). Reading the table whole, as the export once did, takes its 366 MiB over that."""
    bound = 128 * 2**20
    num_rows, dim = 3_000_000, 32
    (tmp_path / "small").mkdir()
    (tmp_path / "big").mkdir()
    small, big = saved_chain(tmp_path / "small", 1000), saved_chain(tmp_path / "big", num_rows, dim)
    for which, fmt in ((0, "parquet"), (1, "numpy")):
        _, baseline = export_peak_rss(small[which], fmt, tmp_path)
        num_bytes, peak = export_peak_rss(big[which], fmt, tmp_path)
        assert num_bytes > num_rows * dim * 4
        assert peak - baseline < bound, (fmt, baseline >> 20, peak >> 20)
