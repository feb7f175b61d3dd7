"""Dynamic tables against hashed ones of the same memory, on data with more distinct ids than the hashed rows.

    .venv/bin/python benchmarks/dynamic_tables.py                  # all three parts, tables at the end
    .venv/bin/python benchmarks/dynamic_tables.py --only admission # or movielens, zipf

- admission: the two ways of counting sightings before admission (exact counters, the counting Bloom filter),
  and a probabilistic admission (each sighting admits with probability 1 / (admit_after + 1)), on a Zipf(1.1)
  stream of ids: ids admitted too early (seen fewer than admit_after + 1 times), ids admitted late or never
  (seen that often, but without a row at that sighting), and the memory each keeps for waiting ids.
- movielens: MovieLens-100k (943 users, 1,682 movies; the seeded 80/20 split of tests/real_data.py), the ratings
  defaults (docs/trainer.md), with users and movies hashed into fewer rows than they are (`--hashed-share`),
  against dynamic tables given the same memory, index included (the capacity whose `memory_bytes` fits, as
  the API counts it: kembed_contract.kinds), and the plain tables with a row per id for reference. RMSE.
- zipf: the synthetic CTR data (a planted logistic model over Zipf ids: the ground truth is known, and the
  Bayes AUC is below 1 by the label noise) with many more ids than rows; DLRM, AUC.

Each model trains in this process (one rank, `--threads` torch threads), all in one run, so the figures compare.
"""

from __future__ import annotations

import argparse
import os
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
from kembed_contract import kinds  # noqa: E402 - after the path insert
from kembed_contract import trainer_config as config  # noqa: E402
from tests import real_data  # noqa: E402
from tests.trainer.test_real_data import movielens_config  # noqa: E402


# ----------------------------------------------------------------------------------------------- admission
def admission(num_steps: int, batch: int, num_ids: int, admit_after: int, bloom_bytes: int) -> list[tuple]:
    from tests.trainer.test_dynamic import make_index

    rng = np.random.default_rng(0)
    pmf = np.arange(1, num_ids + 1, dtype=np.float64) ** -1.1
    steps = [np.unique(rng.choice(num_ids, batch, p=pmf / pmf.sum())) for _ in range(num_steps)]
    capacity = num_ids  # room for all: admission alone decides
    ways = {
        "counter (exact)": make_index(capacity, admit_after),
        f"bloom ({bloom_bytes >> 10} KiB)": make_index(capacity, admit_after, admission="bloom",
                                                        bloom_counters=bloom_bytes),
        "probabilistic": None,
    }
    rows = []
    for name, index in ways.items():
        seen = np.zeros(num_ids, np.int64)  # true sightings before this step
        admitted_at = np.full(num_ids, -1, np.int64)  # the sighting (1-based) that got the id its row
        draw = np.random.default_rng(1)
        started = time.perf_counter()
        for step, ids in enumerate(steps):
            if index is None:
                fresh = admitted_at[ids] < 0
                lucky = fresh & (draw.random(ids.shape[0]) < 1 / (admit_after + 1))
                admitted_at[ids[lucky]] = seen[ids[lucky]] + 1
            else:
                got, _ = index.resolve(ids, step)
                fresh = (got >= 0) & (admitted_at[ids] < 0)
                admitted_at[ids[fresh]] = seen[ids[fresh]] + 1
            seen[ids] += 1
        seconds = time.perf_counter() - started
        ever = admitted_at > 0
        early = int((ever & (admitted_at < admit_after + 1)).sum())
        due = seen >= admit_after + 1
        late = int((due & ((admitted_at < 0) | (admitted_at > admit_after + 1))).sum())
        # What admission adds to the index: its counters, and the map's room for waiting ids.
        waiting = 0 if index is None else index.nbytes - make_index(capacity).nbytes
        rows.append((name, int(ever.sum()), early, late, int(due.sum()), waiting, seconds))
    return rows


# ----------------------------------------------------------------------------------------------- training
def run(cfg: dict, threads: int) -> tuple[dict, float]:
    records, seconds = train_in_process(cfg, threads)
    evals = [r for r in records if r["event"] == "eval"]
    return evals[-1], seconds


def same_memory_capacity(cfg: dict, hashed: list[dict], name: str, dynamic: dict) -> int:
    """The largest capacity whose dynamic table `name` (`dynamic` settings; rows and index) takes no more memory
    than the hashed one in `hashed`, as the kinds count it (the other tables as they are)."""
    def memory(tables: list[dict]) -> float:
        whole = config.TrainerConfig.model_validate({**cfg, "embeddings": {"tables": tables}})
        t = next(t for t in whole.embeddings.tables if t.name == name)
        return kinds.table_kind(t).memory_bytes(t, whole, world_size=1)

    budget = memory(hashed)
    table = next(t for t in hashed if t["name"] == name)
    base = {k: v for k, v in table.items() if k not in ("num_embeddings", "hash_ids")}
    lo, hi = 1, table["num_embeddings"]
    while lo < hi:
        mid = (lo + hi + 1) // 2
        tables = [{**base, "dynamic": {"capacity": mid, **dynamic}} if t["name"] == name else t for t in hashed]
        if memory(tables) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return lo


def variants(cfg: dict, rows: dict[str, int], dynamic: dict) -> dict[str, list[dict]]:
    """The tables of each variant: a row per id, hashed into `rows`, dynamic in the hashed ones' memory."""
    plain = cfg["embeddings"]["tables"]
    hashed = [{**t, "num_embeddings": rows[t["name"]], "hash_ids": True} for t in plain]
    dyn = [{k: v for k, v in t.items() if k not in ("num_embeddings", "hash_ids")}
           | {"dynamic": {"capacity": same_memory_capacity(cfg, hashed, t["name"], dynamic), **dynamic}}
           for t in hashed]
    return {"a row per id (reference)": plain, "hashed": hashed, "dynamic, same memory": dyn}


def describe(tables: list[dict]) -> str:
    return ", ".join(f"{t['name']} {t['dynamic']['capacity'] if 'dynamic' in t else t['num_embeddings']}"
                     for t in tables)


def movielens(threads: int, share: float, epochs: int | None) -> list[tuple]:
    train_rows, test_rows = real_data.split(real_data.movielens_100k())
    folder = pathlib.Path(tempfile.mkdtemp(prefix="dynamic-bench-"))
    pq.write_table(train_rows, folder / "train.parquet")
    pq.write_table(test_rows, folder / "eval.parquet")
    cfg = movielens_config(folder)
    cfg["training"] = {"threads": threads, "log_every": 10**6, **({"epochs": epochs} if epochs else {})}
    sizes = {"users": int(943 * share), "items": int(1682 * share)}
    out = []
    for name, tables in variants(cfg, sizes, {}).items():
        result, seconds = run({**cfg, "embeddings": {"tables": tables}}, threads)
        out.append((name, describe(tables), result["rmse"], result.get("dynamic_rows_in_use", ""), seconds))
    return out


def zipf(threads: int, num_ids: int, rows: int, steps: int) -> list[tuple]:
    dims = 32
    tables = [{"name": f"t{i}", "num_embeddings": num_ids, "embedding_dim": dims, "features": [f"c{i}"]}
              for i in range(4)]
    cfg = {"model": {"kind": "dlrm", "bottom_mlp": [64, dims], "top_mlp": [64]},
           "embeddings": {"tables": tables},
           "data": {"kind": "synthetic", "num_dense": 4, "num_ids": num_ids, "zipf_alpha": 1.1, "signal": 2.0,
                    "eval_samples": 65536},
           "optimizer": {"sparse": {"name": "rowwise_adagrad", "lr": 0.05}},
           "training": {"steps": steps, "batch_size": 1024, "threads": threads, "log_every": 10**6}}
    out = []
    for name, variant in variants(cfg, {t["name"]: rows for t in tables}, {}).items():
        result, seconds = run({**cfg, "embeddings": {"tables": variant}}, threads)
        out.append((name, describe(variant[:1]) + " (each of 4)", result["auc"], result.get("dynamic_rows_in_use", ""),
                    seconds))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=["admission", "movielens", "zipf"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--hashed-share", type=float, default=0.5, help="MovieLens: hashed rows per id")
    parser.add_argument("--epochs", type=int, default=None, help="MovieLens: epochs (default: the ratings default)")
    parser.add_argument("--zipf-ids", type=int, default=200_000, help="synthetic: distinct ids per feature")
    parser.add_argument("--zipf-rows", type=int, default=20_000, help="synthetic: hashed rows per table")
    parser.add_argument("--zipf-steps", type=int, default=600)
    args = parser.parse_args()
    os.environ.setdefault("KEMBED_JOB_ID", "dynamic-bench")
    load = os.getloadavg()[0]
    if args.only in (None, "admission"):
        rows = admission(num_steps=200, batch=4096, num_ids=500_000, admit_after=2, bloom_bytes=1 << 20)
        print("\nAdmission after 2 batches, Zipf(1.1) ids (500k possible, 200 batches of 4096 draws)")
        print(f"{'admission':<22}{'admitted':>10}{'too early':>11}{'late/never':>12}{'due':>9}{'adds (B)':>13}"
              f"{'seconds':>9}")
        for name, ever, early, late, due, memory, seconds in rows:
            print(f"{name:<22}{ever:>10}{early:>11}{late:>12}{due:>9}{memory:>13}{seconds:>9.2f}")
    if args.only in (None, "movielens"):
        rows = movielens(args.threads, args.hashed_share, args.epochs)
        print(f"\nMovieLens-100k, ratings defaults, hashed tables of {args.hashed_share:.0%} of the ids' rows")
        print(f"{'tables':<26}{'rows (users, items)':<28}{'RMSE':>8}{'rows used':>11}{'seconds':>9}")
        for name, sizes, rmse, used, seconds in rows:
            print(f"{name:<26}{sizes:<28}{rmse:>8.4f}{used!s:>11}{seconds:>9.1f}")
    if args.only in (None, "zipf"):
        rows = zipf(args.threads, args.zipf_ids, args.zipf_rows, args.zipf_steps)
        print(f"\nSynthetic Zipf(1.1) CTR, {args.zipf_ids} ids per feature, hashed tables of {args.zipf_rows} rows, "
              f"DLRM dim 32, {args.zipf_steps} steps of 1024")
        print(f"{'tables':<26}{'rows':<28}{'AUC':>8}{'rows used':>11}{'seconds':>9}")
        for name, sizes, auc, used, seconds in rows:
            print(f"{name:<26}{sizes:<28}{auc:>8.4f}{used!s:>11}{seconds:>9.1f}")
    print(f"\nload average at the start: {load:.2f}")


if __name__ == "__main__":
    main()
