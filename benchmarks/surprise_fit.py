"""Fit Surprise's SVD and SVD++ (their defaults) on a ratings split; run by benchmarks/ratings.py in Surprise's own
environment (benchmarks/surprise-requirements.txt), so it imports nothing of kembed's and no pyarrow.

    <surprise venv>/bin/python benchmarks/surprise_fit.py train.tsv test.tsv

Each file holds `user<TAB>item<TAB>rating` lines. Prints one JSON object: the versions, and per algorithm its fit
seconds (training only, as Surprise's own benchmarks time it) and its RMSE on the test lines.
"""

from __future__ import annotations

import json
import sys
import time

import numpy
import surprise
from surprise import SVD, Dataset, Reader, SVDpp, accuracy


def main() -> None:
    train_path, test_path = sys.argv[1:3]
    reader = Reader(line_format="user item rating", sep="\t", rating_scale=(1, 5))
    trainset = Dataset.load_from_file(train_path, reader=reader).build_full_trainset()
    with open(test_path, encoding="utf-8") as f:
        testset = [(u, i, float(r)) for u, i, r in (line.split("\t") for line in f if line.strip())]
    out = {"surprise": surprise.__version__, "numpy": numpy.__version__, "algorithms": {}}
    for name, algo in (("SVD", SVD(random_state=0)), ("SVD++", SVDpp(random_state=0))):
        started = time.perf_counter()
        algo.fit(trainset)
        seconds = time.perf_counter() - started
        rmse = accuracy.rmse(algo.test(testset), verbose=False)
        out["algorithms"][name] = {"fit_seconds": seconds, "rmse": rmse}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
