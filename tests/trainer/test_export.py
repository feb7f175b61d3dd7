"""Embeddings out of a checkpoint: the formats other tools load, gathered whole from any world size."""

from __future__ import annotations

import io
import pathlib

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from gensim.models import KeyedVectors

from kembed_trainer import export
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


def test_word2vec_vectors_load_in_gensim_and_match_parquet_and_numpy(tmp_path, ckpt_uri):
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


def test_a_row_sharded_hashed_table_is_gathered_whole_with_its_raw_ids(tmp_path, ckpt_uri):
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
    table = pq.read_table(io.BytesIO(_bytes(country, "parquet")))
    assert table.column_names == ["feature", "id", "row", "vector"]
    for key, row, vector in zip(table.column("id").to_pylist(), table.column("row").to_pylist(),
                                table.column("vector").to_pylist(), strict=True):
        assert np.array_equal(np.asarray(vector, np.float32), country.vectors[row]), key
        assert export.neighbours(country, key, k=1)  # a raw id is found by its text
    items = export.read_table(step, "item")
    assert items.meaning == "ids" and items.vectors.shape == (1000, 8)
    item_table = pq.read_table(io.BytesIO(_bytes(items, "parquet")))
    assert item_table.column("id").type == pa.int64() and item_table.num_rows == 1000


def _bytes(rows: export.TableRows, fmt: str) -> bytes:
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
        assert _bytes(export.read_table(whole, table), "parquet") == _bytes(export.read_table(resumed, table),
                                                                             "parquet"), table


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
