"""Checkpoint saves against the raw write bandwidth of the same S3 client, full and incremental, side by side.

    .venv/bin/python benchmarks/checkpoint_incremental.py              # defaults below, table at the end
    .venv/bin/python benchmarks/checkpoint_incremental.py --rows 400000 --steps-between 10 --json out.json

One run, one S3 server (moto_server from the venv, on 127.0.0.1), one process:
1. saves alone, each beside the raw write bandwidth of the same client: a DLRM with Zipf-distributed ids
   (`zipf_alpha`) trains `--steps-between` steps, then one save is written while training waits (so the CPU is the
   save's): a full checkpoint, then deltas (the rows those steps touched, and the dense part whole), then more
   full ones. Right after each save, s3fs (the client DCP's FsspecWriter writes through) puts as many bytes in
   one object in one request: the raw figure for that much data at that moment (this machine's load moves both
   alike). Bytes, seconds from the start of the save to its COMPLETE marker, MB/s, and MB/s as a share of the
   paired raw figure. Medians of `--repeats`. Also the same full-size bytes as a multipart upload of 8 MiB parts
   sent concurrently, for reference.
2. saves during training: the same trainer checkpointing every `--steps-between` steps with `incremental` (a
   full checkpoint then deltas), asynchronously: the training stall per save as a share of the median step time,
   split into the save's own (choosing full or delta, gathering the changed rows, copying the state) and the wait
   for an earlier save still in flight (`waited_seconds`: saves more often than the storage takes them).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "trainer_image"))
sys.path.insert(0, str(REPO))

from tests.fixtures.servers import start_moto  # noqa: E402 - after the path insert

MB = 1e6


def start_s3() -> tuple[subprocess.Popen, dict[str, str]]:
    proc, endpoint = start_moto(timeout_s=60)
    env = {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
           "AWS_DEFAULT_REGION": "us-east-1"}
    os.environ.update(env)
    return proc, env


def bench_config(args: argparse.Namespace, uri: str, **checkpoint: object):
    from kembed_contract import trainer_config as config

    tables = [{"name": f"big{i}", "num_embeddings": args.rows, "embedding_dim": args.dim, "features": [f"c{i}"]}
              for i in range(args.tables)]
    return config.TrainerConfig.model_validate({
        "model": {"kind": "dlrm", "bottom_mlp": [64, args.dim], "top_mlp": [64]},
        "embeddings": {"tables": tables},
        "data": {"kind": "synthetic", "num_dense": 8, "zipf_alpha": args.zipf, "max_hotness": 2,
                 "eval_samples": 256},
        "optimizer": {"sparse": {"name": args.optimizer, "lr": 0.05}, "dense": {"name": "adam", "lr": 0.001}},
        "training": {"steps": args.steps, "batch_size": args.batch_size, "seed": 0, "log_every": 1, "threads": 1},
        "checkpoint": {"uri": uri, "keep": 2, **checkpoint},
    })


def put_mb_s(fs, path: str, payload: bytes, *, part_bytes: int | None = None) -> float:
    """MB/s of writing `payload` through s3fs: in one PUT however large, or as a multipart upload of
    `part_bytes` parts (s3fs sends them concurrently)."""
    start = time.perf_counter()
    fs.pipe_file(path, payload, chunksize=part_bytes or max(len(payload), 5 * 2**20))
    seconds = time.perf_counter() - start
    fs.rm(path)
    return len(payload) / MB / seconds


def checkpoint_records(out: io.StringIO) -> list[dict]:
    return [r for line in out.getvalue().splitlines() if (r := json.loads(line))["event"] == "checkpoint"]


def saves_alone(args: argparse.Namespace, uri: str, fs, payload: bytes) -> tuple[list[dict], float]:
    """Saves written while training waits, each after `steps_between` steps: a full one, `repeats` deltas on it,
    then `repeats` more full ones, each record with `raw_mb_s` (one PUT of as many bytes right after it); and the
    mean share of table rows a delta held."""
    from kembed_trainer import dist, report, train

    out = io.StringIO()
    cfg = bench_config(args, uri, every_steps=0, incremental=True, full_every=10_000, max_chain_share=100)
    trainer = train.Trainer(cfg, dist.setup("gloo", threads=1), report.Reporter(enabled=True, out=out))
    touched, paired = [], []
    try:
        for i in range(2 * args.repeats + 1):
            trainer.checkpointer.incremental = i <= args.repeats  # the first save is full (no chain yet)
            for _ in range(args.steps_between):
                trainer.train_step()
                trainer.step += 1
            if 0 < i <= args.repeats:
                changed = sum(c.rows.numel() for c in trainer.embeddings.changes(0).values())
                touched.append(changed / (args.rows * args.tables))
            trainer.save(wait=True)
            saved = checkpoint_records(out)[-1]
            saved["raw_mb_s"] = put_mb_s(fs, "bench/raw/paired", payload[: saved["num_bytes"]])
            paired.append(saved)
    finally:
        trainer.close()
    return paired, statistics.mean(touched)


def saves_during_training(args: argparse.Namespace, uri: str) -> tuple[list[dict], float]:
    """The checkpoint records of a run saving every `steps_between` steps, and its median step time."""
    from kembed_trainer import dist, report, train

    out = io.StringIO()
    cfg = bench_config(args, uri, every_steps=args.steps_between, incremental=True, full_every=4,
                       max_chain_share=100)
    trainer = train.Trainer(cfg, dist.setup("gloo", threads=1), report.Reporter(enabled=True, out=out))
    try:
        trainer.train()
    finally:
        trainer.close()
    records = [json.loads(line) for line in out.getvalue().splitlines()]
    step_s = statistics.median(args.batch_size / r["samples_per_sec"] for r in records if r["event"] == "progress")
    return [r for r in records if r["event"] == "checkpoint"], step_s


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tables", type=int, default=2)
    parser.add_argument("--rows", type=int, default=500_000, help="rows per table")
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--optimizer", default="rowwise_adagrad")
    parser.add_argument("--zipf", type=float, default=1.1, help="id frequency ~ 1 / rank**alpha")
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--steps-between", type=int, default=10, help="training steps between two saves")
    parser.add_argument("--steps", type=int, default=120, help="steps of the run that saves while training")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=pathlib.Path, help="also write the figures here")
    args = parser.parse_args(argv)

    import s3fs

    proc, _ = start_s3()
    try:
        fs = s3fs.S3FileSystem()
        fs.mkdir("bench")
        table_bytes = args.tables * args.rows * args.dim * 4
        payload = os.urandom(2 * table_bytes)  # more than a full checkpoint (tables, optimizer state, dense part)
        alone, touched = saves_alone(args, "s3://bench/alone", fs, payload)
        full_bytes = statistics.median(r["num_bytes"] for r in alone if r["kind"] == "full")
        multipart = statistics.median(put_mb_s(fs, "bench/raw/multi", payload[: int(full_bytes)],
                                               part_bytes=8 * 2**20) for _ in range(args.repeats))
        during, step_s = saves_during_training(args, "s3://bench/during")
    finally:
        proc.kill()
        proc.wait()

    rows = []
    for kind in ("full", "delta"):
        mine = [r for r in alone if r["kind"] == kind]
        nbytes = statistics.median(r["num_bytes"] for r in mine)
        seconds = statistics.median(r["seconds"] for r in mine)
        rows.append({"save": kind, "saves": len(mine), "bytes": int(nbytes), "seconds": seconds,
                     "mb_s": nbytes / MB / seconds, "raw_mb_s": statistics.median(r["raw_mb_s"] for r in mine),
                     "share_of_raw": statistics.median(r["num_bytes"] / MB / r["seconds"] / r["raw_mb_s"]
                                                       for r in mine),
                     "share_of_full_bytes": nbytes / full_bytes})
    stalls = {}
    for kind in ("full", "delta"):
        mine = [r for r in during if r["kind"] == kind]
        if mine:
            own = statistics.median(r["blocked_seconds"] - r["waited_seconds"] for r in mine)
            waited = statistics.median(r["waited_seconds"] for r in mine)
            stalls[kind] = {"saves": len(mine), "stall_s": own, "stall_per_step_time": own / step_s,
                            "waited_s": waited, "waited_per_step_time": waited / step_s}
    result = {"load_average": os.getloadavg(), "multipart_mb_s": multipart, "saves": rows, "touched_share": touched,
              "step_seconds": step_s, "stall": stalls, "args": vars(args) | {"json": str(args.json)}}

    print(f"load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}; {args.tables} tables x {args.rows} rows x "
          f"dim {args.dim}, {args.optimizer}, Zipf {args.zipf}, batch {args.batch_size}, "
          f"{args.steps_between} steps between saves: {touched:.1%} of rows touched per delta")
    print(f"raw s3fs, a full checkpoint's bytes as a multipart upload (8 MiB parts, concurrent): {multipart:.1f} MB/s")
    print(f"{'save':6} {'n':>2} {'MB':>8} {'s':>7} {'MB/s':>7} {'raw MB/s':>9} {'of raw':>7} {'of full':>8}")
    for r in rows:
        print(f"{r['save']:6} {r['saves']:2} {r['bytes'] / MB:8.2f} {r['seconds']:7.3f} {r['mb_s']:7.1f} "
              f"{r['raw_mb_s']:9.1f} {r['share_of_raw']:7.0%} {r['share_of_full_bytes']:8.1%}")
    print("raw MB/s: one PUT of as many bytes right after each save (medians); of raw: the median of those pairs")
    print(f"during training (median step {step_s * 1000:.1f} ms):")
    for kind, s in stalls.items():
        print(f"  {kind:6} saves {s['saves']}: own stall {s['stall_s'] * 1000:.1f} ms = "
              f"{s['stall_per_step_time']:.2f} step times; waiting for the save before "
              f"{s['waited_s'] * 1000:.0f} ms = {s['waited_per_step_time']:.1f} step times")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
