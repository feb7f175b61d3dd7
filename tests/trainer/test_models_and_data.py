"""Every model kind learns from every data kind a user can point it at; ids are hashed and admitted."""

from __future__ import annotations

import pathlib
import re

import numpy as np
import pyarrow as pa
import pyarrow.csv as pa_csv
import pyarrow.parquet as pq
import pytest
import torch

from kembed_contract import runtime
from kembed_contract import trainer_config as config
from kembed_trainer import embedding
from kembed_trainer.data.batch import Batch
from kembed_trainer.data.synthetic import SyntheticData
from tests.trainer.conftest import run_trainer, run_trainer_to_its_reason, tiny_config, write_config

TWO_TOWER_TABLES = [
    {"name": "users", "num_embeddings": 2000, "embedding_dim": 9, "features": ["user"]},
    {"name": "items", "num_embeddings": 500, "embedding_dim": 9, "features": ["item"]},
]


def test_matrix_factorisation_predicts_ratings_better_than_their_mean(tmp_path, ckpt_uri):
    cfg = tiny_config(
        model={"kind": "two_tower", "user_features": ["user"], "item_features": ["item"]},
        embeddings={"tables": TWO_TOWER_TABLES},
        data={"kind": "synthetic", "num_dense": 0, "max_hotness": 1, "eval_samples": 4096},
        optimizer={"sparse": {"name": "adam", "lr": 0.02}, "dense": {"name": "adam", "lr": 0.05}},
        training={"steps": 150, "log_every": 50},
        checkpoint={"uri": ckpt_uri},
    )
    code, recs, stderr = run_trainer(write_config(tmp_path / "c.yaml", cfg))
    assert code == 0, stderr
    labels = torch.cat(
        [
            b.labels
            for b in SyntheticData(
                config.TrainerConfig.model_validate(cfg).data,
                tables=config.EmbeddingsConfig.model_validate(cfg["embeddings"]).tables,
                seed=0,
                batch_size=256,
                rank=0,
                world_size=1,
                ratings=True,
            ).eval_batches()
        ]
    )
    final = recs[-1]["eval"]
    assert set(final) == {"rmse", "mae", "loss"}
    assert final["rmse"] < 0.8 * labels.std().item()  # a constant prediction scores the std


def synthetic_rows(n: int, seed: int = 0) -> pa.Table:
    """Click logs with a string-valued, a multi-hot and an integer feature, and a label driven by all three."""
    rng = np.random.default_rng(seed)
    country = rng.choice(["de", "fr", "jp", "br", "us", "中国"], n)
    tags = [list(rng.choice(50, rng.integers(1, 4), replace=False)) for _ in range(n)]
    item = rng.zipf(1.3, n) % 1000
    price = rng.normal(size=n)
    logit = (
        np.array([{"de": 1, "fr": -1, "jp": 0.5, "br": -0.5, "us": 0, "中国": 1.5}[c] for c in country])
        + np.array([sum(1 if t < 25 else -1 for t in ts) for ts in tags]) * 0.7
        + np.where(item % 2 == 0, 1.0, -1.0)
        + price
    )
    label = (rng.random(n) < 1 / (1 + np.exp(-logit))).astype(np.int64)
    return pa.table({"country": country, "tags": tags, "item": item, "price": price, "label": label})


TABLE_TABLES = [
    {"name": "country", "num_embeddings": 64, "embedding_dim": 8, "features": ["country"], "hash_ids": True},
    {"name": "tags", "num_embeddings": 50, "embedding_dim": 8, "features": ["tags"]},
    {"name": "item", "num_embeddings": 1000, "embedding_dim": 8, "features": ["item"]},
]


def table_config(uri: str, ckpt_uri: str, **data) -> dict:
    return tiny_config(
        model={"kind": "dlrm", "bottom_mlp": [8], "top_mlp": [16]},
        embeddings={"tables": TABLE_TABLES},
        data={
            "kind": "table",
            "uri": uri,
            "label": "label",
            "dense": ["price"],
            "sparse": {"country": "country", "tags": "tags", "item": "item"},
            **data,
        },
        training={"steps": 80, "log_every": 20},
        checkpoint={"uri": ckpt_uri},
    )


@pytest.mark.parametrize("fmt", [pytest.param("parquet", id="parquet"), pytest.param("csv", id="csv")])
def test_dlrm_learns_from_files(tmp_path, ckpt_uri, fmt):
    rows = synthetic_rows(12000)
    if fmt == "parquet":
        (tmp_path / "clicks").mkdir()
        for i in range(3):  # a folder of files: each rank reads its own
            pq.write_table(rows.slice(i * 4000, 4000), tmp_path / "clicks" / f"part-{i}.parquet")
        uri = str(tmp_path / "clicks")
    else:
        tags = pa.array(["|".join(map(str, t)) for t in rows.column("tags").to_pylist()])
        pa_csv.write_csv(rows.set_column(1, "tags", tags), tmp_path / "rows.csv")
        uri = f"file://{tmp_path}/rows.csv"
    code, recs, stderr = run_trainer(write_config(tmp_path / "c.yaml", table_config(uri, ckpt_uri)), nproc=2)
    assert code == 0, stderr
    assert recs[-1]["eval"]["auc"] > 0.75


def test_files_on_s3_with_a_separate_eval_file(tmp_path, ckpt_uri, s3_server):
    import s3fs

    bucket = s3_server.create_bucket("kembed-data")
    fs = s3fs.S3FileSystem()
    with fs.open(f"{bucket}/clicks/train.parquet", "wb") as f:
        pq.write_table(synthetic_rows(8000), f)
    with fs.open(f"{bucket}/clicks/eval.parquet", "wb") as f:
        pq.write_table(synthetic_rows(2000, seed=1), f)
    cfg = table_config(f"{bucket}/clicks/train.parquet", ckpt_uri, eval_uri=f"{bucket}/clicks/eval.parquet")
    code, recs, stderr = run_trainer(write_config(tmp_path / "c.yaml", cfg), **s3_server.env)
    assert code == 0, stderr
    assert recs[-1]["eval"]["auc"] > 0.75
    # With an eval file, eval_fraction (0.1 by default) holds out none of the training rows.
    assert recs[0]["dataset"] == {"train_rows": 8000, "eval_rows": 2000}


@pytest.mark.parametrize("nproc", [pytest.param(1, id="1-rank"), pytest.param(2, id="2-ranks")])
def test_epochs_become_steps_over_every_training_row(tmp_path, ckpt_uri, nproc):
    pq.write_table(synthetic_rows(5000), tmp_path / "rows.parquet")
    cfg = table_config(str(tmp_path / "rows.parquet"), ckpt_uri, eval_fraction=0.2)
    cfg["training"] = {**cfg["training"], "steps": None, "epochs": 3, "batch_size": 100}
    code, recs, stderr = run_trainer(write_config(tmp_path / "c.yaml", cfg), nproc=nproc)
    assert code == 0, stderr
    started, done = recs[0], recs[-1]
    train_rows, eval_rows = started["dataset"]["train_rows"], started["dataset"]["eval_rows"]
    assert train_rows + eval_rows == 5000 and 800 < eval_rows < 1200  # the held-out rows are not trained on
    # An epoch: each rank passes over its own rows once, in whole batches (the larger shard decides).
    per_epoch, rest = divmod(started["total_steps"], 3)
    assert rest == 0
    if nproc == 1:
        assert per_epoch == train_rows // 100
    else:
        assert abs(per_epoch - train_rows / nproc / 100) <= 1
    assert done["step"] == started["total_steps"]


@pytest.mark.parametrize("nproc", [pytest.param(1, id="1-rank"), pytest.param(2, id="2-ranks-launcher")])
def test_integer_ids_out_of_range_are_bad_input_with_the_reason_in_the_termination_log(tmp_path, ckpt_uri, nproc):
    pq.write_table(synthetic_rows(1000), tmp_path / "rows.parquet")
    cfg = table_config(str(tmp_path / "rows.parquet"), ckpt_uri)
    cfg["embeddings"]["tables"][2]["num_embeddings"] = 100  # item ids go up to 999
    code, reason, stderr = run_trainer_to_its_reason(write_config(tmp_path / "c.yaml", cfg), nproc=nproc)
    assert code == runtime.EXIT_BAD_CONFIG, stderr  # under the launcher too: the rank's code, not torchrun's 1
    assert re.fullmatch(r"data error: feature 'item': ids \d+\.\.\d+ outside \[0, 100\); set hash_ids on its table.*", reason)
    assert "set hash_ids on its table" in reason and "\n" not in reason.strip()


def write_corpus(path: pathlib.Path) -> None:
    """Sentences from two disjoint topics: words co-occur only within a topic."""
    rng = np.random.default_rng(0)
    topics = [[f"w{i}" for i in range(40)], [f"w{i}" for i in range(40, 80)]]
    chinese = list("我们你们他们今天明天学习工作朋友家人")
    lines = []
    for i in range(3000):
        words = topics[i % 2] if i % 3 else [chinese[j] for j in range(len(chinese)) if j % 2 == i % 2]
        n = rng.integers(4, 12)
        sep = " " if i % 3 else ""
        lines.append(sep.join(rng.choice(words, n)))
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


@pytest.mark.parametrize(
    "tokenizer", [pytest.param("whitespace", id="whitespace"), pytest.param("chars", id="chinese-chars")]
)
def test_word2vec_tells_true_context_from_noise(tmp_path, ckpt_uri, tokenizer):
    write_corpus(tmp_path / "corpus.txt")
    cfg = tiny_config(
        model={"kind": "word2vec"},
        embeddings={
            "tables": [
                {"name": "words_in", "num_embeddings": 200, "embedding_dim": 16, "features": ["center"]},
                {"name": "words_out", "num_embeddings": 200, "embedding_dim": 16, "features": ["context"]},
            ]
        },
        data={
            "kind": "text",
            "uri": str(tmp_path / "corpus.txt"),
            "tokenizer": tokenizer,
            "min_count": 1,  # every token: the tables' size caps the vocabulary
            "window": 3,
            "negatives": 3,
        },
        training={"steps": 60, "batch_size": 2000, "log_every": 20},
        checkpoint={"uri": ckpt_uri},
    )
    del cfg["optimizer"]  # word2vec's own defaults: SGD from 0.025 down to 0.0001, as gensim
    code, recs, stderr = run_trainer(write_config(tmp_path / "c.yaml", cfg))
    assert code == 0, stderr
    assert recs[-1]["eval"]["auc"] > 0.7
    text = (tmp_path / "corpus.txt").read_text(encoding="utf-8")
    # Characters: every distinct one; words: more distinct tokens than rows, so the tables' size caps it.
    assert recs[0]["dataset"]["vocab_size"] == (len(set(text) - set(" \n")) if tokenizer == "chars" else 200)


def test_word2vec_epochs_read_every_training_sentence_once(tmp_path, ckpt_uri):
    write_corpus(tmp_path / "corpus.txt")
    cfg = tiny_config(
        model={"kind": "word2vec"},
        embeddings={"tables": [
            {"name": "words_in", "num_embeddings": 200, "embedding_dim": 8, "features": ["center"]},
            {"name": "words_out", "num_embeddings": 200, "embedding_dim": 8, "features": ["context"]},
        ]},
        data={"kind": "text", "uri": str(tmp_path / "corpus.txt"), "window": 2, "negatives": 3, "subsample": 0},
        training={"steps": None, "epochs": 2, "batch_size": 400, "log_every": 100},
    )
    del cfg["optimizer"]  # word2vec's own (SGD, as gensim)
    code, recs, stderr = run_trainer(write_config(tmp_path / "c.yaml", cfg))
    assert code == 0, stderr
    dataset = recs[0]["dataset"]
    # batch_size counts corpus words: a step is that many words' worth of whole sentences (at the corpus's
    # sentences per word), an epoch every training sentence once, so about as many steps as words / batch_size.
    sentences, tokens = dataset["train_sentences"], dataset["train_tokens"]
    per_epoch = sentences // round(400 * sentences / tokens)
    assert recs[0]["total_steps"] == 2 * per_epoch
    assert abs(per_epoch - tokens / 400) <= 1
    assert recs[-1]["step"] == recs[0]["total_steps"]
    assert dataset["train_sentences"] + dataset["eval_sentences"] <= 3000


def one_feature_collection(**table) -> embedding.EmbeddingCollection:
    emb_cfg = config.EmbeddingsConfig(
        tables=[config.TableConfig(name="t", embedding_dim=4, features=["f"], **table)]
    )
    return embedding.EmbeddingCollection(
        emb_cfg,
        config.SparseOptimizerConfig(name="sgd", lr=1.0),
        device=torch.device("cpu"),
        seed=0,
        world_size=1,
    )


def batch_of(ids: list[int]) -> Batch:
    n = len(ids)
    return Batch(torch.zeros(n, 0), torch.tensor(ids), torch.ones(n, dtype=torch.int64), torch.zeros(n))


def test_hashed_ids_accept_any_int64_and_spread_over_the_table():
    emb = one_feature_collection(num_embeddings=1000, hash_ids=True)
    ids = [2**62 + i for i in range(200)] + [-5]
    out = emb(batch_of(ids))[0]
    assert out.shape == (201, 1, 4)
    assert emb.last_unique_rows > 150  # neighbouring raw ids do not pile into a few buckets


def test_rare_ids_share_the_fallback_row_until_admitted():
    emb = one_feature_collection(num_embeddings=100, admit_after=2)
    fallback = emb.groups[0].weight[99].clone()

    def lookup_and_step(ids):
        out = emb(batch_of(ids))[0][:, 0]
        out.sum().backward()
        emb.step(0)
        return out

    first = lookup_and_step([7, 8])
    assert torch.equal(first[0], fallback) and torch.equal(first[1], fallback)  # unseen: fallback row
    lookup_and_step([7])
    own = emb(batch_of([7, 8]))[0][:, 0]
    assert torch.equal(own[0], emb.groups[0].weight[7])  # seen in 2 batches: its own row
    assert torch.equal(own[1], emb.groups[0].weight[99])  # seen once: still the fallback
    emb.discard_lookup()
