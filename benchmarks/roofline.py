"""kembed's DLRM step (benchmarks/trainer.py's config, 1 rank) against this machine's floor (issue 31).

    .venv/bin/python benchmarks/roofline.py                        # the default: bf16 where the CPU has it
    .venv/bin/python benchmarks/roofline.py --precision none       # the dense part in float32

Three tables:
1. This machine's rates: random-row gather bandwidth (`index_select` of sorted distinct random rows of dim 64,
   float32, as a lookup gathers them: from the benchmark's 26 tables stacked, 1.25 GB, and from a matrix of one
   step's unique rows, where pooling gathers from), and matmul GFLOP/s at the dense part's shapes (fp32, bf16).
2. The step's phases (the trainer's `STEP_PHASES`, timed by torch.profiler) and, in the backward, its costliest
   autograd nodes.
3. The step's bytes and flops, the floor each implies at the measured rates, and the measured step beside them.

Threads: the cores this process may run on, as benchmarks/trainer.py gives a 1-rank variant.
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import trainer as bench  # noqa: E402 - benchmarks/trainer.py: the config and cached batches compared there

from kembed_trainer import dist, hugepages, precision, report, train  # noqa: E402 - on the path after `trainer`

DIM = 64
ROW_BYTES = DIM * 4


def _median_seconds(fn, repeats: int) -> float:
    fn()  # warm: first touch, oneDNN's kernel choice
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# ------------------------------------------------------------------------------------------------ rates
def gather_bandwidth(num_rows: int, num_gathered: int, repeats: int) -> float:
    """GB/s of rows read by `index_select` of `num_gathered` sorted distinct random rows of a [num_rows, 64]
    float32 matrix on huge pages (as the trainer's tables are), a fresh draw of rows each time."""
    table = hugepages.empty(num_rows, DIM, device=torch.device("cpu")).uniform_()
    out = torch.empty(num_gathered, DIM)
    draws = [torch.randperm(num_rows)[:num_gathered].sort().values for _ in range(repeats + 1)]
    it = iter(draws)
    seconds = _median_seconds(lambda: torch.index_select(table, 0, next(it), out=out), repeats)
    return num_gathered * ROW_BYTES / seconds / 1e9


def matmul_rate(m: int, k: int, n: int, dtype: torch.dtype, repeats: int) -> float:
    """GFLOP/s of a linear layer's forward: [m, k] x [k, n]."""
    x, w = torch.randn(m, k, dtype=dtype), torch.randn(n, k, dtype=dtype)
    return 2 * m * k * n / _median_seconds(lambda: F.linear(x, w), repeats) / 1e9


def bmm_rate(b: int, n: int, d: int, dtype: torch.dtype, repeats: int) -> float:
    """GFLOP/s of the dot interaction: [b, n, d] x [b, d, n]."""
    z = torch.randn(b, n, d, dtype=dtype)
    return 2 * b * n * n * d / _median_seconds(lambda: torch.bmm(z, z.transpose(1, 2)), repeats) / 1e9


# ------------------------------------------------------------------------------------------------ the step
def dense_shapes(model: torch.nn.Module, batch: int) -> list[tuple[str, int, int, int]]:
    """(name, m, k, n) of every matmul of the dense forward: the linear layers, and the interaction as one."""
    shapes = [(f"linear {mod.in_features}->{mod.out_features}", batch, mod.in_features, mod.out_features)
              for mod in model.modules() if isinstance(mod, torch.nn.Linear)]
    num_vectors = int(model.pair_of_place.numel() ** 0.5)
    return [*shapes, (f"interaction bmm {num_vectors}x{DIM}", batch * num_vectors, DIM, num_vectors)]


def profile_steps(trainer: train.Trainer, first: int, steps: int):
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for i in range(first, steps):
            trainer.step = i
            trainer.train_step()
        seconds = (time.perf_counter() - start) / (steps - first)
    return prof, seconds


def phase_ms(prof, num_steps: int) -> dict[str, float]:
    totals = {e.key: e.cpu_time_total for e in prof.key_averages() if e.key in train.STEP_PHASES}
    return {name: totals.get(name, 0.0) / 1e3 / num_steps for name in train.STEP_PHASES}


def backward_nodes_ms(prof, num_steps: int, top: int) -> list[tuple[str, float]]:
    """The backward's autograd nodes by time (each node's own evaluation, children included)."""
    prefix = "autograd::engine::evaluate_function: "
    totals = collections.Counter()
    for e in prof.key_averages():
        if e.key.startswith(prefix):
            totals[e.key[len(prefix):]] += e.cpu_time_total / 1e3 / num_steps
    return totals.most_common(top)


# ------------------------------------------------------------------------------------------------ main
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=13, help="steps of the trainer, incl. warm-up")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=4096)
    parser.add_argument("--precision", default="auto", choices=["auto", "none", "bf16"],
                        help="training.mixed_precision (auto: the clicks default)")
    parser.add_argument("--repeats", type=int, default=9, help="timings per rate (the median is shown)")
    args = parser.parse_args()

    cfg = bench.bench_config("rowwise_adagrad", args.batch_size, args.steps)
    cfg = cfg.model_copy(update={"training": cfg.training.model_copy(update={"mixed_precision": args.precision})})
    env = dist.setup("gloo", threads=len(os.sched_getaffinity(0)))
    torch.manual_seed(cfg.training.seed)
    trainer = train.Trainer(cfg, env, report.Reporter(enabled=False))
    trainer.data = bench.CachedData(trainer.data, args.steps)
    unique = []
    for i in range(args.warmup):
        trainer.step = i
        trainer.train_step()
        unique.append(trainer.embeddings.last_unique_rows)
    prof, step_seconds = profile_steps(trainer, args.warmup, args.steps)
    num_steps = args.steps - args.warmup
    phases = phase_ms(prof, num_steps)
    nodes = backward_nodes_ms(prof, num_steps, top=8)
    model = trainer.model
    num_ids = sum(trainer.data.train_batch(i).values.numel() for i in range(args.steps)) // args.steps
    num_unique = int(statistics.median(unique))
    num_rows = sum(g.num_rows for g in trainer.embeddings.groups)
    shapes = dense_shapes(model, args.batch_size)
    del trainer, prof  # the tables: the rates below are measured without them in memory

    rows = {
        "tables": gather_bandwidth(num_rows, num_unique, args.repeats),
        "unique": gather_bandwidth(num_unique, min(num_unique, num_ids), args.repeats),
    }
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    rates = {
        (name, label): (bmm_rate(m // k, k, n, dtype, args.repeats) if name.startswith("interaction")
                        else matmul_rate(m, k, n, dtype, args.repeats))
        for name, m, k, n in shapes
        for label, dtype in dtypes.items()
    }

    load = os.getloadavg()
    label = "bf16" if precision.dense_dtype(args.precision, torch.device("cpu")) == torch.bfloat16 else "fp32"
    print(f"\n{len(os.sched_getaffinity(0))} cores, torch {torch.__version__}, batch {args.batch_size}, "
          f"dense part {args.precision} ({label}), {num_steps} profiled steps, load average {load[0]:.1f}\n")
    print("| random-row gather (dim 64, float32) | rows | gathered | GB/s |\n| --- | ---: | ---: | ---: |")
    print(f"| from the 26 tables stacked | {num_rows:,} | {num_unique:,} | {rows['tables']:.1f} |")
    print(f"| from one step's unique rows (pooling) | {num_unique:,} | {min(num_unique, num_ids):,} | "
          f"{rows['unique']:.1f} |")
    print("\n| matmul | m x k x n | fp32 GFLOP/s | bf16 GFLOP/s |\n| --- | --- | ---: | ---: |")
    for name, m, k, n in shapes:
        print(f"| {name} | {m} x {k} x {n} | {rates[name, 'fp32']:.0f} | {rates[name, 'bf16']:.0f} |")

    print("\n| phase | ms per step |\n| --- | ---: |")
    for name, ms in phases.items():
        print(f"| {name} | {ms:.1f} |")
    print(f"| **step (wall, profiled)** | **{step_seconds * 1e3:.1f}** |")
    print("\n| backward node | ms per step |\n| --- | ---: |")
    for name, ms in nodes:
        print(f"| {name} | {ms:.1f} |")

    # Bytes: the lookup gathers each unique row once, pooling reads one gathered row per id (forward) and one
    # pooled gradient row per id (backward), and the update reads and writes each unique row (its accumulator
    # is 1/64 of that, left out).
    table_bytes = 3 * num_unique * ROW_BYTES
    pool_bytes = 2 * num_ids * ROW_BYTES
    embedding_floor = table_bytes / rows["tables"] / 1e9 + pool_bytes / rows["unique"] / 1e9
    # Flops: each matmul of the forward, and in the backward the weight's gradient and (but for the first layer,
    # whose input needs none) the input's, each as much again; the interaction's backward is one bmm of the
    # forward's size (`dlrm._PairwiseDots`).
    flops = {name: 2 * m * k * n * (2 if i == 0 or name.startswith("interaction") else 3)
             for i, (name, m, k, n) in enumerate(shapes)}
    dense_floor = sum(f / rates[name, label] / 1e9 for name, f in flops.items())
    total_flops = sum(flops.values())
    print("\n| part | per step | at the measured rate | measured |\n| --- | ---: | ---: | ---: |")
    print(f"| embedding: random rows moved | {(table_bytes + pool_bytes) / 1e6:.0f} MB "
          f"({num_unique:,} unique rows, {num_ids:,} ids) | {embedding_floor * 1e3:.1f} ms | "
          f"{phases['lookup'] + phases['sparse update']:.1f} ms (lookup + sparse update) |")
    print(f"| dense: matmul flops | {total_flops / 1e9:.2f} GFLOP | {dense_floor * 1e3:.1f} ms | "
          f"{phases['dense forward'] + phases['backward'] + phases['dense optimizer']:.1f} ms "
          "(forward + backward + optimizer) |")
    floor = embedding_floor + dense_floor
    print(f"| **step** | | **{floor * 1e3:.1f} ms** | **{step_seconds * 1e3:.1f} ms "
          f"({floor / step_seconds:.0%} of the floor's speed)** |")


if __name__ == "__main__":
    main()
