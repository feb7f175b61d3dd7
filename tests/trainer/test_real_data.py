"""The ratings and clicks examples' settings on real data sets of their kind, against well-known baselines run on
the same split in the same test (data from installed packages: tests/real_data.py). word2vec against gensim on
gensim's corpus is benchmarks/word2vec.py's."""

from __future__ import annotations

import pathlib

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import roc_auc_score
from sklearn.preprocessing import OneHotEncoder

from tests import real_data
from tests.trainer.conftest import EXAMPLES, run_trainer, write_config

pytestmark = pytest.mark.slow


def example(name: str) -> dict:
    return yaml.safe_load((EXAMPLES / name).read_text())


def bias_baseline_rmse(train: pa.Table, test: pa.Table, *, reg_user: float = 15.0, reg_item: float = 10.0) -> float:
    """Surprise's BaselineOnly (Koren 2010): global mean plus regularised user and item biases, by 10 ALS sweeps."""
    users, items = train.column("user_id").to_numpy(), train.column("movie_id").to_numpy()
    ratings = train.column("rating").to_numpy().astype(np.float64)
    mu = ratings.mean()
    bu, bi = np.zeros(users.max() + 2), np.zeros(items.max() + 2)
    for _ in range(10):
        bi = np.bincount(items, ratings - mu - bu[users], bi.size) / (reg_item + np.bincount(items, None, bi.size))
        bu = np.bincount(users, ratings - mu - bi[items], bu.size) / (reg_user + np.bincount(users, None, bu.size))
    tu = np.minimum(test.column("user_id").to_numpy(), bu.size - 1)
    ti = np.minimum(test.column("movie_id").to_numpy(), bi.size - 1)
    predicted = np.clip(mu + bu[tu] + bi[ti], 1, 5)
    return float(np.sqrt(np.mean((predicted - test.column("rating").to_numpy()) ** 2)))


def test_matrix_factorisation_beats_the_bias_baseline_on_movielens(tmp_path: pathlib.Path):
    train, test = real_data.split(real_data.movielens_100k())
    pq.write_table(train, tmp_path / "train.parquet")
    pq.write_table(test, tmp_path / "eval.parquet")
    cfg = example("two-tower-ratings.yaml")
    cfg["data"].update(uri=str(tmp_path / "train.parquet"), eval_uri=str(tmp_path / "eval.parquet"))
    cfg["checkpoint"]["uri"] = f"file://{tmp_path}/ckpt"
    cfg["training"]["threads"] = 1
    code, recs, stderr = run_trainer(write_config(tmp_path / "c.yaml", cfg), timeout=600)
    assert code == 0, stderr
    kembed_rmse = recs[-1]["eval"]["rmse"]
    baseline = bias_baseline_rmse(train, test)
    # Well-known figures on an 80/20 split of MovieLens-100k: biases alone ~0.94-0.95, SVD ~0.93-0.94.
    assert 0.92 < baseline < 0.97
    assert kembed_rmse < baseline - 0.005, (kembed_rmse, baseline)
    assert recs[0]["dataset"] == {"train_rows": train.num_rows, "eval_rows": test.num_rows}


ADULT_CATEGORICAL = ["workclass", "education", "marital-status", "occupation", "relationship", "race", "gender",
                     "native-country"]
ADULT_NUMERIC = ["age", "fnlwgt", "educational-num", "capital-gain", "capital-loss", "hours-per-week"]


def standardised(table: pa.Table, reference: pa.Table) -> pa.Table:
    """Numeric columns as log1p, then standardised by the training rows' mean and deviation (for both models)."""
    for name in ADULT_NUMERIC:
        ref = np.log1p(reference.column(name).to_numpy().astype(np.float64))
        values = np.log1p(table.column(name).to_numpy().astype(np.float64))
        table = table.set_column(table.column_names.index(name), name,
                                 pa.array(((values - ref.mean()) / ref.std()).astype(np.float32)))
    return table


def test_dlrm_matches_logistic_regression_on_the_adult_census(tmp_path: pathlib.Path):
    raw_train, raw_test = real_data.split(real_data.adult())
    train, test = standardised(raw_train, raw_train), standardised(raw_test, raw_train)
    pq.write_table(train, tmp_path / "train.parquet")
    pq.write_table(test, tmp_path / "eval.parquet")

    def design(table: pa.Table, encoder: OneHotEncoder) -> np.ndarray:
        categorical = np.stack([table.column(c).to_numpy(zero_copy_only=False) for c in ADULT_CATEGORICAL], 1)
        numeric = np.stack([table.column(c).to_numpy() for c in ADULT_NUMERIC], 1)
        return np.hstack([encoder.transform(categorical).toarray(), numeric])

    encoder = OneHotEncoder(handle_unknown="ignore").fit(
        np.stack([train.column(c).to_numpy(zero_copy_only=False) for c in ADULT_CATEGORICAL], 1))
    logistic = LogisticRegression(max_iter=2000).fit(design(train, encoder), train.column("label").to_numpy())
    baseline_auc = roc_auc_score(test.column("label").to_numpy(), logistic.predict_proba(design(test, encoder))[:, 1])

    cfg = example("dlrm-clicks.yaml")
    dim = cfg["embeddings"]["tables"][0]["embedding_dim"]
    cfg["embeddings"]["tables"] = [
        {"name": c.replace("-", "_"), "num_embeddings": 1000, "embedding_dim": dim, "features": [c.replace("-", "_")],
         "hash_ids": True} for c in ADULT_CATEGORICAL]
    cfg["data"] = {"kind": "table", "uri": str(tmp_path / "train.parquet"), "eval_uri": str(tmp_path / "eval.parquet"),
                   "label": "label", "dense": ADULT_NUMERIC, "sparse": {c.replace("-", "_"): c for c in ADULT_CATEGORICAL}}
    cfg["training"].update(batch_size=256, eval_every=300, threads=1)
    cfg["checkpoint"] = {"uri": f"file://{tmp_path}/ckpt"}
    code, recs, stderr = run_trainer(write_config(tmp_path / "c.yaml", cfg), timeout=600)
    assert code == 0, stderr
    kembed_auc = recs[-1]["eval"]["auc"]
    assert 0.88 < baseline_auc < 0.93  # the Adult census's well-known range for a linear model
    assert kembed_auc > baseline_auc - 0.01, (kembed_auc, baseline_auc)

