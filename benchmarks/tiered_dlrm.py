"""A DLRM job whose tables are 4x the memory it is given, tiered, against the same model with every row in memory.

    nice .venv/bin/python benchmarks/tiered_dlrm.py --limit-gb 3                  # every variant, 300 steps each
    nice .venv/bin/python benchmarks/tiered_dlrm.py --limit-gb 3 --cache-share 0.05 --repeats 2 \
        --variants in-memory tiered-4x tiered-4x-cold                              # medians of 2 interleaved
    nice .venv/bin/python benchmarks/tiered_dlrm.py --variants in-memory tiered-4x --steps 100

Each variant is a real trainer job (`python -m kembed_trainer --config ...`, one process, 2 torch threads) whose
records are read back: samples/s, peak RSS (`memory_mb`, the job's own metric) and the tier's metrics, averaged
over the progress windows after the first (start-up, first fetches and compilation left out). The model is
benchmarks/trainer.py's DLRM (26 sparse features, dim 64, multi-hot 1-3, Zipf(1.1) ids, MLPs 256-64 / 256-1,
row-wise Adagrad, batches of 4096) with its 4 big tables grown or shrunk. The data is a Parquet file made here
(table data, streamed: ids drawn Zipf(1.1) over an affine permutation of each table's rows, labels from a
planted per-id score), not synthetic data, whose generator keeps some 36 bytes per id of every table in memory
and draws ids on the training thread.

- `in-memory`: 4 big tables of `--fit-rows` rows each, every row in memory (the size that fits).
- `tiered-fit`: the same tables, tiered, with the cache of `tiered-4x`: the tier's own cost at one size.
- `tiered-4x`: big tables of as many rows as make all tables (weights and optimizer state) `4 x --limit-gb`,
  tiered, each cached in `--cache-share` of its rows; the job must stay under `--limit-gb` of peak RSS.
- `tiered-4x-cold`: as `tiered-4x`, with the pages of every row about to be fetched or written back dropped
  from the page cache first (`posix_fadvise(DONTNEED)` on each row): every miss and write-back goes to the disk,
  the worst case of a node whose page cache holds none of the file. Without it the kernel keeps what it can of
  the file in the node's free memory, which is not the process's RSS (and on Kubernetes counts to the pod's
  limit only until reclaimed).

Figures are the mean of the progress windows of the second half of the run (`--steps`), when the cache is full
and evicting. Every job runs with `OMP_WAIT_POLICY=passive`: on this shared 2-core machine (load 4-8) torch's
OpenMP workers spinning between parallel regions made the in-memory job 5-18x slower per step with 2 threads
(0.96 s against 0.05 s at load 7.7), and the tiered jobs not: a comparison of the spinning, not of the tables.

`compute samples/s` leaves out the time steps spent getting their batches (`data_share`).
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

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import yaml

REPO = pathlib.Path(__file__).resolve().parents[1]
ROW_BYTES = 64 * 4 + 4  # a dim-64 row and its row-wise Adagrad accumulator
SMALL = [int(10_000 * 10 ** (i / 21)) for i in range(22)]  # 10k .. 100k, geometric (benchmarks/trainer.py)


def make_data(path: pathlib.Path, big_rows: int, num_samples: int, *, seed: int = 0) -> None:
    """`num_samples` rows: 13 dense floats, 26 multi-hot (1-3) Zipf(1.1) id lists, a 0/1 label."""
    rng = np.random.default_rng(seed)
    sizes = [big_rows] * 4 + SMALL
    cdfs: dict[int, np.ndarray] = {}
    columns: dict[str, pa.Array] = {}
    dense = rng.standard_normal((num_samples, 13)).astype(np.float32)
    logit = dense[:, 0] * 0.3
    for f, n in enumerate(sizes):
        if n not in cdfs:
            cdf = np.cumsum(np.arange(1, n + 1, dtype=np.float64) ** -1.1)
            cdfs[n] = cdf / cdf[-1]
        lengths = rng.integers(1, 4, num_samples)
        ranks = np.minimum(np.searchsorted(cdfs[n], rng.random(int(lengths.sum()))), n - 1)
        a = next(p for p in (1_000_003, 999_983, 1_000_033) if n % p)  # a prime: (a r + c) mod n permutes rows
        ids = (a * ranks + 7 * f + 1) % n
        score = ((ids * 2654435761 + f * 97) % 2**32) / 2**32 - 0.5  # a fixed per-id score
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        logit += np.add.reduceat(score, offsets[:-1]) / lengths * 0.8
        columns[f"s{f}"] = pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), pa.array(ids, pa.int64()))
    label = (rng.random(num_samples) < 1 / (1 + np.exp(-logit))).astype(np.float32)
    table = pa.table({"label": label, **{f"d{i}": dense[:, i] for i in range(13)}, **columns})
    pq.write_table(table, path, row_group_size=32768)


def job_config(big_rows: int, *, cache_rows: int | None, steps: int, batch: int, log_every: int,
               data: pathlib.Path, checkpoint: str | None = None, checkpoint_every: int = 0) -> dict:
    tier = {"tier": {"cache_rows": cache_rows}} if cache_rows else {"sharding": "row_wise"}
    tables = [{"name": f"big{i}", "num_embeddings": big_rows, "embedding_dim": 64, "features": [f"b{i}"], **tier}
              for i in range(4)]
    tables += [{"name": f"t{i}", "num_embeddings": n, "embedding_dim": 64, "features": [f"c{i}"]}
               for i, n in enumerate(SMALL)]
    return {
        "model": {"kind": "dlrm", "bottom_mlp": [256, 64], "top_mlp": [256]},
        "embeddings": {"tables": tables},
        "data": {"kind": "table", "uri": str(data), "label": "label", "dense": [f"d{i}" for i in range(13)],
                 "sparse": {f"b{i}": f"s{i}" for i in range(4)} | {f"c{i}": f"s{i + 4}" for i in range(22)},
                 "eval_fraction": 0.02, "shuffle_buffer": 32768},
        "optimizer": {"sparse": {"name": "rowwise_adagrad", "lr": 0.05}, "dense": {"name": "adam", "lr": 0.001}},
        "training": {"steps": steps, "batch_size": batch, "seed": 0, "log_every": log_every, "threads": 2},
        **({"checkpoint": {"uri": f"{checkpoint}-{big_rows}-{bool(cache_rows)}", "every_steps": checkpoint_every,
                           "incremental": True, "keep": 2}} if checkpoint else {}),
    }


def table_bytes(big_rows: int) -> int:
    return (4 * big_rows + sum(SMALL)) * ROW_BYTES


def run_job(name: str, cfg: dict, *, cold: bool, folder: pathlib.Path) -> dict:
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    env = {**os.environ, "PYTHONPATH": str(REPO / "trainer_image"), "KEMBED_LOCAL_DIR": str(folder),
           "OMP_WAIT_POLICY": "passive"}
    cmd = [sys.executable, str(pathlib.Path(__file__).resolve()), "--worker", str(path)]
    if cold:
        cmd.append("--cold")
    started = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)  # noqa: PLW1510
    wall = time.perf_counter() - started
    records = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0:
        print(f"{name}: exit {proc.returncode}\n{proc.stderr[-3000:]}", file=sys.stderr)
        return {}
    progress = [r for r in records if r["event"] == "progress"]
    progress = progress[len(progress) // 2:]  # the second half: the cache full (start-up, filling left out)
    started_rec = next(r for r in records if r["event"] == "started")
    saves = [(r["step"], r["kind"], round(r["num_bytes"] / 2**20, 1), r["seconds"], r["blocked_seconds"])
             for r in records if r["event"] == "checkpoint"]
    out = {
        "samples_per_sec": statistics.mean(r["samples_per_sec"] for r in progress),
        "compute_samples_per_sec": statistics.mean(
            r["samples_per_sec"] / max(1e-9, 1 - r["data_share"]) for r in progress),
        "peak_rss_mb": max(r["memory_mb"] for r in records if "memory_mb" in r),
        "embedding_mb": started_rec["embedding_mb"],
        "wall_s": wall,
        "auc": next((r["auc"] for r in records if r["event"] == "eval"), None),
    }
    if saves:
        print(f"{name} saves (step, kind, MB, seconds, blocked seconds): {saves}", flush=True)
    for key in ("tier_hit_rate", "tier_fetched_rows_per_step", "tier_written_rows_per_step",
                "tier_fetched_mb_per_step", "tier_written_mb_per_step", "tier_wait_share", "tier_io_share",
                "compute_share", "data_share"):
        if key in progress[0]:
            out[key] = statistics.mean(r[key] for r in progress)
    return out


def worker(config_path: str, cold: bool) -> int:
    sys.path.insert(0, str(REPO / "trainer_image"))
    if cold:
        from kembed_trainer.tiered import table as tiered

        read, write = tiered.TieredGroup._read, tiered.TieredGroup._write

        def forget(self, rows):
            for f, file_rows, _ in self._by_file(rows):
                for r in file_rows.tolist():
                    os.posix_fadvise(f.fd, r * f.record_bytes, f.record_bytes, os.POSIX_FADV_DONTNEED)

        def cold_read(self, rows, out, stats):
            forget(self, rows)
            read(self, rows, out, stats)

        def cold_write(self, rows, values, stats):
            forget(self, np.asarray(rows))
            write(self, rows, values, stats)

        tiered.TieredGroup._read, tiered.TieredGroup._write = cold_read, cold_write
    from kembed_trainer import __main__ as trainer_main

    return trainer_main.main(["--config", config_path])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--limit-gb", type=float, default=2.0, help="the memory the job is given (GiB)")
    parser.add_argument("--fit-rows", type=int, default=1_000_000, help="rows of each big table that fits")
    parser.add_argument("--cache-share", type=float, default=0.02, help="of a tiered big table's rows")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=4096)
    parser.add_argument("--log-every", type=int, default=20)
    parser.add_argument("--variants", nargs="+", default=["in-memory", "tiered-fit", "tiered-4x", "tiered-4x-cold"])
    parser.add_argument("--repeats", type=int, default=1, help="rounds of every variant, interleaved; medians")
    parser.add_argument("--checkpoint-every", type=int, default=0,
                        help="steps between checkpoints (incremental, to the temp folder); 0 = none")
    parser.add_argument("--dir", default=None, help="where the stores go (default: the temp folder)")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--cold", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        sys.exit(worker(args.worker, args.cold))

    limit = args.limit_gb * 2**30
    big_rows = -(-(int(4 * limit) // ROW_BYTES - sum(SMALL)) // 4)
    cache_rows = int(big_rows * args.cache_share)
    print(f"limit {args.limit_gb} GiB; 4x tables: 4 x {big_rows:,} rows + 22 small = "
          f"{table_bytes(big_rows) / 2**30:.2f} GiB; cache {cache_rows:,} rows per big table; "
          f"load average {os.getloadavg()}", flush=True)
    results = {}
    with tempfile.TemporaryDirectory(prefix="tiered-dlrm-", dir=args.dir) as tmp:
        samples = int((args.steps + 1) * args.batch_size / 0.98) + 1
        fit_data, big_data = pathlib.Path(tmp) / "fit.parquet", pathlib.Path(tmp) / "big.parquet"
        t = time.perf_counter()
        make_data(fit_data, args.fit_rows, samples)
        make_data(big_data, big_rows, samples)
        print(f"data: 2 x {samples:,} rows ({time.perf_counter() - t:.0f} s)", flush=True)
        common = {"steps": args.steps, "batch": args.batch_size, "log_every": args.log_every,
                  "checkpoint": f"file://{tmp}/ckpt" if args.checkpoint_every else None,
                  "checkpoint_every": args.checkpoint_every}
        fit_cache = min(cache_rows, args.fit_rows)
        variants = {
            "in-memory": (job_config(args.fit_rows, cache_rows=None, data=fit_data, **common), False, args.fit_rows),
            "tiered-fit": (job_config(args.fit_rows, cache_rows=fit_cache, data=fit_data, **common), False,
                           args.fit_rows),
            "tiered-4x": (job_config(big_rows, cache_rows=cache_rows, data=big_data, **common), False, big_rows),
            "tiered-4x-cold": (job_config(big_rows, cache_rows=cache_rows, data=big_data, **common), True, big_rows),
        }
        runs: dict[str, list[dict]] = {name: [] for name in args.variants}
        for _ in range(args.repeats):  # interleaved, so the machine's load moves every variant alike
            for name in args.variants:
                cfg, cold, rows = variants[name]
                t = time.perf_counter()
                runs[name].append(run_job(name, cfg, cold=cold, folder=pathlib.Path(tmp)))
                print(f"{name}: {json.dumps(runs[name][-1])} ({time.perf_counter() - t:.0f} s, "
                      f"load average {os.getloadavg()})", flush=True)
        for name, done in runs.items():
            done = [r for r in done if r]
            results[name] = {key: statistics.median(r[key] for r in done) for key in done[0]} if done else {}
    base = results.get("in-memory", {}).get("samples_per_sec")
    base_compute = results.get("in-memory", {}).get("compute_samples_per_sec")
    print("\n| variant | tables GiB | samples/s | x in-memory | compute samples/s | x in-memory | peak RSS MB | "
          "under limit | hit rate | fetched rows/step | written rows/step | fetch wait share | eval AUC |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: |")
    for name, r in results.items():
        if not r:
            print(f"| {name} | failed |")
            continue
        rows = variants[name][2]
        ratio = f"{r['samples_per_sec'] / base:.2f}" if base else ""
        cratio = f"{r['compute_samples_per_sec'] / base_compute:.2f}" if base_compute else ""
        under = "yes" if r["peak_rss_mb"] < args.limit_gb * 1024 else "**no**"
        tier = [f"{r[k]:.3f}" if k in r else "" for k in ("tier_hit_rate",)] + \
               [f"{r[k]:,.0f}" if k in r else "" for k in ("tier_fetched_rows_per_step", "tier_written_rows_per_step")] + \
               [f"{r[k]:.3f}" if k in r else "" for k in ("tier_wait_share",)]
        print(f"| {name} | {table_bytes(rows) / 2**30:.2f} | {r['samples_per_sec']:,.0f} | {ratio} | "
              f"{r['compute_samples_per_sec']:,.0f} | {cratio} | {r['peak_rss_mb']:,.0f} | {under} | "
              + " | ".join(tier) + f" | {r['auc']:.4f} |")
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
